//===- Dispatch.cpp - plan instructions to CPU kernels --------------------===//
//
// One kernel launcher per compute op of PlanSchema.h. Shapes, dtypes and
// attributes were checked at plan load by core (runtime/core/OpRules.cpp),
// which also derives the dimensions a launcher needs (matmulDims, the
// widened view of a bf16 instruction), so both sides agree by construction.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Dispatch.h"

#include "runtime/core/Bf16.h"
#include "runtime/core/OpRules.h"
#include "runtime/core/ShapeRules.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/cpu/Kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <vector>

namespace fsdp::cpu {

namespace {

using rules::around;
using rules::ceClasses;
using rules::ceSmoothing;
using rules::lastDim;
using rules::matmulDims;
using rules::MM;
using rules::needsWidening;
using rules::Op;
using rules::rowsOf;
using rules::widen;
using rules::Widened;
using Shape = rules::Shape;

/// Where buffer `id` is: in the one block `arena` ([Note: two arenas] in
/// Plan.h), or, when the host arena is elsewhere (`host`, the CUDA device's
/// pinned memory), there for a host buffer.
uint8_t *addressOf(const Plan &plan, int64_t id, int64_t rank, uint8_t *arena, uint8_t *host) {
  int64_t off = bufferOffset(plan, id, rank);
  if (host && plan.buffers[id].host)
    return host + (off - hostArenaStart(plan.arenaBytes));
  return arena + off;
}

/// Kernel-time view: typed pointers to operands.
struct Run {
  const Op &op;
  uint8_t *arena;
  int64_t rank;
  const DropoutContext &dropout;
  uint8_t *host = nullptr;
  template <typename T = float> T *in(size_t i) const {
    return reinterpret_cast<T *>(addressOf(op.plan, op.inst.in[i], rank, arena, host));
  }
  template <typename T = float> T *out(size_t i) const {
    return reinterpret_cast<T *>(addressOf(op.plan, op.inst.out[i], rank, arena, host));
  }
};

using Exec = std::function<Status(const Run &)>;

Exec binaryRun(BinaryKind k) {
  return [k](const Run &r) {
    binary<float>(k, r.in(0), r.op.in(0).shape, r.in(1), r.op.in(1).shape, r.out(0),
                  r.op.out(0).shape);
    return Status::ok();
  };
}

template <typename I> Status runEmbedding(const Run &r) {
  const Buffer &t = r.op.in(0), &ids = r.op.in(1);
  int64_t bad =
      embedding<float, I>(r.in(0), r.in<I>(1), r.out(0), ids.numel(), t.shape[0], t.shape[1]);
  if (bad >= 0)
    return FSDP_ERROR("embedding: token id ", (int64_t)r.in<I>(1)[bad], " at position ", bad,
                      " is outside the vocabulary [0, ", t.shape[0], ")");
  return Status::ok();
}

template <typename I> Status runEmbeddingGrad(const Run &r) {
  const Buffer &ids = r.op.in(0), &t = r.op.out(0);
  int64_t bad =
      embeddingGrad<float, I>(r.in<I>(0), r.in(1), r.out(0), ids.numel(), t.shape[0], t.shape[1]);
  if (bad >= 0)
    return FSDP_ERROR("embedding_grad: token id ", (int64_t)r.in<I>(0)[bad],
                      " is outside the vocabulary [0, ", t.shape[0], ")");
  return Status::ok();
}

/// cross_entropy (loss), cross_entropy_grad (grad) or cross_entropy_fused
/// (both: the loss into out(0), then the gradient into out(1), the two
/// kernels one after the other, so the same bits as the unfused ops; in
/// place too, as the forward only reads the logits).
template <typename I> Status runCrossEntropy(const Run &r, bool loss, bool grad) {
  const Buffer &l = r.op.in(0);
  int64_t stride = lastDim(l), rows = rowsOf(l), classes = ceClasses(r.op);
  double smoothing = ceSmoothing(r.op);
  rules::CeIgnore ig = rules::ceIgnore(r.op);
  const float *norm = ig.on ? r.in(ig.normalizer) : nullptr;
  int64_t bad = -1;
  if (loss)
    bad = crossEntropy<float, I>(r.in(0), r.in<I>(1), r.out(0), rows, classes, stride, smoothing,
                                 norm, ig.index);
  if (grad && bad < 0)
    bad = crossEntropyGrad<float, I>(r.in(0), r.in<I>(1), r.in(2), r.out(loss ? 1 : 0), rows,
                                     classes, stride, smoothing, norm, ig.index);
  if (bad >= 0)
    return FSDP_ERROR(r.op.inst.op, ": label ", (int64_t)r.in<I>(1)[bad], " at position ", bad,
                      " is outside [0, ", classes, ")");
  return Status::ok();
}

/// Converts n elements between storage dtypes, one of them f32 (or both
/// the same). See [Note: bf16 storage, f32 compute] in runtime/core/OpRules.cpp.
void convert(const uint8_t *src, DType from, uint8_t *dst, DType to, int64_t n);
/// Counts `bytes` of per-thread scratch outside the arena in the
/// high-water mark fsdp-run reports (widenedScratchHighWater).
void noteScratch(int64_t bytes);

const std::unordered_map<std::string, Exec> &table() {
  static const std::unordered_map<std::string, Exec> t = [] {
    std::unordered_map<std::string, Exec> m;
    m["add"] = binaryRun(BinaryKind::Add);
    m["sub"] = binaryRun(BinaryKind::Sub);
    m["mul"] = binaryRun(BinaryKind::Mul);
    m["div"] = binaryRun(BinaryKind::Div);
    m["neg"] = [](const Run &r) {
      neg<float>(r.in(0), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["scale"] = [](const Run &r) {
      scale<float>(r.in(0), r.out(0), r.op.out(0).numel(), r.op.f("factor", 1.0));
      return Status::ok();
    };
    m["dropout"] = [](const Run &r) {
      const DropoutContext &c = r.dropout;
      int64_t n = r.op.out(0).numel();
      double p = r.op.f("p", 0);
      if (!c.training || p == 0) {
        scale<float>(r.in(0), r.out(0), n, 1.0);
        return Status::ok();
      }
      int64_t micro = r.op.i("micro", 0), count = r.op.i("micro_count", 1);
      uint64_t first = (uint64_t)((c.dataRank * count + micro) * n);
      dropout<float>(r.in(0), r.out(0), n, dropoutKey(c.seed, c.step, r.op.i("id", 0)),
                     first, dropoutThreshold(p), 1.0 / (1.0 - p));
      return Status::ok();
    };
    m["fill"] = [](const Run &r) {
      fill<float>(r.out(0), r.op.out(0).numel(), r.op.f("value", 0));
      return Status::ok();
    };
    m["copy"] = [](const Run &r) {
      void *dst = r.out<uint8_t>(0);
      const void *src = r.in<uint8_t>(0);
      if (dst != src)
        std::memmove(dst, src, r.op.out(0).bytes);
      return Status::ok();
    };
    m["relu"] = [](const Run &r) {
      relu<float>(r.in(0), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["gelu"] = [](const Run &r) {
      (rules::geluExact(r.op) ? geluExact<float> : gelu<float>)(r.in(0), r.out(0),
                                                                r.op.out(0).numel());
      return Status::ok();
    };
    m["softmax"] = [](const Run &r) {
      softmax<float>(r.in(0), r.out(0), rowsOf(r.op.out(0)), lastDim(r.op.out(0)));
      return Status::ok();
    };
    m["relu_grad"] = [](const Run &r) {
      reluGrad<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["gelu_grad"] = [](const Run &r) {
      (rules::geluExact(r.op) ? geluExactGrad<float> : geluGrad<float>)(
          r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["softmax_grad"] = [](const Run &r) {
      softmaxGrad<float>(r.in(0), r.in(1), r.out(0), rowsOf(r.op.out(0)), lastDim(r.op.out(0)));
      return Status::ok();
    };
    m["bias_add"] = [](const Run &r) {
      biasAdd<float>(r.in(0), r.in(1), r.out(0), rowsOf(r.op.in(0)), lastDim(r.op.in(0)));
      return Status::ok();
    };
    m["matmul"] = [](const Run &r) {
      MM d;
      FSDP_RETURN_IF_ERROR(matmulDims(r.op, d));
      // acc + a b: the GEMM adds to the result, which starts as acc (in
      // place when the plan put the result on it).
      bool acc = r.op.inst.in.size() > 2;
      if (acc && r.in(2) != r.out(0))
        std::memmove(r.out(0), r.in(2), sizeof(float) * r.op.out(0).numel());
      matmul<float>(r.in(0), r.in(1), r.out(0), d.batch, d.m, d.n, d.k, r.op.b("transpose_lhs"),
                    r.op.b("transpose_rhs"), acc);
      return Status::ok();
    };
    // The fused matmuls run the GEMM, then the ops fsdp-fuse-epilogues
    // folded into it as passes over the [M, N] result, in the order and with
    // the kernels of the unfused ops: an f32 plan gives bitwise the unfused
    // results (a bf16 one rounds once, at the end: the whole instruction is
    // widened).
    m["matmul_bias"] = [](const Run &r) {
      MM d;
      FSDP_RETURN_IF_ERROR(matmulDims(r.op, d));
      float *y = r.out(0);
      matmul<float>(r.in(0), r.in(1), y, 1, d.m, d.n, d.k, r.op.b("transpose_lhs"),
                    r.op.b("transpose_rhs"));
      float *pre = r.op.inst.out.size() > 1 ? r.out(1) : y;
      biasAdd<float>(y, r.in(2), pre, d.m, d.n);
      if (r.op.b("gelu"))
        gelu<float>(pre, y, d.m * d.n);
      return Status::ok();
    };
    m["matmul_gelu_grad"] = [](const Run &r) {
      MM d;
      FSDP_RETURN_IF_ERROR(matmulDims(r.op, d));
      float *dx = r.out(0);
      matmul<float>(r.in(0), r.in(1), dx, 1, d.m, d.n, d.k, r.op.b("transpose_lhs"),
                    r.op.b("transpose_rhs"));
      geluGrad<float>(r.in(2), dx, dx, d.m * d.n);
      if (r.op.inst.out.size() > 1)
        sumTo<float>(dx, r.op.out(0).shape, r.out(1), r.op.out(1).shape);
      return Status::ok();
    };
    // A linear layer's weight gradient dy^T x, then its bias gradient (the
    // sum of dy over its rows) with sum_to's kernel. With accumulators (aw,
    // ab): the GEMM adds to aw (beta = 1, the result starts as aw, in place
    // when the plan put it there), and the column sums are taken first and
    // then added to ab, as the unfused sum_to and add (the same bits).
    m["matmul_bias_grad"] = [](const Run &r) {
      MM d;
      FSDP_RETURN_IF_ERROR(matmulDims(r.op, d));
      const bool acc = r.op.inst.in.size() > 2;
      if (acc && r.in(2) != r.out(0))
        std::memmove(r.out(0), r.in(2), sizeof(float) * r.op.out(0).numel());
      matmul<float>(r.in(0), r.in(1), r.out(0), 1, d.m, d.n, d.k, true, false, acc);
      if (!acc) {
        sumTo<float>(r.in(0), r.op.in(0).shape, r.out(1), r.op.out(1).shape);
        return Status::ok();
      }
      thread_local std::vector<float> sums;
      sums.resize(d.m);
      sumTo<float>(r.in(0), r.op.in(0).shape, sums.data(), r.op.out(1).shape);
      const float *ab = r.in(3);
      float *db = r.out(1);
      for (int64_t j = 0; j < d.m; ++j)
        db[j] = ab[j] + sums[j];
      return Status::ok();
    };
    m["layer_norm"] = [](const Run &r) {
      layerNorm<float>(r.in(0), r.in(1), r.in(2), r.out(0), rowsOf(r.op.in(0)), lastDim(r.op.in(0)),
                       r.op.f("epsilon", 1e-5));
      return Status::ok();
    };
    // The fused residual stream (fsdp-fuse-epilogues): the add's and the
    // layer norm's kernels in order, so f32 is bitwise the unfused plan.
    m["residual_layer_norm"] = [](const Run &r) {
      const Shape &x = r.op.in(0).shape;
      binary<float>(BinaryKind::Add, r.in(0), x, r.in(1), x, r.out(0), x);
      layerNorm<float>(r.out(0), r.in(2), r.in(3), r.out(1), rowsOf(r.op.in(0)),
                       lastDim(r.op.in(0)), r.op.f("epsilon", 1e-5));
      return Status::ok();
    };
    m["layer_norm_grad_acc"] = [](const Run &r) {
      const Shape &x = r.op.in(0).shape;
      layerNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.out(1), r.out(2),
                           rowsOf(r.op.in(0)), lastDim(r.op.in(0)), r.op.f("epsilon", 1e-5));
      binary<float>(BinaryKind::Add, r.in(3), x, r.out(0), x, r.out(0), x);
      return Status::ok();
    };
    m["layer_norm_grad"] = [](const Run &r) {
      layerNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.out(1), r.out(2),
                           rowsOf(r.op.in(0)), lastDim(r.op.in(0)), r.op.f("epsilon", 1e-5));
      return Status::ok();
    };
    m["attention"] = [](const Run &r) {
      const Shape &s = r.op.in(0).shape;
      int64_t heads = r.op.i("heads", 1);
      attention<float>(r.in(0), r.in(1), r.in(2), r.out(0),
                       r.op.inst.out.size() > 1 ? r.out(1) : nullptr, s[0], s[1], s[2], heads,
                       r.op.b("causal"), r.op.i("kv_heads", heads));
      return Status::ok();
    };
    m["attention_grad"] = [](const Run &r) {
      const Shape &s = r.op.in(0).shape;
      int64_t heads = r.op.i("heads", 1);
      // r.in(3), the forward's output y, is not read: this kernel forms
      // each row's delta = dy . y from P and dP in the same pass.
      attentionGrad<float>(r.in(0), r.in(1), r.in(2), r.in(4), r.in(5), r.out(0), r.out(1),
                           r.out(2), s[0], s[1], s[2], heads, r.op.b("causal"),
                           r.op.i("kv_heads", heads));
      return Status::ok();
    };
    // attention_qkv(_grad): q, k, v are column ranges [0, C), [C, C + KC),
    // [C + KC, C + 2 KC) of the packed rows, read (and their gradients
    // written) in place at the packed row stride.
    struct Packed {
      int64_t heads, kv, kc; // kc = kv_heads * D, the width of k and of v
      AttentionRows rows;
    };
    auto packed = [](const Run &r, const Shape &y) {
      int64_t heads = r.op.i("heads", 1), kv = r.op.i("kv_heads", heads);
      int64_t kc = kv * (y[2] / heads), w = y[2] + 2 * kc;
      return Packed{heads, kv, kc, AttentionRows{w, w, 0}};
    };
    m["attention_qkv"] = [packed](const Run &r) {
      const Shape &y = r.op.out(0).shape;
      Packed p = packed(r, y);
      const float *qkv = r.in(0);
      attention<float>(qkv, qkv + y[2], qkv + y[2] + p.kc, r.out(0),
                       r.op.inst.out.size() > 1 ? r.out(1) : nullptr, y[0], y[1], y[2], p.heads,
                       r.op.b("causal"), p.kv, p.rows);
      return Status::ok();
    };
    m["attention_qkv_grad"] = [packed](const Run &r) {
      const Shape &y = r.op.in(1).shape;
      Packed p = packed(r, y);
      const float *qkv = r.in(0);
      float *d = r.out(0);
      attentionGrad<float>(qkv, qkv + y[2], qkv + y[2] + p.kc, r.in(2), r.in(3), d, d + y[2],
                           d + y[2] + p.kc, y[0], y[1], y[2], p.heads, r.op.b("causal"), p.kv,
                           p.rows);
      return Status::ok();
    };
    m["silu"] = [](const Run &r) {
      silu<float>(r.in(0), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["silu_grad"] = [](const Run &r) {
      siluGrad<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["swiglu"] = [](const Run &r) {
      swiglu<float>(r.in(0), r.in(1), r.out(0), r.op.out(0).numel());
      return Status::ok();
    };
    m["swiglu_grad"] = [](const Run &r) {
      swigluGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.out(1), r.op.out(0).numel());
      return Status::ok();
    };
    m["rms_norm"] = [](const Run &r) {
      rmsNorm<float>(r.in(0), r.in(1), r.out(0), rowsOf(r.op.in(0)), lastDim(r.op.in(0)),
                     r.op.f("epsilon", 1e-6));
      return Status::ok();
    };
    // The fused residual stream of a Llama (fsdp-fuse-epilogues): the add's
    // and the norm's kernels in order, so f32 is bitwise the unfused plan.
    m["residual_rms_norm"] = [](const Run &r) {
      const Shape &x = r.op.in(0).shape;
      binary<float>(BinaryKind::Add, r.in(0), x, r.in(1), x, r.out(0), x);
      rmsNorm<float>(r.out(0), r.in(2), r.out(1), rowsOf(r.op.in(0)), lastDim(r.op.in(0)),
                     r.op.f("epsilon", 1e-6));
      return Status::ok();
    };
    m["rms_norm_grad_acc"] = [](const Run &r) {
      const Shape &x = r.op.in(0).shape;
      rmsNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.out(1), rowsOf(r.op.in(0)),
                         lastDim(r.op.in(0)), r.op.f("epsilon", 1e-6));
      binary<float>(BinaryKind::Add, r.in(3), x, r.out(0), x, r.out(0), x);
      return Status::ok();
    };
    m["rms_norm_grad"] = [](const Run &r) {
      rmsNormGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.out(1), rowsOf(r.op.in(0)),
                         lastDim(r.op.in(0)), r.op.f("epsilon", 1e-6));
      return Status::ok();
    };
    m["rope"] = [](const Run &r) {
      const Shape &s = r.op.in(0).shape;
      rope<float>(r.in(0), r.out(0), s[0], s[1], s[2], r.op.i("heads", 1), r.op.f("theta", 1e4));
      return Status::ok();
    };
    m["rope_grad"] = [](const Run &r) {
      const Shape &s = r.op.in(0).shape;
      ropeGrad<float>(r.in(0), r.out(0), s[0], s[1], s[2], r.op.i("heads", 1),
                      r.op.f("theta", 1e4));
      return Status::ok();
    };
    m["embedding"] = [](const Run &r) {
      return r.op.in(1).dtype == DType::I32 ? runEmbedding<int32_t>(r) : runEmbedding<int64_t>(r);
    };
    m["embedding_grad"] = [](const Run &r) {
      return r.op.in(0).dtype == DType::I32 ? runEmbeddingGrad<int32_t>(r)
                                            : runEmbeddingGrad<int64_t>(r);
    };
    m["reshape"] = [](const Run &r) {
      std::memcpy(r.out<uint8_t>(0), r.in<uint8_t>(0), r.op.out(0).bytes);
      return Status::ok();
    };
    // On the CPU both arenas are host memory: the copies are memcpy.
    m["to_host"] = m["to_device"] = m["reshape"];
    m["transpose"] = [](const Run &r) {
      transpose<float>(r.in(0), r.op.in(0).shape, r.op.iv("perm"), r.out(0));
      return Status::ok();
    };
    m["slice"] = [](const Run &r) {
      int64_t dim = r.op.i("dim", 0), outer, inner;
      around(r.op.in(0).shape, dim, outer, inner);
      slice<float>(r.in(0), r.out(0), outer, r.op.in(0).shape[dim], r.op.out(0).shape[dim], inner,
                   r.op.i("offset", 0));
      return Status::ok();
    };
    m["slice_grad"] = [](const Run &r) {
      int64_t dim = r.op.i("dim", 0), outer, inner;
      around(r.op.out(0).shape, dim, outer, inner);
      sliceGrad<float>(r.in(0), r.out(0), outer, r.op.out(0).shape[dim], r.op.in(0).shape[dim],
                       inner, r.op.i("offset", 0));
      return Status::ok();
    };
    m["concat"] = [](const Run &r) {
      int64_t dim = r.op.i("dim", 0), outer, inner, off = 0;
      const Buffer &o = r.op.out(0);
      around(o.shape, dim, outer, inner);
      for (size_t i = 0; i < r.op.inst.in.size(); ++i) {
        int64_t len = r.op.in(i).shape[dim];
        const float *src = r.in(i);
        float *dst = r.out(0);
        for (int64_t a = 0; a < outer; ++a)
          std::memcpy(dst + (a * o.shape[dim] + off) * inner, src + a * len * inner,
                      sizeof(float) * len * inner);
        off += len;
      }
      return Status::ok();
    };
    auto runReduce = [](bool mean) {
      return [mean](const Run &r) {
        // A reduction is sum_to the keep-dims shape, whose layout is that
        // of the dropped-dims result.
        const Shape &in = r.op.in(0).shape;
        std::vector<int64_t> dims = r.op.iv("dims");
        sumTo<float>(r.in(0), in, r.out(0), shapes::kept(in, dims));
        if (mean)
          scale<float>(r.out(0), r.out(0), r.op.out(0).numel(),
                       1.0 / shapes::reducedCount(in, dims));
        return Status::ok();
      };
    };
    m["reduce_sum"] = runReduce(false);
    m["reduce_mean"] = runReduce(true);
    m["broadcast"] = [](const Run &r) {
      broadcastTo<float>(r.in(0), r.op.in(0).shape, r.out(0), r.op.out(0).shape);
      return Status::ok();
    };
    m["sum_to"] = [](const Run &r) {
      sumTo<float>(r.in(0), r.op.in(0).shape, r.out(0), r.op.out(0).shape);
      return Status::ok();
    };
    // ZeRO++'s qwZ (runtime/core/Quantize.h): a shard into int8 blocks,
    // and the gathered parts back into the compute dtype.
    m["quantize"] = [](const Run &r) {
      const int64_t n = r.op.in(0).numel();
      const float *x = r.in(0);
      thread_local std::vector<float> wide; // a narrow shard, widened exactly
      if (r.op.in(0).dtype != DType::F32) {
        if ((int64_t)wide.size() < n) {
          wide.resize(n);
          noteScratch(n * 4);
        }
        convert(r.in<uint8_t>(0), r.op.in(0).dtype, reinterpret_cast<uint8_t *>(wide.data()),
                DType::F32, n);
        x = wide.data();
      }
      // parts (qgZ): each part quantized on its own, one after another.
      const int64_t parts = r.op.i("parts", 1), block = r.op.i("block", 1), per = n / parts;
      // chunks (hierarchical qgZ): part p is chunks p, p + parts, ... of
      // the values, gathered into one run first.
      const int64_t chunks = r.op.i("chunks", parts);
      thread_local std::vector<float> gathered;
      if (chunks != parts) {
        if ((int64_t)gathered.size() < n) {
          gathered.resize(n);
          noteScratch((int64_t)(wide.size() + gathered.size()) * 4);
        }
        const int64_t c = n / chunks, each = chunks / parts;
        for (int64_t p = 0; p < parts; ++p)
          for (int64_t j = 0; j < each; ++j)
            std::memcpy(gathered.data() + p * per + j * c, x + (j * parts + p) * c, (size_t)c * 4);
        x = gathered.data();
      }
      const int64_t partBytes = shapes::quantizedBytes(per, block);
      for (int64_t p = 0; p < parts; ++p)
        quantize(x + p * per, per, block, r.out<uint8_t>(0) + p * partBytes);
      return Status::ok();
    };
    m["dequantize"] = [](const Run &r) {
      const DType to = r.op.out(0).dtype;
      const DequantizeTo kind = to == DType::F32    ? DequantizeTo::F32
                                : to == DType::BF16 ? DequantizeTo::BF16
                                                    : DequantizeTo::F16;
      const int64_t parts = r.op.i("parts", 1), block = r.op.i("block", 1);
      if (r.op.has("reduce")) { // qgZ: the parts summed into this rank's shard
        dequantizeSum(r.in<uint8_t>(0), parts, r.op.out(0).numel(), block,
                      r.op.s("reduce", "sum") == "mean", r.out<uint8_t>(0), kind);
        return Status::ok();
      }
      dequantize(r.in<uint8_t>(0), parts, r.op.out(0).numel() / parts, block, r.out<uint8_t>(0),
                 kind);
      return Status::ok();
    };
    m["cast"] = [](const Run &r) {
      int64_t n = r.op.out(0).numel();
      DType from = r.op.in(0).dtype, to = r.op.out(0).dtype;
      if (r.op.b("stochastic") && r.dropout.training) {
        // Evaluation rounds to nearest (the closest bf16 model).
        const DropoutContext &c = r.dropout;
        uint64_t first = r.op.b("sharded") ? (uint64_t)(r.rank * n) : 0;
        castBf16Stochastic(r.in(0), r.out<uint16_t>(0), n,
                           stochasticRoundingKey(c.seed, c.step, r.op.i("key", 0)), first);
        return Status::ok();
      }
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
          r.out<uint16_t>(0)[i] = to == DType::BF16 ? floatToBf16(tmp[i]) : floatToHalf(tmp[i]);
      }
      return Status::ok();
    };
    auto crossEntropyRun = [](bool loss, bool grad) -> Exec {
      return [loss, grad](const Run &r) {
        return r.op.in(1).dtype == DType::I32 ? runCrossEntropy<int32_t>(r, loss, grad)
                                              : runCrossEntropy<int64_t>(r, loss, grad);
      };
    };
    m["count_labels"] = [](const Run &r) {
      int64_t n = r.op.in(0).numel(), ignore = r.op.i("ignore_index", 0),
              divisor = r.op.i("divisor", 1);
      *r.out(0) = r.op.in(0).dtype == DType::I32
                      ? countLabels(r.in<int32_t>(0), n, ignore, divisor)
                      : countLabels(r.in<int64_t>(0), n, ignore, divisor);
      return Status::ok();
    };
    m["cross_entropy"] = crossEntropyRun(true, false);
    m["cross_entropy_grad"] = crossEntropyRun(false, true);
    m["cross_entropy_fused"] = crossEntropyRun(true, true);
    m["mse_loss"] = [](const Run &r) {
      mseLoss<float>(r.in(0), r.in(1), r.out(0), r.op.in(0).numel());
      return Status::ok();
    };
    m["mse_loss_grad"] = [](const Run &r) {
      mseLossGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.op.in(0).numel());
      return Status::ok();
    };
    m["bce_with_logits"] = [](const Run &r) {
      bceWithLogits<float>(r.in(0), r.in(1), r.out(0), r.op.in(0).numel());
      return Status::ok();
    };
    m["bce_with_logits_grad"] = [](const Run &r) {
      bceWithLogitsGrad<float>(r.in(0), r.in(1), r.in(2), r.out(0), r.op.in(0).numel());
      return Status::ok();
    };
    // skip_nonfinite (dynamic loss scaling): when the global squared norm
    // of the scaled gradients overflowed, every result is its input.
    // grad_scale (fsdp-fuse-epilogues' folded clipping / unscaling): the
    // gradient times that scalar, 1 without it.
    auto skipped = [](const Run &r, int nOut) {
      int at = rules::updateExtras(r.op).skip;
      if (at < 0 || std::isfinite(*r.in(at)))
        return false;
      for (int i = 0; i < nOut; ++i) {
        // p, then the states (bf16 moments: state-dtype=bf16)
        const uint8_t *src = r.in<uint8_t>(i == 0 ? 0 : i + 1);
        if (src != r.out<uint8_t>(i))
          std::memmove(r.out<uint8_t>(i), src, r.op.out(i).bytes);
      }
      return true;
    };
    // The optimizer's step count arrives as an f32 scalar (the executor
    // writes the count of applied updates, 1 on the first). Anything else
    // (a plan wiring another buffer there) is an error, not a cast of a NaN.
    auto stepCount = [](const Run &r, size_t at, int64_t &step) {
      float s = *r.in(at);
      if (!(s >= 1 && s <= 9007199254740992.0f) || s != std::floor(s))
        return FSDP_ERROR(r.op.inst.op, ": the step operand (buffer ", r.op.inst.in[at],
                          ") holds ", s, "; expected a whole update count >= 1");
      step = (int64_t)s;
      return Status::ok();
    };
    // weight-decay-params=matrices: `update(offset, count, weight decay)`
    // on the decayed prefix, then on the rest without decay (each
    // element's arithmetic is the one-call one).
    auto inTwoParts = [](const Run &r, double decay, auto &&update) {
      int64_t n = r.op.in(0).numel(), k = rules::decayedCount(r.op, r.rank);
      update(0, k, decay);
      update(k, n - k, 0.0);
    };
    auto gradScale = [](const Run &r) {
      int at = rules::updateExtras(r.op).scale;
      return at < 0 ? 1.f : *r.in(at);
    };
    // The parameters of elements [at, at + count) as an update reads (p)
    // and writes (np) them: `step(at, count, p, np)`. f32 parameters are
    // the operands themselves (in place allowed). bf16 parameters with an
    // f32 gradient (updatesBf16Params: master-dtype=bf16) are widened a
    // piece at a time into an f32 buffer, the piece stepped in place there,
    // and rounded back once: stochastically with the stochastic parameter
    // cast's draws (stochastic_param: the unit's key, each element at its
    // place in the unit), else to nearest even. A piece is a whole number
    // of every 8-bit block (at most 4096), and big enough for the kernels'
    // own threads.
    auto params = [](const Run &r, int64_t at, int64_t count, auto &&step) {
      if (!rules::updatesBf16Params(r.op.plan, r.op.inst)) {
        step(at, count, r.in(0) + at, r.out(0) + at);
        return;
      }
      constexpr int64_t kPiece = int64_t(1) << 16;
      thread_local std::vector<float> work(kPiece);
      const uint16_t *p = r.in<uint16_t>(0);
      uint16_t *np = r.out<uint16_t>(0);
      const bool stochastic = r.op.b("stochastic_param");
      const uint64_t key = stochasticRoundingKey(r.dropout.seed, r.dropout.step, r.op.i("key", 0));
      const uint64_t first = (uint64_t)(r.rank * r.op.i("shard_stride", 0));
      for (int64_t a = at; a < at + count; a += kPiece) {
        const int64_t len = std::min(kPiece, at + count - a);
        float *w = work.data();
        convert(reinterpret_cast<const uint8_t *>(p + a), DType::BF16,
                reinterpret_cast<uint8_t *>(w), DType::F32, len);
        step(a, len, w, w);
        if (stochastic)
          castBf16Stochastic(w, np + a, len, key, first + (uint64_t)a);
        else
          convert(reinterpret_cast<const uint8_t *>(w), DType::F32,
                  reinterpret_cast<uint8_t *>(np + a), DType::BF16, len);
      }
    };
    m["sgd_update"] = [skipped, inTwoParts, gradScale, params](const Run &r) {
      if (skipped(r, 1))
        return Status::ok();
      float gs = gradScale(r);
      inTwoParts(r, r.op.f("weight_decay", 0), [&](int64_t at, int64_t count, double wd) {
        params(r, at, count, [&](int64_t a, int64_t len, const float *p, float *np) {
          sgdUpdate<float>(p, r.in(1) + a, np, len, *r.in(2), wd, gs);
        });
      });
      return Status::ok();
    };
    // bf16 optimizer state (state-dtype=bf16; never widened:
    // needsWidening): how the part of the operand from element `at` rounds
    // it. The draws are keyed by the unit and placed by the element's
    // position in it, so every rank layout stores the same bits.
    auto stateRounding = [](const Run &r, int64_t at) {
      MomentRounding mr;
      mr.stochastic = r.op.b("stochastic");
      mr.key = stateRoundingKey(r.dropout.seed, r.dropout.step, r.op.i("key", 0));
      mr.first = (uint64_t)(r.rank * r.op.i("shard_stride", 0) + at);
      return mr;
    };
    m["sgd_momentum_update"] = [skipped, stepCount, inTwoParts, gradScale, stateRounding,
                                params](const Run &r) {
      if (skipped(r, 2))
        return Status::ok();
      float gs = gradScale(r);
      int64_t step;
      FSDP_RETURN_IF_ERROR(stepCount(r, 4, step));
      const double mom = r.op.f("momentum", 0), damp = r.op.f("dampening", 0);
      if (r.op.in(2).dtype == DType::I8) {
        // an 8-bit buffer (state-dtype=8bit): one call, as adamw_update's
        const int64_t n = r.op.in(0).numel(), block = r.op.i("state_block", 256),
                      k = rules::decayedCount(r.op, r.rank);
        params(r, 0, n, [&](int64_t a, int64_t len, const float *p, float *np) {
          sgdMomentumUpdate8bitStatePiece(p, np, a, len, r.in(1), r.in<uint8_t>(2),
                                          r.out<uint8_t>(1), n, block, *r.in(3), step, mom, damp,
                                          r.op.f("weight_decay", 0), r.op.b("nesterov"), k, gs);
        });
        return Status::ok();
      }
      const bool bf16State = r.op.in(2).dtype == DType::BF16;
      inTwoParts(r, r.op.f("weight_decay", 0), [&](int64_t at, int64_t count, double wd) {
        params(r, at, count, [&](int64_t a, int64_t len, const float *p, float *np) {
          if (bf16State)
            sgdMomentumUpdateBf16State(p, r.in(1) + a, r.in<uint16_t>(2) + a, np,
                                       r.out<uint16_t>(1) + a, len, *r.in(3), step, mom, damp, wd,
                                       r.op.b("nesterov"), gs, stateRounding(r, a));
          else
            sgdMomentumUpdate<float>(p, r.in(1) + a, r.in(2) + a, np, r.out(1) + a, len, *r.in(3),
                                     step, mom, damp, wd, r.op.b("nesterov"), gs);
        });
      });
      return Status::ok();
    };
    m["adamw_update"] = [skipped, stepCount, inTwoParts, gradScale, stateRounding,
                         params](const Run &r) {
      if (skipped(r, 3))
        return Status::ok();
      float gs = gradScale(r);
      int64_t step;
      FSDP_RETURN_IF_ERROR(stepCount(r, 5, step));
      const double b1 = r.op.f("beta1", 0.9), b2 = r.op.f("beta2", 0.999),
                   eps = r.op.f("eps", 1e-8);
      const int64_t n = r.op.in(0).numel();
      if (r.op.in(2).dtype == DType::I8) {
        // 8-bit or 4-bit moments (state-dtype=8bit|4bit): one call, since
        // a block may straddle the decayed prefix (weight-decay-params=
        // matrices)
        const int64_t block = r.op.i("state_block", 256), k = rules::decayedCount(r.op, r.rank);
        const double wd = r.op.f("weight_decay", 0.01);
        auto *const piece =
            r.op.i("state_bits", 8) == 4 ? adamwUpdate4bitStatePiece : adamwUpdate8bitStatePiece;
        params(r, 0, n, [&](int64_t a, int64_t len, const float *p, float *np) {
          piece(p, np, a, len, r.in(1), r.in<uint8_t>(2), r.in<uint8_t>(3), r.out<uint8_t>(1),
                r.out<uint8_t>(2), n, block, *r.in(4), step, b1, b2, eps, wd, k, gs);
        });
        return Status::ok();
      }
      const bool bf16State = r.op.in(2).dtype == DType::BF16;
      inTwoParts(r, r.op.f("weight_decay", 0.01), [&](int64_t at, int64_t count, double wd) {
        params(r, at, count, [&](int64_t a, int64_t len, const float *p, float *np) {
          if (bf16State)
            adamwUpdateBf16State(p, r.in(1) + a, r.in<uint16_t>(2) + a, r.in<uint16_t>(3) + a, np,
                                 r.out<uint16_t>(1) + a, r.out<uint16_t>(2) + a, len, *r.in(4),
                                 step, b1, b2, eps, wd, gs, stateRounding(r, a));
          else
            adamwUpdate<float>(p, r.in(1) + a, r.in(2) + a, r.in(3) + a, np, r.out(1) + a,
                               r.out(2) + a, len, *r.in(4), step, b1, b2, eps, wd, gs);
        });
      });
      return Status::ok();
    };
    // LAMB: the sums of a unit's (or shard's) parameters, all-reduced by
    // the plan between the two ops, then the update with their trust ratios.
    auto lambLayout = [](const Run &r) { return rules::lambLayout(r.op, r.rank); };
    m["lamb_norms"] = [stepCount, gradScale, lambLayout](const Run &r) {
      int64_t step;
      FSDP_RETURN_IF_ERROR(stepCount(r, 4, step));
      const double b1 = r.op.f("beta1", 0.9), b2 = r.op.f("beta2", 0.999),
                   eps = r.op.f("eps", 1e-6), wd = r.op.f("weight_decay", 0.01);
      if (r.op.in(2).dtype == DType::BF16)
        lambNormsBf16State(r.in(0), r.in(1), r.in<uint16_t>(2), r.in<uint16_t>(3), r.out(0),
                           r.op.in(0).numel(), lambLayout(r), step, b1, b2, eps, wd, gradScale(r));
      else if (r.op.in(2).dtype == DType::I8) // state-dtype=8bit
        lambNorms8bitState(r.in(0), r.in(1), r.in<uint8_t>(2), r.in<uint8_t>(3), r.out(0),
                           r.op.in(0).numel(), r.op.i("state_block", 256), lambLayout(r), step, b1,
                           b2, eps, wd, gradScale(r));
      else
        lambNorms<float>(r.in(0), r.in(1), r.in(2), r.in(3), r.out(0), r.op.in(0).numel(),
                         lambLayout(r), step, b1, b2, eps, wd, gradScale(r));
      return Status::ok();
    };
    m["lamb_update"] = [skipped, stepCount, gradScale, lambLayout, stateRounding](const Run &r) {
      if (skipped(r, 3))
        return Status::ok();
      int64_t step;
      FSDP_RETURN_IF_ERROR(stepCount(r, 6, step));
      const double b1 = r.op.f("beta1", 0.9), b2 = r.op.f("beta2", 0.999),
                   eps = r.op.f("eps", 1e-6), wd = r.op.f("weight_decay", 0.01);
      if (r.op.in(2).dtype == DType::BF16)
        lambUpdateBf16State(r.in(0), r.in(1), r.in<uint16_t>(2), r.in<uint16_t>(3), r.in(4),
                            r.out(0), r.out<uint16_t>(1), r.out<uint16_t>(2), r.op.in(0).numel(),
                            lambLayout(r), *r.in(5), step, b1, b2, eps, wd, gradScale(r),
                            stateRounding(r, 0));
      else if (r.op.in(2).dtype == DType::I8) // state-dtype=8bit
        lambUpdate8bitState(r.in(0), r.in(1), r.in<uint8_t>(2), r.in<uint8_t>(3), r.in(4), r.out(0),
                            r.out<uint8_t>(1), r.out<uint8_t>(2), r.op.in(0).numel(),
                            r.op.i("state_block", 256), lambLayout(r), *r.in(5), step, b1, b2, eps,
                            wd, gradScale(r));
      else
        lambUpdate<float>(r.in(0), r.in(1), r.in(2), r.in(3), r.in(4), r.out(0), r.out(1), r.out(2),
                          r.op.in(0).numel(), lambLayout(r), *r.in(5), step, b1, b2, eps, wd,
                          gradScale(r));
      return Status::ok();
    };
    m["squared_norm"] = [](const Run &r) {
      double s = 0;
      for (size_t i = 0; i < r.op.inst.in.size(); ++i)
        s += squaredNorm<float>(r.in(i), r.op.in(i).numel());
      *r.out(0) = (float)s;
      return Status::ok();
    };
    m["clip_coef"] = [](const Run &r) {
      double norm = std::sqrt((double)*r.in(0));
      double c = r.op.f("max_norm", 1.0) / (norm + 1e-6);
      *r.out(0) = (float)std::min(c, 1.0);
      return Status::ok();
    };
    m["grad_coef"] = [](const Run &r) {
      // OpRules: max_norm, when present, is > 0.
      *r.out(0) = gradCoef(*r.in(0), *r.in(1),
                           r.op.has("max_norm") ? r.op.f("max_norm", 1.0) : 0.0);
      return Status::ok();
    };
    m["pack"] = [](const Run &r) {
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
    };
    return m;
  }();
  return t;
}

std::atomic<int64_t> scratchHighWater{0};

void noteScratch(int64_t bytes) {
  int64_t seen = scratchHighWater.load();
  while (seen < bytes && !scratchHighWater.compare_exchange_weak(seen, bytes)) {
  }
}

void convert(const uint8_t *src, DType from, uint8_t *dst, DType to, int64_t n) {
  if (from == to) {
    std::memmove(dst, src, n * dtypeSize(from)); // a cast may be in place
    return;
  }
  // bf16 / f16 <-> f32 through the inline conversions of runtime/core/Bf16.h
  // (the same rounding as cpu::floatToBf16 / floatToHalf): the loops
  // vectorize, where a call per element made conversion most of a step.
  if (to == DType::F32) {
    auto *s = reinterpret_cast<const uint16_t *>(src);
    auto *d = reinterpret_cast<float *>(dst);
    if (from == DType::BF16) {
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i)
        d[i] = widenBf16(s[i]);
    } else {
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i)
        d[i] = widenHalf(s[i]);
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
#pragma omp parallel for if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      d[i] = roundToHalf(s[i]);
  }
}

Status runWidened(const Plan &plan, const Instruction &inst, uint8_t *arena, uint8_t *host,
                  int64_t rank, const DropoutContext &dropout, const Exec &run) {
  Widened w = widen(plan, inst);
  thread_local std::vector<uint8_t> scratch;
  if ((int64_t)scratch.size() < w.bytes) {
    scratch.resize(w.bytes);
    noteScratch(w.bytes);
  }
  std::vector<bool> isIn(w.ids.size());
  for (int64_t s : w.inst.in)
    isIn[s] = true;
  for (size_t s = 0; s < w.ids.size(); ++s)
    if (isIn[s]) {
      const Buffer &b = plan.buffers[w.ids[s]];
      convert(addressOf(plan, w.ids[s], rank, arena, host), b.dtype,
              scratch.data() + w.plan.buffers[s].offset, w.plan.buffers[s].dtype, b.numel());
    }
  Op op{w.plan, w.inst};
  // The rank still matters to the kernel (an update's decayed prefix,
  // decayedCount; today's plan check admits only f32 updates); the
  // widened buffers have no rank stride, so their addresses do not move.
  FSDP_RETURN_IF_ERROR(run(Run{op, scratch.data(), rank, dropout}));
  for (int64_t s : w.inst.out) {
    const Buffer &b = plan.buffers[w.ids[s]];
    convert(scratch.data() + w.plan.buffers[s].offset, w.plan.buffers[s].dtype,
            addressOf(plan, w.ids[s], rank, arena, host), b.dtype, b.numel());
  }
  return Status::ok();
}

} // namespace

int64_t widenedScratchHighWater() { return scratchHighWater.load(); }

bool implementsOp(const std::string &op) { return table().count(op) > 0; }

Status runInstruction(const Plan &plan, const Instruction &inst, uint8_t *arena, int64_t rank,
                      const DropoutContext &dropout, uint8_t *hostArena) {
  auto it = table().find(inst.op);
  if (it == table().end())
    return FSDP_ERROR("unknown op '", inst.op, "'");
  if (needsWidening(plan, inst))
    return runWidened(plan, inst, arena, hostArena, rank, dropout, it->second);
  Op op{plan, inst};
  return it->second(Run{op, arena, rank, dropout, hostArena});
}

} // namespace fsdp::cpu
