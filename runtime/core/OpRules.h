//===- OpRules.h - every op's shape, dtype and attribute rules --*- C++ -*-===//
//
// The load-time check of each plan instruction, owned by core so that every
// device runs only instructions that passed it: arity (PlanSchema.h),
// operand shapes and dtypes, attribute types. The rules repeat the
// dialect's verifiers on purpose: the runtime does not trust a plan file
// (it may be hand-edited, corrupt or produced by another compiler
// version). The shape helpers a kernel launcher needs too (matmul
// dimensions, the widened f32 view of a bf16 instruction) live here so a
// device derives them exactly as the check did.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_OPRULES_H
#define FSDP_RUNTIME_CORE_OPRULES_H

#include "runtime/core/LambLayout.h"
#include "runtime/core/Plan.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp {

/// Checks that `inst` names an op of the schema with the right number of
/// operands, dtypes, shapes and attributes (collectives included: group,
/// sizes over the group, reduce, async). The message names the op and the
/// problem.
Status checkInstruction(const Plan &plan, const Instruction &inst);

/// True when core has rules for compute op `name` (every compute op of
/// PlanSchema.h must).
bool hasOpRule(std::string_view name);

namespace rules {

using Shape = std::vector<int64_t>;

/// One instruction with typed access to its operands and attributes.
struct Op {
  const Plan &plan;
  const Instruction &inst;
  /// The first attribute found with the wrong type (or out of range); the
  /// load-time check reports it, so a kernel never runs on a default that
  /// stood in for a malformed value (transpose_rhs: "yes").
  mutable std::string attrError;
  const Buffer &in(size_t i) const { return plan.buffers[inst.in[i]]; }
  const Buffer &out(size_t i) const { return plan.buffers[inst.out[i]]; }
  const nlohmann::json *attr(const char *name, bool ok(const nlohmann::json &),
                             const char *expected) const {
    auto it = inst.attrs.find(name);
    if (it == inst.attrs.end())
      return nullptr;
    if (!ok(*it)) {
      if (attrError.empty())
        attrError = std::string("attribute ") + name + ": expected " + expected + ", found " +
                    (it->is_primitive() ? it->dump() : it->type_name());
      return nullptr;
    }
    return &*it;
  }
  static bool isFinite(const nlohmann::json &v) {
    return v.is_number() && std::isfinite(v.get<double>());
  }
  static bool isInt(const nlohmann::json &v) {
    return v.is_number_integer() &&
           (!v.is_number_unsigned() || v.get<uint64_t>() <= (uint64_t)INT64_MAX);
  }
  static bool isIntArray(const nlohmann::json &v) {
    if (!v.is_array() || v.size() > 4096)
      return false;
    for (auto &e : v)
      if (!isInt(e))
        return false;
    return true;
  }
  double f(const char *name, double dflt) const {
    const nlohmann::json *v = attr(name, isFinite, "a finite number");
    return v ? v->get<double>() : dflt;
  }
  int64_t i(const char *name, int64_t dflt) const {
    const nlohmann::json *v = attr(name, isInt, "an integer");
    return v ? v->get<int64_t>() : dflt;
  }
  bool b(const char *name) const {
    const nlohmann::json *v = attr(
        name, [](const nlohmann::json &x) { return x.is_boolean(); }, "true or false");
    return v && v->get<bool>();
  }
  std::vector<int64_t> iv(const char *name) const {
    std::vector<int64_t> v;
    if (const nlohmann::json *a = attr(name, isIntArray, "an array of at most 4096 integers"))
      for (auto &e : *a)
        v.push_back(e.get<int64_t>());
    return v;
  }
  std::string s(const char *name, const char *dflt) const {
    const nlohmann::json *v = attr(
        name, [](const nlohmann::json &x) { return x.is_string(); }, "a string");
    return v ? v->get<std::string>() : dflt;
  }
  bool has(const char *name) const { return inst.attrs.contains(name); }
};

/// weight-decay-params=matrices: how many leading elements of an optimizer
/// update's operand weight decay applies to (all of them without
/// decay_numel). The unit packs its decayed parameters first; element i of
/// the operand is at position shard * shard_stride + i of the unit
/// (shard_stride 0: the whole unit). The plan check validated both.
inline int64_t decayedCount(const Op &op, int64_t shard) {
  int64_t n = op.in(0).numel();
  if (!op.has("decay_numel"))
    return n;
  int64_t left = op.i("decay_numel", 0) - shard * op.i("shard_stride", 0);
  return left < 0 ? 0 : left > n ? n : left;
}

/// lamb_norms / lamb_update: where the operand lies in its FSDP unit
/// (LambLayout.h) from its attributes: `segments`, base = shard *
/// shard_stride (0 without shard_stride), decayNumel = decay_numel (all
/// positions without it). The plan check validated all three.
inline LambLayout lambLayout(const Op &op, int64_t shard) {
  LambLayout l;
  l.segments = op.iv("segments");
  l.base = shard * op.i("shard_stride", 0);
  if (op.has("decay_numel"))
    l.decayNumel = op.i("decay_numel", 0);
  return l;
}

/// An optimizer update's optional operands, after its required ones (p, g,
/// the states, lr, and step: the schema's numInputs), each marked by an
/// attribute of its name (true) and in this order: skip_nonfinite, then
/// grad_scale; -1 when absent. The plan check holds the count to the marks.
struct UpdateExtras {
  int skip = -1, scale = -1;
};
inline UpdateExtras updateExtras(const Op &op) {
  UpdateExtras e;
  const OpSchema *schema = findOp(op.inst.op);
  int next = schema ? schema->numInputs : (int)op.inst.in.size();
  if (op.b("skip_nonfinite"))
    e.skip = next++;
  if (op.b("grad_scale"))
    e.scale = next;
  return e;
}

/// gelu / gelu_grad: the exact (erf) form rather than the tanh one.
inline bool geluExact(const Op &op) { return op.s("approximate", "tanh") == "none"; }

/// Kernel-time view: typed pointers to operands.

/// "2x3", or "scalar".
std::string shapeStr(const Shape &s);

inline int64_t lastDim(const Buffer &b) { return b.shape.empty() ? 1 : b.shape.back(); }
inline int64_t rowsOf(const Buffer &b) {
  int64_t d = lastDim(b);
  return b.numel() / (d > 1 ? d : 1);
}

/// cross_entropy(_grad)'s classes: the first `classes` columns of each row
/// of the logits (the rest padding, fsdp-pad-classes); all of them when the
/// attribute is absent. checkInstruction has checked 1 <= classes <= last dim.
inline int64_t ceClasses(const Op &op) { return op.i("classes", lastDim(op.in(0))); }
/// cross_entropy(_grad / _fused)'s label_smoothing e (0 when absent; the
/// target is (1 - e) onehot + e / classes). checkInstruction has checked
/// 0 <= e <= 1.
inline double ceSmoothing(const Op &op) { return op.f("label_smoothing", 0); }

/// cross_entropy(_grad / _fused)'s ignore_index: a label equal to `index`
/// adds nothing to the loss and gets a zero gradient row, and the loss
/// divides by the f32 scalar input `normalizer` (the kept-label count,
/// count_labels) instead of the row count. checkInstruction has checked
/// that the two come together and that the index fits an int32.
struct CeIgnore {
  bool on = false;
  int32_t index = 0;
  int normalizer = -1; ///< the input holding the count
};
inline CeIgnore ceIgnore(const Op &op) {
  CeIgnore c;
  const OpSchema *schema = findOp(op.inst.op);
  if (!op.has("ignore_index") || !schema || (int)op.inst.in.size() <= schema->numInputs)
    return c;
  c.on = true;
  c.index = (int32_t)op.i("ignore_index", 0);
  c.normalizer = schema->numInputs;
  return c;
}

/// matmul dimensions from shapes and flags.
struct MM {
  int64_t batch, m, n, k;
};
Status matmulDims(const Op &op, MM &d);

/// [outer, full, inner] decomposition around `dim` of `s`.
inline void around(const Shape &s, int64_t dim, int64_t &outer, int64_t &inner) {
  outer = inner = 1;
  for (int64_t i = 0; i < dim; ++i)
    outer *= s[i];
  for (size_t i = dim + 1; i < s.size(); ++i)
    inner *= s[i];
}

// [Note: bf16 storage, f32 compute] in OpRules.cpp.
inline bool isNarrowFloat(DType t) { return t == DType::BF16 || t == DType::F16; }
/// A compute instruction with a bf16 / f16 operand (cast excepted).
bool needsWidening(const Plan &plan, const Instruction &inst);
/// An sgd_update, sgd_momentum_update or adamw_update of bf16 parameters
/// with an f32 gradient (fsdp-mixed-precision's master-dtype=bf16): it
/// widens them, steps in f32 and rounds the new parameters back itself
/// (never widened as a whole: needsWidening is false for it).
bool updatesBf16Params(const Plan &plan, const Instruction &inst);

/// The instruction over f32 copies of its operands, laid out from 0 in a
/// scratch buffer of `bytes`; slot i holds the original buffer ids[i].
struct Widened {
  Plan plan;
  Instruction inst;
  std::vector<int64_t> ids;
  int64_t bytes = 0;
};
Widened widen(const Plan &plan, const Instruction &inst);

} // namespace rules
} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_OPRULES_H
