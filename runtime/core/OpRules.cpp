//===- OpRules.cpp - every op's shape, dtype and attribute rules ----------===//
//
// One check per compute op, keyed by the op names of PlanSchema.h (which
// also holds the arities), plus the collectives' rules. Devices never
// re-check: an instruction reaches Device::run only after checkInstruction
// accepted it at plan load.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/OpRules.h"

#include "runtime/core/ShapeRules.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_map>

namespace fsdp {
namespace rules {

std::string shapeStr(const Shape &s) { return shapes::name(s); }

namespace {

Status expectShape(const Op &op, const Buffer &b, const Shape &want, const char *what) {
  if (b.shape != want)
    return FSDP_ERROR(op.inst.op, ": expected ", what, " of shape ", shapeStr(want), ", found ",
                      shapeStr(b.shape));
  return Status::ok();
}

Status expectF32(const Op &op, std::initializer_list<const Buffer *> bufs) {
  for (const Buffer *b : bufs)
    if (b->dtype != DType::F32)
      return FSDP_ERROR("unsupported dtype ", dtypeName(b->dtype), " for op ", op.inst.op,
                        " on the CPU backend (f32 only)");
  return Status::ok();
}

/// Whether `op` is an update whose state may be stored in bf16 or 8 bits.
bool hasNarrowableState(const std::string &op) {
  return op == "adamw_update" || op == "sgd_momentum_update" || op == "lamb_norms" ||
         op == "lamb_update";
}

/// Whether an update's state is 8-bit (state-dtype=8bit: adamw_update's,
/// lamb_norms' and lamb_update's i8 moments, sgd_momentum_update's i8
/// buffer, each a packed vector of codes and scales).
bool packedMoments(const Op &op) {
  return hasNarrowableState(op.inst.op) && op.inst.in.size() > 2 && op.in(2).dtype == DType::I8;
}

/// An update's dtypes when its state may be bf16 (state-dtype=bf16:
/// adamw_update's and lamb_update's two moments, sgd_momentum_update's
/// buffer, and lamb_norms, which reads the moments and writes only its
/// f32 sums: `writes` false): p, g, lr, step and the new p in f32; the
/// `states` state operands (from operand 2) and the new states all f32,
/// or all bf16. `stochastic` rounds into bf16 and needs its draws' key.
/// With bf16 parameters (updatesBf16Params: master-dtype=bf16) p and the
/// new p are bf16, the rest as said; `stochastic_param` rounds the new p
/// stochastically and needs the key too.
Status updateStateDtype(const Op &op, int states, bool writes = true) {
  const int results = writes ? 1 + states : 1;
  if ((int)op.inst.in.size() < 2 + states || (int)op.inst.out.size() != results)
    return FSDP_ERROR(op.inst.op, ": expected at least ", 2 + states, " operands and ", results,
                      " result(s), found ", op.inst.in.size(), " and ", op.inst.out.size());
  const DType state = op.in(2).dtype;
  const bool packed = packedMoments(op);
  if (state != DType::F32 && state != DType::BF16 && !packed)
    return FSDP_ERROR(op.inst.op, ": state of ", dtypeName(state),
                      ": expected f32 or bf16 (or i8 8-bit codes)");
  if (packed != op.has("state_block"))
    return FSDP_ERROR(op.inst.op,
                      packed ? ": i8 state is 8-bit block codes: expected "
                               "state_block"
                             : ": state_block is for i8 state, found ",
                      packed ? "" : dtypeName(state));
  auto isState = [&](int i) { return i >= 2 && i < 2 + states; };
  const DType param = updatesBf16Params(op.plan, op.inst) ? DType::BF16 : DType::F32;
  for (int i = 0; i < (int)op.inst.in.size(); ++i) {
    DType want = isState(i) ? state : i == 0 ? param : DType::F32;
    if (op.in(i).dtype != want)
      return FSDP_ERROR(op.inst.op, ": operand ", i, " is ", dtypeName(op.in(i).dtype),
                        ", expected ", dtypeName(want),
                        isState(i) && states > 1 ? " (both moments in one dtype)" : "");
  }
  for (int i = 0; i < results; ++i) {
    DType want = i == 0 ? param : state;
    if (op.out(i).dtype != want)
      return FSDP_ERROR(op.inst.op, ": result ", i, " is ", dtypeName(op.out(i).dtype),
                        ", expected ", dtypeName(want));
  }
  if (op.b("stochastic_param")) {
    if (param != DType::BF16)
      return FSDP_ERROR(op.inst.op, ": stochastic_param rounds the parameters to bf16, but "
                                    "they are f32");
    if (!(op.i("key", -1) >= 0))
      return FSDP_ERROR(op.inst.op,
                        ": stochastic_param needs an integer key >= 0 (its draws' stream)");
  }
  if (op.b("stochastic")) {
    if (!writes)
      return FSDP_ERROR(op.inst.op, ": stochastic is the update's (this op writes no state)");
    if (state != DType::BF16)
      return FSDP_ERROR(op.inst.op, ": stochastic rounds the state to bf16, but it is ",
                        dtypeName(state));
    if (!(op.i("key", -1) >= 0))
      return FSDP_ERROR(op.inst.op, ": stochastic needs an integer key >= 0 (its draws' stream)");
  }
  if (packed) {
    // 8-bit or 4-bit state (state-dtype=8bit|4bit): each a packed vector
    // of the operand's codes and block scales (runtime/core/Moments8.h,
    // Moments4.h). 4-bit is AdamW's, and the plan says so as a whole (its
    // checkpoints name their buffers by it).
    const int64_t block = op.i("state_block", 0), n = op.in(0).numel();
    const int64_t bits = op.has("state_bits") ? op.i("state_bits", 0) : 8;
    if (!(block >= 32 && block <= 4096 && (block & (block - 1)) == 0))
      return FSDP_ERROR(op.inst.op, ": state_block must be a power of two in [32, 4096]");
    if (bits != 4 && bits != 8)
      return FSDP_ERROR(op.inst.op, ": state_bits must be 4 (absent: 8), found ", bits);
    if (bits == 4 && op.inst.op != "adamw_update")
      return FSDP_ERROR(op.inst.op, ": 4-bit state (state_bits = 4) is adamw_update's only");
    if ((bits == 4) != op.plan.stateCodes4())
      return FSDP_ERROR(op.inst.op, ": ", bits, "-bit state in a plan that ",
                        bits == 4 ? "does not require" : "requires",
                        " optimizer-state-4bit: a plan keeps its packed state in one code width");
    const int64_t want = shapes::packedStateBytes(n, block, bits);
    for (int i = 2; i < 2 + states; ++i) {
      if (op.in(i).numel() != want)
        return FSDP_ERROR(op.inst.op, ": ", bits, "-bit state of ", n, " elements in blocks of ",
                          block, " are ", want, " bytes; operand ", i, " has ", op.in(i).numel());
      if (writes && op.out(i - 1).numel() != want)
        return FSDP_ERROR(op.inst.op, ": ", bits, "-bit state of ", n, " elements in blocks of ",
                          block, " are ", want, " bytes; result ", i - 1, " has ",
                          op.out(i - 1).numel());
    }
  } else if (op.has("state_bits")) {
    return FSDP_ERROR(op.inst.op, ": state_bits is for i8 state, found ", dtypeName(state));
  }
  if (!op.attrError.empty())
    return FSDP_ERROR(op.inst.op, ": ", op.attrError);
  return Status::ok();
}

Status expectAllF32(const Op &op) {
  for (int64_t id : op.inst.in)
    FSDP_RETURN_IF_ERROR(expectF32(op, {&op.plan.buffers[id]}));
  for (int64_t id : op.inst.out)
    FSDP_RETURN_IF_ERROR(expectF32(op, {&op.plan.buffers[id]}));
  return Status::ok();
}

bool isInt(DType t) { return t == DType::I32 || t == DType::I64; }
bool isFloat(DType t) { return t == DType::F32 || isNarrowFloat(t); }

Status checkSame(const Op &op) {
  FSDP_RETURN_IF_ERROR(expectAllF32(op));
  for (int64_t id : op.inst.in)
    if (op.plan.buffers[id].numel() != op.out(0).numel())
      return FSDP_ERROR(op.inst.op, ": expected operands of ", op.out(0).numel(),
                        " elements, found ", op.plan.buffers[id].numel());
  return Status::ok();
}

Status checkBinary(const Op &op) {
  FSDP_RETURN_IF_ERROR(expectAllF32(op));
  Shape s;
  if (!shapes::broadcast(op.in(0).shape, op.in(1).shape, s))
    return FSDP_ERROR(op.inst.op, ": shapes ", shapeStr(op.in(0).shape), " and ",
                      shapeStr(op.in(1).shape), " do not broadcast");
  return expectShape(op, op.out(0), s, "a result");
}

Status checkWindow(const Op &op, const Buffer &big, const Buffer &small) {
  int64_t dim = op.i("dim", -1), off = op.i("offset", -1);
  if (dim < 0 || dim >= (int64_t)big.shape.size() || small.shape.size() != big.shape.size())
    return FSDP_ERROR(op.inst.op, ": bad dim ", dim, " for shapes ", shapeStr(big.shape), " and ",
                      shapeStr(small.shape));
  Shape want = big.shape;
  want[dim] = small.shape[dim];
  FSDP_RETURN_IF_ERROR(expectShape(op, small, want, "a window"));
  if (off < 0 || off > big.shape[dim] - small.shape[dim])
    return FSDP_ERROR(op.inst.op, ": a window of ", small.shape[dim], " at offset ", off,
                      " is out of bounds of ", big.shape[dim]);
  return Status::ok();
}

} // namespace

Status matmulDims(const Op &op, MM &d) {
  shapes::Matmul mm;
  std::string why;
  if (!shapes::matmul(op.in(0).shape, op.in(1).shape, op.b("transpose_lhs"), op.b("transpose_rhs"),
                      mm, why))
    return FSDP_ERROR(op.inst.op, ": ", why);
  d.batch = mm.batch;
  d.m = mm.m;
  d.n = mm.n;
  d.k = mm.k;
  return expectShape(op, op.out(0), mm.result(), "a result");
}

// [Note: bf16 storage, f32 compute]
// A mixed-precision plan stores activations, gathered parameters and
// gradients in bf16 (or f16); every kernel computes in f32. An instruction
// with such operands runs the f32 kernel on f32 copies: a plan of its own
// operands, each widened to f32 in a per-thread scratch buffer OUTSIDE the
// arena (fsdp-run reports its high-water mark next to the arena's), the
// inputs converted exactly, the outputs rounded back to nearest even. The
// load-time check is the f32 op's check on that widened plan, so shapes,
// attributes and integer operands are checked exactly as for f32. `cast`
// converts dtypes itself and is never widened.

/// (accumulator operand, the result that continues its sum) of the ops
/// that take accumulators, those of them `inst` has (valid buffer ids only).
static std::vector<std::pair<size_t, size_t>> accumulatorsOf(const Plan &plan,
                                                             const Instruction &inst) {
  std::vector<std::pair<size_t, size_t>> pairs;
  if (inst.op == "matmul")
    pairs = {{2, 0}};
  else if (inst.op == "matmul_bias_grad")
    pairs = {{2, 0}, {3, 1}};
  else if (inst.op == "layer_norm_grad_acc" || inst.op == "rms_norm_grad_acc")
    pairs = {{3, 0}};
  auto valid = [&](const std::vector<int64_t> &ids, size_t i) {
    return i < ids.size() && ids[i] >= 0 && ids[i] < (int64_t)plan.buffers.size();
  };
  pairs.erase(std::remove_if(
                  pairs.begin(), pairs.end(),
                  [&](auto p) { return !valid(inst.in, p.first) || !valid(inst.out, p.second); }),
              pairs.end());
  return pairs;
}

bool updatesBf16Params(const Plan &plan, const Instruction &inst) {
  if (inst.op != "sgd_update" && inst.op != "sgd_momentum_update" && inst.op != "adamw_update")
    return false;
  auto dtypeOf = [&](const std::vector<int64_t> &ids, size_t i) {
    return i < ids.size() && ids[i] >= 0 && ids[i] < (int64_t)plan.buffers.size()
               ? plan.buffers[ids[i]].dtype
               : DType::I8; // none
  };
  return dtypeOf(inst.in, 0) == DType::BF16 && dtypeOf(inst.in, 1) == DType::F32;
}

bool needsWidening(const Plan &plan, const Instruction &inst) {
  if (updatesBf16Params(plan, inst))
    return false; // widens its bf16 parameters itself (master-dtype=bf16)
  if (inst.op == "cast" || inst.op == "to_host" || inst.op == "to_device" ||
      inst.op == "quantize" || inst.op == "dequantize")
    return false; // converts or copies bytes itself
  if (hasNarrowableState(inst.op) && inst.in.size() > 2 && inst.in[2] >= 0 &&
      inst.in[2] < (int64_t)plan.buffers.size() &&
      (plan.buffers[inst.in[2]].dtype == DType::BF16 || plan.buffers[inst.in[2]].dtype == DType::I8))
    return false; // reads and writes its bf16 or 8-bit state itself (state-dtype=bf16|8bit)
  for (const std::vector<int64_t> *ids : {&inst.in, &inst.out})
    for (int64_t id : *ids)
      if (id >= 0 && id < (int64_t)plan.buffers.size() && isNarrowFloat(plan.buffers[id].dtype))
        return true;
  return false;
}

Widened widen(const Plan &plan, const Instruction &inst) {
  Widened w;
  w.plan.version = plan.version;
  w.plan.worldSize = plan.worldSize;
  w.plan.meshReplicas = plan.meshReplicas;
  w.plan.meshShards = plan.meshShards;
  w.plan.meshReshard = plan.meshReshard;
  w.plan.meshNode = plan.meshNode;
  w.plan.stage = plan.stage;
  std::unordered_map<int64_t, int64_t> slot;
  auto map = [&](int64_t id) {
    auto [it, fresh] = slot.try_emplace(id, (int64_t)w.ids.size());
    if (fresh) {
      Buffer b = plan.buffers[id];
      b.id = it->second;
      if (isNarrowFloat(b.dtype))
        b.dtype = DType::F32;
      b.bytes = b.numel() * dtypeSize(b.dtype);
      b.offset = w.bytes;
      b.rankStride = 0;
      b.rankPeriod = 0;
      b.aliasOf = -1;
      w.bytes += (b.bytes + 63) / 64 * 64;
      w.plan.buffers.push_back(std::move(b));
      w.ids.push_back(id);
    }
    return it->second;
  };
  w.inst.op = inst.op;
  w.inst.attrs = inst.attrs;
  for (int64_t id : inst.in)
    w.inst.in.push_back(map(id));
  for (int64_t id : inst.out)
    w.inst.out.push_back(map(id));
  return w;
}

} // namespace rules

namespace {

using namespace rules;
using Check = std::function<Status(const Op &)>;

const std::unordered_map<std::string, Check> &checks() {
  static const std::unordered_map<std::string, Check> t = [] {
    std::unordered_map<std::string, Check> m;
    m["add"] = checkBinary;
    m["sub"] = checkBinary;
    m["mul"] = checkBinary;
    m["div"] = checkBinary;
    m["neg"] = checkSame;
    m["scale"] = checkSame;
    m["dropout"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(checkSame(op));
      for (const char *a : {"p", "id"})
        if (!op.inst.attrs.contains(a))
          return FSDP_ERROR("dropout: missing attribute ", a);
      double p = op.f("p", -1);
      int64_t id = op.i("id", -1), micro = op.i("micro", 0), count = op.i("micro_count", 1);
      if (!op.attrError.empty())
        return Status::error(op.attrError);
      if (!(p >= 0 && p < 1))
        return FSDP_ERROR("dropout: p must be in [0, 1), found ", p);
      if (id < 0)
        return FSDP_ERROR("dropout: id must be an integer >= 0, found ", id);
      if (count < 1 || count > (int64_t(1) << 20) || micro < 0 || micro >= count)
        return FSDP_ERROR("dropout: micro must be in [0, micro_count) with micro_count in "
                          "1..2^20, found micro ", micro, " of ", count);
      return Status::ok();
    };
    m["fill"] = expectAllF32;
    m["copy"] = [](const Op &op) {
      if (op.in(0).bytes != op.out(0).bytes)
        return FSDP_ERROR("copy: sizes differ (", op.in(0).bytes, " vs ", op.out(0).bytes,
                          " bytes)");
      return Status::ok();
    };
    m["relu"] = checkSame;
    auto checkGelu = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(checkSame(op));
      std::string form = op.s("approximate", "tanh");
      if (form != "tanh" && form != "none")
        return FSDP_ERROR(op.inst.op, ": approximate must be \"tanh\" or \"none\", found \"",
                          form, "\"");
      return Status::ok();
    };
    m["gelu"] = checkGelu;
    m["softmax"] = checkSame;
    m["relu_grad"] = checkSame;
    m["gelu_grad"] = checkGelu;
    m["softmax_grad"] = checkSame;
    m["bias_add"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), {lastDim(op.in(0))}, "a bias"));
      return expectShape(op, op.out(0), op.in(0).shape, "a result");
    };
    m["matmul"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      MM d;
      FSDP_RETURN_IF_ERROR(matmulDims(op, d));
      if (op.inst.in.size() > 2) { // acc + a b (rank 2): the accumulator is the result's shape
        if (op.in(0).shape.size() != 2)
          return FSDP_ERROR("matmul: an accumulator takes rank-2 operands, found ",
                            shapeStr(op.in(0).shape));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), op.out(0).shape, "an accumulator"));
      }
      return Status::ok();
    };
    // The fused matmuls (fsdp-fuse-epilogues): rank-2 products only.
    auto fusedDims = [](const Op &op, MM &d) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      if (op.in(0).shape.size() != 2 || op.in(1).shape.size() != 2)
        return FSDP_ERROR(op.inst.op, ": expected rank-2 operands, found ",
                          shapeStr(op.in(0).shape), " and ", shapeStr(op.in(1).shape));
      return matmulDims(op, d);
    };
    m["matmul_bias"] = [fusedDims](const Op &op) {
      MM d;
      FSDP_RETURN_IF_ERROR(fusedDims(op, d));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {d.n}, "a bias"));
      if (op.inst.out.size() > 1) {
        if (!op.b("gelu"))
          return FSDP_ERROR("matmul_bias: a pre-activation output needs the gelu attribute");
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), {d.m, d.n}, "a pre-activation"));
      }
      return Status::ok();
    };
    m["matmul_gelu_grad"] = [fusedDims](const Op &op) {
      MM d;
      FSDP_RETURN_IF_ERROR(fusedDims(op, d));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {d.m, d.n}, "a pre-activation"));
      if (op.inst.out.size() > 1)
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), {d.n}, "a bias gradient"));
      return Status::ok();
    };
    m["matmul_bias_grad"] = [fusedDims](const Op &op) {
      if (!op.b("transpose_lhs") || op.b("transpose_rhs"))
        return FSDP_ERROR("matmul_bias_grad: expected transpose_lhs and not transpose_rhs");
      MM d;
      FSDP_RETURN_IF_ERROR(fusedDims(op, d));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), {d.m}, "a bias gradient"));
      if (op.inst.in.size() == 3)
        return FSDP_ERROR("matmul_bias_grad: expected two accumulators (the weight and bias "
                          "gradients' sums) or none, found one");
      if (op.inst.in.size() == 4) { // dw += dy^T x, db += dy's column sums
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), op.out(0).shape, "a weight accumulator"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), {d.m}, "a bias accumulator"));
      }
      return Status::ok();
    };
    m["layer_norm"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), {lastDim(op.in(0))}, "gamma"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {lastDim(op.in(0))}, "beta"));
      return expectShape(op, op.out(0), op.in(0).shape, "a result");
    };
    m["residual_layer_norm"] = [](const Op &op) { // lhs, rhs, gamma, beta -> sum, y
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &x = op.in(0).shape;
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), x, "a right operand"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {lastDim(op.in(0))}, "gamma"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), {lastDim(op.in(0))}, "beta"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), x, "a sum"));
      return expectShape(op, op.out(1), x, "a result");
    };
    m["layer_norm_grad_acc"] = [](const Op &op) { // x, gamma, dy, acc -> dx + acc, dg, db
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      Shape c{lastDim(op.in(0))};
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), c, "gamma"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), op.in(0).shape, "a gradient"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), op.in(0).shape, "an accumulated gradient"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), op.in(0).shape, "d_input"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), c, "d_gamma"));
      return expectShape(op, op.out(2), c, "d_beta");
    };
    m["layer_norm_grad"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      Shape c{lastDim(op.in(0))};
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), c, "gamma"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), op.in(0).shape, "a gradient"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), op.in(0).shape, "d_input"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), c, "d_gamma"));
      return expectShape(op, op.out(2), c, "d_beta");
    };
    // attention (q, k, v -> y [, lse]) and attention_grad (q, k, v, y,
    // lse, dy -> dq, dk, dv): q, y, dy and dq are [B, T, heads*D]; k, v, dk
    // and dv [B, T, kv_heads*D] (kv_heads = heads when absent); lse is f32
    // [B, heads, T].
    // heads and kv_heads of an attention op whose queries are [B, T, C]
    // (`s`): heads divides C, kv_heads (default heads) divides heads.
    auto attentionHeads = [](const Op &op, const Shape &s, const char *what, int64_t &heads,
                             int64_t &kv) {
      heads = op.i("heads", 0);
      if (s.size() != 3 || heads <= 0 || s[2] % heads)
        return FSDP_ERROR(op.inst.op, ": expected [B, T, C] ", what,
                          " with heads dividing C, found ", shapeStr(s), " and heads = ", heads);
      kv = op.i("kv_heads", heads);
      if (!op.attrError.empty())
        return FSDP_ERROR(op.inst.op, ": ", op.attrError);
      if (kv <= 0 || heads % kv)
        return FSDP_ERROR(op.inst.op, ": expected kv_heads to divide heads = ", heads,
                          ", found kv_heads = ", kv);
      return Status::ok();
    };
    auto checkAttention = [attentionHeads](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      int64_t heads, kv;
      FSDP_RETURN_IF_ERROR(attentionHeads(op, s, "operands", heads, kv));
      Shape ks{s[0], s[1], kv * (s[2] / heads)}, ls{s[0], heads, s[1]};
      bool grad = op.inst.op == "attention_grad";
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), ks, "k"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), ks, "v"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), s, "y"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(4), ls, "lse"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(5), s, "a gradient"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), ks, "d_k"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(2), ks, "d_v"));
      } else if (op.inst.out.size() == 2) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), ls, "lse"));
      }
      return expectShape(op, op.out(0), s, grad ? "d_q" : "a result");
    };
    m["attention"] = checkAttention;
    m["attention_grad"] = checkAttention;
    // attention_qkv (qkv -> y [, lse]) and attention_qkv_grad (qkv, y, lse,
    // dy -> dqkv): y and dy are [B, T, C] with C = heads * D; qkv and dqkv
    // [B, T, C + 2 kv_heads * D] (q, k, v side by side); lse f32 [B, heads, T].
    auto checkPackedAttention = [attentionHeads](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      bool grad = op.inst.op == "attention_qkv_grad";
      const Shape &s = grad ? op.in(1).shape : op.out(0).shape;
      int64_t heads, kv;
      FSDP_RETURN_IF_ERROR(attentionHeads(op, s, grad ? "y" : "result", heads, kv));
      Shape ps{s[0], s[1], s[2] + 2 * kv * (s[2] / heads)}, ls{s[0], heads, s[1]};
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(0), ps, "qkv (q, k, v side by side)"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), ls, "lse"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), s, "a gradient"));
        return expectShape(op, op.out(0), ps, "d_qkv");
      }
      if (op.inst.out.size() == 2)
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), ls, "lse"));
      return Status::ok();
    };
    m["attention_qkv"] = checkPackedAttention;
    m["attention_qkv_grad"] = checkPackedAttention;
    m["silu"] = checkSame;
    m["silu_grad"] = checkSame;
    m["swiglu"] = checkSame;
    m["swiglu_grad"] = [](const Op &op) { // both gradients of the operands' size
      FSDP_RETURN_IF_ERROR(checkSame(op));
      if (op.out(1).numel() != op.out(0).numel())
        return FSDP_ERROR("swiglu_grad: expected d_up of ", op.out(0).numel(),
                          " elements, found ", op.out(1).numel());
      return Status::ok();
    };
    // rms_norm (x, w -> y) and rms_norm_grad (x, w, dy -> dx, dw).
    auto checkRmsNorm = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      if (s.empty())
        return FSDP_ERROR(op.inst.op, ": expected an input of rank >= 1, found a scalar");
      Shape c{s.back()};
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), c, "a weight"));
      if (!op.has("epsilon"))
        return FSDP_ERROR(op.inst.op, ": missing attribute epsilon");
      double eps = op.f("epsilon", 0);
      if (op.attrError.empty() && !(eps > 0))
        return FSDP_ERROR(op.inst.op,
                          ": attribute epsilon: expected a positive "
                          "number, found ",
                          eps);
      if (op.inst.in.size() >= 3) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), s, "a gradient"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), c, "d_weight"));
      }
      if (op.inst.in.size() == 4)
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), s, "an accumulated gradient"));
      return expectShape(op, op.out(0), s, "a result");
    };
    m["rms_norm"] = checkRmsNorm;
    m["rms_norm_grad"] = checkRmsNorm;
    m["rms_norm_grad_acc"] = checkRmsNorm; // x, w, dy, acc -> dx + acc, dw
    m["residual_rms_norm"] = [](const Op &op) { // a, b, w -> a + b, y
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      if (s.empty())
        return FSDP_ERROR(op.inst.op, ": expected an input of rank >= 1, found a scalar");
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), s, "a right operand"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {s.back()}, "a weight"));
      double eps = op.f("epsilon", 0);
      if (!op.attrError.empty())
        return Status::error(op.attrError);
      if (!(eps > 0))
        return FSDP_ERROR(op.inst.op, ": attribute epsilon: expected a positive number, found ",
                          eps);
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), s, "a sum"));
      return expectShape(op, op.out(1), s, "a result");
    };
    // rope / rope_grad: [B, T, heads*D] -> the same, D even, theta > 1.
    auto checkRope = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      int64_t heads = op.i("heads", 0);
      if (s.size() != 3 || heads <= 0 || s[2] % heads || (s[2] / heads) % 2)
        return FSDP_ERROR(op.inst.op,
                          ": expected a [B, T, C] operand with heads "
                          "dividing C into heads of even size, found ",
                          shapeStr(s), " and heads = ", heads);
      if (!op.has("theta"))
        return FSDP_ERROR(op.inst.op, ": missing attribute theta");
      double theta = op.f("theta", 0);
      if (op.attrError.empty() && !(theta > 1))
        return FSDP_ERROR(op.inst.op,
                          ": attribute theta: expected a number > 1, "
                          "found ",
                          theta);
      return expectShape(op, op.out(0), s, "a result");
    };
    m["rope"] = checkRope;
    m["rope_grad"] = checkRope;
    m["embedding"] = [](const Op &op) {
      const Buffer &t = op.in(0), &ids = op.in(1);
      FSDP_RETURN_IF_ERROR(expectF32(op, {&t, &op.out(0)}));
      if (t.shape.size() != 2 || !isInt(ids.dtype))
        return FSDP_ERROR("embedding: expected a [vocab, width] "
                          "table and integer ids");
      Shape want = ids.shape;
      want.push_back(t.shape[1]);
      return expectShape(op, op.out(0), want, "a result");
    };
    m["embedding_grad"] = [](const Op &op) {
      const Buffer &ids = op.in(0), &t = op.out(0);
      FSDP_RETURN_IF_ERROR(expectF32(op, {&op.in(1), &t}));
      if (t.shape.size() != 2 || !isInt(ids.dtype))
        return FSDP_ERROR("embedding_grad: expected integer "
                          "ids and a [vocab, width] result");
      Shape want = ids.shape;
      want.push_back(t.shape[1]);
      return expectShape(op, op.in(1), want, "a gradient");
    };
    m["reshape"] = [](const Op &op) {
      if (op.in(0).bytes != op.out(0).bytes || op.in(0).dtype != op.out(0).dtype)
        return FSDP_ERROR("reshape: expected the same size and "
                          "dtype, found ",
                          shapeStr(op.in(0).shape), " -> ", shapeStr(op.out(0).shape));
      return Status::ok();
    };
    m["transpose"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      std::vector<int64_t> perm = op.iv("perm");
      const Shape &s = op.in(0).shape;
      if (perm.size() != s.size())
        return FSDP_ERROR("transpose: expected a permutation of ", s.size(), " dimensions");
      Shape want;
      std::vector<bool> seen(s.size(), false);
      for (int64_t p : perm) {
        if (p < 0 || p >= (int64_t)s.size() || seen[p])
          return FSDP_ERROR("transpose: perm is not a permutation");
        seen[p] = true;
        want.push_back(s[p]);
      }
      return expectShape(op, op.out(0), want, "a result");
    };
    m["slice"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      return checkWindow(op, op.in(0), op.out(0));
    };
    m["slice_grad"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      return checkWindow(op, op.out(0), op.in(0));
    };
    m["concat"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      int64_t dim = op.i("dim", -1);
      Shape want = op.out(0).shape;
      if (dim < 0 || dim >= (int64_t)want.size())
        return FSDP_ERROR("concat: bad dim ", dim);
      int64_t total = 0;
      for (size_t i = 0; i < op.inst.in.size(); ++i) {
        Shape s = want;
        s[dim] = op.in(i).shape.size() == want.size() ? op.in(i).shape[dim] : -1;
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(i), s, "an input"));
        total += s[dim];
      }
      if (total != want[dim])
        return FSDP_ERROR("concat: inputs add up to ", total, " along dim ", dim, ", result has ",
                          want[dim]);
      return Status::ok();
    };
    auto checkReduce = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      std::vector<int64_t> dims = op.iv("dims");
      const Shape &s = op.in(0).shape;
      std::vector<bool> red(s.size(), false);
      for (int64_t d : dims) {
        if (d < 0 || d >= (int64_t)s.size() || red[d])
          return FSDP_ERROR(op.inst.op, ": bad dims");
        red[d] = true;
      }
      return expectShape(op, op.out(0), shapes::reduced(s, dims), "a result");
    };
    m["reduce_sum"] = checkReduce;
    m["reduce_mean"] = checkReduce;
    m["broadcast"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      Shape s;
      if (!shapes::broadcast(op.in(0).shape, op.out(0).shape, s) || s != op.out(0).shape)
        return FSDP_ERROR("broadcast: cannot broadcast ", shapeStr(op.in(0).shape), " to ",
                          shapeStr(op.out(0).shape));
      return Status::ok();
    };
    m["sum_to"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      Shape s;
      if (!shapes::broadcast(op.out(0).shape, op.in(0).shape, s) || s != op.in(0).shape)
        return FSDP_ERROR("sum_to: ", shapeStr(op.out(0).shape), " does not broadcast to ",
                          shapeStr(op.in(0).shape));
      return Status::ok();
    };
    m["cast"] = [](const Op &op) {
      if (op.in(0).numel() != op.out(0).numel() || !isFloat(op.in(0).dtype) ||
          !isFloat(op.out(0).dtype))
        return FSDP_ERROR("cast: expected float tensors of one size");
      bool stochastic = op.b("stochastic"), sharded = op.b("sharded");
      int64_t key = op.i("key", -1);
      if (!op.attrError.empty())
        return Status::error(op.attrError);
      if (!stochastic && (sharded || op.inst.attrs.contains("key")))
        return FSDP_ERROR("cast: `key` and `sharded` belong to stochastic rounding");
      if (stochastic && (op.in(0).dtype != DType::F32 || op.out(0).dtype != DType::BF16))
        return FSDP_ERROR("cast: stochastic rounding converts f32 to bf16, found ",
                          dtypeName(op.in(0).dtype), " -> ", dtypeName(op.out(0).dtype));
      if (stochastic && key < 0)
        return FSDP_ERROR("cast: stochastic rounding needs `key`, an integer >= 0, found ", key);
      return Status::ok();
    };
    // ZeRO++'s qwZ (fsdp.quantize / fsdp.dequantize in the dialect): one
    // part, or `parts` gathered parts, of n values each in i8 bytes of
    // shapes::quantizedBytes(n, block).
    auto checkQuantized = [](const Op &op, const Buffer &values, const Buffer &bytes,
                             int64_t parts) {
      int64_t block = op.i("block", 0);
      if (!op.attrError.empty())
        return Status::error(op.attrError);
      if (!isFloat(values.dtype) || bytes.dtype != DType::I8 || values.shape.size() != 1 ||
          bytes.shape.size() != 1)
        return FSDP_ERROR(op.inst.op, ": expected flat float values and flat i8 bytes, found ",
                          dtypeName(values.dtype), " ", shapeStr(values.shape), " and ",
                          dtypeName(bytes.dtype), " ", shapeStr(bytes.shape));
      if (block <= 0 || parts <= 0 || values.numel() % parts != 0)
        return FSDP_ERROR(op.inst.op, ": expected block >= 1 and parts >= 1 dividing ",
                          values.numel(), " values, found block ", block, ", parts ", parts);
      const int64_t n = values.numel() / parts;
      if (n > (int64_t(1) << 40))
        return FSDP_ERROR(op.inst.op, ": ", n, " values a part, more than 2^40");
      if (bytes.numel() != parts * shapes::quantizedBytes(n, block))
        return FSDP_ERROR(op.inst.op, ": ", parts, " x ", n, " values in blocks of ", block,
                          " take ", parts * shapes::quantizedBytes(n, block), " bytes, found ",
                          bytes.numel());
      return Status::ok();
    };
    // `parts` on a quantize: equal parts quantized one after another
    // (qgZ, for an all_to_all); `reduce` on a dequantize: the parts summed
    // (or averaged) into one part's values instead of concatenated.
    auto checkParts = [](const Op &op, int64_t parts) {
      if (!op.attrError.empty())
        return Status::error(op.attrError);
      if (parts < 1 || parts > (int64_t(1) << 20))
        return FSDP_ERROR(op.inst.op, ": expected parts in 1..2^20, found ", parts);
      return Status::ok();
    };
    // `chunks` K on a quantize (hierarchical qgZ): the values are K equal
    // chunks and part p is chunks p, p + parts, p + 2 parts, ... (so K is
    // a multiple of parts; K == parts, the default, is parts in order).
    m["quantize"] = [checkQuantized, checkParts](const Op &op) {
      int64_t parts = op.i("parts", 1), chunks = op.i("chunks", parts);
      FSDP_RETURN_IF_ERROR(checkParts(op, parts));
      if (op.has("chunks") && !op.has("parts"))
        return FSDP_ERROR("quantize: `chunks` needs `parts`");
      const int64_t numel = op.in(0).numel();
      if (op.has("chunks") &&
          (chunks < parts || chunks % parts != 0 || chunks > numel || numel % chunks != 0))
        return FSDP_ERROR("quantize: expected chunks a multiple of parts (", parts,
                          ") dividing the ", numel, " values, found chunks ", chunks);
      return checkQuantized(op, op.in(0), op.out(0), parts);
    };
    m["dequantize"] = [checkQuantized, checkParts](const Op &op) {
      int64_t parts = op.i("parts", 0);
      std::string reduce = op.s("reduce", "");
      FSDP_RETURN_IF_ERROR(checkParts(op, parts));
      if (op.has("chunks"))
        return FSDP_ERROR("dequantize: `chunks` belongs to quantize");
      if (!op.has("reduce"))
        return checkQuantized(op, op.out(0), op.in(0), parts);
      if (reduce != "sum" && reduce != "mean")
        return FSDP_ERROR("dequantize: expected reduce = \"sum\" or \"mean\", found ",
                          op.inst.attrs["reduce"].dump());
      // The values of one part, parts times over: the bytes' count (at
      // most 2^40 x 2^20 values: no overflow).
      Buffer whole = op.out(0);
      if (whole.numel() > (int64_t(1) << 40))
        return FSDP_ERROR("dequantize: ", whole.numel(), " values a part, more than 2^40");
      if (whole.shape.size() == 1)
        whole.shape[0] *= parts;
      return checkQuantized(op, whole, op.in(0), parts);
    };
    // fsdp-offload's copies between the arenas (Plan.cpp checks the
    // sides): the same bytes, any dtype.
    for (const char *copy : {"to_host", "to_device"})
      m[copy] = [](const Op &op) {
        if (op.in(0).shape != op.out(0).shape || op.in(0).dtype != op.out(0).dtype)
          return FSDP_ERROR(op.inst.op, ": expected the same shape and dtype, found ",
                            shapeStr(op.in(0).shape), " ", dtypeName(op.in(0).dtype), " -> ",
                            shapeStr(op.out(0).shape), " ", dtypeName(op.out(0).dtype));
        return Status::ok();
      };
    // grad: cross_entropy_grad (one result, the gradient) or
    // cross_entropy_fused (two: the loss, then the gradient).
    auto checkCE = [](const Op &op, bool grad) {
      const Buffer &l = op.in(0), &y = op.in(1);
      bool fused = op.inst.out.size() == 2;
      FSDP_RETURN_IF_ERROR(expectF32(op, {&l, &op.out(0)}));
      if (fused)
        FSDP_RETURN_IF_ERROR(expectF32(op, {&op.out(1)}));
      if (l.shape.size() < 2 || !isInt(y.dtype))
        return FSDP_ERROR(op.inst.op, ": expected [..., classes] logits and integer labels");
      Shape lead(l.shape.begin(), l.shape.end() - 1);
      FSDP_RETURN_IF_ERROR(expectShape(op, y, lead, "labels"));
      int64_t classes = op.i("classes", l.shape.back());
      if (op.attrError.empty() && (classes < 1 || classes > l.shape.back()))
        return FSDP_ERROR(op.inst.op, ": classes = ", classes, " must lie in [1, ",
                          l.shape.back(), "] (the logits' last dimension)");
      double smoothing = op.f("label_smoothing", 0);
      if (op.attrError.empty() && !(smoothing >= 0 && smoothing <= 1))
        return FSDP_ERROR(op.inst.op, ": label_smoothing = ", smoothing, " must lie in [0, 1]");
      // ignore_index and its normalizer (the last input) come together.
      size_t required = grad ? 3 : 2;
      bool hasNorm = op.inst.in.size() > required, hasIgnore = op.has("ignore_index");
      if (hasNorm != hasIgnore)
        return FSDP_ERROR(op.inst.op, hasIgnore ? ": ignore_index needs the kept-label count "
                                                  "input (fsdp.count_labels) after the others"
                                                : ": a normalizer input without ignore_index");
      if (hasIgnore) {
        int64_t ignore = op.i("ignore_index", 0);
        if (op.attrError.empty() && (ignore < INT32_MIN || ignore > INT32_MAX))
          return FSDP_ERROR(op.inst.op, ": ignore_index = ", ignore, " does not fit 32 bits");
        FSDP_RETURN_IF_ERROR(expectF32(op, {&op.in(required)}));
        FSDP_RETURN_IF_ERROR(
            expectShape(op, op.in(required), {}, "a scalar normalizer (the kept-label count)"));
      }
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {}, "a scalar gradient"));
        if (fused)
          FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), {}, "a scalar loss"));
        return expectShape(op, op.out(fused ? 1 : 0), l.shape, "a result");
      }
      return expectShape(op, op.out(0), {}, "a scalar loss");
    };
    m["cross_entropy"] = [checkCE](const Op &op) { return checkCE(op, false); };
    m["cross_entropy_grad"] = [checkCE](const Op &op) { return checkCE(op, true); };
    m["cross_entropy_fused"] = [checkCE](const Op &op) { return checkCE(op, true); };
    m["count_labels"] = [](const Op &op) {
      if (!isInt(op.in(0).dtype))
        return FSDP_ERROR("count_labels: expected integer labels, found ",
                          dtypeName(op.in(0).dtype));
      FSDP_RETURN_IF_ERROR(expectF32(op, {&op.out(0)}));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), {}, "a scalar count"));
      if (!op.has("ignore_index"))
        return FSDP_ERROR("count_labels: missing ignore_index");
      int64_t ignore = op.i("ignore_index", 0), divisor = op.i("divisor", 1);
      if (op.attrError.empty() && (ignore < INT32_MIN || ignore > INT32_MAX))
        return FSDP_ERROR("count_labels: ignore_index = ", ignore, " does not fit 32 bits");
      if (op.attrError.empty() && divisor < 1)
        return FSDP_ERROR("count_labels: divisor = ", divisor, " must be >= 1");
      return Status::ok();
    };
    auto checkPair = [](const Op &op, bool grad) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), op.in(0).shape, "a target"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {}, "a scalar gradient"));
        return expectShape(op, op.out(0), op.in(0).shape, "a result");
      }
      return expectShape(op, op.out(0), {}, "a scalar loss");
    };
    m["mse_loss"] = [checkPair](const Op &op) { return checkPair(op, false); };
    m["mse_loss_grad"] = [checkPair](const Op &op) { return checkPair(op, true); };
    m["bce_with_logits"] = [checkPair](const Op &op) { return checkPair(op, false); };
    m["bce_with_logits_grad"] = [checkPair](const Op &op) { return checkPair(op, true); };
    // Optimizer updates: operands (p, g, [states...], lr, [step]).
    auto checkUpdate = [](int states, bool hasStep) {
      return [states, hasStep](const Op &op) {
        // adamw_update / sgd_momentum_update with bf16 state
        // (state-dtype=bf16) comes here unwidened (needsWidening): the
        // states and new states bf16, the rest f32.
        FSDP_RETURN_IF_ERROR(hasNarrowableState(op.inst.op) || updatesBf16Params(op.plan, op.inst)
                                 ? updateStateDtype(op, states)
                                 : expectAllF32(op));
        int64_t n = op.in(0).numel();
        // (8-bit moments are packed: their sizes checked by updateStateDtype)
        const bool packed = packedMoments(op);
        for (int i = 1; i < 2 + states; ++i)
          if (op.in(i).numel() != n && !(packed && i >= 2))
            return FSDP_ERROR(op.inst.op, ": operand ", i, " has ", op.in(i).numel(),
                              " elements, the parameter ", n);
        for (int i = 0; i <= states; ++i)
          if (op.out(i).numel() != n && !(packed && i >= 1))
            return FSDP_ERROR(op.inst.op, ": result ", i, " has the wrong size");
        size_t scalars = 2 + states;
        if (op.in(scalars).numel() != 1 || (hasStep && op.in(scalars + 1).numel() != 1))
          return FSDP_ERROR(op.inst.op, ": expected scalar lr/step operands");
        if (op.has("decay_numel") || op.has("shard_stride")) {
          // weight-decay-params=matrices (decayedCount): both or neither,
          // except that a stochastic update places its draws by
          // shard_stride alone.
          const bool strideAlone =
              (op.b("stochastic") || op.b("stochastic_param")) && !op.has("decay_numel");
          int64_t d = op.i("decay_numel", strideAlone ? 0 : -1), stride = op.i("shard_stride", -1);
          if (!(d >= 0 && d <= (int64_t(1) << 48)))
            return FSDP_ERROR(op.inst.op, ": decay_numel must be an integer in [0, 2^48]");
          if (stride != 0 && stride != n)
            return FSDP_ERROR(op.inst.op, ": shard_stride must be 0 (the whole unit) or the "
                                          "operand's ", n, " elements (a shard), found ",
                              op.inst.attrs.value("shard_stride", nlohmann::json()).dump());
        }
        // skip_nonfinite, then grad_scale: optional, each marked.
        size_t required = scalars + (hasStep ? 2 : 1);
        UpdateExtras extra = updateExtras(op);
        if (!op.attrError.empty())
          return FSDP_ERROR(op.inst.op, ": ", op.attrError);
        size_t marked = required + (extra.skip >= 0) + (extra.scale >= 0);
        if (op.inst.in.size() != marked)
          return FSDP_ERROR(op.inst.op, ": ", op.inst.in.size(), " operands, expected ", marked,
                            ": its ", required, " required ones, then skip_nonfinite and "
                            "grad_scale where their attributes (true) mark them");
        if (extra.skip >= 0 && op.in(extra.skip).numel() != 1)
          return FSDP_ERROR(op.inst.op, ": expected a scalar skip_nonfinite operand");
        if (extra.scale >= 0 && op.in(extra.scale).numel() != 1)
          return FSDP_ERROR(op.inst.op, ": expected a scalar grad_scale operand");
        return Status::ok();
      };
    };
    m["sgd_update"] = checkUpdate(0, false);
    m["sgd_momentum_update"] = checkUpdate(1, true);
    m["adamw_update"] = checkUpdate(2, true);
    // LAMB: p, g, m, v, step -> the per-parameter sums [2K]; p, g, m, v,
    // those sums, lr, step -> p, m, v. segments (required) bounds the unit's
    // K parameters; shard_stride and decay_numel as adamw_update's, except
    // that either may come alone (a shard always needs its positions).
    auto checkLamb = [](bool update) {
      return [update](const Op &op) {
        const std::string &name = op.inst.op;
        // bf16 moments (state-dtype=bf16) come here unwidened, as
        // adamw_update's.
        FSDP_RETURN_IF_ERROR(updateStateDtype(op, 2, update));
        int64_t n = op.in(0).numel();
        // (8-bit moments are packed: their sizes checked by updateStateDtype)
        const bool packed = packedMoments(op);
        for (int i = 1; i < 4; ++i)
          if (op.in(i).numel() != n && !(packed && i >= 2))
            return FSDP_ERROR(name, ": operand ", i, " has ", op.in(i).numel(),
                              " elements, the parameter ", n);
        for (int i = 0; update && i < 3; ++i)
          if (op.out(i).numel() != n && !(packed && i >= 1))
            return FSDP_ERROR(name, ": result ", i, " has the wrong size");
        if (!op.has("segments"))
          return FSDP_ERROR(name, ": missing attribute segments (the unit's parameter bounds)");
        std::vector<int64_t> seg = op.iv("segments");
        if (!op.attrError.empty())
          return FSDP_ERROR(name, ": ", op.attrError);
        bool rising = seg.size() >= 2 && seg[0] == 0 && seg.back() <= (int64_t(1) << 48);
        for (size_t k = 1; rising && k < seg.size(); ++k)
          rising = seg[k] > seg[k - 1];
        if (!rising)
          return FSDP_ERROR(name,
                            ": segments must rise strictly from 0 to at most 2^48, with "
                            "at least one parameter, found ",
                            op.inst.attrs.at("segments").dump());
        const int64_t K = (int64_t)seg.size() - 1;
        FSDP_RETURN_IF_ERROR(expectShape(op, update ? op.in(4) : op.out(0), {2 * K},
                                         "per-parameter sums (2 x the segments' K)"));
        size_t required = update ? 7 : 5;
        for (size_t i = 4 + update; i < required; ++i)
          if (op.in(i).numel() != 1)
            return FSDP_ERROR(name, ": expected scalar ", update ? "lr/step" : "step", " operands");
        if (op.has("shard_stride")) {
          int64_t stride = op.i("shard_stride", -1);
          if (stride != 0 && stride != n)
            return FSDP_ERROR(name,
                              ": shard_stride must be 0 (the whole unit) or the "
                              "operand's ",
                              n, " elements (a shard), found ",
                              op.inst.attrs.at("shard_stride").dump());
        }
        if (op.has("decay_numel")) {
          int64_t d = op.i("decay_numel", -1);
          if (!(d >= 0 && d <= (int64_t(1) << 48)))
            return FSDP_ERROR(name, ": decay_numel must be an integer in [0, 2^48]");
          // A parameter decays wholly or not at all (its trust ratio is
          // one number).
          if (d < seg.back() && !std::binary_search(seg.begin(), seg.end(), d)) {
            auto at = std::upper_bound(seg.begin(), seg.end(), d) - 1;
            return FSDP_ERROR(name, ": decay_numel = ", d, " falls inside parameter ",
                              at - seg.begin(), " [", at[0], ", ", at[1],
                              "); it must be one of the segments' bounds");
          }
        }
        // lamb_norms has no skip (the update skips); grad_scale may come to both.
        if (!update && op.b("skip_nonfinite"))
          return FSDP_ERROR(name, ": skip_nonfinite is lamb_update's (the sums are not "
                                  "skipped)");
        UpdateExtras extra = updateExtras(op);
        if (!op.attrError.empty())
          return FSDP_ERROR(name, ": ", op.attrError);
        size_t marked = required + (extra.skip >= 0) + (extra.scale >= 0);
        if (op.inst.in.size() != marked)
          return FSDP_ERROR(name, ": ", op.inst.in.size(), " operands, expected ", marked, ": its ",
                            required, " required ones, then ",
                            update ? "skip_nonfinite and grad_scale where their attributes "
                                     "(true) mark them"
                                   : "grad_scale where its attribute (true) marks it");
        if (extra.skip >= 0 && op.in(extra.skip).numel() != 1)
          return FSDP_ERROR(name, ": expected a scalar skip_nonfinite operand");
        if (extra.scale >= 0 && op.in(extra.scale).numel() != 1)
          return FSDP_ERROR(name, ": expected a scalar grad_scale operand");
        return Status::ok();
      };
    };
    m["lamb_norms"] = checkLamb(false);
    m["lamb_update"] = checkLamb(true);
    m["squared_norm"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      return expectShape(op, op.out(0), {}, "a scalar");
    };
    m["clip_coef"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      if (!op.has("max_norm"))
        return FSDP_ERROR("clip_coef: missing max_norm");
      return expectShape(op, op.out(0), {}, "a scalar");
    };
    m["grad_coef"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(0), {}, "a scalar squared norm"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), {}, "a scalar loss scale"));
      if (op.has("max_norm") && !(op.f("max_norm", 0) > 0))
        return FSDP_ERROR("grad_coef: max_norm must be positive");
      return expectShape(op, op.out(0), {}, "a scalar");
    };
    m["pack"] = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      std::vector<int64_t> offs = op.iv("offsets");
      if (offs.size() != op.inst.in.size())
        return FSDP_ERROR("pack: expected one offset per input");
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (size_t i = 0; i < offs.size(); ++i) {
        if (offs[i] < 0 || offs[i] > op.out(0).numel() - op.in(i).numel())
          return FSDP_ERROR("pack: input ", i, " does not fit");
        ranges.push_back({offs[i], offs[i] + op.in(i).numel()});
      }
      std::sort(ranges.begin(), ranges.end());
      for (size_t i = 1; i < ranges.size(); ++i)
        if (ranges[i].first < ranges[i - 1].second)
          return FSDP_ERROR("pack: inputs overlap at element ", ranges[i].first);
      return Status::ok();
    };
    return m;
  }();
  return t;
}

} // namespace

bool hasOpRule(std::string_view name) { return checks().count(std::string(name)) > 0; }

Status checkInstruction(const Plan &plan, const Instruction &inst) {
  if (isCollectiveOp(inst.op)) {
    if (inst.in.size() != 1 || inst.out.size() != 1) // PlanSchema.h: 1 -> 1
      return FSDP_ERROR(inst.op, ": expected one input and one output");
    if (inst.op == "wait") {
      if (inst.in[0] != inst.out[0])
        return FSDP_ERROR("wait: expected its input and output to be one buffer");
      return Status::ok();
    }
    const Buffer &a = plan.buffers[inst.in[0]], &b = plan.buffers[inst.out[0]];
    // f32, or bf16 / f16 (mixed precision: all-gathers move the bytes,
    // reductions sum in f32 and round once per reduction step); an
    // all-gather also moves quantized shards' bytes (i8).
    const bool movesBytes = inst.op == "all_gather" || inst.op == "all_to_all";
    if (a.dtype != b.dtype || isInt(a.dtype) || (a.dtype == DType::I8 && !movesBytes))
      return FSDP_ERROR(inst.op, ": expected one float dtype in and out (f32, bf16 or f16",
                        movesBytes ? ", or i8: quantized values" : "", "), found ",
                        dtypeName(a.dtype), " -> ", dtypeName(b.dtype));
    // The ranks it runs over: all of them, or one axis of a 2-D mesh.
    std::string group = "world";
    auto g = inst.attrs.find("group");
    if (g != inst.attrs.end()) {
      if (!g->is_string() || plan.groupSize(g->get<std::string>()) == 0)
        return FSDP_ERROR(inst.op,
                          ": attribute group: expected \"world\", "
                          "\"shard\", \"replica\", (with a mesh reshard group) "
                          "\"reshard\" or (with a mesh node size) \"node\" or "
                          "\"cross\", found ",
                          g->is_primitive() ? g->dump() : g->type_name());
      group = g->get<std::string>();
    }
    // [Note: node comm stream]: only the node group's collectives may run
    // on the second comm stream (each stream's groups in program order).
    auto st = inst.attrs.find("stream");
    if (st != inst.attrs.end() &&
        !(st->is_string() && (*st == "comm" || (*st == "node" && group == "node"))))
      return FSDP_ERROR(inst.op, ": attribute stream: expected \"comm\"",
                        group == "node" ? " or \"node\"" : " (\"node\" is for group node only)",
                        ", found ", st->is_primitive() ? st->dump() : st->type_name());
    int64_t w = plan.groupSize(group);
    bool ok = inst.op == "all_reduce"   ? a.numel() == b.numel()
              : inst.op == "all_to_all" ? a.numel() == b.numel() && a.numel() % w == 0
              : inst.op == "all_gather" ? b.numel() == a.numel() * w
                                        : a.numel() == b.numel() * w;
    if (!ok)
      return FSDP_ERROR(inst.op, ": sizes ", a.numel(), " -> ", b.numel(), " do not fit ", w,
                        " rank(s) (group ", group, ")");
    auto async = inst.attrs.find("async");
    if (async != inst.attrs.end() && !async->is_boolean())
      return FSDP_ERROR(inst.op, ": attribute async: expected true or false, found ",
                        async->is_primitive() ? async->dump() : async->type_name());
    if (inst.op == "all_to_all" && inst.in[0] == inst.out[0])
      return FSDP_ERROR("all_to_all: expected distinct input and output buffers");
    if (!movesBytes) {
      auto it = inst.attrs.find("reduce");
      if (it == inst.attrs.end() || !it->is_string() || (*it != "sum" && *it != "mean"))
        return FSDP_ERROR(inst.op, ": expected reduce = \"sum\" or \"mean\"");
    }
    return Status::ok();
  }
  const OpSchema *schema = findOp(inst.op);
  auto it = checks().find(inst.op);
  if (!schema || it == checks().end())
    return FSDP_ERROR("unknown op '", inst.op, "' (this runtime does not implement it)");
  const int nin = schema->numInputs, nout = schema->numOutputs;
  const int nopt = schema->optionalInputs, noptOut = schema->optionalOutputs;
  if (!acceptsArity(*schema, (int)inst.in.size(), (int)inst.out.size()))
    return FSDP_ERROR(inst.op, ": expected ",
                      nin < 0    ? std::string("1+")
                      : nopt > 0 ? std::to_string(nin) + "-" + std::to_string(nin + nopt)
                                 : std::to_string(nin),
                      " inputs and ",
                      noptOut > 0 ? std::to_string(nout) + "-" + std::to_string(nout + noptOut)
                                  : std::to_string(nout),
                      " outputs, found ", inst.in.size(), " and ", inst.out.size());
  if ((inst.op == "lamb_norms" || inst.op == "lamb_update") && needsWidening(plan, inst)) {
    // Widening would run them on f32 copies; LAMB's states and its sums
    // are f32 by design, and a narrow gradient is the compiler's to cast.
    for (size_t i = 0; i < inst.in.size() + inst.out.size(); ++i) {
      bool in = i < inst.in.size();
      int64_t id = in ? inst.in[i] : inst.out[i - inst.in.size()];
      if (id >= 0 && id < (int64_t)plan.buffers.size() && isNarrowFloat(plan.buffers[id].dtype))
        return FSDP_ERROR(inst.op, ": expected f32 operands only, found ",
                          dtypeName(plan.buffers[id].dtype), " ", in ? "operand " : "result ",
                          in ? i : i - inst.in.size(), in && i == 1 ? " (the gradient)" : "");
    }
  }
  // An accumulator holds the sum its result continues (the memory plan may
  // put the result on it): the result's dtype, as the dialect's verifiers
  // require. Checked before widening, which would make both f32.
  for (auto [in, out] : rules::accumulatorsOf(plan, inst)) {
    const Buffer &a = plan.buffers[inst.in[in]], &r = plan.buffers[inst.out[out]];
    if (a.dtype != r.dtype)
      return FSDP_ERROR(inst.op, ": expected accumulator (operand ", in, ") of its result's dtype ",
                        dtypeName(r.dtype), ", found ", dtypeName(a.dtype));
  }
  if (needsWidening(plan, inst)) {
    // See [Note: bf16 storage, f32 compute].
    Widened w = widen(plan, inst);
    return checkInstruction(w.plan, w.inst);
  }
  Op op{plan, inst};
  FSDP_RETURN_IF_ERROR(it->second(op));
  // Every attribute a kernel reads, type-checked whether or not the op's
  // own check looked at it.
  for (const char *name : {"transpose_lhs", "transpose_rhs", "causal", "nesterov", "async"})
    op.b(name);
  for (const char *name : {"dim", "offset", "heads", "kv_heads"})
    op.i(name, 0);
  for (const char *name : {"perm", "dims", "offsets"})
    op.iv(name);
  for (const char *name : {"factor", "value", "epsilon", "momentum", "dampening", "weight_decay",
                           "beta1", "beta2", "eps", "max_norm", "theta"})
    op.f(name, 0);
  if (!op.attrError.empty())
    return FSDP_ERROR(inst.op, ": ", op.attrError);
  return Status::ok();
}

} // namespace fsdp
