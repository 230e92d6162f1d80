//===- ExportPlan.cpp - lowering @train_step to the runtime's plan --------===//
//
// convert-fsdp-to-plan: writes the plan file (docs/PLAN_FORMAT.md). The
// buffers and offsets come from the same planner fsdp-plan-memory uses;
// this pass only serializes: explicit buffers, parameters with their unit
// placement, optimizer state, the step's input/output bindings and the
// ordered instruction list. The file is written atomically.
//
//===----------------------------------------------------------------------===//

#include "passes/MemoryPlan.h"
#include "passes/Passes.h"
#include "runtime/core/PlanSchema.h"

#include "mlir/IR/Builders.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <optional>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPEXPORTPLAN
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;
namespace json = llvm::json;

namespace {

/// An optimizer update's optional operands, marked by name in the plan
/// (they follow the required ones in this order): skip_nonfinite,
/// grad_scale.
void markUpdateOperands(Operation *op, json::Object &attrs) {
  auto mark = [&](auto u) {
    if (u.getSkipNonfinite())
      attrs["skip_nonfinite"] = true;
    if (u.getGradScale())
      attrs["grad_scale"] = true;
  };
  if (auto a = dyn_cast<AdamwUpdateOp>(op))
    mark(a);
  else if (auto l = dyn_cast<LambUpdateOp>(op))
    mark(l);
  else if (auto n = dyn_cast<LambNormsOp>(op); n && n.getGradScale())
    attrs["grad_scale"] = true;
  else if (auto m = dyn_cast<SgdMomentumUpdateOp>(op))
    mark(m);
  else if (auto g = dyn_cast<SgdUpdateOp>(op))
    mark(g);
}

/// The plan's dtype name of an element type (runtime/core/PlanSchema.h);
/// "" when the plan format has none.
std::string dtypeOf(Type t) {
  using ::fsdp::DType;
  std::optional<DType> d;
  if (t.isF32())
    d = DType::F32;
  else if (t.isBF16())
    d = DType::BF16;
  else if (t.isF16())
    d = DType::F16;
  else if (t.isInteger(32))
    d = DType::I32;
  else if (t.isInteger(64))
    d = DType::I64;
  else if (t.isInteger(8))
    d = DType::I8;
  return d ? ::fsdp::dtypeName(*d) : "";
}

json::Array shapeOf(RankedTensorType t) {
  json::Array a;
  for (int64_t d : t.getShape())
    a.push_back(d);
  return a;
}

/// Converts an op attribute to JSON; false when its kind is not supported.
bool attrToJson(Attribute attr, json::Value &out) {
  if (isa<UnitAttr>(attr)) {
    out = true;
  } else if (auto b = dyn_cast<BoolAttr>(attr)) {
    out = b.getValue();
  } else if (auto f = dyn_cast<FloatAttr>(attr)) {
    out = f.getValueAsDouble();
  } else if (auto i = dyn_cast<IntegerAttr>(attr)) {
    out = i.getInt();
  } else if (auto a = dyn_cast<DenseI64ArrayAttr>(attr)) {
    json::Array arr;
    for (int64_t v : a.asArrayRef())
      arr.push_back(v);
    out = std::move(arr);
  } else if (auto s = dyn_cast<StringAttr>(attr)) {
    out = s.getValue().str();
  } else {
    return false;
  }
  return true;
}

/// The number of classes an integer input indexes, found by following it
/// (through reshapes, micro-batch views and fsdp-chunk-loss's row views)
/// to an embedding table or to cross-entropy logits.
int64_t integerRange(Value v) {
  SmallVector<Value> work{v};
  while (!work.empty()) {
    Value cur = work.pop_back_val();
    for (Operation *user : cur.getUsers()) {
      if (isa<ReshapeOp, MicrobatchOp, ViewOp>(user))
        work.push_back(user->getResult(0));
      else if (auto e = dyn_cast<EmbeddingOp>(user))
        return cast<RankedTensorType>(e.getTable().getType()).getShape()[0];
      else if (isa<CrossEntropyOp, CrossEntropyGradOp, CrossEntropyFusedOp>(user) &&
               user->getOperand(1) == cur) {
        auto classes = user->getAttrOfType<IntegerAttr>("classes");
        return classes ? classes.getInt()
                       : cast<RankedTensorType>(user->getOperand(0).getType()).getShape().back();
      }
    }
  }
  return 0;
}

/// "buffers": every planned buffer, its place, kind and live range.
FailureOr<json::Array> buffersJson(const MemoryPlan &plan, Location loc) {
  json::Array buffers;
  for (auto [id, b] : llvm::enumerate(plan.buffers)) {
    std::string dt = dtypeOf(b.type.getElementType());
    if (dt.empty()) {
      mlir::emitError(loc) << "buffer " << b.name << " has unsupported type " << b.type;
      return failure();
    }
    buffers.push_back(json::Object{
        {"id", (int64_t)id},
        {"name", b.name},
        {"offset", b.offset},
        {"bytes", b.bytes},
        {"shape", shapeOf(b.type)},
        {"dtype", dt},
        {"kind", bufKindName(b.kind)},
        {"first", b.first},
        {"last", b.last},
        {"persistent", b.persistent},
    });
    if (b.host) // fsdp-offload's host arena ([Note: two arenas], Plan.h)
      (*buffers.back().getAsObject())["space"] = b.nvme ? "nvme" : "host";
    if (b.aliasOf >= 0) {
      json::Object &o = *buffers.back().getAsObject();
      o["alias_of"] = b.aliasOf;
      if (b.rankStride)
        o["rank_stride"] = b.rankStride;
      if (b.rankPeriod)
        o["rank_period"] = b.rankPeriod;
    }
  }
  return std::move(buffers);
}

/// "units": each unit's flat, padded and shard sizes and its storage.
json::Array unitsJson(const MemoryPlan &plan) {
  json::Array units;
  for (const PlannedUnit &u : plan.units) {
    units.push_back(json::Object{{"name", u.name},
                                 {"flat_numel", u.flatNumel},
                                 {"padded_numel", u.paddedNumel},
                                 {"shard_numel", u.shardNumel},
                                 {"sharded", u.sharded},
                                 {"frozen", u.frozen},
                                 {"buffer", u.buffer}});
    if (u.buffer >= 0 && plan.buffers[u.buffer].host)
      (*units.back().getAsObject())["offloaded"] = true;
  }
  return units;
}

/// "params": each parameter's shape, init and place in its unit.
json::Array paramsJson(const MemoryPlan &plan) {
  json::Array params;
  for (const PlannedParam &p : plan.params) {
    ParamOp op = p.op;
    json::Object o{{"name", op.getSymName().str()},
                   {"shape", shapeOf(op.getTensorType())},
                   {"dtype", dtypeOf(op.getTensorType().getElementType())},
                   {"init", op.getInit().str()},
                   {"scale", op.getScale() ? op.getScale()->convertToDouble() : 0.0},
                   {"trainable", op.isTrainable()},
                   {"unit", p.unit},
                   {"flat_offset", p.flatOffset},
                   {"buffer", p.buffer}};
    params.push_back(std::move(o));
  }
  return params;
}

/// "states": the optimizer state buffers and what each shadows.
json::Array statesJson(ModuleOp module, const MemoryPlan &plan) {
  json::Array states;
  for (StateOp s : module.getOps<StateOp>()) {
    json::Object o{{"name", s.getSymName().str()},
                   {"kind", s.getKind().str()},
                   {"buffer", plan.symbolBuffer.lookup(s.getSymName())}};
    // State shadows a parameter (unsharded plans) or a unit.
    if (module.lookupSymbol<UnitOp>(s.getParamAttr()))
      o["unit"] = s.getParam().str();
    else
      o["param"] = s.getParam().str();
    states.push_back(std::move(o));
  }
  return states;
}

/// "inputs": the step's arguments. Roles from the fsdp.role argument
/// attributes; by position (input, target) when absent.
FailureOr<json::Array> inputsJson(func::FuncOp step, const MemoryPlan &plan) {
  json::Array inputs;
  llvm::StringMap<int> roleCount;
  for (BlockArgument arg : step.getArguments()) {
    std::string role;
    if (auto r = step.getArgAttrOfType<StringAttr>(arg.getArgNumber(),
                                                   kRoleAttrName))
      role = r.getValue().str();
    else if (arg.getArgNumber() < 2)
      role = arg.getArgNumber() == 0 ? "input" : "target";
    else {
      mlir::emitError(step.getLoc())
          << "argument #" << arg.getArgNumber()
          << " has no fsdp.role (input, target, lr, step or loss_scale)";
      return failure();
    }
    if (!llvm::is_contained({"input", "target", "lr", "step", "loss_scale"},
                            role)) {
      mlir::emitError(step.getLoc())
          << "argument #" << arg.getArgNumber() << " has unknown role \""
          << role << "\"; expected input, target, lr, step or loss_scale";
      return failure();
    }
    int n = roleCount[role]++;
    json::Object o{{"name", n ? role + std::to_string(n) : role},
                   {"role", role},
                   {"buffer", plan.valueBuffer.lookup(arg)}};
    auto t = cast<RankedTensorType>(arg.getType());
    if (t.getElementType().isInteger()) {
      int64_t range = integerRange(arg);
      if (range <= 0) {
        mlir::emitError(step.getLoc()) << "integer argument #" << arg.getArgNumber()
                         << " is neither embedding ids nor cross-entropy "
                            "labels; its value range is unknown";
        return failure();
      }
      o["range"] = range;
    }
    inputs.push_back(std::move(o));
  }
  return std::move(inputs);
}

/// "outputs" (the loss, loss scaling's squared norm, published gradients)
/// and "program": every op that is not a storage alias, in order, with its
/// buffers and attributes; write-backs to storage become copies.
LogicalResult programJson(ModuleOp module, func::FuncOp step, const MemoryPlan &plan,
                          json::Array &outputs, json::Array &program) {
  for (Operation &op : step.getBody().front()) {
    if (auto ret = dyn_cast<func::ReturnOp>(op)) {
      outputs.push_back(json::Object{
          {"name", "loss"},
          {"role", "loss"},
          {"buffer", plan.valueBuffer.lookup(ret.getOperand(0))}});
      // The squared gradient norm, with clipping or loss scaling (its
      // overflow signal).
      if (ret.getNumOperands() > 1)
        outputs.push_back(json::Object{
            {"name", "grad_sumsq"},
            {"role", "grad_sumsq"},
            {"buffer", plan.valueBuffer.lookup(ret.getOperand(1))}});
      continue;
    }
    if (auto g = dyn_cast<SetGradOp>(op)) {
      outputs.push_back(json::Object{
          {"name", ("grad." + g.getName()).str()},
          {"role", "grad"},
          {"param", g.getName().str()},
          {"buffer", plan.valueBuffer.lookup(g.getValue())}});
      continue;
    }
    if (isStorageAlias(&op))
      continue;
    json::Object instr;
    json::Array in, out;
    if (auto [sym, written] = storageWrite(&op); written) {
      instr["op"] = "copy";
      in.push_back(plan.valueBuffer.lookup(written));
      out.push_back(plan.symbolBuffer.lookup(sym));
    } else {
      if (op.getDialect() != module->getContext()->getLoadedDialect<FsdpDialect>()) {
        op.emitOpError() << "cannot be lowered to the plan: only fsdp ops run "
                            "on the runtime";
        return failure();
      }
      // Every op the runtime runs is in the plan schema with its arity: an
      // op added to the dialect but not to the schema is caught here, not
      // by fsdp-run's loader.
      StringRef name = op.getName().stripDialect();
      const ::fsdp::OpSchema *schema = ::fsdp::findOp({name.data(), name.size()});
      if (!schema) {
        op.emitOpError() << "has no entry in the plan schema "
                            "(runtime/core/PlanSchema.h): the runtime cannot run it";
        return failure();
      }
      if (!::fsdp::acceptsArity(*schema, (int)op.getNumOperands(),
                                (int)op.getNumResults())) {
        op.emitOpError() << "has " << op.getNumOperands() << " operand(s) and "
                         << op.getNumResults() << " result(s); the plan schema "
                         << "expects " << schema->numInputs << " and "
                         << schema->numOutputs;
        return failure();
      }
      instr["op"] = name.str();
      for (Value v : op.getOperands())
        in.push_back(plan.valueBuffer.lookup(v));
      for (Value v : op.getResults())
        out.push_back(plan.valueBuffer.lookup(v));
      json::Object attrs;
      for (NamedAttribute na : op.getAttrs()) {
        StringRef name = na.getName().getValue();
        if (name.starts_with("fsdp.") || name == "operandSegmentSizes")
          continue;
        json::Value v = nullptr;
        if (!attrToJson(na.getValue(), v)) {
          op.emitOpError() << "attribute '" << name
                           << "' cannot be written to the plan";
          return failure();
        }
        attrs[name] = std::move(v);
      }
      // An update's optional operands follow lr (and step) in order,
      // skip_nonfinite then grad_scale; the runtime knows them by these
      // marks (docs/PLAN_FORMAT.md).
      markUpdateOperands(&op, attrs);
      // The join of an update whose result is in the swap file
      // (nvme-params: the new master shard, in its staging until written
      // back) names that staging, as the update does: the runtime knows an
      // update in flight by its first output.
      if (isa<WaitOp>(op)) {
        Operation *joined = plan.carried.lookup(&op);
        if (!joined)
          joined = op.getOperand(0).getDefiningOp();
        if (auto it = plan.swaps.find(joined); joined && it != plan.swaps.end())
          for (const PlannedSwap &sw : it->second)
            for (json::Array *ids : {&in, &out})
              for (json::Value &id : *ids)
                if (id.getAsInteger() == sw.operand)
                  id = sw.view;
      }
      // fsdp-offload's nvme: the instruction reads (and, updating in
      // place, writes) staging buffers; the runtime moves each between
      // the swap file and the host arena around it. A copy to the device
      // of part of a buffer there (nvme-params) reads from a view of its
      // staging, which holds the blocks from byte `offset` of the file
      // buffer on: [file, staging, write, offset].
      if (auto it = plan.swaps.find(&op); it != plan.swaps.end()) {
        json::Array swaps;
        for (const PlannedSwap &sw : it->second) {
          for (json::Array *ids : {&in, &out})
            for (json::Value &id : *ids)
              if (id.getAsInteger() == sw.operand)
                id = sw.view;
          json::Array entry{sw.file, sw.staging, sw.write};
          if (sw.offset != 0 || plan.buffers[sw.staging].bytes != plan.buffers[sw.file].bytes)
            entry.push_back(sw.offset);
          swaps.push_back(std::move(entry));
        }
        attrs["swap"] = std::move(swaps);
        // nvme-read-ahead: the reads issued after that earlier instruction.
        if (Operation *from = plan.swapReadAt.lookup(&op))
          attrs["swap_read_at"] = plan.instrIndex.lookup(from);
      }
      instr["attrs"] = std::move(attrs);
    }
    instr["in"] = std::move(in);
    instr["out"] = std::move(out);
    program.push_back(std::move(instr));
  }
  return success();
}

/// "options": the optimizer's settings (fsdp-insert-optimizer).
json::Object optionsJson(ModuleOp module) {
  json::Object options;
  if (auto opt = module->getAttrOfType<DictionaryAttr>("fsdp.optimizer"))
    for (NamedAttribute na : opt) {
      json::Value v = nullptr;
      if (attrToJson(na.getValue(), v))
        options[na.getName().getValue()] = std::move(v);
    }
  else
    options["optimizer"] = "none";
  return options;
}

/// "memory": the totals and peaks by kind (docs/PLAN_FORMAT.md), and the
/// host arena's when there is one.
json::Object memoryJson(const MemoryPlan &plan) {
  auto byKind = [&](BufKind k, bool peak) {
    return peak ? plan.peakByKind[(int)k] : plan.totalByKind[(int)k];
  };
  auto maxLive = [&](BufKind k) { return plan.maxLiveByKind[(int)k]; };
  json::Object memory{{"params", byKind(BufKind::Param, false)},
                      {"state", byKind(BufKind::State, false)},
                      {"inputs", byKind(BufKind::Input, false)},
                      {"grads", maxLive(BufKind::Grad)},
                      {"activations", maxLive(BufKind::Activation)},
                      {"temps", byKind(BufKind::Temp, true)},
                      {"comm", maxLive(BufKind::Comm)},
                      {"grads_at_peak", byKind(BufKind::Grad, true)},
                      {"activations_at_peak", byKind(BufKind::Activation, true)},
                      {"peak_live", plan.peakLive},
                      {"peak", plan.arenaBytes}};
  if (plan.hostArenaBytes > 0)
    memory["host"] = json::Object{{"params", plan.hostTotalByKind[(int)BufKind::Param]},
                                  {"state", plan.hostTotalByKind[(int)BufKind::State]},
                                  {"activations", plan.hostTotalByKind[(int)BufKind::Activation]},
                                  {"peak_live", plan.hostPeakLive},
                                  {"peak", plan.hostArenaBytes}};
  if (plan.nvmeBytes > 0) {
    // The staging buffers are state too: count what is live at once, not
    // their sum.
    json::Object &host = *memory["host"].getAsObject();
    host["state"] = plan.hostPersistentState;
    host["staging"] = plan.hostStagingPeak;
    memory["nvme"] = json::Object{
        {"state", plan.nvmeState}, {"params", plan.nvmeParams}, {"file", plan.nvmeBytes}};
  }
  return memory;
}

struct ExportPlanPass : mlir::fsdp::impl::FsdpExportPlanBase<ExportPlanPass> {
  using Base::Base;

  void runOnOperation() override;
};

void ExportPlanPass::runOnOperation() {
  ModuleOp module = getOperation();
  if (output.empty()) {
    mlir::emitError(module.getLoc()) << "convert-fsdp-to-plan needs output=PATH";
    return signalPassFailure();
  }
  auto step = getTrainStep(module, "fsdp-autodiff");
  if (!step)
    return signalPassFailure();
  // The plan fsdp-plan-memory computed (preserved by it), or one planned
  // now with the alignment it recorded (64 when it did not run), so the
  // plan file and the IR's recorded offsets agree.
  auto &analysis = getAnalysis<MemoryPlanAnalysis>();
  markAllAnalysesPreserved();
  if (failed(analysis.plan))
    return signalPassFailure();
  MemoryPlan &plan = *analysis.plan;

  // The sections that can fail, in order (the first error stops it).
  FailureOr<json::Array> buffers = buffersJson(plan, step.getLoc());
  if (failed(buffers))
    return signalPassFailure();
  FailureOr<json::Array> inputs = inputsJson(step, plan);
  if (failed(inputs))
    return signalPassFailure();
  json::Array outputs, program;
  if (failed(programJson(module, step, plan, outputs, program)))
    return signalPassFailure();
  MeshAttr mesh = getMesh(module);
  int64_t world = mesh ? mesh.getWorldSize() : 1;
  int64_t stage = 0;
  if (auto s = module->getAttrOfType<IntegerAttr>("fsdp.stage"))
    stage = s.getInt();
  std::string modelName = "model";
  if (auto name = module.getSymName())
    modelName = name->str();
  json::Object root{
      {"format", std::string(::fsdp::kPlanFormat)},
      {"version", (int64_t)::fsdp::kPlanVersion},
      {"model", modelName},
      {"world_size", world},
      {"stage", stage},
      {"options", optionsJson(module)},
      {"arena_bytes", plan.arenaBytes},
      {"memory", memoryJson(plan)},
      {"units", unitsJson(plan)},
      {"params", paramsJson(plan)},
      {"states", statesJson(module, plan)},
      {"inputs", std::move(*inputs)},
      {"outputs", std::move(outputs)},
      {"buffers", std::move(*buffers)},
      {"program", std::move(program)},
  };
  // The features a runtime needs beyond the version (PlanSchema.h's
  // kPlanFeatures), listed only where used: an older runtime refuses the
  // plan by the field instead of running it otherwise.
  json::Array features;
  if (auto opt = module->getAttrOfType<DictionaryAttr>("fsdp.optimizer"))
    if (auto dtype = opt.getAs<StringAttr>("state_dtype"))
      features.push_back(("optimizer-state-" + dtype.getValue()).str()); // bf16, 8bit, 4bit
  if (auto mp = module->getAttrOfType<DictionaryAttr>(kMixedPrecisionAttrName))
    if (mp.get(kMasterDtypeAttrName))
      features.push_back("master-bf16");
  if (!features.empty())
    root["requires"] = std::move(features);
  if (plan.hostArenaBytes > 0)
    root["host_arena_bytes"] = plan.hostArenaBytes;
  if (plan.nvmeBytes > 0) {
    root["nvme_bytes"] = plan.nvmeBytes;
    // Each swapped buffer and its staging on whole blocks of this many
    // bytes (MemoryPlan's ioAlign): the runtime may move them with O_DIRECT.
    root["swap_alignment"] = plan.swapAlignment;
  }
  // The schedule fsdp-search-schedule chose (docs/PLAN_FORMAT.md): for
  // people and tools; the runtime ignores it.
  if (auto strategy = module->getAttrOfType<DictionaryAttr>("fsdp.strategy")) {
    json::Object o;
    for (NamedAttribute na : strategy) {
      json::Value v = nullptr;
      if (attrToJson(na.getValue(), v))
        o[na.getName().getValue()] = std::move(v);
    }
    root["strategy"] = std::move(o);
  }
  // Dynamic loss scaling (docs/PLAN_FORMAT.md): the runtime's GradScaler.
  if (DictionaryAttr ls = getLossScalePolicy(module)) {
    json::Object o;
    for (StringRef key : {"init", "growth_factor", "backoff_factor"})
      if (auto f = ls.getAs<FloatAttr>(key))
        o[key] = f.getValueAsDouble();
    if (auto gi = ls.getAs<IntegerAttr>("growth_interval"))
      o["growth_interval"] = gi.getInt();
    root["loss_scale"] = std::move(o);
  }
  // A 1-D mesh needs no record (docs/PLAN_FORMAT.md: absent = 1 x N).
  if (mesh && (mesh.getReplicas() > 1 || mesh.getReshard() || mesh.getNode())) {
    json::Object m{{"replicas", mesh.getReplicas()},
                   {"shards", mesh.getShards()}};
    if (mesh.getReshard())
      m["reshard"] = mesh.getReshard();
    if (mesh.getNode())
      m["node"] = mesh.getNode();
    root["mesh"] = std::move(m);
  }
  json::Value value(std::move(root));
  llvm::Error err = llvm::writeToOutput(output, [&](llvm::raw_ostream &os) {
    os << llvm::formatv("{0:1}", value) << "\n";
    return llvm::Error::success();
  });
  if (err) {
    mlir::emitError(module.getLoc()) << "cannot write the plan to '" << output
                       << "': " << llvm::toString(std::move(err));
    return signalPassFailure();
  }
}

} // namespace
