//===- CudaKernelsTest.cpp - CUDA kernels against their CPU twins ---------===//
//
// Every CUDA kernel (runtime/cuda/CudaKernels.h) and the cuBLASLt GEMM run on
// random data and are compared with the CPU kernel of the same op
// (runtime/cpu/Kernels.h, itself checked against finite differences and
// PyTorch). Tolerances follow from float32 rounding: u = 2^-24 per
// operation; an elementwise op may differ by a few u of its result (the
// GPU's expf/tanhf are within 2 ulp, glibc's within 1); a reduction of n
// terms summed in another order by at most n u times the sum of the terms'
// magnitudes (Higham's gamma_n), which the tests compute from the data.
//
// Without a GPU every test is skipped, visibly (GTEST_SKIP with the reason).
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Dropout.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/cuda/CudaGemm.h"
#include "runtime/cuda/CudaKernels.h"
#include "test/unit/OptimizerSlack.h"

#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace cpu = fsdp::cpu;
namespace gpu = fsdp::cuda;

namespace {

constexpr double kU = 1.0 / (1 << 24); // float32 unit roundoff

std::vector<float> randomVec(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float &x : v)
    x = d(g);
  return v;
}

/// Bitwise equal (NaNs and signed zeros included).
bool same(const std::vector<float> &x, const std::vector<float> &y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
}

/// A device copy of a host vector (or n uninitialised elements), freed at
/// scope exit.
template <typename T> class Dev {
public:
  explicit Dev(const std::vector<T> &h) : n_(h.size()) {
    EXPECT_EQ(cudaMalloc(&p_, sizeof(T) * std::max<size_t>(n_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, h.data(), sizeof(T) * n_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, sizeof(T) * std::max<size_t>(n_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p_, 0xff, sizeof(T) * n_), cudaSuccess); // NaN poison for floats
  }
  ~Dev() { cudaFree(p_); }
  T *get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

private:
  T *p_ = nullptr;
  size_t n_;
};

/// |got - want| <= ulps * u * |want| + slack[i] for every element.
void expectNear(const std::vector<float> &got, const std::vector<float> &want, double ulps,
                const std::vector<double> &slack, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    double tol = ulps * kU * std::fabs(want[i]) + (slack.empty() ? 0.0 : slack[i]);
    EXPECT_LE(std::fabs((double)got[i] - want[i]), tol)
        << what << " element " << i << ": gpu " << got[i] << ", cpu " << want[i];
  }
}

std::vector<double> constant(size_t n, double v) { return std::vector<double>(n, v); }

double maxAbs(const std::vector<float> &v) {
  double m = 0;
  for (float x : v)
    m = std::max(m, (double)std::fabs(x));
  return m;
}

class CudaKernelsTest : public ::testing::Test {
protected:
  void SetUp() override {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      GTEST_SKIP() << "no CUDA GPU here (cudaGetDeviceCount: " << cudaGetErrorName(e)
                   << ", " << n << " devices): the CUDA kernels are compiled, not run";
  }
};

TEST_F(CudaKernelsTest, UnaryElementwise) {
  const int64_t n = 1000;
  auto x = randomVec(n, 1, 2.f), dy = randomVec(n, 2);
  Dev<float> dx(x), ddy(dy), out(n);
  std::vector<float> want(n);
  double tiny = 4 * kU * maxAbs(x); // results that cancel to ~0
  auto check = [&](cudaError_t e, auto cpuFn, double ulps, const char *what) {
    ASSERT_EQ(e, cudaSuccess) << what;
    cpuFn();
    expectNear(out.host(), want, ulps, constant(n, tiny), what);
  };
  check(gpu::neg(dx.get(), out.get(), n, 0), [&] { cpu::neg(x.data(), want.data(), n); }, 0,
        "neg");
  check(gpu::scale(dx.get(), out.get(), n, 0.37, 0),
        [&] { cpu::scale(x.data(), want.data(), n, 0.37); }, 1, "scale");
  // The same mask bit for bit (runtime/core/Dropout.h on both sides); the
  // GPU reads {seed 7, step 3} from device memory.
  Dev<uint64_t> ctx(std::vector<uint64_t>{7, 3});
  check(gpu::dropout(dx.get(), out.get(), n, ctx.get(), 2, 12345, fsdp::dropoutThreshold(0.3),
                     1.0 / 0.7, 0),
        [&] {
          cpu::dropout(x.data(), want.data(), n, fsdp::dropoutKey(7, 3, 2), 12345,
                       fsdp::dropoutThreshold(0.3), 1.0 / 0.7);
        },
        0, "dropout");
  check(gpu::relu(dx.get(), out.get(), n, 0), [&] { cpu::relu(x.data(), want.data(), n); }, 0,
        "relu");
  check(gpu::reluGrad(dx.get(), ddy.get(), out.get(), n, 0),
        [&] { cpu::reluGrad(x.data(), dy.data(), want.data(), n); }, 0, "relu_grad");
  check(gpu::gelu(dx.get(), out.get(), n, 0), [&] { cpu::gelu(x.data(), want.data(), n); }, 8,
        "gelu");
  check(gpu::geluGrad(dx.get(), ddy.get(), out.get(), n, 0),
        [&] { cpu::geluGrad(x.data(), dy.data(), want.data(), n); }, 16, "gelu_grad");
  check(gpu::geluExact(dx.get(), out.get(), n, 0),
        [&] { cpu::geluExact(x.data(), want.data(), n); }, 8, "gelu exact");
  check(gpu::geluExactGrad(dx.get(), ddy.get(), out.get(), n, 0),
        [&] { cpu::geluExactGrad(x.data(), dy.data(), want.data(), n); }, 16,
        "gelu exact grad");
  check(gpu::silu(dx.get(), out.get(), n, 0), [&] { cpu::silu(x.data(), want.data(), n); }, 8,
        "silu");
  check(gpu::siluGrad(dx.get(), ddy.get(), out.get(), n, 0),
        [&] { cpu::siluGrad(x.data(), dy.data(), want.data(), n); }, 16, "silu_grad");
  check(gpu::fill(out.get(), n, -1.25, 0), [&] { cpu::fill(want.data(), n, -1.25); }, 0,
        "fill");
}

TEST_F(CudaKernelsTest, BroadcastBinarySumTo) {
  cpu::Shape sa{4, 1, 8}, sb{3, 1}, so{4, 3, 8};
  auto a = randomVec(32, 3), b = randomVec(3, 4);
  Dev<float> da(a), db(b), out(96);
  std::vector<float> want(96);
  for (auto k : {0, 1, 2, 3}) {
    ASSERT_EQ(gpu::binary((gpu::BinaryKind)k, da.get(), sa, db.get(), sb, out.get(), so, 0),
              cudaSuccess);
    cpu::binary((cpu::BinaryKind)k, a.data(), sa, b.data(), sb, want.data(), so);
    expectNear(out.host(), want, 0, {}, "binary");
  }
  {
    // Equal shapes (no index arithmetic): four elements at a time with a
    // tail (1003), and one float off 16-byte alignment (element by
    // element): the CPU's bits for each kind.
    const int64_t n = 1003;
    auto x = randomVec(n + 1, 6), y = randomVec(n + 1, 7);
    for (float &v : y)
      v = v == 0.f ? 0.5f : v; // no division by zero
    Dev<float> dx(x), dy(y), dout(n + 1);
    std::vector<float> w(n);
    for (int64_t off : {0, 1})
      for (auto k : {0, 1, 2, 3}) {
        ASSERT_EQ(gpu::binary((gpu::BinaryKind)k, dx.get() + off, {n}, dy.get() + off, {n},
                              dout.get() + off, {n}, 0),
                  cudaSuccess);
        cpu::binary((cpu::BinaryKind)k, x.data() + off, {n}, y.data() + off, {n}, w.data(), {n});
        auto got = dout.host();
        expectNear(std::vector<float>(got.begin() + off, got.begin() + off + n), w, 0, {},
                   off ? "binary, equal shapes, misaligned" : "binary, equal shapes");
      }
  }
  ASSERT_EQ(gpu::broadcastTo(db.get(), sb, out.get(), so, 0), cudaSuccess);
  cpu::broadcastTo(b.data(), sb, want.data(), so);
  expectNear(out.host(), want, 0, {}, "broadcast");
  auto big = randomVec(96, 5);
  Dev<float> dbig(big), red(3);
  std::vector<float> wantRed(3), absRed(3), absBig(96);
  for (int i = 0; i < 96; ++i)
    absBig[i] = std::fabs(big[i]);
  ASSERT_EQ(gpu::sumTo(dbig.get(), so, red.get(), sb, 0), cudaSuccess);
  cpu::sumTo(big.data(), so, wantRed.data(), sb);
  cpu::sumTo(absBig.data(), so, absRed.data(), sb);
  std::vector<double> slack(3);
  for (int i = 0; i < 3; ++i)
    slack[i] = 32 * kU * absRed[i]; // 32 terms per output
  expectNear(red.host(), wantRed, 0, slack, "sum_to");
}

TEST_F(CudaKernelsTest, SoftmaxAndBiasAdd) {
  const int64_t rows = 7, cols = 300;
  auto x = randomVec(rows * cols, 6, 3.f), dy = randomVec(rows * cols, 7);
  Dev<float> dx(x), ddy(dy), y(rows * cols), g(rows * cols);
  std::vector<float> wy(rows * cols), wg(rows * cols);
  ASSERT_EQ(gpu::softmax(dx.get(), y.get(), rows, cols, 0), cudaSuccess);
  cpu::softmax(x.data(), wy.data(), rows, cols);
  // the row sum of cols terms in another order: cols u relative
  expectNear(y.host(), wy, 2.0 * cols + 8, {}, "softmax");
  Dev<float> dwy(wy);
  ASSERT_EQ(gpu::softmaxGrad(dwy.get(), ddy.get(), g.get(), rows, cols, 0), cudaSuccess);
  cpu::softmaxGrad(wy.data(), dy.data(), wg.data(), rows, cols);
  expectNear(g.host(), wg, 8, constant(rows * cols, 2.0 * cols * kU * maxAbs(dy)),
             "softmax_grad");
  auto b = randomVec(cols, 8);
  Dev<float> dbias(b);
  ASSERT_EQ(gpu::biasAdd(dx.get(), dbias.get(), y.get(), rows, cols, 0), cudaSuccess);
  cpu::biasAdd(x.data(), b.data(), wy.data(), rows, cols);
  expectNear(y.host(), wy, 0, {}, "bias_add");
}

/// The CPU GEMM of a and b, and each element's bound: both sides are
/// within k u sum|a b| of the exact product (the same GEMM of |a|, |b|).
void gemmReference(const std::vector<float> &a, const std::vector<float> &b, int64_t batch,
                   int64_t m, int64_t n, int64_t k, bool ta, bool tb, std::vector<float> &want,
                   std::vector<double> &slack) {
  std::vector<float> aa(a.size()), ab(b.size()), mag(batch * m * n);
  for (size_t i = 0; i < a.size(); ++i)
    aa[i] = std::fabs(a[i]);
  for (size_t i = 0; i < b.size(); ++i)
    ab[i] = std::fabs(b[i]);
  want.assign(batch * m * n, 0.f);
  cpu::matmul(a.data(), b.data(), want.data(), batch, m, n, k, ta, tb);
  cpu::matmul(aa.data(), ab.data(), mag.data(), batch, m, n, k, ta, tb);
  slack.resize(mag.size());
  for (size_t i = 0; i < mag.size(); ++i)
    slack[i] = 2.0 * k * kU * mag[i];
}

TEST_F(CudaKernelsTest, GemmEveryTransposeAndBatch) {
  gpu::Gemm gemm;
  ASSERT_TRUE(gemm.init(32 << 20, /*allowTf32=*/false).isOk());
  for (auto [batch, m, n, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 5, 7, 9},
                                {3, 5, 7, 9},
                                {2, 64, 48, 80},
                                {1, 1, 1, 1}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        auto a = randomVec(batch * m * k, 9), b = randomVec(batch * k * n, 10);
        Dev<float> da(a), db(b), dc(batch * m * n);
        auto st = gemm.run(da.get(), db.get(), dc.get(), batch, m, n, k, ta, tb, 0);
        ASSERT_TRUE(st.isOk()) << st.message();
        std::vector<float> want;
        std::vector<double> slack;
        gemmReference(a, b, batch, m, n, k, ta, tb, want, slack);
        expectNear(dc.host(), want, 0, slack, "gemm");
      }
}

// Plan buffers are 64-byte aligned and views may be merely element-aligned:
// the GEMM must pick an algorithm for the pointers it gets, never reuse one
// chosen for 256-byte-aligned pointers (run first, on the same Gemm).
TEST_F(CudaKernelsTest, GemmOnOperandsOneElementOffAlignment) {
  gpu::Gemm gemm;
  ASSERT_TRUE(gemm.init(32 << 20, /*allowTf32=*/false).isOk());
  for (auto [batch, m, n, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 64, 48, 80},
                                {3, 5, 7, 9},
                                {1, 128, 128, 128}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (int shifted : {0, 1, 2, 4, 7}) { // bit 0: A off by one, 1: B, 2: C
          int64_t offA = shifted & 1, offB = (shifted >> 1) & 1, offC = (shifted >> 2) & 1;
          auto a = randomVec(batch * m * k, 19), b = randomVec(batch * k * n, 20);
          // A shifted operand gets one leading element, so that it starts
          // 4 bytes into its allocation (only then: an unshifted operand
          // with the extra element would be a different matrix).
          std::vector<float> pa(a), pb(b);
          if (offA)
            pa.insert(pa.begin(), 0.f);
          if (offB)
            pb.insert(pb.begin(), 0.f);
          Dev<float> da(pa), db(pb), dc(batch * m * n + 1);
          auto st = gemm.run(da.get() + offA, db.get() + offB, dc.get() + offC, batch, m, n, k,
                             ta, tb, 0);
          ASSERT_TRUE(st.isOk()) << st.message();
          std::vector<float> want;
          std::vector<double> slack;
          gemmReference(a, b, batch, m, n, k, ta, tb, want, slack);
          std::vector<float> got = dc.host();
          got.erase(offC ? got.begin() : got.end() - 1);
          expectNear(got, want, 0, slack, "gemm off alignment");
        }
}

TEST_F(CudaKernelsTest, LayerNormAndRmsNormWithGradients) {
  const int64_t rows = 5, cols = 96;
  auto x = randomVec(rows * cols, 11, 2.f), dy = randomVec(rows * cols, 12),
       g = randomVec(cols, 13), b = randomVec(cols, 14);
  Dev<float> dx(x), ddy(dy), dg(g), dbb(b), y(rows * cols), gx(rows * cols), gg(cols),
      gb(cols), scratch(2 * rows);
  std::vector<float> wy(rows * cols), wgx(rows * cols), wgg(cols), wgb(cols);
  double rowTol = 4.0 * cols + 16; // row statistics summed in another order
  double colSlack = 4.0 * (rows + cols) * kU * maxAbs(dy) * maxAbs(x) * 4;
  ASSERT_EQ(gpu::layerNorm(dx.get(), dg.get(), dbb.get(), y.get(), rows, cols, 1e-5, 0),
            cudaSuccess);
  cpu::layerNorm(x.data(), g.data(), b.data(), wy.data(), rows, cols, 1e-5);
  expectNear(y.host(), wy, rowTol, constant(rows * cols, rowTol * kU * 4 * maxAbs(g)),
             "layer_norm");
  ASSERT_EQ(gpu::layerNormGrad(dx.get(), dg.get(), ddy.get(), gx.get(), gg.get(), gb.get(),
                               scratch.get(), rows, cols, 1e-5, 0),
            cudaSuccess);
  cpu::layerNormGrad(x.data(), g.data(), dy.data(), wgx.data(), wgg.data(), wgb.data(), rows,
                     cols, 1e-5);
  expectNear(gx.host(), wgx, rowTol,
             constant(rows * cols, rowTol * kU * 8 * maxAbs(dy) * maxAbs(g)), "d_input");
  expectNear(gg.host(), wgg, rowTol, constant(cols, colSlack), "d_gamma");
  expectNear(gb.host(), wgb, rowTol, constant(cols, colSlack), "d_beta");

  Dev<float> gw(cols);
  ASSERT_EQ(gpu::rmsNorm(dx.get(), dg.get(), y.get(), rows, cols, 1e-6, 0), cudaSuccess);
  cpu::rmsNorm(x.data(), g.data(), wy.data(), rows, cols, 1e-6);
  expectNear(y.host(), wy, 16, {}, "rms_norm");
  ASSERT_EQ(gpu::rmsNormGrad(dx.get(), dg.get(), ddy.get(), gx.get(), gw.get(),
                             scratch.get(), rows, cols, 1e-6, 0),
            cudaSuccess);
  cpu::rmsNormGrad(x.data(), g.data(), dy.data(), wgx.data(), wgg.data(), rows, cols, 1e-6);
  expectNear(gx.host(), wgx, 16, constant(rows * cols, 16 * kU * maxAbs(dy) * maxAbs(g)),
             "rms d_input");
  expectNear(gw.host(), wgg, rowTol, constant(cols, colSlack), "rms d_weight");
}

TEST_F(CudaKernelsTest, AttentionCausalFullAndGroupedQuery) {
  const int64_t B = 2, T = 9, heads = 4, D = 8, C = heads * D;
  for (int64_t kv : {heads, int64_t(2)})
    for (bool causal : {true, false}) {
      int64_t KC = kv * D;
      auto q = randomVec(B * T * C, 15), k = randomVec(B * T * KC, 16),
           v = randomVec(B * T * KC, 17), dy = randomVec(B * T * C, 18);
      Dev<float> dq(q), dk(k), dv(v), ddy(dy), y(B * T * C), lse(B * heads * T),
          gq(B * T * C), gk(B * T * KC), gv(B * T * KC),
          scratch(gpu::attentionGradScratch(B, T, heads));
      std::vector<float> wy(B * T * C), wlse(B * heads * T), wq(B * T * C), wk(B * T * KC),
          wv(B * T * KC);
      ASSERT_EQ(gpu::attention(dq.get(), dk.get(), dv.get(), y.get(), lse.get(), B, T, C,
                               heads, causal, kv, 0),
                cudaSuccess);
      cpu::attention(q.data(), k.data(), v.data(), wy.data(), wlse.data(), B, T, C, heads,
                     causal, kv);
      // scores (D terms), softmax (T terms), weighted sums (T terms), and
      // the backward's sums over heads * T: a generous n u with n their sum
      double n = D + 2.0 * T + heads * T;
      double mag = maxAbs(q) * maxAbs(k) * maxAbs(v) * maxAbs(dy) + maxAbs(v);
      expectNear(y.host(), wy, 0, constant(wy.size(), 16 * n * kU * mag), "attention");
      // lse = max + log(sum): the scores' error (D terms of |q||k|) plus
      // the sum's (T terms) and the log's, relative to the row's magnitude.
      double lmag = maxAbs(q) * maxAbs(k) * std::sqrt((double)D) + std::log((double)T) + 1;
      expectNear(lse.host(), wlse, 0, constant(wlse.size(), 16 * n * kU * lmag), "lse");
      // The backward reads the CPU's y and lse: both kernels differentiate
      // the same saved forward.
      Dev<float> sy(wy), slse(wlse);
      ASSERT_EQ(gpu::attentionGrad(dq.get(), dk.get(), dv.get(), sy.get(), slse.get(),
                                   ddy.get(), gq.get(), gk.get(), gv.get(), scratch.get(), B,
                                   T, C, heads, causal, kv, 0),
                cudaSuccess);
      cpu::attentionGrad(q.data(), k.data(), v.data(), wlse.data(), dy.data(), wq.data(),
                         wk.data(), wv.data(), B, T, C, heads, causal, kv);
      double gmag = mag * T * D;
      expectNear(gq.host(), wq, 0, constant(wq.size(), 16 * n * kU * gmag), "d_q");
      expectNear(gk.host(), wk, 0, constant(wk.size(), 16 * n * kU * gmag), "d_k");
      expectNear(gv.host(), wv, 0, constant(wv.size(), 16 * n * kU * gmag), "d_v");
    }
}

TEST_F(CudaKernelsTest, RopeAndItsGradient) {
  const int64_t B = 2, T = 11, heads = 3, D = 8, C = heads * D;
  auto x = randomVec(B * T * C, 19);
  Dev<float> dx(x), y(B * T * C);
  std::vector<float> want(B * T * C);
  double slack = 4 * kU * maxAbs(x);
  ASSERT_EQ(gpu::rope(dx.get(), y.get(), B, T, C, heads, 10000.0, 0), cudaSuccess);
  cpu::rope(x.data(), want.data(), B, T, C, heads, 10000.0);
  expectNear(y.host(), want, 4, constant(want.size(), slack), "rope");
  ASSERT_EQ(gpu::ropeGrad(dx.get(), y.get(), B, T, C, heads, 500000.0, 0), cudaSuccess);
  cpu::ropeGrad(x.data(), want.data(), B, T, C, heads, 500000.0);
  expectNear(y.host(), want, 4, constant(want.size(), slack), "rope_grad");
}

TEST_F(CudaKernelsTest, EmbeddingGradientAndBadIds) {
  const int64_t vocab = 10, width = 6, n = 12;
  auto table = randomVec(vocab * width, 20), dy = randomVec(n * width, 21);
  std::vector<int32_t> ids{3, 1, 3, 9, 0, 0, 3, 7, 2, 2, 8, 3};
  Dev<float> dt(table), ddy(dy), y(n * width), gt(vocab * width);
  Dev<int32_t> did(ids);
  Dev<long long> bad(std::vector<long long>{LLONG_MAX});
  std::vector<float> wy(n * width), wg(vocab * width);
  ASSERT_EQ(gpu::embedding(dt.get(), did.get(), y.get(), n, vocab, width, bad.get(), 0),
            cudaSuccess);
  ASSERT_EQ(cpu::embedding(table.data(), ids.data(), wy.data(), n, vocab, width), -1);
  expectNear(y.host(), wy, 0, {}, "embedding");
  ASSERT_EQ(gpu::embeddingGrad(did.get(), ddy.get(), gt.get(), n, vocab, width, bad.get(), 0),
            cudaSuccess);
  ASSERT_EQ(cpu::embeddingGrad(ids.data(), dy.data(), wg.data(), n, vocab, width), -1);
  expectNear(gt.host(), wg, 0, {}, "embedding_grad (same order of adds: bitwise)");
  EXPECT_EQ(bad.host()[0], LLONG_MAX);
  ids[5] = 10;
  ids[8] = -1;
  Dev<int32_t> badIds(ids);
  ASSERT_EQ(gpu::embedding(dt.get(), badIds.get(), y.get(), n, vocab, width, bad.get(), 0),
            cudaSuccess);
  EXPECT_EQ(bad.host()[0], 5) << "the first out-of-range position";
}

TEST_F(CudaKernelsTest, TransposeSliceConcat) {
  cpu::Shape s{3, 4, 5};
  std::vector<int64_t> perm{2, 0, 1};
  auto x = randomVec(60, 22);
  Dev<float> dx(x), y(60);
  std::vector<float> want(60);
  ASSERT_EQ(gpu::transpose(dx.get(), s, perm, y.get(), 0), cudaSuccess);
  cpu::transpose(x.data(), s, perm, want.data());
  expectNear(y.host(), want, 0, {}, "transpose");
  // slice rows 1..2 of dim 1: outer 3, full 4, len 2, inner 5
  Dev<float> sl(30), back(60);
  std::vector<float> wsl(30), wback(60);
  ASSERT_EQ(gpu::slice(dx.get(), sl.get(), 3, 4, 2, 5, 1, 0), cudaSuccess);
  cpu::slice(x.data(), wsl.data(), 3, 4, 2, 5, 1);
  expectNear(sl.host(), wsl, 0, {}, "slice");
  ASSERT_EQ(gpu::sliceGrad(sl.get(), back.get(), 3, 4, 2, 5, 1, 0), cudaSuccess);
  cpu::sliceGrad(wsl.data(), wback.data(), 3, 4, 2, 5, 1);
  expectNear(back.host(), wback, 0, {}, "slice_grad");
  // concat = place each part: the two halves of dim 1 rebuild x
  Dev<float> lo(30), hi(30), whole(60);
  ASSERT_EQ(gpu::slice(dx.get(), lo.get(), 3, 4, 2, 5, 0, 0), cudaSuccess);
  ASSERT_EQ(gpu::slice(dx.get(), hi.get(), 3, 4, 2, 5, 2, 0), cudaSuccess);
  ASSERT_EQ(gpu::place(lo.get(), whole.get(), 3, 4, 2, 5, 0, 0), cudaSuccess);
  ASSERT_EQ(gpu::place(hi.get(), whole.get(), 3, 4, 2, 5, 2, 0), cudaSuccess);
  expectNear(whole.host(), x, 0, {}, "concat");
}

TEST_F(CudaKernelsTest, LossesAndTheirGradients) {
  const int64_t rows = 6, classes = 50, n = 40;
  auto logits = randomVec(rows * classes, 23, 2.f);
  std::vector<int32_t> labels{0, 49, 7, 7, 20, 33};
  Dev<float> dl(logits), loss(1), one(std::vector<float>{1.5f}), g(rows * classes);
  Dev<int32_t> dlab(labels);
  Dev<long long> bad(std::vector<long long>{LLONG_MAX});
  Dev<double> scratch(std::max<int64_t>(rows, gpu::reductionScratch()));
  float wl;
  std::vector<float> wg(rows * classes);
  ASSERT_EQ(gpu::crossEntropy(dl.get(), dlab.get(), loss.get(), scratch.get(), rows, classes,
                              classes, bad.get(), 0),
            cudaSuccess);
  ASSERT_EQ(cpu::crossEntropy(logits.data(), labels.data(), &wl, rows, classes), -1);
  expectNear(loss.host(), {wl}, 4.0 * classes + 16, constant(1, 4 * classes * kU * 8), "ce");
  float dls = 1.5f;
  ASSERT_EQ(gpu::crossEntropyGrad(dl.get(), dlab.get(), one.get(), g.get(), rows, classes,
                                  classes, bad.get(), 0),
            cudaSuccess);
  cpu::crossEntropyGrad(logits.data(), labels.data(), &dls, wg.data(), rows, classes);
  expectNear(g.host(), wg, 4.0 * classes + 16, constant(wg.size(), 8 * kU), "ce_grad");
  EXPECT_EQ(bad.host()[0], LLONG_MAX);
  {
    // Rows padded to 64 columns (fsdp-pad-classes): the padding, holding
    // large values, is outside the softmax, and its gradient is 0.
    const int64_t stride = 64;
    std::vector<float> padded(rows * stride, 50.f), pg(rows * stride, NAN);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(logits.begin() + r * classes, classes, padded.begin() + r * stride);
    Dev<float> dp(padded), gp(pg), lp(1);
    ASSERT_EQ(gpu::crossEntropy(dp.get(), dlab.get(), lp.get(), scratch.get(), rows, classes,
                                stride, bad.get(), 0),
              cudaSuccess);
    expectNear(lp.host(), {wl}, 4.0 * classes + 16, constant(1, 4 * classes * kU * 8),
               "padded ce");
    ASSERT_EQ(gpu::crossEntropyGrad(dp.get(), dlab.get(), one.get(), gp.get(), rows, classes,
                                    stride, bad.get(), 0),
              cudaSuccess);
    std::vector<float> want(rows * stride, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(wg.begin() + r * classes, classes, want.begin() + r * stride);
    expectNear(gp.host(), want, 4.0 * classes + 16, constant(want.size(), 8 * kU),
               "padded ce_grad");
    // The CPU kernel with the same stride: the same values.
    float cl = 0;
    std::vector<float> cg(rows * stride, NAN);
    ASSERT_EQ(cpu::crossEntropy(padded.data(), labels.data(), &cl, rows, classes, stride), -1);
    EXPECT_EQ(cl, wl);
    cpu::crossEntropyGrad(padded.data(), labels.data(), &dls, cg.data(), rows, classes, stride);
    EXPECT_EQ(cg, want);
    EXPECT_EQ(bad.host()[0], LLONG_MAX);

    // Label smoothing 0.1 on the padded rows: the CPU kernel's value and
    // gradient within the same bounds (the smoothed term adds double
    // arithmetic on the same row statistics), and not the unsmoothed ones.
    const double e = 0.1;
    float sl = 0;
    std::vector<float> sg(rows * stride, NAN);
    ASSERT_EQ(cpu::crossEntropy(padded.data(), labels.data(), &sl, rows, classes, stride, e), -1);
    cpu::crossEntropyGrad(padded.data(), labels.data(), &dls, sg.data(), rows, classes, stride, e);
    ASSERT_GT(std::fabs(sl - wl), 1e-3);
    ASSERT_EQ(gpu::crossEntropy(dp.get(), dlab.get(), lp.get(), scratch.get(), rows, classes,
                                stride, bad.get(), 0, e),
              cudaSuccess);
    expectNear(lp.host(), {sl}, 4.0 * classes + 16, constant(1, 4 * classes * kU * 8),
               "smoothed ce");
    ASSERT_EQ(gpu::crossEntropyGrad(dp.get(), dlab.get(), one.get(), gp.get(), rows, classes,
                                    stride, bad.get(), 0, e),
              cudaSuccess);
    expectNear(gp.host(), sg, 4.0 * classes + 16, constant(sg.size(), 8 * kU), "smoothed ce_grad");
    EXPECT_EQ(bad.host()[0], LLONG_MAX);

    // ignore_index -100 on rows 1 and 4 (a count of 3, as if other ranks
    // kept more): count_labels bit for bit the CPU's, the loss and
    // gradient within the same bounds of the CPU kernel's, the ignored
    // rows' gradient exactly 0 (padding included), -100 not a bad label.
    std::vector<int32_t> masked = labels;
    masked[1] = masked[4] = -100;
    Dev<int32_t> dmask(masked);
    Dev<float> count(1);
    ASSERT_EQ(gpu::countLabels(dmask.get(), rows, -100, 2, count.get(), 0), cudaSuccess);
    EXPECT_EQ(count.host()[0], cpu::countLabels(masked.data(), rows, -100, 2));
    const float norm = 7.5f;
    Dev<float> dnorm(std::vector<float>{norm});
    gpu::CeIgnore ig{dnorm.get(), -100};
    float il = 0;
    std::vector<float> ig32(rows * stride, NAN);
    ASSERT_EQ(cpu::crossEntropy(padded.data(), masked.data(), &il, rows, classes, stride, 0.0,
                                &norm, -100),
              -1);
    cpu::crossEntropyGrad(padded.data(), masked.data(), &dls, ig32.data(), rows, classes, stride,
                          0.0, &norm, -100);
    ASSERT_EQ(gpu::crossEntropy(dp.get(), dmask.get(), lp.get(), scratch.get(), rows, classes,
                                stride, bad.get(), 0, 0.0, ig),
              cudaSuccess);
    expectNear(lp.host(), {il}, 4.0 * classes + 16, constant(1, 4 * classes * kU * 8),
               "ignore_index ce");
    ASSERT_EQ(gpu::crossEntropyGrad(dp.get(), dmask.get(), one.get(), gp.get(), rows, classes,
                                    stride, bad.get(), 0, 0.0, ig),
              cudaSuccess);
    std::vector<float> igGot = gp.host();
    expectNear(igGot, ig32, 4.0 * classes + 16, constant(ig32.size(), 8 * kU),
               "ignore_index ce_grad");
    for (int64_t r : {1, 4})
      for (int64_t c = 0; c < stride; ++c)
        ASSERT_EQ(igGot[r * stride + c], 0.f) << "ignored row " << r << ", column " << c;
    EXPECT_EQ(bad.host()[0], LLONG_MAX);
  }

  auto x = randomVec(n, 24), t = randomVec(n, 25);
  std::vector<float> t01(n);
  for (int64_t i = 0; i < n; ++i)
    t01[i] = t[i] > 0 ? 1.f : 0.f;
  Dev<float> dx(x), dt(t), dt01(t01), gx(n);
  std::vector<float> wgx(n);
  ASSERT_EQ(gpu::mseLoss(dx.get(), dt.get(), loss.get(), scratch.get(), n, 0), cudaSuccess);
  cpu::mseLoss(x.data(), t.data(), &wl, n);
  expectNear(loss.host(), {wl}, 4, {}, "mse (double sums)");
  ASSERT_EQ(gpu::mseLossGrad(dx.get(), dt.get(), one.get(), gx.get(), n, 0), cudaSuccess);
  cpu::mseLossGrad(x.data(), t.data(), &dls, wgx.data(), n);
  expectNear(gx.host(), wgx, 4, {}, "mse_grad");
  ASSERT_EQ(gpu::bceWithLogits(dx.get(), dt01.get(), loss.get(), scratch.get(), n, 0),
            cudaSuccess);
  cpu::bceWithLogits(x.data(), t01.data(), &wl, n);
  expectNear(loss.host(), {wl}, 16, {}, "bce");
  ASSERT_EQ(gpu::bceWithLogitsGrad(dx.get(), dt01.get(), one.get(), gx.get(), n, 0),
            cudaSuccess);
  cpu::bceWithLogitsGrad(x.data(), t01.data(), &dls, wgx.data(), n);
  expectNear(gx.host(), wgx, 8, constant(n, 8 * kU), "bce_grad");
}

TEST_F(CudaKernelsTest, OptimizersNormAndClip) {
  const int64_t n = 777;
  auto p = randomVec(n, 26), g = randomVec(n, 27), m = randomVec(n, 28),
       v0 = randomVec(n, 29);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = v0[i] * v0[i];
  for (float step : {1.f, 2.f, 7.f}) {
    Dev<float> dp(p), dg(g), dm(m), dv(v), lr(std::vector<float>{3e-3f}),
        st(std::vector<float>{step});
    std::vector<float> wp(n), wm(n), wv(n);
    ASSERT_EQ(gpu::adamwUpdate(dp.get(), dg.get(), dm.get(), dv.get(), dp.get(), dm.get(),
                               dv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1, 0),
              cudaSuccess);
    cpu::adamwUpdate(p.data(), g.data(), m.data(), v.data(), wp.data(), wm.data(), wv.data(),
                     n, 3e-3f, (int64_t)step, 0.9, 0.95, 1e-8, 0.1);
    // FMA contraction on the GPU: test/unit/OptimizerSlack.h.
    fsdp::test::AdamwSlack as(p, g, m, v, 3e-3, step, 0.9, 0.95, 1e-8);
    expectNear(dp.host(), wp, 8, as.p, "adamw param");
    expectNear(dm.host(), wm, 4, as.m, "adamw exp_avg");
    expectNear(dv.host(), wv, 4, as.v, "adamw exp_avg_sq");
    Dev<float> sp(p), sb(m);
    ASSERT_EQ(gpu::sgdMomentumUpdate(sp.get(), dg.get(), sb.get(), sp.get(), sb.get(), n,
                                     lr.get(), st.get(), 0.9, 0.1, 0.01, true, 0),
              cudaSuccess);
    cpu::sgdMomentumUpdate(p.data(), g.data(), m.data(), wp.data(), wm.data(), n, 3e-3f,
                           (int64_t)step, 0.9, 0.1, 0.01, true);
    fsdp::test::SgdMomentumSlack ss(p, g, m, 3e-3, (int64_t)step, 0.9, 0.1, 0.01, true);
    expectNear(sp.host(), wp, 4, ss.p, "sgd momentum param");
    expectNear(sb.host(), wm, 4, ss.buf, "sgd momentum buffer");
    // The gradient operand is m as the CPU reads it: dm holds AdamW's
    // in-place update by now.
    Dev<float> plainM(m);
    ASSERT_EQ(gpu::sgdUpdate(dg.get(), plainM.get(), sp.get(), n, lr.get(), 0.01, 0),
              cudaSuccess);
    cpu::sgdUpdate(g.data(), m.data(), wp.data(), n, 3e-3f, 0.01);
    expectNear(sp.host(), wp, 4, {}, "sgd");
  }
  Dev<float> dp(p), dg(g), out(1), coef(1);
  Dev<double> partial(gpu::squaredNormScratch(2));
  ASSERT_EQ(gpu::squaredNorm({dp.get(), dg.get()}, {n, n}, out.get(), partial.get(), 0),
            cudaSuccess);
  float want = (float)(cpu::squaredNorm(p.data(), n) + cpu::squaredNorm(g.data(), n));
  expectNear(out.host(), {want}, 2, {}, "squared_norm (double sums)");
  {
    // The 16-byte path with a tail (1, 5, and one element past a whole
    // grid stride of 4-vectors), and the scalar path (a tensor one float
    // past a 16-byte boundary) over several grid strides. Every square and
    // sum is in double: the f32 result within 2 ulps of the CPU's.
    std::vector<int64_t> lens = {1, 5, 1024 * 256 * 4 + 3, 3000001};
    std::vector<std::unique_ptr<Dev<float>>> ts;
    std::vector<const float *> ptrs;
    double sum = 0;
    for (size_t i = 0; i < lens.size(); ++i) {
      auto x = randomVec(lens[i] + 1, 400 + (uint32_t)i);
      int64_t off = i == 3 ? 1 : 0;
      sum += cpu::squaredNorm(x.data() + off, lens[i]);
      ts.push_back(std::make_unique<Dev<float>>(x));
      ptrs.push_back(ts.back()->get() + off);
    }
    Dev<double> part(gpu::squaredNormScratch((int64_t)lens.size()));
    Dev<float> o(1);
    ASSERT_EQ(gpu::squaredNorm(ptrs, lens, o.get(), part.get(), 0), cudaSuccess);
    expectNear(o.host(), {(float)sum}, 2, {}, "squared_norm, tails and misaligned");
  }
  ASSERT_EQ(gpu::clipCoef(out.get(), coef.get(), 1.0, 0), cudaSuccess);
  float c = (float)std::min(1.0, 1.0 / (std::sqrt((double)want) + 1e-6));
  expectNear(coef.host(), {c}, 4, {}, "clip_coef");
}

// LAMB against the CPU on an odd-sized unit: four parameters (the last one
// without weight decay) and padding, run whole and as shard 1 of 3 (stride
// 999, its bounds inside parameters 1 and 3), with grad_scale. The sums
// are each a double sum of nonnegative terms in another order (block
// partials here, chunks there): within ~n 2^-53 relative before each side
// rounds once to f32 (half an ulp, 2^-24 relative), so 1e-6 relative
// is ample and still catches a wrong term or a wrong segment. The updates
// are compared bitwise, given the same sums: every f32 operation is
// rounded on its own in the CPU's order (__fmul_rn / __fdiv_rn / ...: no
// FMA contraction), the trust ratio is a double sqrt and divide (correctly
// rounded on both), and the scalars are the same doubles rounded once to
// f32 (the GPU's pow may differ from glibc's in the last bit of a double,
// which would flip an f32 rounding only on a near tie: not for these
// inputs). The emulator runs the same f32 operations on the CPU.
TEST_F(CudaKernelsTest, LambAgainstCpu) {
  const std::vector<int64_t> seg{0, 301, 1000, 1003, 2777};
  const int64_t stride = 999, unit = 3 * stride, K = 4, decayed = 1003;
  const double b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01;
  const float lrv = 2e-3f, scale = 0.625f;
  auto p = randomVec(unit, 81), g = randomVec(unit, 82), m = randomVec(unit, 83, 1e-2f),
       v0 = randomVec(unit, 84, 1e-2f);
  std::vector<float> v(unit);
  for (int64_t i = 0; i < unit; ++i)
    v[i] = v0[i] * v0[i];
  Dev<float> lr(std::vector<float>{lrv}), gs(std::vector<float>{scale}),
      skip(std::vector<float>{1.f}), inf(std::vector<float>{INFINITY}),
      scratch(gpu::lambScratch() * 2); // doubles
  double *partial = reinterpret_cast<double *>(scratch.get());
  for (float step : {1.f, 3.f}) {
    Dev<float> st(std::vector<float>{step});
    for (int64_t shard : {-1, 1}) { // -1: the whole unit
      int64_t at = shard < 0 ? 0 : shard * stride, n = shard < 0 ? unit : stride;
      std::vector<float> hp(p.begin() + at, p.begin() + at + n),
          hg(g.begin() + at, g.begin() + at + n), hm(m.begin() + at, m.begin() + at + n),
          hv(v.begin() + at, v.begin() + at + n);
      cpu::LambLayout layout{seg, at, decayed};
      std::vector<float> want(2 * K);
      cpu::lambNorms<float>(hp.data(), hg.data(), hm.data(), hv.data(), want.data(), n, layout,
                            (int64_t)step, b1, b2, eps, wd, scale);
      Dev<float> dp(hp), dg(hg), dm(hm), dv(hv), norms(2 * K);
      ASSERT_EQ(gpu::lambNorms(dp.get(), dg.get(), dm.get(), dv.get(), norms.get(), n, seg, at,
                               decayed, st.get(), b1, b2, eps, wd, gs.get(), partial, 0),
                cudaSuccess);
      std::vector<float> got = norms.host();
      for (int64_t k = 0; k < 2 * K; ++k)
        EXPECT_LE(std::fabs((double)got[k] - want[k]), 1e-6 * want[k])
            << "sum " << k << ", shard " << shard << ", step " << step << ": gpu " << got[k]
            << ", cpu " << want[k];
      if (shard == 1) {
        EXPECT_EQ(got[0], 0.f); // parameter 0 lies in shard 0
      }
      EXPECT_TRUE(same(dm.host(), hm) && same(dv.host(), hv)) << "lamb_norms wrote m or v";
      // The update, in place, from the CPU's sums.
      std::vector<float> wp(n), wm(n), wv(n);
      cpu::lambUpdate<float>(hp.data(), hg.data(), hm.data(), hv.data(), want.data(), wp.data(),
                             wm.data(), wv.data(), n, layout, lrv, (int64_t)step, b1, b2, eps, wd,
                             scale);
      Dev<float> sums(want);
      ASSERT_EQ(gpu::lambUpdate(dp.get(), dg.get(), dm.get(), dv.get(), sums.get(), dp.get(),
                                dm.get(), dv.get(), n, seg, at, decayed, lr.get(), st.get(), b1, b2,
                                eps, wd, gs.get(), skip.get(), 0),
                cudaSuccess);
      EXPECT_TRUE(same(dp.host(), wp)) << "param, shard " << shard << ", step " << step;
      EXPECT_TRUE(same(dm.host(), wm)) << "exp_avg, shard " << shard << ", step " << step;
      EXPECT_TRUE(same(dv.host(), wv)) << "exp_avg_sq, shard " << shard << ", step " << step;
      // skip_nonfinite inf: p, m and v through (into separate results)
      Dev<float> op(n), om(n), ov(n);
      ASSERT_EQ(gpu::lambUpdate(dp.get(), dg.get(), dm.get(), dv.get(), sums.get(), op.get(),
                                om.get(), ov.get(), n, seg, at, decayed, lr.get(), st.get(), b1, b2,
                                eps, wd, gs.get(), inf.get(), 0),
                cudaSuccess);
      EXPECT_TRUE(same(op.host(), wp) && same(om.host(), wm) && same(ov.host(), wv)) << "skip";
    }
  }
  // A decay_numel inside a parameter has no one trust ratio: refused.
  Dev<float> x(10), sums(4);
  EXPECT_EQ(gpu::lambNorms(x.get(), x.get(), x.get(), x.get(), sums.get(), 10, {0, 5, 10}, 0, 3,
                           lr.get(), b1, b2, eps, wd, nullptr, partial, 0),
            cudaErrorInvalidValue);
}

// Dynamic loss scaling: grad_coef (bitwise: one correctly rounded double
// sqrt and two divisions, as on the CPU), and the skipped updates of an
// overflowed step (every result its input, bit for bit, in and out of
// place; a finite norm changes nothing against no skip operand).
TEST_F(CudaKernelsTest, LossScalingCoefficientAndSkippedUpdates) {
  for (float sumsq : {0.f, 3.5f, 1.0e12f, 7.0e30f})
    for (float scale : {1.f, 65536.f, 0x1p40f})
      for (double maxNorm : {0.0, 1.0, 0.25}) {
        Dev<float> ds(std::vector<float>{sumsq}), dsc(std::vector<float>{scale}), out(1);
        ASSERT_EQ(gpu::gradCoef(ds.get(), dsc.get(), out.get(), maxNorm, 0), cudaSuccess);
        float want = cpu::gradCoef(sumsq, scale, maxNorm);
        float got = out.host()[0];
        EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0)
            << "grad_coef sumsq " << sumsq << " scale " << scale << " max_norm " << maxNorm
            << ": gpu " << got << ", cpu " << want;
      }
  const int64_t n = 513;
  auto p = randomVec(n, 61), g = randomVec(n, 62), b = randomVec(n, 63);
  Dev<float> dg(g), lr(std::vector<float>{1e-2f}), st(std::vector<float>{3.f}),
      inf(std::vector<float>{INFINITY}), nan(std::vector<float>{NAN}),
      fin(std::vector<float>{4.f});
  for (const Dev<float> *skip : {&inf, &nan}) {
    Dev<float> dp(p), np(n), db(b), nb(n);
    ASSERT_EQ(gpu::sgdUpdate(dp.get(), dg.get(), np.get(), n, lr.get(), 0.1, 0, skip->get()),
              cudaSuccess);
    EXPECT_TRUE(same(np.host(), p)) << "sgd, skipped: param";
    ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dg.get(), db.get(), np.get(), nb.get(), n,
                                     lr.get(), st.get(), 0.9, 0.0, 0.1, false, 0, skip->get()),
              cudaSuccess);
    EXPECT_TRUE(same(np.host(), p)) << "momentum, skipped: param";
    EXPECT_TRUE(same(nb.host(), b)) << "momentum, skipped: buffer";
    ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dg.get(), db.get(), dp.get(), db.get(), n,
                                     lr.get(), st.get(), 0.9, 0.0, 0.1, false, 0, skip->get()),
              cudaSuccess);
    EXPECT_TRUE(same(dp.host(), p) && same(db.host(), b)) << "momentum, skipped, in place";
  }
  Dev<float> dp(p), db(b), a(n), ab(n), c(n), cb(n);
  ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dg.get(), db.get(), a.get(), ab.get(), n,
                                   lr.get(), st.get(), 0.9, 0.0, 0.1, false, 0, fin.get()),
            cudaSuccess);
  ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dg.get(), db.get(), c.get(), cb.get(), n,
                                   lr.get(), st.get(), 0.9, 0.0, 0.1, false, 0),
            cudaSuccess);
  EXPECT_TRUE(same(a.host(), c.host()) && same(ab.host(), cb.host()) && !same(a.host(), p))
      << "momentum with a finite norm: the update, as without a skip operand";
  ASSERT_EQ(gpu::sgdUpdate(dp.get(), dg.get(), a.get(), n, lr.get(), 0.1, 0, fin.get()),
            cudaSuccess);
  ASSERT_EQ(gpu::sgdUpdate(dp.get(), dg.get(), c.get(), n, lr.get(), 0.1, 0), cudaSuccess);
  EXPECT_TRUE(same(a.host(), c.host()) && !same(a.host(), p))
      << "sgd with a finite norm: the update, as without a skip operand";
}

// grad_scale (fsdp-fuse-epilogues folds the clipping mul into the
// update): the update of g with *gradScale is bitwise the update of the
// product g * scale rounded to f32 (fsdp.mul's), also where the weight
// decay's FMA could have absorbed an unrounded product.
TEST_F(CudaKernelsTest, GradScaleUpdatesTheRoundedProduct) {
  const int64_t n = 1031;
  auto p = randomVec(n, 71), g = randomVec(n, 72), b = randomVec(n, 73);
  for (float scale : {0.3712f, 1.f / 65536, 0.f}) {
    std::vector<float> prod(n);
    for (int64_t i = 0; i < n; ++i)
      prod[i] = g[i] * scale;
    Dev<float> dp(p), dg(g), dprod(prod), db(b), sc(std::vector<float>{scale}),
        lr(std::vector<float>{1e-2f}), st(std::vector<float>{3.f}), a(n), ab(n), c(n), cb(n);
    ASSERT_EQ(gpu::sgdUpdate(dp.get(), dg.get(), a.get(), n, lr.get(), 0.1, 0, nullptr,
                             sc.get()),
              cudaSuccess);
    ASSERT_EQ(gpu::sgdUpdate(dp.get(), dprod.get(), c.get(), n, lr.get(), 0.1, 0), cudaSuccess);
    EXPECT_TRUE(same(a.host(), c.host())) << "sgd, grad_scale " << scale;
    for (bool nesterov : {false, true}) {
      ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dg.get(), db.get(), a.get(), ab.get(), n,
                                       lr.get(), st.get(), 0.9, 0.1, 0.1, nesterov, 0, nullptr,
                                       sc.get()),
                cudaSuccess);
      ASSERT_EQ(gpu::sgdMomentumUpdate(dp.get(), dprod.get(), db.get(), c.get(), cb.get(), n,
                                       lr.get(), st.get(), 0.9, 0.1, 0.1, nesterov, 0),
                cudaSuccess);
      EXPECT_TRUE(same(a.host(), c.host()) && same(ab.host(), cb.host()))
          << "momentum, grad_scale " << scale << ", nesterov " << nesterov;
    }
    // The CPU kernels with the same scale: within the FMA slack of the
    // unscaled comparison above (OptimizerSlack.h) of the product.
    std::vector<float> wp(n), wb(n);
    cpu::sgdMomentumUpdate(p.data(), g.data(), b.data(), wp.data(), wb.data(), n, 1e-2f, 3, 0.9,
                           0.1, 0.1, true, scale);
    fsdp::test::SgdMomentumSlack ss(p, prod, b, 1e-2, 3, 0.9, 0.1, 0.1, true);
    expectNear(a.host(), wp, 4, ss.p, "momentum against the CPU's grad_scale");
    expectNear(ab.host(), wb, 4, ss.buf, "momentum buffer against the CPU's grad_scale");
  }
}

TEST_F(CudaKernelsTest, CastsRoundToNearestEven) {
  auto x = randomVec(500, 30, 100.f);
  x.push_back(65520.f); // rounds to inf in f16
  x.push_back(-0.f);
  // Aligned operands take the 16-byte kernel (502 = 62 x 8 + a tail of 6;
  // 5: the tail alone), an operand one element off the scalar one.
  for (int64_t n : {(int64_t)x.size(), (int64_t)5})
    for (int64_t off : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset " << off);
      std::vector<float> xo(n + off, 7.f);
      std::copy(x.begin(), x.begin() + n, xo.begin() + off);
      Dev<float> dx(xo), back(n + off);
      Dev<uint16_t> h(n + off);
      for (auto kind : {gpu::FloatKind::BF16, gpu::FloatKind::F16}) {
        ASSERT_EQ(gpu::cast(dx.get() + off, gpu::FloatKind::F32, h.get() + off, kind, n, 0),
                  cudaSuccess);
        ASSERT_EQ(gpu::cast(h.get() + off, kind, back.get() + off, gpu::FloatKind::F32, n, 0),
                  cudaSuccess);
        auto bits = h.host();
        auto got = back.host();
        for (int64_t i = 0; i < n; ++i) {
          uint16_t want = kind == gpu::FloatKind::BF16 ? cpu::floatToBf16(x[i])
                                                       : cpu::floatToHalf(x[i]);
          EXPECT_EQ(bits[off + i], want) << "element " << i << " (" << x[i] << ")";
          float wf =
              kind == gpu::FloatKind::BF16 ? cpu::bf16ToFloat(want) : cpu::halfToFloat(want);
          EXPECT_EQ(std::memcmp(&got[off + i], &wf, 4), 0) << "element " << i;
        }
      }
    }
}

} // namespace
