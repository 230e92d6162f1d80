//===- CostModel.cpp - predicted step time of a planned step --------------===//
//
// Keep in step with tools/fsdp-sim (simulate, comm_cost, flops_of,
// units_of, bytes_of): the two must predict the same step for the same
// plan, and test/lit/e2e/budget.test compares them.
//
//===----------------------------------------------------------------------===//

#include "passes/CostModel.h"
#include "passes/Passes.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <cmath>

using namespace mlir;
using namespace mlir::fsdp;
namespace json = llvm::json;

bool mlir::fsdp::loadDeviceProfile(StringRef nameOrPath, DeviceProfile &p,
                                   std::string &error) {
  p = DeviceProfile();
  if (nameOrPath == "h100")
    return true;
  auto buf = llvm::MemoryBuffer::getFile(nameOrPath);
  if (!buf) {
    error = "cannot read device profile '" + nameOrPath.str() +
            "' (expected h100 or a JSON from fsdp-run --calibrate): " +
            buf.getError().message();
    return false;
  }
  llvm::Expected<json::Value> v = json::parse((*buf)->getBuffer());
  if (!v) {
    error = "device profile '" + nameOrPath.str() +
            "' is not JSON: " + llvm::toString(v.takeError());
    return false;
  }
  const json::Object *root = v->getAsObject();
  const json::Object *c = root ? root->getObject("compute") : nullptr;
  if (!c || !c->getNumber("gemm_flops_per_s") ||
      !c->getNumber("mem_bytes_per_s") || !c->getNumber("op_overhead_s")) {
    error = "device profile '" + nameOrPath.str() +
            "' has no compute.{gemm_flops_per_s, mem_bytes_per_s, "
            "op_overhead_s} (write one with fsdp-run --calibrate)";
    return false;
  }
  if (auto n = root->getString("name"))
    p.name = n->str();
  else
    p.name = nameOrPath.str();
  p.cpu = root->getString("kind") == StringRef("cpu");
  p.cores = root->getInteger("cores").value_or(0);
  p.threadsPerRank = root->getInteger("threads_per_rank").value_or(0);
  p.gemmFlopsPerS = *c->getNumber("gemm_flops_per_s");
  p.gemmFlopsPerSBf16 =
      c->getNumber("gemm_flops_per_s_bf16").value_or(p.gemmFlopsPerS);
  p.memBytesPerS = *c->getNumber("mem_bytes_per_s");
  p.opOverheadS = *c->getNumber("op_overhead_s");
  if (p.gemmFlopsPerS <= 0 || p.gemmFlopsPerSBf16 <= 0 || p.memBytesPerS <= 0 ||
      p.opOverheadS < 0) {
    error = "device profile '" + nameOrPath.str() +
            "': rates must be positive and the overhead >= 0";
    return false;
  }
  if (const json::Object *per = c->getObject("seconds_per_unit"))
    for (const auto &kv : *per)
      if (auto s = kv.second.getAsNumber())
        p.secondsPerUnit[kv.first.str()] = *s;
  p.ranksPerNode = 0;
  p.alphaS = p.betaSPerByte = 0;
  if (const json::Object *link = root->getObject("link")) {
    p.alphaS = link->getNumber("alpha_s").value_or(0.0);
    p.betaSPerByte = link->getNumber("beta_s_per_byte").value_or(0.0);
    p.ranksPerNode = link->getInteger("ranks_per_node").value_or(0);
    p.interAlphaS = link->getNumber("inter_alpha_s").value_or(p.alphaS);
    p.interBetaSPerByte =
        link->getNumber("inter_beta_s_per_byte").value_or(p.betaSPerByte);
  }
  return true;
}

double mlir::fsdp::collectiveSeconds(StringRef op, int64_t n, int64_t bytes,
                                     bool interNode, const DeviceProfile &p) {
  if (n <= 1)
    return 0.0;
  double alpha = interNode ? p.interAlphaS : p.alphaS;
  double beta = interNode ? p.interBetaSPerByte : p.betaSPerByte;
  double frac = double(n - 1) / double(n);
  // Gloo's reduce-scatter over a group whose size is not a power of two is
  // an all-reduce (runtime/comm/GlooComm.cpp); NCCL's ring has no such case.
  if (op == "all_reduce" || (op == "reduce_scatter" && p.cpu && (n & (n - 1))))
    return 2.0 * (n - 1) * alpha + 2.0 * frac * double(bytes) * beta;
  return (n - 1) * alpha + frac * double(bytes) * beta;
}

namespace {

int64_t numel(ArrayRef<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}

double flopsOf(Operation *op) {
  if (isa<MatmulOp>(op)) {
    ArrayRef<int64_t> lhs = shapeOf(op->getOperand(0));
    int64_t k = op->hasAttr("transpose_lhs") ? lhs[lhs.size() - 2] : lhs.back();
    return 2.0 * double(numel(shapeOf(op->getResult(0)))) * double(k);
  }
  StringRef name = op->getName().stripDialect();
  if (name == "attention" || name == "attention_grad") {
    ArrayRef<int64_t> q = shapeOf(op->getOperand(0)); // [B, T, C]
    double f = 4.0 * q[0] * q[1] * q[1] * q[2];        // Q K^T and P V
    return f * (name == "attention_grad" ? 2.5 : 1.0);
  }
  return 0.0;
}

double unitsOf(Operation *op, Value firstIn) {
  ArrayRef<int64_t> s = shapeOf(firstIn);
  StringRef name = op->getName().stripDialect();
  if (name == "attention" || name == "attention_grad")
    return double(s[0]) * s[1] * s[1] * s[2];
  return double(numel(s));
}

bool isLowPrecision(Value v) {
  Type e = cast<RankedTensorType>(v.getType()).getElementType();
  return e.isBF16() || e.isF16();
}

} // namespace

StepPrediction mlir::fsdp::predictStep(ModuleOp module, func::FuncOp step,
                                       const MemoryPlan &plan,
                                       const DeviceProfile &p) {
  int64_t world = 1, replicas = 1, shards = 1;
  if (MeshAttr mesh = getMesh(module)) {
    world = mesh.getWorldSize();
    replicas = mesh.getReplicas();
    shards = mesh.getShards();
  }
  double slow = 1.0;
  if (p.cpu && p.cores > 0)
    slow = std::max(1.0, double(world) * std::max<int64_t>(1, p.threadsPerRank) /
                             double(p.cores));
  auto bytesOf = [&](Value v) -> double {
    auto it = plan.valueBuffer.find(v);
    return it == plan.valueBuffer.end() ? 0.0
                                        : double(plan.buffers[it->second].bytes);
  };

  StepPrediction r;
  double t = 0, commFree = 0;
  DenseMap<Value, double> pending;
  for (Operation &opRef : step.getBody().front()) {
    Operation *op = &opRef;
    if (isa<func::ReturnOp, SetGradOp>(op) || isStorageAlias(op))
      continue;
    if (auto w = dyn_cast<WaitOp>(op)) {
      auto it = pending.find(op->getOperand(0));
      double done = it == pending.end() ? t : it->second;
      if (it != pending.end())
        pending.erase(it);
      double stall = std::max(0.0, done - t);
      r.exposedS += stall;
      t += stall;
      continue;
    }
    StringRef name = op->getName().stripDialect();
    if (isa<AllGatherOp, ReduceScatterOp, AllReduceOp>(op)) {
      StringRef group = "world";
      if (auto g = op->getAttrOfType<StringAttr>("group"))
        group = g.getValue();
      int64_t n = group == "shard" ? shards : group == "replica" ? replicas : world;
      // A group spans nodes when its ranks do not fit one node: shard
      // groups are contiguous ranks, replica groups strided across all.
      int64_t span = group == "shard" ? shards : world;
      bool inter = p.ranksPerNode > 0 && span > p.ranksPerNode;
      Value whole = isa<AllGatherOp>(op) ? op->getResult(0) : op->getOperand(0);
      double cost = collectiveSeconds(name, n, int64_t(bytesOf(whole)), inter, p);
      r.commS += cost;
      double start = std::max(t, commFree);
      commFree = start + cost;
      if (op->hasAttr("async")) {
        pending[op->getResult(0)] = commFree;
      } else {
        r.exposedS += commFree - t;
        t = commFree;
      }
      continue;
    }
    // A compute instruction (set_param / set_state / set_unit are copies).
    double bytes = 0;
    Value firstIn;
    if (isa<SetParamOp, SetStateOp, SetUnitOp>(op)) {
      Value v = op->getOperand(0);
      firstIn = v;
      StringRef sym;
      if (auto s = dyn_cast<SetParamOp>(op))
        sym = s.getName();
      else if (auto s = dyn_cast<SetStateOp>(op))
        sym = s.getName();
      else
        sym = cast<SetUnitOp>(op).getName();
      bytes = bytesOf(v);
      auto it = plan.symbolBuffer.find(sym);
      if (it != plan.symbolBuffer.end())
        bytes += double(plan.buffers[it->second].bytes);
    } else {
      for (Value v : op->getOperands())
        bytes += bytesOf(v);
      for (Value v : op->getResults())
        bytes += bytesOf(v);
      if (op->getNumOperands())
        firstIn = op->getOperand(0);
    }
    double gemm = firstIn && isLowPrecision(firstIn) ? p.gemmFlopsPerSBf16
                                                     : p.gemmFlopsPerS;
    double work = std::max(flopsOf(op) / gemm, bytes / p.memBytesPerS);
    auto per = p.secondsPerUnit.find(isa<SetParamOp, SetStateOp, SetUnitOp>(op)
                                         ? StringRef("copy")
                                         : name);
    if (per != p.secondsPerUnit.end() && firstIn)
      work = std::max(work, unitsOf(op, firstIn) * per->second);
    double cost = (p.opOverheadS + work) * slow;
    r.computeS += cost;
    t += cost;
  }
  r.stepS = std::max(t, commFree);
  return r;
}

bool mlir::fsdp::parseByteSize(StringRef text, int64_t &bytes) {
  text = text.trim();
  size_t i = 0;
  while (i < text.size() && (isdigit(text[i]) || text[i] == '.'))
    ++i;
  StringRef num = text.take_front(i), unit = text.drop_front(i).trim();
  double v;
  if (num.empty() || num.getAsDouble(v) || !(v > 0))
    return false;
  double mult;
  std::string u = unit.lower();
  if (u.empty() || u == "b")
    mult = 1;
  else if (u == "kib" || u == "k")
    mult = 1024.0;
  else if (u == "mib" || u == "m")
    mult = 1024.0 * 1024;
  else if (u == "gib" || u == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (u == "tib" || u == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "kb")
    mult = 1e3;
  else if (u == "mb")
    mult = 1e6;
  else if (u == "gb")
    mult = 1e9;
  else if (u == "tb")
    mult = 1e12;
  else
    return false;
  double b = v * mult;
  if (!(b >= 1) || b > 9.0e18)
    return false;
  bytes = int64_t(b);
  return true;
}
