//===- Dispatch.cpp - plan instructions to CPU kernels --------------------===//
//
// One table entry per op: its arity, a load-time check of shapes and
// dtypes, and the kernel call. The checks repeat the dialect's verifiers on
// purpose: the runtime does not trust a plan file (it may be hand-edited,
// corrupt or produced by another compiler version).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Dispatch.h"

#include "runtime/core/Bf16.h"
#include "runtime/cpu/Kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <unordered_map>

namespace fsdp::cpu {

namespace {

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
        attrError = std::string("attribute ") + name + ": expected " + expected +
                    ", found " + (it->is_primitive() ? it->dump() : it->type_name());
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
    if (const nlohmann::json *a = attr(name, isIntArray, "an array of integers"))
      for (auto &e : *a)
        v.push_back(e.get<int64_t>());
    return v;
  }
  bool has(const char *name) const { return inst.attrs.contains(name); }
};

/// Kernel-time view: typed pointers to operands.
struct Run {
  const Op &op;
  uint8_t *arena;
  int64_t rank;
  template <typename T = float> T *in(size_t i) const {
    return reinterpret_cast<T *>(bufferAddress(op.plan, op.inst.in[i], arena, rank));
  }
  template <typename T = float> T *out(size_t i) const {
    return reinterpret_cast<T *>(bufferAddress(op.plan, op.inst.out[i], arena, rank));
  }
};

using Check = std::function<Status(const Op &)>;
using Exec = std::function<Status(const Run &)>;
struct OpDef {
  int nin; ///< -1: one or more
  int nout;
  Check check;
  Exec run;
};

std::string shapeStr(const Shape &s) {
  if (s.empty())
    return "scalar";
  std::string r;
  for (size_t i = 0; i < s.size(); ++i)
    r += (i ? "x" : "") + std::to_string(s[i]);
  return r;
}

Status expectShape(const Op &op, const Buffer &b, const Shape &want,
                   const char *what) {
  if (b.shape != want)
    return FSDP_ERROR(op.inst.op, ": expected ", what, " of shape ",
                      shapeStr(want), ", found ", shapeStr(b.shape));
  return Status::ok();
}

Status expectF32(const Op &op, std::initializer_list<const Buffer *> bufs) {
  for (const Buffer *b : bufs)
    if (b->dtype != DType::F32)
      return FSDP_ERROR("unsupported dtype ", dtypeName(b->dtype), " for op ",
                        op.inst.op, " on the CPU backend (f32 only)");
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

/// NumPy broadcast of two shapes; false when incompatible.
bool broadcast(const Shape &a, const Shape &b, Shape &out) {
  size_t r = std::max(a.size(), b.size());
  out.assign(r, 1);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    if (da != db && da != 1 && db != 1)
      return false;
    out[i] = da == 1 ? db : da;
  }
  return true;
}

Status checkSame(const Op &op) {
  FSDP_RETURN_IF_ERROR(expectAllF32(op));
  for (int64_t id : op.inst.in)
    if (op.plan.buffers[id].numel() != op.out(0).numel())
      return FSDP_ERROR(op.inst.op, ": expected operands of ",
                        op.out(0).numel(), " elements, found ",
                        op.plan.buffers[id].numel());
  return Status::ok();
}

Status checkBinary(const Op &op) {
  FSDP_RETURN_IF_ERROR(expectAllF32(op));
  Shape s;
  if (!broadcast(op.in(0).shape, op.in(1).shape, s))
    return FSDP_ERROR(op.inst.op, ": shapes ", shapeStr(op.in(0).shape), " and ",
                      shapeStr(op.in(1).shape), " do not broadcast");
  return expectShape(op, op.out(0), s, "a result");
}

Exec binaryRun(BinaryKind k) {
  return [k](const Run &r) {
    binary<float>(k, r.in(0), r.op.in(0).shape, r.in(1), r.op.in(1).shape,
                  r.out(0), r.op.out(0).shape);
    return Status::ok();
  };
}

int64_t lastDim(const Buffer &b) { return b.shape.empty() ? 1 : b.shape.back(); }
int64_t rowsOf(const Buffer &b) { return b.numel() / std::max<int64_t>(lastDim(b), 1); }

/// matmul dimensions from shapes and flags.
struct MM {
  int64_t batch, m, n, k;
};
Status matmulDims(const Op &op, MM &d) {
  const Shape &a = op.in(0).shape, &b = op.in(1).shape;
  bool ta = op.b("transpose_lhs"), tb = op.b("transpose_rhs");
  if (a.size() != b.size() || (a.size() != 2 && a.size() != 3))
    return FSDP_ERROR("matmul: expected operands of equal rank 2 or 3, found ",
                      shapeStr(a), " and ", shapeStr(b));
  size_t r = a.size();
  d.batch = r == 3 ? a[0] : 1;
  if (r == 3 && a[0] != b[0])
    return FSDP_ERROR("matmul: expected equal batch sizes, found ", a[0],
                      " and ", b[0]);
  d.m = ta ? a[r - 1] : a[r - 2];
  d.k = ta ? a[r - 2] : a[r - 1];
  int64_t kb = tb ? b[r - 1] : b[r - 2];
  d.n = tb ? b[r - 2] : b[r - 1];
  if (d.k != kb)
    return FSDP_ERROR("matmul: expected contracting sizes to agree, found ",
                      d.k, " and ", kb);
  Shape want;
  if (r == 3)
    want.push_back(d.batch);
  want.push_back(d.m);
  want.push_back(d.n);
  return expectShape(op, op.out(0), want, "a result");
}

/// [outer, full, inner] decomposition around `dim` of `s`.
void around(const Shape &s, int64_t dim, int64_t &outer, int64_t &inner) {
  outer = inner = 1;
  for (int64_t i = 0; i < dim; ++i)
    outer *= s[i];
  for (size_t i = dim + 1; i < s.size(); ++i)
    inner *= s[i];
}

Status checkWindow(const Op &op, const Buffer &big, const Buffer &small) {
  int64_t dim = op.i("dim", -1), off = op.i("offset", -1);
  if (dim < 0 || dim >= (int64_t)big.shape.size() ||
      small.shape.size() != big.shape.size())
    return FSDP_ERROR(op.inst.op, ": bad dim ", dim, " for shapes ",
                      shapeStr(big.shape), " and ", shapeStr(small.shape));
  Shape want = big.shape;
  want[dim] = small.shape[dim];
  FSDP_RETURN_IF_ERROR(expectShape(op, small, want, "a window"));
  if (off < 0 || off > big.shape[dim] - small.shape[dim])
    return FSDP_ERROR(op.inst.op, ": a window of ", small.shape[dim],
                      " at offset ", off, " is out of bounds of ", big.shape[dim]);
  return Status::ok();
}

template <typename I>
Status runEmbedding(const Run &r) {
  const Buffer &t = r.op.in(0), &ids = r.op.in(1);
  int64_t bad = embedding<float, I>(r.in(0), r.in<I>(1), r.out(0), ids.numel(),
                                    t.shape[0], t.shape[1]);
  if (bad >= 0)
    return FSDP_ERROR("embedding: token id ", (int64_t)r.in<I>(1)[bad],
                      " at position ", bad, " is outside the vocabulary [0, ",
                      t.shape[0], ")");
  return Status::ok();
}

template <typename I>
Status runEmbeddingGrad(const Run &r) {
  const Buffer &ids = r.op.in(0), &t = r.op.out(0);
  int64_t bad = embeddingGrad<float, I>(r.in<I>(0), r.in(1), r.out(0),
                                        ids.numel(), t.shape[0], t.shape[1]);
  if (bad >= 0)
    return FSDP_ERROR("embedding_grad: token id ", (int64_t)r.in<I>(0)[bad],
                      " is outside the vocabulary [0, ", t.shape[0], ")");
  return Status::ok();
}

template <typename I>
Status runCrossEntropy(const Run &r, bool grad) {
  const Buffer &l = r.op.in(0);
  int64_t classes = lastDim(l), rows = rowsOf(l);
  int64_t bad = grad ? crossEntropyGrad<float, I>(r.in(0), r.in<I>(1), r.in(2),
                                                  r.out(0), rows, classes)
                     : crossEntropy<float, I>(r.in(0), r.in<I>(1), r.out(0),
                                              rows, classes);
  if (bad >= 0)
    return FSDP_ERROR(r.op.inst.op, ": label ", (int64_t)r.in<I>(1)[bad],
                      " at position ", bad, " is outside [0, ", classes, ")");
  return Status::ok();
}

/// Converts n elements between storage dtypes, one of them f32 (or both
/// the same). See [Note: bf16 storage, f32 compute].
void convert(const uint8_t *src, DType from, uint8_t *dst, DType to, int64_t n);

const std::unordered_map<std::string, OpDef> &table() {
  static const std::unordered_map<std::string, OpDef> t = [] {
    std::unordered_map<std::string, OpDef> m;
    m["add"] = {2, 1, checkBinary, binaryRun(BinaryKind::Add)};
    m["sub"] = {2, 1, checkBinary, binaryRun(BinaryKind::Sub)};
    m["mul"] = {2, 1, checkBinary, binaryRun(BinaryKind::Mul)};
    m["div"] = {2, 1, checkBinary, binaryRun(BinaryKind::Div)};
    m["neg"] = {1, 1, checkSame, [](const Run &r) {
                  neg<float>(r.in(0), r.out(0), r.op.out(0).numel());
                  return Status::ok();
                }};
    m["scale"] = {1, 1, checkSame, [](const Run &r) {
                    scale<float>(r.in(0), r.out(0), r.op.out(0).numel(),
                                 r.op.f("factor", 1.0));
                    return Status::ok();
                  }};
    m["fill"] = {0, 1, expectAllF32, [](const Run &r) {
                   fill<float>(r.out(0), r.op.out(0).numel(), r.op.f("value", 0));
                   return Status::ok();
                 }};
    m["copy"] = {1, 1,
                 [](const Op &op) {
                   if (op.in(0).bytes != op.out(0).bytes)
                     return FSDP_ERROR("copy: sizes differ (", op.in(0).bytes,
                                       " vs ", op.out(0).bytes, " bytes)");
                   return Status::ok();
                 },
                 [](const Run &r) {
                   void *dst = r.out<uint8_t>(0);
                   const void *src = r.in<uint8_t>(0);
                   if (dst != src)
                     std::memmove(dst, src, r.op.out(0).bytes);
                   return Status::ok();
                 }};
    m["relu"] = {1, 1, checkSame, [](const Run &r) {
                   relu<float>(r.in(0), r.out(0), r.op.out(0).numel());
                   return Status::ok();
                 }};
    m["gelu"] = {1, 1, checkSame, [](const Run &r) {
                   gelu<float>(r.in(0), r.out(0), r.op.out(0).numel());
                   return Status::ok();
                 }};
    m["softmax"] = {1, 1, checkSame, [](const Run &r) {
                      softmax<float>(r.in(0), r.out(0), rowsOf(r.op.out(0)),
                                     lastDim(r.op.out(0)));
                      return Status::ok();
                    }};
    m["relu_grad"] = {2, 1, checkSame, [](const Run &r) {
                        reluGrad<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
                        return Status::ok();
                      }};
    m["gelu_grad"] = {2, 1, checkSame, [](const Run &r) {
                        geluGrad<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
                        return Status::ok();
                      }};
    m["softmax_grad"] = {2, 1, checkSame, [](const Run &r) {
                           softmaxGrad<float>(r.in(0), r.in(1), r.out(0),
                                              rowsOf(r.op.out(0)),
                                              lastDim(r.op.out(0)));
                           return Status::ok();
                         }};
    m["bias_add"] = {2, 1,
                     [](const Op &op) {
                       FSDP_RETURN_IF_ERROR(expectAllF32(op));
                       FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), {lastDim(op.in(0))}, "a bias"));
                       return expectShape(op, op.out(0), op.in(0).shape, "a result");
                     },
                     [](const Run &r) {
                       biasAdd<float>(r.in(0), r.in(1), r.out(0), rowsOf(r.op.in(0)),
                                      lastDim(r.op.in(0)));
                       return Status::ok();
                     }};
    m["matmul"] = {2, 1,
                   [](const Op &op) {
                     FSDP_RETURN_IF_ERROR(expectAllF32(op));
                     MM d;
                     return matmulDims(op, d);
                   },
                   [](const Run &r) {
                     MM d;
                     FSDP_RETURN_IF_ERROR(matmulDims(r.op, d));
                     matmul<float>(r.in(0), r.in(1), r.out(0), d.batch, d.m, d.n,
                                   d.k, r.op.b("transpose_lhs"), r.op.b("transpose_rhs"));
                     return Status::ok();
                   }};
    m["layer_norm"] = {3, 1,
                       [](const Op &op) {
                         FSDP_RETURN_IF_ERROR(expectAllF32(op));
                         FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), {lastDim(op.in(0))}, "gamma"));
                         FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {lastDim(op.in(0))}, "beta"));
                         return expectShape(op, op.out(0), op.in(0).shape, "a result");
                       },
                       [](const Run &r) {
                         layerNorm<float>(r.in(0), r.in(1), r.in(2), r.out(0),
                                          rowsOf(r.op.in(0)), lastDim(r.op.in(0)),
                                          r.op.f("epsilon", 1e-5));
                         return Status::ok();
                       }};
    m["layer_norm_grad"] = {3, 3,
                            [](const Op &op) {
                              FSDP_RETURN_IF_ERROR(expectAllF32(op));
                              Shape c{lastDim(op.in(0))};
                              FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), c, "gamma"));
                              FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), op.in(0).shape, "a gradient"));
                              FSDP_RETURN_IF_ERROR(expectShape(op, op.out(0), op.in(0).shape, "d_input"));
                              FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), c, "d_gamma"));
                              return expectShape(op, op.out(2), c, "d_beta");
                            },
                            [](const Run &r) {
                              layerNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0),
                                                   r.out(1), r.out(2), rowsOf(r.op.in(0)),
                                                   lastDim(r.op.in(0)),
                                                   r.op.f("epsilon", 1e-5));
                              return Status::ok();
                            }};
    // attention (q, k, v -> y) and attention_grad (q, k, v, dy -> dq, dk,
    // dv): q, dy, y and dq are [B, T, heads*D]; k, v, dk and dv
    // [B, T, kv_heads*D] (kv_heads = heads when absent).
    auto checkAttention = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      int64_t heads = op.i("heads", 0);
      if (s.size() != 3 || heads <= 0 || s[2] % heads)
        return FSDP_ERROR(op.inst.op, ": expected [B, T, C] operands with heads "
                          "dividing C, found ", shapeStr(s), " and heads = ", heads);
      int64_t kv = op.i("kv_heads", heads);
      if (!op.attrError.empty())
        return FSDP_ERROR(op.inst.op, ": ", op.attrError);
      if (kv <= 0 || heads % kv)
        return FSDP_ERROR(op.inst.op, ": expected kv_heads to divide heads = ", heads,
                          ", found kv_heads = ", kv);
      Shape ks{s[0], s[1], kv * (s[2] / heads)};
      bool grad = op.inst.in.size() == 4;
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), ks, "k"));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), ks, "v"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(3), s, "a gradient"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), ks, "d_k"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(2), ks, "d_v"));
      }
      return expectShape(op, op.out(0), s, grad ? "d_q" : "a result");
    };
    m["attention"] = {3, 1, checkAttention, [](const Run &r) {
                        const Shape &s = r.op.in(0).shape;
                        int64_t heads = r.op.i("heads", 1);
                        attention<float>(r.in(0), r.in(1), r.in(2), r.out(0), s[0], s[1],
                                         s[2], heads, r.op.b("causal"),
                                         r.op.i("kv_heads", heads));
                        return Status::ok();
                      }};
    m["attention_grad"] = {4, 3, checkAttention, [](const Run &r) {
                             const Shape &s = r.op.in(0).shape;
                             int64_t heads = r.op.i("heads", 1);
                             attentionGrad<float>(r.in(0), r.in(1), r.in(2), r.in(3),
                                                  r.out(0), r.out(1), r.out(2), s[0], s[1],
                                                  s[2], heads, r.op.b("causal"),
                                                  r.op.i("kv_heads", heads));
                             return Status::ok();
                           }};
    m["silu"] = {1, 1, checkSame, [](const Run &r) {
                   silu<float>(r.in(0), r.out(0), r.op.out(0).numel());
                   return Status::ok();
                 }};
    m["silu_grad"] = {2, 1, checkSame, [](const Run &r) {
                        siluGrad<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
                        return Status::ok();
                      }};
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
        return FSDP_ERROR(op.inst.op, ": attribute epsilon: expected a positive "
                          "number, found ", eps);
      if (op.inst.in.size() == 3) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), s, "a gradient"));
        FSDP_RETURN_IF_ERROR(expectShape(op, op.out(1), c, "d_weight"));
      }
      return expectShape(op, op.out(0), s, "a result");
    };
    m["rms_norm"] = {2, 1, checkRmsNorm, [](const Run &r) {
                       rmsNorm<float>(r.in(0), r.in(1), r.out(0), rowsOf(r.op.in(0)),
                                      lastDim(r.op.in(0)), r.op.f("epsilon", 1e-6));
                       return Status::ok();
                     }};
    m["rms_norm_grad"] = {3, 2, checkRmsNorm, [](const Run &r) {
                            rmsNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0),
                                               r.out(1), rowsOf(r.op.in(0)),
                                               lastDim(r.op.in(0)),
                                               r.op.f("epsilon", 1e-6));
                            return Status::ok();
                          }};
    // rope / rope_grad: [B, T, heads*D] -> the same, D even, theta > 1.
    auto checkRope = [](const Op &op) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      const Shape &s = op.in(0).shape;
      int64_t heads = op.i("heads", 0);
      if (s.size() != 3 || heads <= 0 || s[2] % heads || (s[2] / heads) % 2)
        return FSDP_ERROR(op.inst.op, ": expected a [B, T, C] operand with heads "
                          "dividing C into heads of even size, found ", shapeStr(s),
                          " and heads = ", heads);
      if (!op.has("theta"))
        return FSDP_ERROR(op.inst.op, ": missing attribute theta");
      double theta = op.f("theta", 0);
      if (op.attrError.empty() && !(theta > 1))
        return FSDP_ERROR(op.inst.op, ": attribute theta: expected a number > 1, "
                          "found ", theta);
      return expectShape(op, op.out(0), s, "a result");
    };
    m["rope"] = {1, 1, checkRope, [](const Run &r) {
                   const Shape &s = r.op.in(0).shape;
                   rope<float>(r.in(0), r.out(0), s[0], s[1], s[2], r.op.i("heads", 1),
                               r.op.f("theta", 1e4));
                   return Status::ok();
                 }};
    m["rope_grad"] = {1, 1, checkRope, [](const Run &r) {
                        const Shape &s = r.op.in(0).shape;
                        ropeGrad<float>(r.in(0), r.out(0), s[0], s[1], s[2],
                                        r.op.i("heads", 1), r.op.f("theta", 1e4));
                        return Status::ok();
                      }};
    m["embedding"] = {2, 1,
                      [](const Op &op) {
                        const Buffer &t = op.in(0), &ids = op.in(1);
                        FSDP_RETURN_IF_ERROR(expectF32(op, {&t, &op.out(0)}));
                        if (t.shape.size() != 2 || !isInt(ids.dtype))
                          return FSDP_ERROR("embedding: expected a [vocab, width] "
                                            "table and integer ids");
                        Shape want = ids.shape;
                        want.push_back(t.shape[1]);
                        return expectShape(op, op.out(0), want, "a result");
                      },
                      [](const Run &r) {
                        return r.op.in(1).dtype == DType::I32
                                   ? runEmbedding<int32_t>(r)
                                   : runEmbedding<int64_t>(r);
                      }};
    m["embedding_grad"] = {2, 1,
                           [](const Op &op) {
                             const Buffer &ids = op.in(0), &t = op.out(0);
                             FSDP_RETURN_IF_ERROR(expectF32(op, {&op.in(1), &t}));
                             if (t.shape.size() != 2 || !isInt(ids.dtype))
                               return FSDP_ERROR("embedding_grad: expected integer "
                                                 "ids and a [vocab, width] result");
                             Shape want = ids.shape;
                             want.push_back(t.shape[1]);
                             return expectShape(op, op.in(1), want, "a gradient");
                           },
                           [](const Run &r) {
                             return r.op.in(0).dtype == DType::I32
                                        ? runEmbeddingGrad<int32_t>(r)
                                        : runEmbeddingGrad<int64_t>(r);
                           }};
    m["reshape"] = {1, 1,
                    [](const Op &op) {
                      if (op.in(0).bytes != op.out(0).bytes ||
                          op.in(0).dtype != op.out(0).dtype)
                        return FSDP_ERROR("reshape: expected the same size and "
                                          "dtype, found ", shapeStr(op.in(0).shape),
                                          " -> ", shapeStr(op.out(0).shape));
                      return Status::ok();
                    },
                    [](const Run &r) {
                      std::memcpy(r.out<uint8_t>(0), r.in<uint8_t>(0), r.op.out(0).bytes);
                      return Status::ok();
                    }};
    m["transpose"] = {1, 1,
                      [](const Op &op) {
                        FSDP_RETURN_IF_ERROR(expectAllF32(op));
                        std::vector<int64_t> perm = op.iv("perm");
                        const Shape &s = op.in(0).shape;
                        if (perm.size() != s.size())
                          return FSDP_ERROR("transpose: expected a permutation of ",
                                            s.size(), " dimensions");
                        Shape want;
                        std::vector<bool> seen(s.size(), false);
                        for (int64_t p : perm) {
                          if (p < 0 || p >= (int64_t)s.size() || seen[p])
                            return FSDP_ERROR("transpose: perm is not a permutation");
                          seen[p] = true;
                          want.push_back(s[p]);
                        }
                        return expectShape(op, op.out(0), want, "a result");
                      },
                      [](const Run &r) {
                        transpose<float>(r.in(0), r.op.in(0).shape, r.op.iv("perm"), r.out(0));
                        return Status::ok();
                      }};
    m["slice"] = {1, 1,
                  [](const Op &op) {
                    FSDP_RETURN_IF_ERROR(expectAllF32(op));
                    return checkWindow(op, op.in(0), op.out(0));
                  },
                  [](const Run &r) {
                    int64_t dim = r.op.i("dim", 0), outer, inner;
                    around(r.op.in(0).shape, dim, outer, inner);
                    slice<float>(r.in(0), r.out(0), outer, r.op.in(0).shape[dim],
                                 r.op.out(0).shape[dim], inner, r.op.i("offset", 0));
                    return Status::ok();
                  }};
    m["slice_grad"] = {1, 1,
                       [](const Op &op) {
                         FSDP_RETURN_IF_ERROR(expectAllF32(op));
                         return checkWindow(op, op.out(0), op.in(0));
                       },
                       [](const Run &r) {
                         int64_t dim = r.op.i("dim", 0), outer, inner;
                         around(r.op.out(0).shape, dim, outer, inner);
                         sliceGrad<float>(r.in(0), r.out(0), outer, r.op.out(0).shape[dim],
                                          r.op.in(0).shape[dim], inner, r.op.i("offset", 0));
                         return Status::ok();
                       }};
    m["concat"] = {-1, 1,
                   [](const Op &op) {
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
                       return FSDP_ERROR("concat: inputs add up to ", total,
                                         " along dim ", dim, ", result has ", want[dim]);
                     return Status::ok();
                   },
                   [](const Run &r) {
                     int64_t dim = r.op.i("dim", 0), outer, inner, off = 0;
                     const Buffer &o = r.op.out(0);
                     around(o.shape, dim, outer, inner);
                     for (size_t i = 0; i < r.op.inst.in.size(); ++i) {
                       int64_t len = r.op.in(i).shape[dim];
                       const float *src = r.in(i);
                       float *dst = r.out(0);
                       for (int64_t a = 0; a < outer; ++a)
                         std::memcpy(dst + (a * o.shape[dim] + off) * inner,
                                     src + a * len * inner, sizeof(float) * len * inner);
                       off += len;
                     }
                     return Status::ok();
                   }};
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
      Shape want;
      for (size_t i = 0; i < s.size(); ++i)
        if (!red[i])
          want.push_back(s[i]);
      return expectShape(op, op.out(0), want, "a result");
    };
    auto runReduce = [](bool mean) {
      return [mean](const Run &r) {
        // A reduction is sum_to the keep-dims shape, whose layout is that
        // of the dropped-dims result.
        Shape kept = r.op.in(0).shape;
        int64_t count = 1;
        for (int64_t d : r.op.iv("dims")) {
          count *= kept[d];
          kept[d] = 1;
        }
        sumTo<float>(r.in(0), r.op.in(0).shape, r.out(0), kept);
        if (mean)
          scale<float>(r.out(0), r.out(0), r.op.out(0).numel(), 1.0 / count);
        return Status::ok();
      };
    };
    m["reduce_sum"] = {1, 1, checkReduce, runReduce(false)};
    m["reduce_mean"] = {1, 1, checkReduce, runReduce(true)};
    m["broadcast"] = {1, 1,
                      [](const Op &op) {
                        FSDP_RETURN_IF_ERROR(expectAllF32(op));
                        Shape s;
                        if (!broadcast(op.in(0).shape, op.out(0).shape, s) ||
                            s != op.out(0).shape)
                          return FSDP_ERROR("broadcast: cannot broadcast ",
                                            shapeStr(op.in(0).shape), " to ",
                                            shapeStr(op.out(0).shape));
                        return Status::ok();
                      },
                      [](const Run &r) {
                        broadcastTo<float>(r.in(0), r.op.in(0).shape, r.out(0),
                                           r.op.out(0).shape);
                        return Status::ok();
                      }};
    m["sum_to"] = {1, 1,
                   [](const Op &op) {
                     FSDP_RETURN_IF_ERROR(expectAllF32(op));
                     Shape s;
                     if (!broadcast(op.out(0).shape, op.in(0).shape, s) ||
                         s != op.in(0).shape)
                       return FSDP_ERROR("sum_to: ", shapeStr(op.out(0).shape),
                                         " does not broadcast to ",
                                         shapeStr(op.in(0).shape));
                     return Status::ok();
                   },
                   [](const Run &r) {
                     sumTo<float>(r.in(0), r.op.in(0).shape, r.out(0), r.op.out(0).shape);
                     return Status::ok();
                   }};
    m["cast"] = {1, 1,
                 [](const Op &op) {
                   if (op.in(0).numel() != op.out(0).numel() || isInt(op.in(0).dtype) ||
                       isInt(op.out(0).dtype))
                     return FSDP_ERROR("cast: expected float tensors of one size");
                   return Status::ok();
                 },
                 [](const Run &r) {
                   int64_t n = r.op.out(0).numel();
                   DType from = r.op.in(0).dtype, to = r.op.out(0).dtype;
                   if (from == to || from == DType::F32 || to == DType::F32) {
                     // One step, vectorized (mixed-precision plans cast a lot).
                     convert(r.in<uint8_t>(0), from, r.out<uint8_t>(0), to, n);
                     return Status::ok();
                   }
                   std::vector<float> tmp(n);
                   for (int64_t i = 0; i < n; ++i)
                     tmp[i] = from == DType::F32    ? r.in(0)[i]
                              : from == DType::BF16 ? bf16ToFloat(r.in<uint16_t>(0)[i])
                                                    : halfToFloat(r.in<uint16_t>(0)[i]);
                   for (int64_t i = 0; i < n; ++i) {
                     if (to == DType::F32)
                       r.out(0)[i] = tmp[i];
                     else
                       r.out<uint16_t>(0)[i] = to == DType::BF16 ? floatToBf16(tmp[i])
                                                                 : floatToHalf(tmp[i]);
                   }
                   return Status::ok();
                 }};
    auto checkCE = [](const Op &op, bool grad) {
      const Buffer &l = op.in(0), &y = op.in(1);
      FSDP_RETURN_IF_ERROR(expectF32(op, {&l, &op.out(0)}));
      if (l.shape.size() < 2 || !isInt(y.dtype))
        return FSDP_ERROR(op.inst.op, ": expected [..., classes] logits and integer labels");
      Shape lead(l.shape.begin(), l.shape.end() - 1);
      FSDP_RETURN_IF_ERROR(expectShape(op, y, lead, "labels"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {}, "a scalar gradient"));
        return expectShape(op, op.out(0), l.shape, "a result");
      }
      return expectShape(op, op.out(0), {}, "a scalar loss");
    };
    m["cross_entropy"] = {2, 1, [checkCE](const Op &op) { return checkCE(op, false); },
                          [](const Run &r) {
                            return r.op.in(1).dtype == DType::I32
                                       ? runCrossEntropy<int32_t>(r, false)
                                       : runCrossEntropy<int64_t>(r, false);
                          }};
    m["cross_entropy_grad"] = {3, 1, [checkCE](const Op &op) { return checkCE(op, true); },
                               [](const Run &r) {
                                 return r.op.in(1).dtype == DType::I32
                                            ? runCrossEntropy<int32_t>(r, true)
                                            : runCrossEntropy<int64_t>(r, true);
                               }};
    auto checkPair = [](const Op &op, bool grad) {
      FSDP_RETURN_IF_ERROR(expectAllF32(op));
      FSDP_RETURN_IF_ERROR(expectShape(op, op.in(1), op.in(0).shape, "a target"));
      if (grad) {
        FSDP_RETURN_IF_ERROR(expectShape(op, op.in(2), {}, "a scalar gradient"));
        return expectShape(op, op.out(0), op.in(0).shape, "a result");
      }
      return expectShape(op, op.out(0), {}, "a scalar loss");
    };
    m["mse_loss"] = {2, 1, [checkPair](const Op &op) { return checkPair(op, false); },
                     [](const Run &r) {
                       mseLoss<float>(r.in(0), r.in(1), r.out(0), r.op.in(0).numel());
                       return Status::ok();
                     }};
    m["mse_loss_grad"] = {3, 1, [checkPair](const Op &op) { return checkPair(op, true); },
                          [](const Run &r) {
                            mseLossGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0),
                                               r.op.in(0).numel());
                            return Status::ok();
                          }};
    m["bce_with_logits"] = {2, 1, [checkPair](const Op &op) { return checkPair(op, false); },
                            [](const Run &r) {
                              bceWithLogits<float>(r.in(0), r.in(1), r.out(0),
                                                   r.op.in(0).numel());
                              return Status::ok();
                            }};
    m["bce_with_logits_grad"] = {3, 1,
                                 [checkPair](const Op &op) { return checkPair(op, true); },
                                 [](const Run &r) {
                                   bceWithLogitsGrad<float>(r.in(0), r.in(1), r.in(2),
                                                            r.out(0), r.op.in(0).numel());
                                   return Status::ok();
                                 }};
    // Optimizer updates: operands (p, g, [states...], lr, [step]).
    auto checkUpdate = [](int states, bool hasStep) {
      return [states, hasStep](const Op &op) {
        FSDP_RETURN_IF_ERROR(expectAllF32(op));
        int64_t n = op.in(0).numel();
        for (int i = 1; i < 2 + states; ++i)
          if (op.in(i).numel() != n)
            return FSDP_ERROR(op.inst.op, ": operand ", i, " has ", op.in(i).numel(),
                              " elements, the parameter ", n);
        for (int i = 0; i <= states; ++i)
          if (op.out(i).numel() != n)
            return FSDP_ERROR(op.inst.op, ": result ", i, " has the wrong size");
        size_t scalars = 2 + states;
        if (op.in(scalars).numel() != 1 || (hasStep && op.in(scalars + 1).numel() != 1))
          return FSDP_ERROR(op.inst.op, ": expected scalar lr/step operands");
        return Status::ok();
      };
    };
    m["sgd_update"] = {3, 1, checkUpdate(0, false), [](const Run &r) {
                         sgdUpdate<float>(r.in(0), r.in(1), r.out(0), r.op.in(0).numel(),
                                          *r.in(2), r.op.f("weight_decay", 0));
                         return Status::ok();
                       }};
    m["sgd_momentum_update"] = {5, 2, checkUpdate(1, true), [](const Run &r) {
                                  sgdMomentumUpdate<float>(
                                      r.in(0), r.in(1), r.in(2), r.out(0), r.out(1),
                                      r.op.in(0).numel(), *r.in(3), (int64_t)*r.in(4),
                                      r.op.f("momentum", 0), r.op.f("dampening", 0),
                                      r.op.f("weight_decay", 0), r.op.b("nesterov"));
                                  return Status::ok();
                                }};
    m["adamw_update"] = {6, 3, checkUpdate(2, true), [](const Run &r) {
                           adamwUpdate<float>(r.in(0), r.in(1), r.in(2), r.in(3), r.out(0),
                                              r.out(1), r.out(2), r.op.in(0).numel(),
                                              *r.in(4), (int64_t)*r.in(5),
                                              r.op.f("beta1", 0.9), r.op.f("beta2", 0.999),
                                              r.op.f("eps", 1e-8),
                                              r.op.f("weight_decay", 0.01));
                           return Status::ok();
                         }};
    m["squared_norm"] = {-1, 1,
                         [](const Op &op) {
                           FSDP_RETURN_IF_ERROR(expectAllF32(op));
                           return expectShape(op, op.out(0), {}, "a scalar");
                         },
                         [](const Run &r) {
                           double s = 0;
                           for (size_t i = 0; i < r.op.inst.in.size(); ++i)
                             s += squaredNorm<float>(r.in(i), r.op.in(i).numel());
                           *r.out(0) = (float)s;
                           return Status::ok();
                         }};
    m["clip_coef"] = {1, 1,
                      [](const Op &op) {
                        FSDP_RETURN_IF_ERROR(expectAllF32(op));
                        if (!op.has("max_norm"))
                          return FSDP_ERROR("clip_coef: missing max_norm");
                        return expectShape(op, op.out(0), {}, "a scalar");
                      },
                      [](const Run &r) {
                        double norm = std::sqrt((double)*r.in(0));
                        double c = r.op.f("max_norm", 1.0) / (norm + 1e-6);
                        *r.out(0) = (float)std::min(c, 1.0);
                        return Status::ok();
                      }};
    m["pack"] = {-1, 1,
                 [](const Op &op) {
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
                       return FSDP_ERROR("pack: inputs overlap at element ",
                                         ranges[i].first);
                   return Status::ok();
                 },
                 [](const Run &r) {
                   // Inputs the memory plan placed inside the packed buffer
                   // are already there; only the others are copied, and the
                   // padding is zeroed.
                   float *dst = r.out(0);
                   int64_t n = r.op.out(0).numel();
                   std::vector<std::pair<int64_t, int64_t>> covered;
                   std::vector<int64_t> offs = r.op.iv("offsets");
                   for (size_t i = 0; i < offs.size(); ++i) {
                     int64_t len = r.op.in(i).numel();
                     // memmove: an input may sit partly inside the packed
                     // buffer (views of it), never trust a plan with memcpy.
                     if (r.in(i) != dst + offs[i])
                       std::memmove(dst + offs[i], r.in(i), sizeof(float) * len);
                     covered.push_back({offs[i], offs[i] + len});
                   }
                   std::sort(covered.begin(), covered.end());
                   int64_t at = 0;
                   for (auto [lo, hi] : covered) {
                     if (lo > at)
                       std::fill(dst + at, dst + lo, 0.0f);
                     at = std::max(at, hi);
                   }
                   if (at < n)
                     std::fill(dst + at, dst + n, 0.0f);
                   return Status::ok();
                 }};
    return m;
  }();
  return t;
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

bool isNarrowFloat(DType t) { return t == DType::BF16 || t == DType::F16; }

bool needsWidening(const Plan &plan, const Instruction &inst) {
  if (inst.op == "cast")
    return false;
  for (const std::vector<int64_t> *ids : {&inst.in, &inst.out})
    for (int64_t id : *ids)
      if (id >= 0 && id < (int64_t)plan.buffers.size() &&
          isNarrowFloat(plan.buffers[id].dtype))
        return true;
  return false;
}

/// The instruction over f32 copies of its operands, laid out from 0 in a
/// scratch buffer of `bytes`; slot i holds the original buffer ids[i].
struct Widened {
  Plan plan;
  Instruction inst;
  std::vector<int64_t> ids;
  int64_t bytes = 0;
};

Widened widen(const Plan &plan, const Instruction &inst) {
  Widened w;
  w.plan.version = plan.version;
  w.plan.worldSize = plan.worldSize;
  w.plan.meshReplicas = plan.meshReplicas;
  w.plan.meshShards = plan.meshShards;
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

std::atomic<int64_t> scratchHighWater{0};

void convert(const uint8_t *src, DType from, uint8_t *dst, DType to, int64_t n) {
  if (from == to) {
    std::memmove(dst, src, n * dtypeSize(from)); // a cast may be in place
    return;
  }
  // bf16 <-> f32 through the inline conversions of runtime/core/Bf16.h (the
  // same rounding as cpu::floatToBf16): the loops vectorize, where a call
  // per element made conversion most of a bf16 step's time.
  if (to == DType::F32) {
    auto *s = reinterpret_cast<const uint16_t *>(src);
    auto *d = reinterpret_cast<float *>(dst);
    if (from == DType::BF16) {
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i)
        d[i] = widenBf16(s[i]);
    } else {
      for (int64_t i = 0; i < n; ++i)
        d[i] = halfToFloat(s[i]);
    }
    return;
  }
  auto *s = reinterpret_cast<const float *>(src);
  auto *d = reinterpret_cast<uint16_t *>(dst);
  if (to == DType::BF16) {
#pragma omp parallel for if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      d[i] = roundToBf16(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i)
      d[i] = floatToHalf(s[i]);
  }
}

Status runWidened(const Plan &plan, const Instruction &inst, uint8_t *arena,
                  int64_t rank, const OpDef &def) {
  Widened w = widen(plan, inst);
  thread_local std::vector<uint8_t> scratch;
  if ((int64_t)scratch.size() < w.bytes) {
    scratch.resize(w.bytes);
    int64_t seen = scratchHighWater.load();
    while (seen < w.bytes && !scratchHighWater.compare_exchange_weak(seen, w.bytes)) {
    }
  }
  std::vector<bool> isIn(w.ids.size());
  for (int64_t s : w.inst.in)
    isIn[s] = true;
  for (size_t s = 0; s < w.ids.size(); ++s)
    if (isIn[s]) {
      const Buffer &b = plan.buffers[w.ids[s]];
      convert(bufferAddress(plan, w.ids[s], arena, rank), b.dtype,
              scratch.data() + w.plan.buffers[s].offset, w.plan.buffers[s].dtype,
              b.numel());
    }
  Op op{w.plan, w.inst};
  FSDP_RETURN_IF_ERROR(def.run(Run{op, scratch.data(), 0}));
  for (int64_t s : w.inst.out) {
    const Buffer &b = plan.buffers[w.ids[s]];
    convert(scratch.data() + w.plan.buffers[s].offset, w.plan.buffers[s].dtype,
            bufferAddress(plan, w.ids[s], arena, rank), b.dtype, b.numel());
  }
  return Status::ok();
}

} // namespace

int64_t widenedScratchHighWater() { return scratchHighWater.load(); }

bool isCollectiveOp(const std::string &op) {
  return op == "all_reduce" || op == "reduce_scatter" || op == "all_gather" ||
         op == "wait";
}

Status checkInstruction(const Plan &plan, const Instruction &inst) {
  if (isCollectiveOp(inst.op)) {
    if (inst.in.size() != 1 || inst.out.size() != 1)
      return FSDP_ERROR(inst.op, ": expected one input and one output");
    if (inst.op == "wait") {
      if (inst.in[0] != inst.out[0])
        return FSDP_ERROR("wait: expected its input and output to be one buffer");
      return Status::ok();
    }
    const Buffer &a = plan.buffers[inst.in[0]], &b = plan.buffers[inst.out[0]];
    // f32, or bf16 / f16 (mixed precision: all-gathers move the bytes,
    // reductions sum in f32 and round once per reduction step).
    if (a.dtype != b.dtype || isInt(a.dtype))
      return FSDP_ERROR(inst.op, ": expected one float dtype in and out (f32, "
                        "bf16 or f16), found ", dtypeName(a.dtype), " -> ",
                        dtypeName(b.dtype));
    // The ranks it runs over: all of them, or one axis of a 2-D mesh.
    std::string group = "world";
    auto g = inst.attrs.find("group");
    if (g != inst.attrs.end()) {
      if (!g->is_string() || plan.groupSize(g->get<std::string>()) == 0)
        return FSDP_ERROR(inst.op, ": attribute group: expected \"world\", "
                          "\"shard\" or \"replica\", found ",
                          g->is_primitive() ? g->dump() : g->type_name());
      group = g->get<std::string>();
    }
    int64_t w = plan.groupSize(group);
    bool ok = inst.op == "all_reduce"       ? a.numel() == b.numel()
              : inst.op == "all_gather"     ? b.numel() == a.numel() * w
                                            : a.numel() == b.numel() * w;
    if (!ok)
      return FSDP_ERROR(inst.op, ": sizes ", a.numel(), " -> ", b.numel(),
                        " do not fit ", w, " rank(s) (group ", group, ")");
    auto async = inst.attrs.find("async");
    if (async != inst.attrs.end() && !async->is_boolean())
      return FSDP_ERROR(inst.op, ": attribute async: expected true or false, found ",
                        async->is_primitive() ? async->dump() : async->type_name());
    if (inst.op != "all_gather") {
      auto it = inst.attrs.find("reduce");
      if (it == inst.attrs.end() || !it->is_string() ||
          (*it != "sum" && *it != "mean"))
        return FSDP_ERROR(inst.op, ": expected reduce = \"sum\" or \"mean\"");
    }
    return Status::ok();
  }
  auto it = table().find(inst.op);
  if (it == table().end())
    return FSDP_ERROR("unknown op '", inst.op,
                      "' (this runtime does not implement it)");
  const OpDef &def = it->second;
  if ((def.nin >= 0 && (int)inst.in.size() != def.nin) ||
      (def.nin < 0 && inst.in.empty()) || (int)inst.out.size() != def.nout)
    return FSDP_ERROR(inst.op, ": expected ", def.nin < 0 ? std::string("1+")
                                                         : std::to_string(def.nin),
                      " inputs and ", def.nout, " outputs, found ", inst.in.size(),
                      " and ", inst.out.size());
  if (needsWidening(plan, inst)) {
    // See [Note: bf16 storage, f32 compute].
    Widened w = widen(plan, inst);
    return checkInstruction(w.plan, w.inst);
  }
  Op op{plan, inst};
  FSDP_RETURN_IF_ERROR(def.check(op));
  // Every attribute a kernel reads, type-checked whether or not the op's
  // own check looked at it.
  for (const char *name : {"transpose_lhs", "transpose_rhs", "causal", "nesterov"})
    op.b(name);
  for (const char *name : {"dim", "offset", "heads", "kv_heads"})
    op.i(name, 0);
  for (const char *name : {"perm", "dims", "offsets"})
    op.iv(name);
  for (const char *name : {"factor", "value", "epsilon", "momentum", "dampening",
                           "weight_decay", "beta1", "beta2", "eps", "max_norm",
                           "theta"})
    op.f(name, 0);
  if (!op.attrError.empty())
    return FSDP_ERROR(inst.op, ": ", op.attrError);
  return Status::ok();
}

Status runInstruction(const Plan &plan, const Instruction &inst, uint8_t *arena,
                      int64_t rank) {
  auto it = table().find(inst.op);
  if (it == table().end())
    return FSDP_ERROR("unknown op '", inst.op, "'");
  if (needsWidening(plan, inst))
    return runWidened(plan, inst, arena, rank, it->second);
  Op op{plan, inst};
  return it->second.run(Run{op, arena, rank});
}

} // namespace fsdp::cpu
