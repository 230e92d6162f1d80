//===- CudaFastKernelsTest.cpp - native bf16, tiled attention, fused AdamW ===//
//
// The fast kernels of the CUDA backend (CudaNative.h, CudaFlash.h, the bf16
// cuBLASLt GEMM) against two references on the same inputs:
//   - bitwise, the widened path (the f32 reference kernel of CudaKernels.h
//     on exact f32 copies, rounded once by gpu::cast) wherever the native
//     kernel's f32 math is the reference's expression for expression;
//   - the CPU kernel (runtime/cpu/Kernels.h) in f32 on the widened inputs,
//     i.e. the CPU device's bf16 semantics before its one rounding.
// Tolerance against the unrounded CPU value w: the GPU's f32 value g
// differs from w by at most delta (f32 arithmetic: a few u = 2^-24 per
// operation, n u sum|terms| for a sum of n terms in another order, derived
// from the data), and rounding g to bf16 moves it by at most 2^-8 |g|; so
// |bf16(g) - w| <= 2^-8 (|w| + delta) + delta.
//
// Without a GPU every test is skipped, visibly (GTEST_SKIP with the reason).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Kernels.h"
#include "runtime/cuda/CudaFlash.h"
#include "runtime/cuda/CudaGemm.h"
#include "runtime/cuda/CudaKernels.h"
#include "runtime/cuda/CudaNative.h"
#include "test/unit/OptimizerSlack.h"

#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

namespace cpu = fsdp::cpu;
namespace gpu = fsdp::cuda;
namespace nat = fsdp::cuda::native;
using gpu::FloatKind;

namespace {

constexpr double kU = 1.0 / (1 << 24); // f32 unit roundoff
constexpr double kUb = 1.0 / (1 << 8); // bf16 unit roundoff

std::vector<float> randomVec(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float &x : v)
    x = d(g);
  return v;
}

/// x rounded to bf16 (bits) and those values widened back (exact).
struct Bf16Vec {
  std::vector<uint16_t> bits;
  std::vector<float> wide;
  /// half: f16 bits instead of bf16.
  explicit Bf16Vec(const std::vector<float> &x, bool half = false)
      : bits(x.size()), wide(x.size()) {
    for (size_t i = 0; i < x.size(); ++i) {
      bits[i] = half ? cpu::floatToHalf(x[i]) : cpu::floatToBf16(x[i]);
      wide[i] = half ? cpu::halfToFloat(bits[i]) : cpu::bf16ToFloat(bits[i]);
    }
  }
};

std::vector<float> widen(const std::vector<uint16_t> &b, bool half = false) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i)
    f[i] = half ? cpu::halfToFloat(b[i]) : cpu::bf16ToFloat(b[i]);
  return f;
}

template <typename T> class Dev {
public:
  explicit Dev(const std::vector<T> &h) : n_(h.size()) {
    EXPECT_EQ(cudaMalloc(&p_, sizeof(T) * std::max<size_t>(n_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, h.data(), sizeof(T) * n_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, sizeof(T) * std::max<size_t>(n_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p_, 0xff, sizeof(T) * n_), cudaSuccess); // NaN poison
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

double maxAbs(const std::vector<float> &v) {
  double m = 0;
  for (float x : v)
    m = std::max(m, (double)std::fabs(x));
  return m;
}

/// bf16 results against the unrounded CPU f32 values (see the file comment);
/// delta: the f32 bound, per element or one for all. half: f16 results
/// (unit roundoff 2^-11).
void expectBf16Near(const std::vector<uint16_t> &got, const std::vector<float> &want,
                    const std::vector<double> &delta, const char *what, bool half = false) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double u = half ? 1.0 / (1 << 11) : kUb;
  for (size_t i = 0; i < got.size(); ++i) {
    double d = delta.size() == 1 ? delta[0] : delta[i];
    double g = half ? cpu::halfToFloat(got[i]) : cpu::bf16ToFloat(got[i]);
    double tol = u * (std::fabs(want[i]) + d) + d;
    EXPECT_LE(std::fabs(g - want[i]), tol)
        << what << " element " << i << ": gpu " << g << ", cpu " << want[i];
  }
}

void expectF32Near(const std::vector<float> &got, const std::vector<float> &want, double ulps,
                   const std::vector<double> &slack, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    double sl = slack.empty() ? 0.0 : slack.size() == 1 ? slack[0] : slack[i];
    EXPECT_LE(std::fabs((double)got[i] - want[i]), ulps * kU * std::fabs(want[i]) + sl)
        << what << " element " << i << ": gpu " << got[i] << ", cpu " << want[i];
  }
}

void expectF32Near(const std::vector<float> &got, const std::vector<float> &want, double ulps,
                   double slack, const char *what) {
  expectF32Near(got, want, ulps, std::vector<double>{slack}, what);
}

template <typename T>
void expectBitwise(const std::vector<T> &got, const std::vector<T> &want, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << " element " << i << " differs from the widened path";
      ++bad;
    }
}

/// The widened path on the GPU: f32 kernel output (device f32, n) -> bf16 bits.
std::vector<uint16_t> roundOnGpu(const Dev<float> &f32, size_t n) {
  Dev<uint16_t> out(n);
  EXPECT_EQ(gpu::cast(f32.get(), FloatKind::F32, out.get(), FloatKind::BF16, (int64_t)n, 0),
            cudaSuccess);
  return out.host();
}

class CudaFastKernelsTest : public ::testing::Test {
protected:
  void SetUp() override {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      GTEST_SKIP() << "no CUDA GPU here (cudaGetDeviceCount: " << cudaGetErrorName(e)
                   << ", " << n << " devices): the fast CUDA kernels are compiled, not run";
  }
};

TEST_F(CudaFastKernelsTest, Bf16ElementwiseIsTheWidenedPathBitwise) {
  const int64_t n = 3000;
  Bf16Vec x(randomVec(n, 1, 2.f)), dy(randomVec(n, 2));
  Dev<uint16_t> bx(x.bits), bdy(dy.bits), bout(n);
  Dev<float> fx(x.wide), fdy(dy.wide), fout(n);
  std::vector<float> want(n);
  using UK = nat::UnaryKind;
  using UG = nat::UnaryGradKind;
  struct U {
    UK k;
    cudaError_t (*ref)(const float *, float *, int64_t, cudaStream_t);
    void (*cpuFn)(const float *, float *, int64_t);
    double ulps;
    const char *what;
  };
  for (U u : {U{UK::Neg, gpu::neg, cpu::neg<float>, 0, "neg"},
              U{UK::Relu, gpu::relu, cpu::relu<float>, 0, "relu"},
              U{UK::Gelu, gpu::gelu, cpu::gelu<float>, 8, "gelu"},
              U{UK::GeluExact, gpu::geluExact, cpu::geluExact<float>, 8, "gelu exact"},
              U{UK::Silu, gpu::silu, cpu::silu<float>, 8, "silu"}}) {
    ASSERT_EQ(nat::unary(FloatKind::BF16, u.k, bx.get(), bout.get(), n, 1.0, 0), cudaSuccess);
    ASSERT_EQ(u.ref(fx.get(), fout.get(), n, 0), cudaSuccess);
    expectBitwise(bout.host(), roundOnGpu(fout, n), u.what);
    u.cpuFn(x.wide.data(), want.data(), n);
    expectBf16Near(bout.host(), want, {u.ulps * kU * 4 * maxAbs(x.wide) + 1e-30}, u.what);
  }
  struct G {
    UG k;
    cudaError_t (*ref)(const float *, const float *, float *, int64_t, cudaStream_t);
    const char *what;
  };
  for (G g : {G{UG::Relu, gpu::reluGrad, "relu_grad"}, G{UG::Gelu, gpu::geluGrad, "gelu_grad"},
              G{UG::GeluExact, gpu::geluExactGrad, "gelu exact grad"},
              G{UG::Silu, gpu::siluGrad, "silu_grad"}}) {
    ASSERT_EQ(nat::unaryGrad(FloatKind::BF16, g.k, bx.get(), bdy.get(), bout.get(), n, 0),
              cudaSuccess);
    ASSERT_EQ(g.ref(fx.get(), fdy.get(), fout.get(), n, 0), cudaSuccess);
    expectBitwise(bout.host(), roundOnGpu(fout, n), g.what);
  }
  cpu::geluGrad(x.wide.data(), dy.wide.data(), want.data(), n);
  ASSERT_EQ(nat::unaryGrad(FloatKind::BF16, UG::Gelu, bx.get(), bdy.get(), bout.get(), n, 0),
            cudaSuccess);
  expectBf16Near(bout.host(), want, {16 * kU * 4 * maxAbs(x.wide) * maxAbs(dy.wide)},
                 "gelu_grad vs cpu");
  ASSERT_EQ(nat::unary(FloatKind::BF16, UK::Scale, bx.get(), bout.get(), n, 0.37, 0),
            cudaSuccess);
  ASSERT_EQ(gpu::scale(fx.get(), fout.get(), n, 0.37, 0), cudaSuccess);
  expectBitwise(bout.host(), roundOnGpu(fout, n), "scale");
  // f32 storage: the same kernels are bitwise the reference.
  Dev<float> fo2(n);
  ASSERT_EQ(nat::unary(FloatKind::F32, UK::Gelu, fx.get(), fo2.get(), n, 1.0, 0), cudaSuccess);
  ASSERT_EQ(gpu::gelu(fx.get(), fout.get(), n, 0), cudaSuccess);
  expectBitwise(fo2.host(), fout.host(), "f32 gelu");
}

/// swiglu / swiglu_grad (fsdp-fuse-epilogues' SwiGLU): on bf16 storage the
/// f32 kernel's result rounded once (bitwise: both compute in f32 from the
/// same widened values); the f32 kernel against the CPU's (its expf and
/// division within 8 ulps of the result per term: the gradient's
/// magnitude is bounded by |dy| (|u| + 1.1 |g| + 1) and the product's by
/// |g u|, so the slack is 8 u of those bounds).
TEST_F(CudaFastKernelsTest, Bf16SwigluIsTheWidenedPathBitwise) {
  const int64_t n = 3000;
  Bf16Vec g(randomVec(n, 11, 4.f)), u(randomVec(n, 12)), dy(randomVec(n, 13));
  Dev<uint16_t> bg(g.bits), bu(u.bits), bdy(dy.bits), by(n), bdg(n), bdu(n);
  Dev<float> fg(g.wide), fu(u.wide), fdy(dy.wide), fy(n), fdg(n), fdu(n);
  ASSERT_EQ(nat::swiglu(FloatKind::BF16, bg.get(), bu.get(), by.get(), n, 0), cudaSuccess);
  ASSERT_EQ(nat::swiglu(FloatKind::F32, fg.get(), fu.get(), fy.get(), n, 0), cudaSuccess);
  expectBitwise(by.host(), roundOnGpu(fy, n), "swiglu");
  ASSERT_EQ(nat::swigluGrad(FloatKind::BF16, bg.get(), bu.get(), bdy.get(), bdg.get(), bdu.get(),
                            n, 0),
            cudaSuccess);
  ASSERT_EQ(nat::swigluGrad(FloatKind::F32, fg.get(), fu.get(), fdy.get(), fdg.get(), fdu.get(),
                            n, 0),
            cudaSuccess);
  expectBitwise(bdg.host(), roundOnGpu(fdg, n), "swiglu_grad d_gate");
  expectBitwise(bdu.host(), roundOnGpu(fdu, n), "swiglu_grad d_up");
  std::vector<float> y(n), dg(n), du(n);
  cpu::swiglu(g.wide.data(), u.wide.data(), y.data(), n);
  cpu::swigluGrad(g.wide.data(), u.wide.data(), dy.wide.data(), dg.data(), du.data(), n);
  std::vector<double> sy(n), sg(n), su(n);
  for (int64_t i = 0; i < n; ++i) {
    double a = std::fabs(g.wide[i]), b = std::fabs(u.wide[i]), d = std::fabs(dy.wide[i]);
    sy[i] = 8 * kU * a * b;
    sg[i] = 8 * kU * d * (b * (1.1 * a + 1) + 1);
    su[i] = 8 * kU * d * a;
  }
  expectF32Near(fy.host(), y, 0, sy, "swiglu vs cpu");
  expectF32Near(fdg.host(), dg, 0, sg, "swiglu_grad d_gate vs cpu");
  expectF32Near(fdu.host(), du, 0, su, "swiglu_grad d_up vs cpu");
}

/// The Llama's row kernels (rms_norm, rms_norm_grad, rope, rope_grad) on bf16
/// storage: the f32 kernel's results on the widened values, rounded once
/// (bitwise: one arithmetic, f32 inside); the f32 kernels against the CPU's.
/// Bounds: the row's sum of squares is within (cols + 2) u of its value, so
/// 1/rms within (cols / 2 + 4) u; y = x r w and dx = r (dy w - xhat m) move by
/// (cols + 16) u of their terms' magnitudes (m, a mean of cols products, by
/// cols u of sum |dy w xhat| / cols); dw, a sum over rows, by (rows + cols +
/// 16) u of sum |dy xhat|. rope: the f32 kernels may contract x1 c - x2 s
/// into an fma: 2 u of |x1 c| + |x2 s| (its angles' tables are the CPU's:
/// native::ropeAngles).
TEST_F(CudaFastKernelsTest, Bf16RmsNormAndRopeAreTheWidenedPathBitwise) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{37, 1024}, {5000, 48}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const int64_t n = rows * cols;
    Bf16Vec x(randomVec(n, 41, 2.f)), w(randomVec(cols, 42)), dy(randomVec(n, 43));
    Dev<uint16_t> bx(x.bits), bw(w.bits), bdy(dy.bits), by(n), bdx(n), bdw(cols);
    Dev<float> fx(x.wide), fw(w.wide), fdy(dy.wide), fy(n), fdx(n), fdw(cols);
    Dev<float> scratch(nat::rmsNormGradScratch(rows, cols));
    ASSERT_EQ(nat::rmsNorm(FloatKind::BF16, bx.get(), bw.get(), by.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    ASSERT_EQ(nat::rmsNorm(FloatKind::F32, fx.get(), fw.get(), fy.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    expectBitwise(by.host(), roundOnGpu(fy, n), "rms_norm");
    ASSERT_EQ(nat::rmsNormGrad(FloatKind::BF16, bx.get(), bw.get(), bdy.get(), bdx.get(),
                               bdw.get(), scratch.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    ASSERT_EQ(nat::rmsNormGrad(FloatKind::F32, fx.get(), fw.get(), fdy.get(), fdx.get(),
                               fdw.get(), scratch.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    expectBitwise(bdx.host(), roundOnGpu(fdx, n), "rms_norm_grad dx");
    expectBitwise(bdw.host(), roundOnGpu(fdw, cols), "rms_norm_grad dw");
    // The f32 kernels against the CPU's.
    std::vector<float> y(n), dx(n), dw(cols);
    cpu::rmsNorm(x.wide.data(), w.wide.data(), y.data(), rows, cols, 1e-5);
    cpu::rmsNormGrad(x.wide.data(), w.wide.data(), dy.wide.data(), dx.data(), dw.data(), rows,
                     cols, 1e-5);
    std::vector<double> sy(n), sdx(n), sdw(cols, 0.0);
    const double k = (cols + 16) * kU;
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0, dot = 0;
      for (int64_t c = 0; c < cols; ++c)
        ss += (double)x.wide[r * cols + c] * x.wide[r * cols + c];
      double rs = 1 / std::sqrt(ss / cols + 1e-5);
      for (int64_t c = 0; c < cols; ++c)
        dot += std::fabs(dy.wide[r * cols + c] * w.wide[c] * x.wide[r * cols + c] * rs);
      for (int64_t c = 0; c < cols; ++c) {
        int64_t i = r * cols + c;
        double xh = std::fabs(x.wide[i] * rs), dyw = std::fabs(dy.wide[i] * w.wide[c]);
        sy[i] = k * xh * std::fabs(w.wide[c]);
        sdx[i] = 2 * k * rs * (dyw + xh * dot / cols);
        sdw[c] += (rows + cols + 16) * kU * std::fabs(dy.wide[i]) * xh;
      }
    }
    expectF32Near(fy.host(), y, 0, sy, "rms_norm vs cpu");
    expectF32Near(fdx.host(), dx, 0, sdx, "rms_norm_grad dx vs cpu");
    expectF32Near(fdw.host(), dw, 0, sdw, "rms_norm_grad dw vs cpu");
    // The residual forms (fsdp-fuse-epilogues): the sum a + b rounded once
    // (the CPU's bits), the norm of the stored sum; dx + acc in f32,
    // rounded once. Each the f32 kernel's result rounded.
    Bf16Vec b(randomVec(n, 45)), acc(randomVec(n, 46));
    Dev<uint16_t> bb(b.bits), bacc(acc.bits), bsum(n);
    Dev<float> fb(b.wide), facc(acc.wide), fsum(n);
    ASSERT_EQ(nat::residualRmsNorm(FloatKind::BF16, bx.get(), bb.get(), bw.get(), bsum.get(),
                                   by.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    std::vector<float> sum(n);
    for (int64_t i = 0; i < n; ++i)
      sum[i] = x.wide[i] + b.wide[i];
    Bf16Vec sumB(sum);
    expectBitwise(bsum.host(), sumB.bits, "residual_rms_norm sum");
    Dev<float> fsumB(sumB.wide);
    ASSERT_EQ(nat::rmsNorm(FloatKind::F32, fsumB.get(), fw.get(), fy.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    expectBitwise(by.host(), roundOnGpu(fy, n), "residual_rms_norm");
    ASSERT_EQ(nat::rmsNormGrad(FloatKind::BF16, bx.get(), bw.get(), bdy.get(), bdx.get(),
                               bdw.get(), scratch.get(), rows, cols, 1e-5, 0, bacc.get()),
              cudaSuccess);
    ASSERT_EQ(nat::rmsNormGrad(FloatKind::F32, fx.get(), fw.get(), fdy.get(), fdx.get(),
                               fdw.get(), scratch.get(), rows, cols, 1e-5, 0, facc.get()),
              cudaSuccess);
    expectBitwise(bdx.host(), roundOnGpu(fdx, n), "rms_norm_grad_acc dx");
    std::vector<float> fdxAcc = fdx.host();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(fdxAcc[i], dx[i] + acc.wide[i], sdx[i] + kU * (std::fabs(dx[i]) +
                                                                 std::fabs(acc.wide[i])))
          << "rms_norm_grad_acc dx vs cpu + acc, element " << i;
  }
  const int64_t B = 2, T = 9, C = 64, H = 4;
  Bf16Vec x(randomVec(B * T * C, 44));
  std::vector<float> cs, sn;
  nat::ropeAngles(T, C / H, 1e4, cs, sn);
  Dev<float> dcs(cs), dsn(sn);
  Dev<uint16_t> bx(x.bits), by(B * T * C);
  Dev<float> fx(x.wide), fy(B * T * C), ref(B * T * C);
  for (bool grad : {false, true}) {
    const char *what = grad ? "rope_grad" : "rope";
    ASSERT_EQ(nat::rope(FloatKind::BF16, bx.get(), by.get(), B, T, C, H, dcs.get(), dsn.get(),
                        grad, 0),
              cudaSuccess);
    ASSERT_EQ(nat::rope(FloatKind::F32, fx.get(), fy.get(), B, T, C, H, dcs.get(), dsn.get(),
                        grad, 0),
              cudaSuccess);
    expectBitwise(by.host(), roundOnGpu(fy, B * T * C), what);
    std::vector<float> want(B * T * C);
    (grad ? cpu::ropeGrad<float> : cpu::rope<float>)(x.wide.data(), want.data(), B, T, C, H,
                                                      1e4);
    // |x1 c| + |x2 s| <= |x1| + |x2| <= 2 max|x|; the reference kernel's
    // angles come from the device's double cos / sin, maybe an ulp of
    // float off the host's: 2 u more.
    expectF32Near(fy.host(), want, 0, 2 * kU * 2 * maxAbs(x.wide), what);
    ASSERT_EQ((grad ? gpu::ropeGrad : gpu::rope)(fx.get(), ref.get(), B, T, C, H, 1e4, 0),
              cudaSuccess);
    expectF32Near(fy.host(), ref.host(), 0, 4 * kU * 2 * maxAbs(x.wide), what);
  }
}

TEST_F(CudaFastKernelsTest, Bf16BroadcastBiasSumToAndDataMovement) {
  gpu::Shape sa{4, 1, 8}, sb{3, 1}, so{4, 3, 8};
  Bf16Vec a(randomVec(32, 3)), b(randomVec(3, 4)), big(randomVec(96, 5));
  Dev<uint16_t> ba(a.bits), bb(b.bits), bbig(big.bits), bout(96);
  Dev<float> fa(a.wide), fb(b.wide), fbig(big.wide), fout(96);
  for (auto k : {gpu::BinaryKind::Add, gpu::BinaryKind::Sub, gpu::BinaryKind::Mul,
                 gpu::BinaryKind::Div}) {
    ASSERT_EQ(nat::binary(FloatKind::BF16, k, ba.get(), sa, bb.get(), sb, bout.get(), so, 0),
              cudaSuccess);
    ASSERT_EQ(gpu::binary(k, fa.get(), sa, fb.get(), sb, fout.get(), so, 0), cudaSuccess);
    expectBitwise(bout.host(), roundOnGpu(fout, 96), "broadcast binary");
    // same shapes: the fast path
    ASSERT_EQ(nat::binary(FloatKind::BF16, k, bbig.get(), so, bbig.get(), so, bout.get(), so, 0),
              cudaSuccess);
    ASSERT_EQ(gpu::binary(k, fbig.get(), so, fbig.get(), so, fout.get(), so, 0), cudaSuccess);
    expectBitwise(bout.host(), roundOnGpu(fout, 96), "same-shape binary");
  }
  Bf16Vec bias(randomVec(8, 6));
  Dev<uint16_t> bbias(bias.bits);
  Dev<float> fbias(bias.wide);
  ASSERT_EQ(nat::biasAdd(FloatKind::BF16, bbig.get(), bbias.get(), bout.get(), 12, 8, 0),
            cudaSuccess);
  ASSERT_EQ(gpu::biasAdd(fbig.get(), fbias.get(), fout.get(), 12, 8, 0), cudaSuccess);
  expectBitwise(bout.host(), roundOnGpu(fout, 96), "bias_add");
  // sum_to over a middle dim: the reference order, bitwise. (Over the
  // leading dims it is the column sum: ColumnSumAgainstCpu.)
  for (gpu::Shape to : {gpu::Shape{4, 1, 8}}) {
    int64_t m = 1;
    for (int64_t d : to)
      m *= d;
    Dev<uint16_t> bs(m);
    Dev<float> fs(m);
    ASSERT_EQ(nat::sumTo(FloatKind::BF16, bbig.get(), so, bs.get(), to, nullptr, 0),
              cudaSuccess);
    ASSERT_EQ(gpu::sumTo(fbig.get(), so, fs.get(), to, 0), cudaSuccess);
    expectBitwise(bs.host(), roundOnGpu(fs, m), "sum_to");
  }
  // slice / slice_grad / transpose: copies, bitwise the widened path.
  Dev<uint16_t> bsl(4 * 2 * 8), bsg(96);
  Dev<float> fsl(4 * 2 * 8), fsg(96);
  ASSERT_EQ(nat::slice(FloatKind::BF16, bbig.get(), bsl.get(), 4, 3, 2, 8, 1, 0), cudaSuccess);
  ASSERT_EQ(gpu::slice(fbig.get(), fsl.get(), 4, 3, 2, 8, 1, 0), cudaSuccess);
  expectBitwise(bsl.host(), roundOnGpu(fsl, 64), "slice");
  ASSERT_EQ(nat::sliceGrad(FloatKind::BF16, bsl.get(), bsg.get(), 4, 3, 2, 8, 1, 0),
            cudaSuccess);
  ASSERT_EQ(gpu::sliceGrad(fsl.get(), fsg.get(), 4, 3, 2, 8, 1, 0), cudaSuccess);
  expectBitwise(bsg.host(), roundOnGpu(fsg, 96), "slice_grad");
  ASSERT_EQ(nat::transpose(FloatKind::BF16, bbig.get(), so, {2, 0, 1}, bout.get(), 0),
            cudaSuccess);
  ASSERT_EQ(gpu::transpose(fbig.get(), so, {2, 0, 1}, fout.get(), 0), cudaSuccess);
  expectBitwise(bout.host(), roundOnGpu(fout, 96), "transpose");
  // Rows of 64 bytes and more go through pitched copies (a q/k/v split:
  // [37, 3 x 48] -> the middle [37, 48], and back into a zeroed whole):
  // the same elements as the per-element kernel of the f32 path.
  const int64_t rows = 37, part = 48;
  Bf16Vec qkv(randomVec(rows * 3 * part, 5));
  Dev<uint16_t> bq(qkv.bits), bk(rows * part), bg(rows * 3 * part);
  Dev<float> fq(qkv.wide), fk(rows * part), fg(rows * 3 * part);
  ASSERT_EQ(nat::slice(FloatKind::BF16, bq.get(), bk.get(), rows, 3 * part, part, 1, part, 0),
            cudaSuccess);
  ASSERT_EQ(gpu::slice(fq.get(), fk.get(), rows, 3 * part, part, 1, part, 0), cudaSuccess);
  expectBitwise(bk.host(), roundOnGpu(fk, rows * part), "slice, pitched");
  ASSERT_EQ(nat::sliceGrad(FloatKind::BF16, bk.get(), bg.get(), rows, 3 * part, part, 1, part,
                           0),
            cudaSuccess);
  ASSERT_EQ(gpu::sliceGrad(fk.get(), fg.get(), rows, 3 * part, part, 1, part, 0), cudaSuccess);
  expectBitwise(bg.host(), roundOnGpu(fg, rows * 3 * part), "slice_grad, pitched");
}

TEST_F(CudaFastKernelsTest, Bf16EmbeddingAndItsGradient) {
  const int64_t vocab = 11, width = 16, n = 40;
  Bf16Vec table(randomVec(vocab * width, 7)), dy(randomVec(n * width, 8));
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i)
    ids[i] = (int32_t)((i * 7) % vocab);
  Dev<uint16_t> bt(table.bits), bdy(dy.bits), by(n * width), bdt(vocab * width);
  Dev<float> fdy(dy.wide), fdt(vocab * width), scratch(nat::embeddingGradScratch(n));
  Dev<int32_t> dids(ids);
  Dev<long long> bad(std::vector<long long>{LLONG_MAX});
  ASSERT_EQ(nat::embedding(FloatKind::BF16, bt.get(), dids.get(), by.get(), n, vocab, width,
                           bad.get(), 0),
            cudaSuccess);
  auto y = by.host();
  for (int64_t i = 0; i < n * width; ++i)
    ASSERT_EQ(y[i], table.bits[ids[i / width] * width + i % width]) << i;
  ASSERT_EQ(nat::embeddingGrad(FloatKind::BF16, dids.get(), bdy.get(), bdt.get(),
                               scratch.get(), n, vocab, width, bad.get(), 0),
            cudaSuccess);
  ASSERT_EQ(gpu::embeddingGrad(dids.get(), fdy.get(), fdt.get(), n, vocab, width, bad.get(), 0),
            cudaSuccess);
  expectBitwise(bdt.host(), roundOnGpu(fdt, vocab * width), "embedding_grad");
  EXPECT_EQ(bad.host()[0], LLONG_MAX);
}

TEST_F(CudaFastKernelsTest, EmbeddingGradientSortedRunsAreTheReferenceBitwise) {
  // The sorted kernel sums each id's rows in row order in f32, as the
  // reference (one thread per column over every row, CudaKernels.h) and
  // the CPU: the same bits. n not a power of two and past one block of
  // the sort, one id taking a third of the rows (a run longer than the
  // eight-row prefetch), ids never seen (their rows zero), and out-of-range
  // ids reported at their first position and skipped. n = 5000 and 20000:
  // the sort's global steps (j >= 2048) between its shared-memory ones,
  // over 4 and 16 chunks; 1500: one chunk, in shared memory only.
  for (int64_t n : {int64_t(5000), int64_t(20000), int64_t(1500)}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const int64_t vocab = 300, width = 40, bad1 = n > 4400 ? 4321 : 1234,
                  bad2 = n > 4400 ? 4400 : 1300;
    std::vector<int32_t> ids(n);
    for (int64_t i = 0; i < n; ++i)
      ids[i] = i % 3 == 0 ? 17 : (int32_t)((i * 131) % 250);
    ids[bad1] = 300; // out of range: reported, skipped
    ids[bad2] = -2;
    auto dy = randomVec(n * width, 91);
    Dev<int32_t> dids(ids);
    Dev<float> fdy(dy), ref(vocab * width), got(vocab * width),
        scratch(nat::embeddingGradScratch(n));
    Dev<long long> badRef(std::vector<long long>{LLONG_MAX}),
        bad(std::vector<long long>{LLONG_MAX});
    ASSERT_EQ(
        gpu::embeddingGrad(dids.get(), fdy.get(), ref.get(), n, vocab, width, badRef.get(), 0),
        cudaSuccess);
    ASSERT_EQ(nat::embeddingGrad(FloatKind::F32, dids.get(), fdy.get(), got.get(), scratch.get(), n,
                                 vocab, width, bad.get(), 0),
              cudaSuccess);
    expectBitwise(got.host(), ref.host(), "sorted embedding_grad (f32)");
    EXPECT_EQ(bad.host()[0], bad1);
    EXPECT_EQ(badRef.host()[0], bad1);
    auto g = got.host();
    for (int64_t c = 0; c < width; ++c)
      EXPECT_EQ(g[299 * width + c], 0.f) << "an id never seen: zero";
    // bf16 storage: the f32 sums rounded once.
    Bf16Vec dyb(dy);
    Dev<uint16_t> bdy(dyb.bits), bgot(vocab * width);
    Dev<float> wdy(dyb.wide);
    ASSERT_EQ(
        gpu::embeddingGrad(dids.get(), wdy.get(), ref.get(), n, vocab, width, badRef.get(), 0),
        cudaSuccess);
    ASSERT_EQ(nat::embeddingGrad(FloatKind::BF16, dids.get(), bdy.get(), bgot.get(), scratch.get(),
                                 n, vocab, width, bad.get(), 0),
              cudaSuccess);
    expectBitwise(bgot.host(), roundOnGpu(ref, vocab * width), "sorted embedding_grad (bf16)");
  }
}

TEST_F(CudaFastKernelsTest, Bf16RowwiseSoftmaxLayerNormAgainstCpu) {
  // 4099 rows: more than the backward's 1024 dg / db partials, whose
  // column sum then takes two passes (the second writes dg and db).
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {37, 96}, {37, 768}, {37, 1000}, {4099, 96}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols));
    Bf16Vec x(randomVec(rows * cols, 11, 2.f)), dy(randomVec(rows * cols, 12)),
        g(randomVec(cols, 13)), b(randomVec(cols, 14));
    Dev<uint16_t> bx(x.bits), bdy(dy.bits), bg(g.bits), bb(b.bits), by(rows * cols),
        bdx(rows * cols), bdg(cols), bdb(cols);
    Dev<float> scratch(nat::layerNormGradScratch(rows, cols));
    std::vector<float> wy(rows * cols), wdx(rows * cols), wdg(cols), wdb(cols);
    // f32 bounds: row sums of `cols` terms in another order (the row
    // statistics, then each output a few operations on them); column sums
    // of `rows` terms in another order for dgamma / dbeta.
    double rowN = 4.0 * cols + 16;
    double mx = maxAbs(x.wide), mdy = maxAbs(dy.wide), mg = maxAbs(g.wide);
    // xhat is at most sqrt(cols) in magnitude (a normalised row).
    double xhat = std::sqrt((double)cols);
    ASSERT_EQ(nat::layerNorm(FloatKind::BF16, bx.get(), bg.get(), bb.get(), by.get(), rows,
                             cols, 1e-5, 0),
              cudaSuccess);
    cpu::layerNorm(x.wide.data(), g.wide.data(), b.wide.data(), wy.data(), rows, cols, 1e-5);
    expectBf16Near(by.host(), wy, {rowN * kU * 4 * (xhat * mg + maxAbs(b.wide))}, "layer_norm");
    ASSERT_EQ(nat::layerNormGrad(FloatKind::BF16, bx.get(), bg.get(), bdy.get(), bdx.get(),
                                 bdg.get(), bdb.get(), scratch.get(), rows, cols, 1e-5, 0),
              cudaSuccess);
    cpu::layerNormGrad(x.wide.data(), g.wide.data(), dy.wide.data(), wdx.data(), wdg.data(),
                       wdb.data(), rows, cols, 1e-5);
    (void)mx;
    // dx = rstd (dy g - m1 - xhat m2): rstd up to 1/std of a row (the rows
    // here have std ~2), m2 sums cols terms of size mdy mg xhat.
    expectBf16Near(bdx.host(), wdx, {rowN * kU * 16 * mdy * mg * xhat}, "layer_norm d_input");
    double colSlack = 4.0 * (rows + cols) * kU * mdy * xhat * rows;
    expectBf16Near(bdg.host(), wdg, {colSlack}, "layer_norm d_gamma");
    expectBf16Near(bdb.host(), wdb, {4.0 * rows * kU * mdy * rows}, "layer_norm d_beta");

    // softmax and its VJP
    ASSERT_EQ(nat::softmax(FloatKind::BF16, bx.get(), by.get(), rows, cols, 0), cudaSuccess);
    cpu::softmax(x.wide.data(), wy.data(), rows, cols);
    expectBf16Near(by.host(), wy, {rowN * kU * 4}, "softmax");
    Bf16Vec yv(wy);
    Dev<uint16_t> byv(yv.bits);
    ASSERT_EQ(nat::softmaxGrad(FloatKind::BF16, byv.get(), bdy.get(), bdx.get(), rows, cols, 0),
              cudaSuccess);
    cpu::softmaxGrad(yv.wide.data(), dy.wide.data(), wdx.data(), rows, cols);
    expectBf16Near(bdx.host(), wdx, {rowN * kU * 4 * mdy}, "softmax_grad");
  }
}

/// The first `classes` columns of each of `rows` rows of `stride` (the
/// gradient without fsdp-pad-classes' padding) into inRows; the padding
/// columns must have been written 0.
void classColumns(const std::vector<uint16_t> &got, int64_t rows, int64_t classes, int64_t stride,
                  std::vector<uint16_t> &inRows) {
  inRows.assign(rows * classes, 0);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(got.begin() + r * stride, classes, inRows.begin() + r * classes);
    for (int64_t c = classes; c < stride; ++c)
      ASSERT_EQ(got[r * stride + c], 0) << "padding column " << c << " of row " << r;
  }
}

/// cross_entropy_fused on the bf16 rows `rowsBits` (label smoothing e):
/// the loss, the rows' loss terms and the gradient bit for bit the two
/// kernels' (`loss`, `perRow`, `grad`), with the row cached in shared
/// memory or read twice, into another buffer or in place.
/// `rows` rows of `classes` bf16 logits laid out at `stride` (>= classes),
/// the padding columns holding 40, a large value that must not enter the
/// softmax (fsdp-pad-classes' padded head).
std::vector<uint16_t> padRows(const std::vector<uint16_t> &bits, int64_t rows, int64_t classes,
                              int64_t stride) {
  std::vector<uint16_t> out(rows * stride, cpu::floatToBf16(40.f));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(bits.begin() + r * classes, classes, out.begin() + r * stride);
  return out;
}

void expectFusedEqualsUnfused(const std::vector<uint16_t> &rowsBits, const int32_t *labels,
                              const float *dloss, const std::vector<float> &loss,
                              const std::vector<double> &perRow, const std::vector<uint16_t> &grad,
                              int64_t rows, int64_t classes, int64_t stride, long long *bad,
                              double e, fsdp::cuda::CeIgnore ig = {}) {
  for (bool cache : {true, false})
    for (bool inPlace : {false, true}) {
      SCOPED_TRACE(std::string(cache ? "row cached" : "two reads") + (inPlace ? ", in place" : ""));
      Dev<uint16_t> src(rowsBits), dst(std::vector<uint16_t>(rows * stride, 0x7fc0));
      Dev<float> fusedLoss(std::vector<float>{-1.f});
      Dev<double> fusedRows(std::vector<double>(rows, -7.0));
      void *to = inPlace ? (void *)src.get() : (void *)dst.get();
      ASSERT_EQ(nat::crossEntropyFused(FloatKind::BF16, src.get(), labels, dloss, fusedLoss.get(),
                                       to, fusedRows.get(), rows, classes, stride, bad, 0, cache, e,
                                       ig),
                cudaSuccess);
      EXPECT_EQ(fusedLoss.host(), loss) << "the fused loss";
      EXPECT_EQ(fusedRows.host(), perRow) << "the rows' loss terms";
      EXPECT_EQ((inPlace ? src : dst).host(), grad) << "the fused gradient";
    }
}

TEST_F(CudaFastKernelsTest, FusedCrossEntropyReadsBf16Logits) {
  const int64_t rows = 33, classes = 50257; // GPT-2's vocabulary: odd, not a multiple of 8
  Bf16Vec logits(randomVec(rows * classes, 21, 3.f));
  std::vector<int32_t> labels(rows);
  for (int64_t r = 0; r < rows; ++r)
    labels[r] = (int32_t)((r * 7919) % classes);
  labels[1] = (int32_t)classes - 1; // the last class, next to the padding
  float wl = 0, dlh = 1.5f;
  cpu::crossEntropy(logits.wide.data(), labels.data(), &wl, rows, classes);
  std::vector<float> wd(rows * classes);
  cpu::crossEntropyGrad(logits.wide.data(), labels.data(), &dlh, wd.data(), rows, classes);
  // Rows of `classes` elements (unaligned: the scalar path), and the same
  // logits in rows padded to 50304 (fsdp-pad-classes: 16-byte chunks) with
  // large values in the padding columns, which must not enter the softmax,
  // and a poisoned gradient buffer, whose padding columns must become 0.
  for (int64_t stride : {classes, int64_t(50304)}) {
    SCOPED_TRACE("row stride " + std::to_string(stride));
    std::vector<uint16_t> rowsBits = padRows(logits.bits, rows, classes, stride);
    Dev<uint16_t> bl(rowsBits), bd(std::vector<uint16_t>(rows * stride, 0x7fc0)); // NaN
    Dev<int32_t> dl(labels);
    Dev<float> loss(1), dloss(std::vector<float>{1.5f});
    Dev<double> perRow(rows);
    Dev<long long> bad(std::vector<long long>{LLONG_MAX});
    ASSERT_EQ(nat::crossEntropy(FloatKind::BF16, bl.get(), dl.get(), loss.get(), perRow.get(),
                                rows, classes, stride, bad.get(), 0),
              cudaSuccess);
    // The sum of exp over `classes` terms in another order (an online
    // max/sum), relative n u, then log: absolute error about classes * u.
    expectF32Near(loss.host(), {wl}, 16, 4.0 * classes * kU, "cross_entropy (f32 loss)");
    ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(), bd.get(),
                                    rows, classes, stride, bad.get(), 0),
              cudaSuccess);
    std::vector<uint16_t> got = bd.host(), inRows;
    ASSERT_NO_FATAL_FAILURE(classColumns(got, rows, classes, stride, inRows));
    // softmax entries: relative error ~ classes u (the row sum), times 1.5/rows
    expectBf16Near(inRows, wd, {4.0 * classes * kU * 1.5 / rows}, "cross_entropy_grad");
    EXPECT_EQ(bad.host()[0], LLONG_MAX);
    // The padded rows (98 KB) take the shared-memory row copy: the same
    // bits as the two-read kernel, and in place (dlogits = logits, as
    // fsdp-plan-memory places the LM head's gradient) the same again.
    Dev<uint16_t> twoRead(std::vector<uint16_t>(rows * stride, 0x7fc0));
    ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(),
                                    twoRead.get(), rows, classes, stride, bad.get(), 0,
                                    /*cacheRow=*/false),
              cudaSuccess);
    EXPECT_EQ(twoRead.host(), got) << "the row copy changed the result";
    Dev<uint16_t> inPlace(rowsBits);
    ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, inPlace.get(), dl.get(), dloss.get(),
                                    inPlace.get(), rows, classes, stride, bad.get(), 0),
              cudaSuccess);
    EXPECT_EQ(inPlace.host(), got) << "in place";
    // cross_entropy_fused: the loss and the gradient from one pass, the
    // same bits as the two kernels, cached row or not, and in place.
    expectFusedEqualsUnfused(rowsBits, dl.get(), dloss.get(), loss.host(), perRow.host(), got, rows,
                             classes, stride, bad.get(), 0.0);
    EXPECT_EQ(bad.host()[0], LLONG_MAX);
    // A bad label is recorded, not a crash; a label in the padding is bad.
    std::vector<int32_t> badLabels = labels;
    badLabels[5] = (int32_t)classes;
    Dev<int32_t> dl2(badLabels);
    ASSERT_EQ(nat::crossEntropy(FloatKind::BF16, bl.get(), dl2.get(), loss.get(), perRow.get(),
                                rows, classes, stride, bad.get(), 0),
              cudaSuccess);
    EXPECT_EQ(bad.host()[0], 5);
    Dev<long long> bad2(std::vector<long long>{LLONG_MAX});
    ASSERT_EQ(nat::crossEntropyFused(FloatKind::BF16, bl.get(), dl2.get(), dloss.get(),
                                     loss.get(), bd.get(), perRow.get(), rows, classes, stride,
                                     bad2.get(), 0),
              cudaSuccess);
    EXPECT_EQ(bad2.host()[0], 5) << "the fused kernel's bad label";
  }
}

// Label smoothing 0.1 on bf16 logits, both row layouts (unaligned rows:
// the scalar path; padded rows of 16-byte chunks: the vector path and the
// shared-memory row copy): the CPU kernel's smoothed loss and gradient
// within the bounds of the unsmoothed test above (the smoothed term adds
// the row's sum of logits in double), the fused kernel bit for bit the two
// kernels (cached or not, in place), and a loss that is not the
// unsmoothed one.
TEST_F(CudaFastKernelsTest, CrossEntropyLabelSmoothing) {
  const int64_t rows = 9, classes = 1001;
  const double e = 0.1;
  Bf16Vec logits(randomVec(rows * classes, 27, 3.f));
  std::vector<int32_t> labels(rows);
  for (int64_t r = 0; r < rows; ++r)
    labels[r] = (int32_t)((r * 389) % classes);
  labels[2] = (int32_t)classes - 1;
  float wl = 0, plain = 0, dlh = 1.5f;
  cpu::crossEntropy(logits.wide.data(), labels.data(), &wl, rows, classes, 0, e);
  cpu::crossEntropy(logits.wide.data(), labels.data(), &plain, rows, classes);
  ASSERT_GT(std::fabs(wl - plain), 1e-2);
  std::vector<float> wd(rows * classes);
  cpu::crossEntropyGrad(logits.wide.data(), labels.data(), &dlh, wd.data(), rows, classes, 0, e);
  for (int64_t stride : {classes, int64_t(1024)}) {
    SCOPED_TRACE("row stride " + std::to_string(stride));
    std::vector<uint16_t> rowsBits = padRows(logits.bits, rows, classes, stride);
    Dev<uint16_t> bl(rowsBits), bd(std::vector<uint16_t>(rows * stride, 0x7fc0));
    Dev<int32_t> dl(labels);
    Dev<float> loss(1), dloss(std::vector<float>{1.5f});
    Dev<double> perRow(rows);
    Dev<long long> bad(std::vector<long long>{LLONG_MAX});
    ASSERT_EQ(nat::crossEntropy(FloatKind::BF16, bl.get(), dl.get(), loss.get(), perRow.get(), rows,
                                classes, stride, bad.get(), 0, e),
              cudaSuccess);
    expectF32Near(loss.host(), {wl}, 16, 4.0 * classes * kU, "smoothed cross_entropy");
    ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(), bd.get(),
                                    rows, classes, stride, bad.get(), 0, true, e),
              cudaSuccess);
    std::vector<uint16_t> got = bd.host(), inRows;
    ASSERT_NO_FATAL_FAILURE(classColumns(got, rows, classes, stride, inRows));
    expectBf16Near(inRows, wd, {4.0 * classes * kU * 1.5 / rows}, "smoothed cross_entropy_grad");
    Dev<uint16_t> twoRead(std::vector<uint16_t>(rows * stride, 0x7fc0));
    ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(), twoRead.get(),
                                    rows, classes, stride, bad.get(), 0,
                                    /*cacheRow=*/false, e),
              cudaSuccess);
    EXPECT_EQ(twoRead.host(), got) << "the row copy changed the result";
    expectFusedEqualsUnfused(rowsBits, dl.get(), dloss.get(), loss.host(), perRow.host(), got, rows,
                             classes, stride, bad.get(), e);
    EXPECT_EQ(bad.host()[0], LLONG_MAX);
  }
}

// ignore_index -100 on bf16 logits, both row layouts, without and with
// label smoothing: the CPU kernel's loss and gradient (over a normalizer
// of 6.5, a count from other ranks too) within the unmasked test's bounds,
// the ignored rows' gradient exactly 0 in every column, -100 not a bad
// label, the fused kernel bit for bit the two kernels (cached or not, in
// place), and a loss that is not the unmasked one.
TEST_F(CudaFastKernelsTest, CrossEntropyIgnoreIndex) {
  const int64_t rows = 9, classes = 1001;
  Bf16Vec logits(randomVec(rows * classes, 28, 3.f));
  std::vector<int32_t> labels(rows);
  for (int64_t r = 0; r < rows; ++r)
    labels[r] = (int32_t)((r * 389) % classes);
  labels[0] = labels[3] = labels[8] = -100;
  const float norm = 6.5f, dlh = 1.5f;
  Dev<float> dnorm(std::vector<float>{norm});
  fsdp::cuda::CeIgnore ig{dnorm.get(), -100};
  for (double e : {0.0, 0.1}) {
    SCOPED_TRACE("smoothing " + std::to_string(e));
    float wl = 0;
    ASSERT_EQ(
        cpu::crossEntropy(logits.wide.data(), labels.data(), &wl, rows, classes, 0, e, &norm, -100),
        -1);
    std::vector<float> wd(rows * classes);
    cpu::crossEntropyGrad(logits.wide.data(), labels.data(), &dlh, wd.data(), rows, classes, 0, e,
                          &norm, -100);
    for (int64_t stride : {classes, int64_t(1024)}) {
      SCOPED_TRACE("row stride " + std::to_string(stride));
      std::vector<uint16_t> rowsBits = padRows(logits.bits, rows, classes, stride);
      Dev<uint16_t> bl(rowsBits), bd(std::vector<uint16_t>(rows * stride, 0x7fc0));
      Dev<int32_t> dl(labels);
      Dev<float> loss(1), dloss(std::vector<float>{dlh});
      Dev<double> perRow(rows);
      Dev<long long> bad(std::vector<long long>{LLONG_MAX});
      ASSERT_EQ(nat::crossEntropy(FloatKind::BF16, bl.get(), dl.get(), loss.get(), perRow.get(),
                                  rows, classes, stride, bad.get(), 0, e, ig),
                cudaSuccess);
      expectF32Near(loss.host(), {wl}, 16, 4.0 * classes * kU, "ignore_index cross_entropy");
      ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(), bd.get(),
                                      rows, classes, stride, bad.get(), 0, true, e, ig),
                cudaSuccess);
      std::vector<uint16_t> got = bd.host(), inRows;
      for (int64_t r : {0, 3, 8})
        for (int64_t c = 0; c < stride; ++c)
          ASSERT_EQ(got[r * stride + c], 0) << "ignored row " << r << ", column " << c;
      ASSERT_NO_FATAL_FAILURE(classColumns(got, rows, classes, stride, inRows));
      expectBf16Near(inRows, wd, {4.0 * classes * kU * 1.5 / norm},
                     "ignore_index cross_entropy_grad");
      Dev<uint16_t> twoRead(std::vector<uint16_t>(rows * stride, 0x7fc0));
      ASSERT_EQ(nat::crossEntropyGrad(FloatKind::BF16, bl.get(), dl.get(), dloss.get(),
                                      twoRead.get(), rows, classes, stride, bad.get(), 0,
                                      /*cacheRow=*/false, e, ig),
                cudaSuccess);
      EXPECT_EQ(twoRead.host(), got) << "the row copy changed the result";
      expectFusedEqualsUnfused(rowsBits, dl.get(), dloss.get(), loss.host(), perRow.host(), got,
                               rows, classes, stride, bad.get(), e, ig);
      EXPECT_EQ(bad.host()[0], LLONG_MAX) << "-100 is not a bad label with ignore_index";
      // Unmasked, -100 is a bad label (row 0).
      ASSERT_EQ(nat::crossEntropy(FloatKind::BF16, bl.get(), dl.get(), loss.get(), perRow.get(),
                                  rows, classes, stride, bad.get(), 0, e),
                cudaSuccess);
      EXPECT_EQ(bad.host()[0], 0);
    }
  }
}

TEST_F(CudaFastKernelsTest, Bf16GemmWithinTheTensorCoreBound) {
  // Without staging, and with it (rows not a multiple of 8 elements are
  // multiplied as padded copies: CudaGemm.h): the same bound either way.
  for (bool staged : {false, true}) {
  gpu::Gemm gemm;
  ASSERT_TRUE(gemm.init(32 << 20, false).isOk());
  if (staged) {
    ASSERT_TRUE(gemm.reserveStaging(1 << 20).isOk());
  }
  for (auto [batch, m, n, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 64, 48, 80},
                                {3, 5, 7, 9},
                                {1, 256, 768, 768},
                                {2, 128, 64, 3072},
                                {1, 37, 61, 53}, // every row length odd: A, B and C staged
                                {1, 64, 50, 80}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        size_t need = gpu::Gemm::stagingNeed(FloatKind::BF16, batch, m, n, k, ta, tb);
        bool aligned = (ta ? m : k) % 8 == 0 && (tb ? k : n) % 8 == 0 && n % 8 == 0;
        EXPECT_EQ(need == 0, aligned || batch != 1) << m << " " << n << " " << k;
        EXPECT_EQ(gpu::Gemm::stagingNeed(FloatKind::F32, batch, m, n, k, ta, tb), 0u);
        ASSERT_LE(need, gemm.stagingBytes() + (staged ? 0 : need));
        Bf16Vec a(randomVec(batch * m * k, 9)), b(randomVec(batch * k * n, 10));
        std::vector<float> aa(a.wide.size()), ab(b.wide.size());
        for (size_t i = 0; i < aa.size(); ++i)
          aa[i] = std::fabs(a.wide[i]);
        for (size_t i = 0; i < ab.size(); ++i)
          ab[i] = std::fabs(b.wide[i]);
        Dev<uint16_t> da(a.bits), db(b.bits), dc(batch * m * n);
        ASSERT_TRUE(gemm.warm(FloatKind::BF16, batch, m, n, k, ta, tb).isOk());
        auto st = gemm.run(FloatKind::BF16, da.get(), db.get(), dc.get(), batch, m, n, k, ta,
                           tb, 0);
        ASSERT_TRUE(st.isOk()) << st.message();
        std::vector<float> want(batch * m * n), mag(batch * m * n);
        cpu::matmul(a.wide.data(), b.wide.data(), want.data(), batch, m, n, k, ta, tb);
        cpu::matmul(aa.data(), ab.data(), mag.data(), batch, m, n, k, ta, tb);
        // CudaGemm.h: tensor-core f32 accumulation within k 2^-22 sum|a b|,
        // the CPU's own f32 sum within k u sum|a b|.
        std::vector<double> delta(mag.size());
        for (size_t i = 0; i < mag.size(); ++i)
          delta[i] = (k * std::ldexp(1.0, -22) + k * kU) * mag[i];
        expectBf16Near(dc.host(), want, delta, staged ? "bf16 gemm, staged" : "bf16 gemm");
      }
  // Bad shapes are a Status, not a crash.
  EXPECT_FALSE(gemm.warm(FloatKind::BF16, (int64_t)1 << 40, 2, 2, 2, false, false).isOk());
  }
}

TEST_F(CudaFastKernelsTest, GemmAccumulatesIntoItsResult) {
  // matmul's accumulator (fsdp-chunk-loss's weight-gradient sum, fused by
  // fsdp-fuse-epilogues): C = acc + op(A) op(B), cuBLASLt's beta = 1, for a
  // bf16 product and an f32 product of bf16 operands; staged (odd row
  // lengths: acc is copied into the padded staging before the GEMM adds to
  // it) and not; in place (acc == C) and out of place (acc read where it
  // lies, left as it was, C poisoned before), acc aligned to 256 bytes or
  // only to its element (the plan must promise cuBLASLt no more than the
  // less aligned of C and acc). Against the CPU's sgemm with beta = 1.
  for (bool staged : {false, true}) {
    gpu::Gemm gemm;
    ASSERT_TRUE(gemm.init(32 << 20, false).isOk());
    if (staged) {
      ASSERT_TRUE(gemm.reserveStaging(1 << 20).isOk());
    }
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 48, 80},
                           {37, 61, 53}, // every row length odd: A, B and C staged
                           {256, 64, 32}})
      for (bool ta : {false, true}) {
        SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                     (ta ? " transpose_lhs" : "") + (staged ? " staged" : ""));
        Bf16Vec a(randomVec(m * k, 21)), b(randomVec(k * n, 22)), c0(randomVec(m * n, 23));
        std::vector<float> aa(a.wide.size()), ab(b.wide.size());
        for (size_t i = 0; i < aa.size(); ++i)
          aa[i] = std::fabs(a.wide[i]);
        for (size_t i = 0; i < ab.size(); ++i)
          ab[i] = std::fabs(b.wide[i]);
        std::vector<float> want = c0.wide, mag(m * n, 0.f);
        cpu::matmul(a.wide.data(), b.wide.data(), want.data(), 1, m, n, k, ta, false, true);
        cpu::matmul(aa.data(), ab.data(), mag.data(), 1, m, n, k, ta, false);
        // The product's bound (Bf16GemmWithinTheTensorCoreBound), then the
        // sum's rounding: u |c0 + ab| each side.
        std::vector<double> delta(mag.size());
        for (size_t i = 0; i < mag.size(); ++i)
          delta[i] = (k * std::ldexp(1.0, -22) + k * kU) * mag[i] +
                     2 * kU * (std::fabs(c0.wide[i]) + mag[i]);
        Dev<uint16_t> da(a.bits), db(b.bits), dc(c0.bits);
        ASSERT_TRUE(
            gemm.warm(FloatKind::BF16, 1, m, n, k, ta, false, da.get(), db.get(), dc.get()).isOk());
        auto st = gemm.run(FloatKind::BF16, da.get(), db.get(), dc.get(), 1, m, n, k, ta, false, 0,
                           dc.get());
        ASSERT_TRUE(st.isOk()) << st.message();
        expectBf16Near(dc.host(), want, delta, "bf16 c += a b");
        gpu::GemmType wide(FloatKind::BF16, FloatKind::F32);
        Dev<float> fc(c0.wide);
        st = gemm.run(wide, da.get(), db.get(), fc.get(), 1, m, n, k, ta, false, 0, fc.get());
        ASSERT_TRUE(st.isOk()) << st.message();
        expectF32Near(fc.host(), want, 0, delta, "f32 c += bf16 a b");
        // Out of place: acc at offset 0 (256-byte aligned) or 1 (its element's alignment).
        for (size_t off : {size_t(0), size_t(1)}) {
          SCOPED_TRACE("acc out of place at element " + std::to_string(off));
          std::vector<uint16_t> accBits(off, 0);
          accBits.insert(accBits.end(), c0.bits.begin(), c0.bits.end());
          std::vector<float> accWide(off, 0.f);
          accWide.insert(accWide.end(), c0.wide.begin(), c0.wide.end());
          Dev<uint16_t> acc(accBits), out(m * n);
          Dev<float> facc(accWide), fout(m * n);
          ASSERT_TRUE(gemm.warm(FloatKind::BF16, 1, m, n, k, ta, false, da.get(), db.get(),
                                out.get(), acc.get() + off)
                          .isOk());
          st = gemm.run(FloatKind::BF16, da.get(), db.get(), out.get(), 1, m, n, k, ta, false, 0,
                        acc.get() + off);
          ASSERT_TRUE(st.isOk()) << st.message();
          expectBf16Near(out.host(), want, delta, "bf16 out = acc + a b");
          EXPECT_EQ(acc.host(), accBits) << "the accumulator was written";
          st = gemm.run(wide, da.get(), db.get(), fout.get(), 1, m, n, k, ta, false, 0,
                        facc.get() + off);
          ASSERT_TRUE(st.isOk()) << st.message();
          expectF32Near(fout.host(), want, 0, delta, "f32 out = acc + bf16 a b");
          EXPECT_EQ(facc.host(), accWide) << "the accumulator was written";
        }
        // Without accumulate the same GEMM overwrites C.
        std::vector<float> product(m * n);
        cpu::matmul(a.wide.data(), b.wide.data(), product.data(), 1, m, n, k, ta, false);
        st = gemm.run(wide, da.get(), db.get(), fc.get(), 1, m, n, k, ta, false, 0);
        ASSERT_TRUE(st.isOk()) << st.message();
        expectF32Near(fc.host(), product, 0, delta, "f32 c = bf16 a b");
      }
    // An empty contraction adds nothing (C = acc; without acc, C = 0).
    const std::vector<float> four{1.f, -2.f, 3.f, 4.f};
    Dev<float> keep(four), copy(4);
    Dev<uint16_t> none(1);
    const gpu::GemmType wide(FloatKind::BF16, FloatKind::F32);
    ASSERT_TRUE(
        gemm.run(wide, none.get(), none.get(), keep.get(), 1, 2, 2, 0, false, false, 0, keep.get())
            .isOk());
    EXPECT_EQ(keep.host(), four);
    ASSERT_TRUE(
        gemm.run(wide, none.get(), none.get(), copy.get(), 1, 2, 2, 0, false, false, 0, keep.get())
            .isOk());
    EXPECT_EQ(copy.host(), four);
    ASSERT_TRUE(
        gemm.run(wide, none.get(), none.get(), copy.get(), 1, 2, 2, 0, false, false, 0).isOk());
    EXPECT_EQ(copy.host(), std::vector<float>(4, 0.f));
  }
}

TEST_F(CudaFastKernelsTest, TunedGemmsWithinTheTensorCoreBound) {
  // FSDP_CUDA_GEMM_TUNE: warm() times the heuristic's candidates on the
  // operands and keeps the fastest; any of them computes the same product
  // within the bound, staged or not, and a plain run of a shape warmed
  // before uses the tuned choice.
  gpu::Gemm gemm;
  ASSERT_TRUE(gemm.init(32 << 20, false).isOk());
  ASSERT_TRUE(gemm.reserveStaging(1 << 20).isOk());
  gemm.setTuning(true);
  int shapes = 0;
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 48, 80}, {37, 61, 53}}) {
    Bf16Vec a(randomVec(m * k, 19)), b(randomVec(n * k, 20));
    std::vector<float> aa(a.wide.size()), ab(b.wide.size());
    for (size_t i = 0; i < aa.size(); ++i)
      aa[i] = std::fabs(a.wide[i]);
    for (size_t i = 0; i < ab.size(); ++i)
      ab[i] = std::fabs(b.wide[i]);
    Dev<uint16_t> da(a.bits), db(b.bits), dc(m * n);
    ASSERT_TRUE(gemm.warm(FloatKind::BF16, 1, m, n, k, false, true, da.get(), db.get(),
                          dc.get())
                    .isOk());
    ++shapes;
    ASSERT_TRUE(
        gemm.run(FloatKind::BF16, da.get(), db.get(), dc.get(), 1, m, n, k, false, true, 0)
            .isOk());
    std::vector<float> want(m * n), mag(m * n);
    cpu::matmul(a.wide.data(), b.wide.data(), want.data(), 1, m, n, k, false, true);
    cpu::matmul(aa.data(), ab.data(), mag.data(), 1, m, n, k, false, true);
    std::vector<double> delta(mag.size());
    for (size_t i = 0; i < mag.size(); ++i)
      delta[i] = (k * std::ldexp(1.0, -22) + k * kU) * mag[i];
    expectBf16Near(dc.host(), want, delta, "tuned bf16 gemm");
  }
  // cuBLASLt offers several algorithms for these shapes: each was timed.
  EXPECT_EQ(gemm.tuned(), shapes);
  EXPECT_EQ(gemm.tunedEpilogue(), 0);
  EXPECT_LE(gemm.tunedChanged(), gemm.tuned());
}

// The fused kernels of fsdp-fuse-epilogues on bf16 storage against the
// unfused CPU ops in f32 on the widened inputs (the reference semantics:
// f32 math, each output rounded once).
TEST_F(CudaFastKernelsTest, Bf16FusedResidualLayerNormAgainstCpu) {
  const int64_t rows = 37, cols = 768;
  Bf16Vec a(randomVec(rows * cols, 31, 2.f)), b(randomVec(rows * cols, 32)),
      g(randomVec(cols, 33)), beta(randomVec(cols, 34)), dy(randomVec(rows * cols, 35)),
      acc(randomVec(rows * cols, 36));
  Dev<uint16_t> da(a.bits), db(b.bits), dg(g.bits), dbeta(beta.bits), dsum(rows * cols),
      dyy(rows * cols), ddy(dy.bits), dacc(acc.bits), ddx(rows * cols), ddg(cols), ddb(cols);
  Dev<float> scratch(nat::layerNormGradScratch(rows, cols));
  ASSERT_EQ(nat::residualLayerNorm(FloatKind::BF16, da.get(), db.get(), dg.get(), dbeta.get(),
                                   dsum.get(), dyy.get(), rows, cols, 1e-5, 0),
            cudaSuccess);
  // The sum: a + b in f32, rounded once: the CPU's bits exactly.
  std::vector<float> sum(rows * cols);
  for (size_t i = 0; i < sum.size(); ++i)
    sum[i] = a.wide[i] + b.wide[i];
  Bf16Vec sumB(sum);
  expectBitwise(dsum.host(), sumB.bits, "residual sum");
  // The layer norm of the rounded sum, as Bf16RowwiseSoftmaxLayerNormAgainstCpu.
  std::vector<float> wy(rows * cols), wdx(rows * cols), wdg(cols), wdb(cols);
  cpu::layerNorm(sumB.wide.data(), g.wide.data(), beta.wide.data(), wy.data(), rows, cols, 1e-5);
  double rowN = 4.0 * cols + 16, xhat = std::sqrt((double)cols);
  double mg = maxAbs(g.wide), mdy = maxAbs(dy.wide);
  expectBf16Near(dyy.host(), wy, {rowN * kU * 4 * (xhat * mg + maxAbs(beta.wide))},
                 "residual_layer_norm");
  // The backward accumulating into acc: dx + acc in f32, rounded once.
  ASSERT_EQ(nat::layerNormGrad(FloatKind::BF16, dsum.get(), dg.get(), ddy.get(), ddx.get(),
                               ddg.get(), ddb.get(), scratch.get(), rows, cols, 1e-5, 0,
                               dacc.get()),
            cudaSuccess);
  cpu::layerNormGrad(sumB.wide.data(), g.wide.data(), dy.wide.data(), wdx.data(), wdg.data(),
                     wdb.data(), rows, cols, 1e-5);
  for (size_t i = 0; i < wdx.size(); ++i)
    wdx[i] += acc.wide[i];
  expectBf16Near(ddx.host(), wdx, {rowN * kU * 16 * mdy * mg * xhat}, "layer_norm_grad_acc");
  expectBf16Near(ddb.host(), wdb, {4.0 * rows * kU * mdy * rows}, "layer_norm_grad_acc d_beta");
}

TEST_F(CudaFastKernelsTest, LayerNormRegisterKernelsAreTheStreamingOnesBitwise) {
  // The register kernels (rows of <= 256, <= 768 and <= 1024 columns) add the same
  // terms in the same order as the streaming ones: the same bits, for the
  // forward, the residual form and the backward with and without acc, at
  // widths around each limit (and one past the last, where both paths are
  // the streaming kernel), and with more rows than the backward's 1024
  // partials (dg / db partials summed over several rows). The values
  // against the CPU: the tests above.
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {37, 7}, {37, 256}, {37, 257}, {37, 768}, {37, 769}, {37, 1000}, {37, 1024}, {37, 1025},
           {4099, 72}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols));
    Bf16Vec x(randomVec(rows * cols, 51, 2.f)), b(randomVec(rows * cols, 52)),
        g(randomVec(cols, 53)), beta(randomVec(cols, 54)), dy(randomVec(rows * cols, 55)),
        acc(randomVec(rows * cols, 56));
    std::vector<uint16_t> shifted(x.bits.size() + 1, 0);
    std::copy(x.bits.begin(), x.bits.end(), shifted.begin() + 1);
    Dev<uint16_t> dxa(x.bits), dxs(shifted), db(b.bits), dg(g.bits), dbeta(beta.bits),
        ddy(dy.bits), dacc(acc.bits);
    std::vector<uint16_t> got[3][7];
    for (int k = 0; k < 3; ++k) {
      auto impl = k == 1 ? nat::LayerNormImpl::Streaming : nat::LayerNormImpl::Auto;
      uint16_t *dxp = k == 2 ? dxs.get() + 1 : dxa.get();
      Dev<uint16_t> y(rows * cols), sum(rows * cols), y2(rows * cols), gx(rows * cols),
          gg(cols), gb(cols), gx2(rows * cols);
      Dev<float> scratch(nat::layerNormGradScratch(rows, cols));
      ASSERT_EQ(nat::layerNorm(FloatKind::BF16, dxp, dg.get(), dbeta.get(), y.get(), rows,
                               cols, 1e-5, 0, impl),
                cudaSuccess);
      ASSERT_EQ(nat::residualLayerNorm(FloatKind::BF16, dxp, db.get(), dg.get(),
                                       dbeta.get(), sum.get(), y2.get(), rows, cols, 1e-5, 0,
                                       impl),
                cudaSuccess);
      ASSERT_EQ(nat::layerNormGrad(FloatKind::BF16, dxp, dg.get(), ddy.get(), gx.get(),
                                   gg.get(), gb.get(), scratch.get(), rows, cols, 1e-5, 0,
                                   nullptr, impl),
                cudaSuccess);
      got[k][4] = gg.host();
      got[k][5] = gb.host();
      ASSERT_EQ(nat::layerNormGrad(FloatKind::BF16, dxp, dg.get(), ddy.get(), gx2.get(),
                                   gg.get(), gb.get(), scratch.get(), rows, cols, 1e-5, 0,
                                   dacc.get(), impl),
                cudaSuccess);
      got[k][0] = y.host();
      got[k][1] = sum.host();
      got[k][2] = y2.host();
      got[k][3] = gx.host();
      got[k][6] = gx2.host();
    }
    const char *what[7] = {"layer_norm", "residual sum", "residual_layer_norm", "dx",
                           "d_gamma", "d_beta", "dx + acc"};
    for (int i = 0; i < 7; ++i) {
      expectBitwise(got[0][i], got[1][i], what[i]);
      expectBitwise(got[0][i], got[2][i], what[i]);
    }
  }
}

TEST_F(CudaFastKernelsTest, Bf16WeightGradientWithItsBiasGradient) {
  // matmul_bias_grad: dw = dy^T x and db = the column sums of dy, one
  // cuBLASLt GEMM with the BGRADB epilogue (our A is its B).
  // Tuned (FSDP_CUDA_GEMM_TUNE=1: every candidate timed on the real
  // operands and bias-gradient pointer) or not, the same bound.
  for (bool tune : {false, true}) {
    SCOPED_TRACE(tune ? "tuned" : "the heuristic's first");
    gpu::Gemm gemm;
    ASSERT_TRUE(gemm.init(32 << 20, false).isOk());
    gemm.setTuning(tune);
    const int64_t M = 37, N = 40, K = 48; // dy [M, N], x [M, K], dw [N, K]
    Bf16Vec y(randomVec(M * N, 51, 2.f)), x(randomVec(M * K, 52));
    Dev<uint16_t> ddy(y.bits), dx(x.bits), ddw(std::vector<uint16_t>(N * K, 0x7fc0)),
        ddb(std::vector<uint16_t>(N, 0x7fc0));
    gpu::EpilogueArgs e{gpu::Epilogue::BGradA, nullptr, nullptr, ddb.get()};
    ASSERT_TRUE(gemm.warmEpilogue(FloatKind::BF16, N, K, M, true, false, ddy.get(), dx.get(),
                                  ddw.get(), e));
    ASSERT_TRUE(
        gemm.run(FloatKind::BF16, ddy.get(), dx.get(), ddw.get(), N, K, M, true, false, e, 0)
            .isOk());
    std::vector<float> want(N * K), mag(N * K), wantDb(N, 0.f);
    std::vector<double> magDb(N, 0.0);
    cpu::matmul(y.wide.data(), x.wide.data(), want.data(), 1, N, K, M, true, false);
    std::vector<float> ay(y.wide), ax(x.wide);
    for (float &v : ay)
      v = std::fabs(v);
    for (float &v : ax)
      v = std::fabs(v);
    cpu::matmul(ay.data(), ax.data(), mag.data(), 1, N, K, M, true, false);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) {
        wantDb[c] += y.wide[r * N + c];
        magDb[c] += std::fabs(y.wide[r * N + c]);
      }
    // The GEMM within M 2^-22 sum|a b| (tensor cores) + M u (the CPU's sum);
    // the bias gradient: M exact bf16 terms summed in f32 in any order,
    // twice (GPU and CPU), M u sum|dy| each.
    std::vector<double> dW(N * K), dB(N);
    for (int64_t i = 0; i < N * K; ++i)
      dW[i] = (M * std::ldexp(1.0, -22) + (M + 1) * kU) * mag[i];
    for (int64_t c = 0; c < N; ++c)
      dB[c] = 2 * M * kU * magDb[c];
    expectBf16Near(ddw.host(), want, dW, "BGRADB weight gradient");
    expectBf16Near(ddb.host(), wantDb, dB, "BGRADB bias gradient");
    // f32 results of the bf16 operands (GemmType{BF16, F32}: the weight and
    // bias gradients of a mixed-precision plan, fsdp-fuse-epilogues'
    // widened products): the same sums, unrounded: no bf16 ulp.
    Dev<float> fdw(std::vector<float>(N * K, NAN)), fdb(std::vector<float>(N, NAN)),
        fmm(std::vector<float>(N * K, NAN));
    gpu::EpilogueArgs ef{gpu::Epilogue::BGradA, nullptr, nullptr, fdb.get()};
    const gpu::GemmType toF32{FloatKind::BF16, FloatKind::F32};
    ASSERT_TRUE(gemm.warmEpilogue(toF32, N, K, M, true, false, ddy.get(), dx.get(), fdw.get(), ef));
    ASSERT_TRUE(
        gemm.run(toF32, ddy.get(), dx.get(), fdw.get(), N, K, M, true, false, ef, 0).isOk());
    ASSERT_TRUE(gemm.warm(toF32, 1, N, K, M, true, false, ddy.get(), dx.get(), fmm.get()).isOk());
    ASSERT_TRUE(gemm.run(toF32, ddy.get(), dx.get(), fmm.get(), 1, N, K, M, true, false, 0).isOk());
    std::vector<float> gw = fdw.host(), gb = fdb.host(), gm = fmm.host();
    for (int64_t i = 0; i < N * K; ++i) {
      EXPECT_LE(std::fabs((double)gw[i] - want[i]), dW[i]) << "f32 BGRADB weight gradient " << i;
      EXPECT_LE(std::fabs((double)gm[i] - want[i]), dW[i]) << "f32 product " << i;
    }
    for (int64_t c = 0; c < N; ++c)
      EXPECT_LE(std::fabs((double)gb[c] - wantDb[c]), dB[c]) << "f32 BGRADB bias gradient " << c;
    // No bias-gradient pointer: refused (the device would run the GEMM and
    // sum_to's kernel).
    gpu::EpilogueArgs none{gpu::Epilogue::BGradA, nullptr, nullptr, nullptr};
    EXPECT_FALSE(gemm.warmEpilogue(FloatKind::BF16, N, K, M, true, false, ddy.get(), dx.get(),
                                   ddw.get(), none));

    // Tuning timed every shape that warmed (3; the refused ones are not).
    if (tune) {
      EXPECT_EQ(gemm.tuned(), 3);
      EXPECT_EQ(gemm.tunedEpilogue(), 2);
    }
  }
}

TEST_F(CudaFastKernelsTest, Bf16GemmEpiloguesAgainstCpu) {
  // Tuned (FSDP_CUDA_GEMM_TUNE=1: every candidate timed on the real
  // operands, bias and aux) or not, the same bounds.
  for (bool tune : {false, true}) {
    SCOPED_TRACE(tune ? "tuned" : "the heuristic's first");
    gpu::Gemm gemm;
    ASSERT_TRUE(gemm.init(32 << 20, false).isOk());
    gemm.setTuning(tune);
    // n = 64: cuBLASLt's epilogues; n = 60 (not a multiple of 8): refused
    // with keep-aux epilogues (the device then runs GEMM + kernels).
    const int64_t m = 37, n = 64, k = 48, n2 = 40;
    Bf16Vec x(randomVec(m * k, 41)), w(randomVec(n * k, 42)), bias(randomVec(n, 43)),
        dz(randomVec(m * n2, 44)), w2(randomVec(n2 * n, 45));
    Dev<uint16_t> dx(x.bits), dw(w.bits), dbias(bias.bits), dy(m * n), dpre(m * n), ddz(dz.bits),
        dw2(w2.bits), dh(m * n), ddb(n);
    auto abs = [](std::vector<float> v) {
      for (float &e : v)
        e = std::fabs(e);
      return v;
    };
    gpu::EpilogueArgs fwd{gpu::Epilogue::GeluAuxBias, dbias.get(), dpre.get(), nullptr};
    ASSERT_TRUE(gemm.warmEpilogue(FloatKind::BF16, m, n, k, false, true, dx.get(), dw.get(),
                                  dy.get(), fwd));
    ASSERT_TRUE(
        gemm.run(FloatKind::BF16, dx.get(), dw.get(), dy.get(), m, n, k, false, true, fwd, 0)
            .isOk());
    std::vector<float> pre(m * n), mag(m * n), gl(m * n);
    cpu::matmul(x.wide.data(), w.wide.data(), pre.data(), 1, m, n, k, false, true);
    auto ax = abs(x.wide), aw = abs(w.wide);
    cpu::matmul(ax.data(), aw.data(), mag.data(), 1, m, n, k, false, true);
    cpu::biasAdd(pre.data(), bias.wide.data(), pre.data(), m, n);
    cpu::gelu(pre.data(), gl.data(), m * n);
    // The GEMM within k 2^-22 sum|a b| (tensor cores) + k u (the CPU's sum),
    // the bias add one f32 rounding, GELU's slope at most 1.13 and its own
    // evaluation (a tanh: a few f32 ulps, 8 u |pre| allowed).
    std::vector<double> dPre(m * n), dGelu(m * n);
    for (size_t i = 0; i < dPre.size(); ++i) {
      dPre[i] = (k * std::ldexp(1.0, -22) + (k + 1) * kU) * (mag[i] + std::fabs(bias.wide[i % n]));
      dGelu[i] = 1.13 * dPre[i] + 8 * kU * std::fabs(pre[i]);
    }
    expectBf16Near(dpre.host(), pre, dPre, "GELU_AUX_BIAS pre-activation");
    expectBf16Near(dy.host(), gl, dGelu, "GELU_AUX_BIAS output");
    // Backward: dh = (dz w2) * gelu'(pre) on the stored (bf16) pre, and the
    // bias gradient, its sum over the m rows.
    std::vector<float> preB = widen(dpre.host());
    gpu::EpilogueArgs bwd{gpu::Epilogue::DGelu, nullptr, dpre.get(), ddb.get()};
    ASSERT_TRUE(gemm.warmEpilogue(FloatKind::BF16, m, n, n2, false, false, ddz.get(), dw2.get(),
                                  dh.get(), bwd));
    ASSERT_TRUE(
        gemm.run(FloatKind::BF16, ddz.get(), dw2.get(), dh.get(), m, n, n2, false, false, bwd, 0)
            .isOk());
    std::vector<float> d(m * n), dmag(m * n), want(m * n), wantDb(n, 0.f);
    cpu::matmul(dz.wide.data(), w2.wide.data(), d.data(), 1, m, n, n2, false, false);
    auto adz = abs(dz.wide), aw2 = abs(w2.wide);
    cpu::matmul(adz.data(), aw2.data(), dmag.data(), 1, m, n, n2, false, false);
    cpu::geluGrad(preB.data(), d.data(), want.data(), m * n);
    // The epilogue's own error (first H100 run, 2026-11-26: up to 1.5 bf16
    // half-ulps): the product rounded to bf16 before the multiply (one more
    // half-ulp, kUb |want|), and its tanh, about PTX tanh.approx.f32's
    // accuracy (|dt| <= 2^-10; DeviceTest's FusedMatmulsMatchTheUnfusedOps
    // derives what that moves gelu' by).
    const double dt = std::ldexp(1.0, -10);
    std::vector<double> dDh(m * n), dDb(n, 0.0);
    for (size_t i = 0; i < dDh.size(); ++i) {
      double x = preB[i];
      dDh[i] =
          1.13 * (n2 * std::ldexp(1.0, -22) + n2 * kU) * dmag[i] + 8 * kU * std::fabs(want[i]) +
          kUb * std::fabs(want[i]) +
          dt * (0.5 + std::fabs(x) * 0.7978845608 * (1 + 3 * 0.044715 * x * x)) * std::fabs(d[i]);
      wantDb[i % n] += want[i];
      // Each row's term as the GPU may sum it: its f32 value or its bf16
      // rounding (one bf16 ulp), in another order (m u).
      dDb[i % n] += dDh[i] + kUb * std::fabs(want[i]) + m * kU * std::fabs(want[i]);
    }
    expectBf16Near(dh.host(), want, dDh, "DGELU output");
    expectBf16Near(ddb.host(), wantDb, dDb, "DGELU_BGRAD bias gradient");
    // A keep-aux epilogue needs n % 8 == 0: refused for n = 60, not run.
    EXPECT_FALSE(gemm.warmEpilogue(FloatKind::BF16, m, 60, k, false, true, dx.get(), dw.get(),
                                   dy.get(), fwd));
    // DGELU with k = 1 is unsupported by cuBLASLt: refused by name, and the
    // warm-up says so (the device then runs the unfused kernels).
    EXPECT_FALSE(gemm.warmEpilogue(FloatKind::BF16, m, n, 1, false, false, ddz.get(), dw2.get(),
                                   dh.get(), bwd));
    auto st =
        gemm.run(FloatKind::BF16, ddz.get(), dw2.get(), dh.get(), m, n, 1, false, false, bwd, 0);
    EXPECT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("k = 1"), std::string::npos) << st.message();

    // Tuning timed every shape that warmed (2; the refused ones are not).
    if (tune) {
      EXPECT_EQ(gemm.tuned(), 2);
      EXPECT_EQ(gemm.tunedEpilogue(), 2);
    }
  }
}

/// sum_to over leading dims (bias gradients) runs as a two-pass column sum
/// (CudaCommon.cuh) in another order than the CPU: within rows u sum|x| of
/// the exact sum (f32 accumulation; Higham's gamma_rows), plus the bf16
/// output's rounding; and the same bits on a second run.
TEST_F(CudaFastKernelsTest, ColumnSumAgainstCpu) {
  struct Case {
    gpu::Shape in, out;
  };
  // One pass (few rows), two passes (3000 rows, columns not a multiple of
  // the 32-column tile), [B, T, C] -> [1, 1, C], and one column; an even
  // column count in one pass and in two (bf16: two columns a thread).
  for (const Case &c : {Case{{2, 7}, {7}}, Case{{3000, 70}, {70}}, Case{{5, 600, 33}, {1, 1, 33}},
                        Case{{1000, 1}, {1}}, Case{{200, 66}, {66}},
                        Case{{3, 700, 130}, {130}}}) {
    int64_t cols = c.out.back(), rows = 1;
    for (int64_t d : c.in)
      rows *= d;
    rows /= cols;
    auto x = randomVec(rows * cols, 51);
    Bf16Vec xb(x);
    std::vector<double> exactF(cols, 0.0), exactB(cols, 0.0), mag(cols, 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        exactF[j] += x[r * cols + j];
        exactB[j] += xb.wide[r * cols + j];
        mag[j] += std::fabs(x[r * cols + j]);
      }
    int64_t need = nat::sumToScratch(c.in, c.out);
    EXPECT_EQ(need > 0, rows > 256) << "two passes from 256 rows on";
    Dev<float> scratch(std::max<int64_t>(need, 1)), dx(x), f1(cols), f2(cols);
    Dev<uint16_t> dxb(xb.bits), b1(cols);
    Dev<float> wide(cols); // bf16 in, the f32 sum unrounded (outF32)
    ASSERT_EQ(nat::sumTo(FloatKind::F32, dx.get(), c.in, f1.get(), c.out, scratch.get(), 0),
              cudaSuccess);
    ASSERT_EQ(nat::sumTo(FloatKind::BF16, dxb.get(), c.in, wide.get(), c.out, scratch.get(), 0,
                         /*outF32=*/true),
              cudaSuccess);
    ASSERT_EQ(nat::sumTo(FloatKind::F32, dx.get(), c.in, f2.get(), c.out, scratch.get(), 0),
              cudaSuccess);
    ASSERT_EQ(nat::sumTo(FloatKind::BF16, dxb.get(), c.in, b1.get(), c.out, scratch.get(), 0),
              cudaSuccess);
    auto got = f1.host(), again = f2.host(), gotW = wide.host();
    auto gotB = b1.host();
    for (int64_t j = 0; j < cols; ++j) {
      double tol = rows * kU * mag[j];
      EXPECT_LE(std::fabs(got[j] - exactF[j]), tol) << "f32 column " << j << " rows " << rows;
      EXPECT_LE(std::fabs(gotW[j] - exactB[j]), tol)
          << "bf16 column summed into f32, column " << j << " rows " << rows;
      EXPECT_LE(std::fabs(cpu::bf16ToFloat(gotB[j]) - exactB[j]),
                tol + kUb * (std::fabs(exactB[j]) + tol))
          << "bf16 column " << j << " rows " << rows;
    }
    expectBitwise(got, again, "column sum, second run");
    // bf16 one element off 4-byte alignment: one column a thread, where the
    // aligned sum took two (even column counts); the same sums, the same
    // bits.
    std::vector<uint16_t> shifted(xb.bits.size() + 1, 0);
    std::copy(xb.bits.begin(), xb.bits.end(), shifted.begin() + 1);
    Dev<uint16_t> dsh(shifted);
    Dev<float> wide1(cols);
    ASSERT_EQ(nat::sumTo(FloatKind::BF16, dsh.get() + 1, c.in, wide1.get(), c.out,
                         scratch.get(), 0, /*outF32=*/true),
              cudaSuccess);
    expectBitwise(wide1.host(), gotW, "bf16 column sum, one or two columns a thread");
  }
  // Two passes without scratch: refused, not run out of bounds.
  Dev<float> x(3000 * 70), y(70);
  EXPECT_EQ(nat::sumTo(FloatKind::F32, x.get(), {3000, 70}, y.get(), {70}, nullptr, 0),
            cudaErrorInvalidValue);
}

void flashCase(FloatKind t, int64_t B, int64_t T, int64_t heads, int64_t kv, int64_t D,
               bool causal, uint32_t seed,
               gpu::flash::Impl impl = gpu::flash::Impl::CudaCores) {
  using gpu::flash::Impl;
  bool tc = gpu::flash::tensorCoreImpl(impl) ||
            (impl == Impl::Auto && t != FloatKind::F32 && D % 16 == 0);
  SCOPED_TRACE(::testing::Message() << "T=" << T << " heads=" << heads << " kv=" << kv
                                    << " D=" << D << " causal=" << causal
                                    << (t == FloatKind::BF16  ? " bf16"
                                        : t == FloatKind::F16 ? " f16"
                                                              : " f32")
                                    << (impl == Impl::Wmma ? " WMMA"
                                        : impl == Impl::Mma       ? " mma.sync"
                                        : impl == Impl::MmaTight  ? " mma.sync tight"
                                        : impl == Impl::MmaTight2 ? " mma.sync tight2"
                                        : impl == Impl::MmaTight3 ? " mma.sync tight3"
                                        : impl == Impl::MmaFused  ? " mma.sync fused"
                                        : impl == Impl::MmaFused64 ? " mma.sync fused64"
                                        : impl == Impl::Wgmma      ? " wgmma"
                                        : impl == Impl::WgmmaFused ? " wgmma fused"
                                        : impl == Impl::WgmmaFused64 ? " wgmma fused64"
                                        : tc                      ? " auto (mma.sync)"
                                                                  : " CUDA cores"));
  int64_t C = heads * D, KC = kv * D;
  auto q0 = randomVec(B * T * C, seed), k0 = randomVec(B * T * KC, seed + 1),
       v0 = randomVec(B * T * KC, seed + 2), dy0 = randomVec(B * T * C, seed + 3);
  // bf: 16-bit storage (bf16, or f16 when half), rounding unit u16.
  bool bf = t != FloatKind::F32, half = t == FloatKind::F16;
  const double u16 = half ? 1.0 / (1 << 11) : kUb;
  Bf16Vec q(q0, half), k(k0, half), v(v0, half), dy(dy0, half);
  // The CPU reference on exactly the values the GPU reads.
  const auto &qw = bf ? q.wide : q0, &kw = bf ? k.wide : k0, &vw = bf ? v.wide : v0,
             &dyw = bf ? dy.wide : dy0;
  std::vector<float> wy(B * T * C), wlse(B * heads * T), wq(B * T * C), wk(B * T * KC),
      wv(B * T * KC);
  cpu::attention(qw.data(), kw.data(), vw.data(), wy.data(), wlse.data(), B, T, C, heads,
                 causal, kv);
  cpu::attentionGrad(qw.data(), kw.data(), vw.data(), wlse.data(), dyw.data(), wq.data(),
                     wk.data(), wv.data(), B, T, C, heads, causal, kv);
  ASSERT_TRUE(gpu::flash::check(B, T, C, heads, kv).isOk());
  size_t es = bf ? 2 : 4;
  auto upload = [&](const Bf16Vec &b, const std::vector<float> &f) {
    void *p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, es * f.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, bf ? (const void *)b.bits.data() : (const void *)f.data(),
                         es * f.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    return p;
  };
  auto alloc = [&](size_t n) {
    void *p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, es * n), cudaSuccess);
    return p;
  };
  auto fetch = [&](void *p, size_t n) {
    std::vector<float> f(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (bf) {
      std::vector<uint16_t> h(n);
      EXPECT_EQ(cudaMemcpy(h.data(), p, 2 * n, cudaMemcpyDeviceToHost), cudaSuccess);
      return std::make_pair(widen(h, half), h);
    }
    EXPECT_EQ(cudaMemcpy(f.data(), p, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
    return std::make_pair(f, std::vector<uint16_t>());
  };
  void *dq = upload(q, q0), *dk = upload(k, k0), *dv = upload(v, v0), *ddy = upload(dy, dy0);
  void *y = alloc(B * T * C), *gq = alloc(B * T * C), *gk = alloc(B * T * KC),
       *gv = alloc(B * T * KC);
  Dev<float> scratch(gpu::flash::backwardScratch(t, B, T, C, heads, kv, causal, impl)),
      lse(B * heads * T);
  ASSERT_EQ(gpu::flash::forward(t, dq, dk, dv, y, lse.get(), B, T, C, heads, causal, kv, 0,
                                impl),
            cudaSuccess);
  // Bounds as CudaKernelsTest's attention test: scores (D terms), softmax
  // and weighted sums (T terms each), the backward's sums over the group's
  // heads * T, each n u times the terms' magnitude.
  double n = D + 2.0 * T + (heads / kv) * T;
  double mag = maxAbs(qw) * maxAbs(kw) * maxAbs(vw) * maxAbs(dyw) + maxAbs(vw);
  double gmag = mag * D * std::sqrt((double)T);
  auto check = [&](void *p, const std::vector<float> &want, double delta, const char *what) {
    auto [f, bits] = fetch(p, want.size());
    if (bf)
      expectBf16Near(bits, want, {delta}, what, half);
    else
      expectF32Near(f, want, 0, delta, what);
  };
  // The tensor-core kernels round each probability to bf16 before it
  // multiplies V (relative error <= kUb): y = sum_j p_j v_j / l moves by at
  // most kUb max|v|; the backward rounds dS (dq: scale sum_j |dS_tj| |k_j|,
  // sum_j |dS_tj| <= max|dP| + |delta| <= 2 D |dy| |v|; dk: the same summed
  // over the T x group query rows) and P (dv: sum_t p_tj |dy_t| <= T group
  // |dy|).
  double scale = 1 / std::sqrt((double)D), group = (double)(heads / kv);
  double dsmag = 2 * D * maxAbs(dyw) * maxAbs(vw);
  double tcY = tc ? u16 * maxAbs(vw) : 0;
  double tcDq = tc ? u16 * scale * dsmag * maxAbs(kw) : 0;
  double tcDk = tc ? u16 * scale * dsmag * maxAbs(qw) * T * group : 0;
  double tcDv = tc ? u16 * T * group * maxAbs(dyw) : 0;
  check(y, wy, 16 * n * kU * mag + tcY, "flash attention");
  // The log-sum-exp stays f32: the scores' error (D terms of |q||k|), the
  // sum's (T terms) and the log's, relative to the row's magnitude.
  double lmag = maxAbs(qw) * maxAbs(kw) * std::sqrt((double)D) + std::log((double)T) + 1;
  expectF32Near(lse.host(), wlse, 0, 16 * n * kU * lmag, "flash lse");
  // The backward reads the y it stored (rounded to bf16 / f16) for each
  // row's delta = dy . y, where the CPU reference forms delta from P and
  // dP: |delta error| <= D |dy| |y| u16, which moves dq by scale |k| times it
  // and dk by scale |q| times it per query row and head of the group.
  double ddelta = bf ? D * maxAbs(dyw) * maxAbs(wy) * u16 : 0;
  ASSERT_EQ(gpu::flash::backward(t, dq, dk, dv, y, lse.get(), ddy, gq, gk, gv, scratch.get(),
                                 B, T, C, heads, causal, kv, 0, impl),
            cudaSuccess);
  check(gq, wq, 16 * n * kU * gmag + scale * ddelta * maxAbs(kw) + tcDq, "flash d_q");
  check(gk, wk, 16 * n * kU * gmag + scale * ddelta * maxAbs(qw) * T * group + tcDk,
        "flash d_k");
  check(gv, wv, 16 * n * kU * gmag + tcDv, "flash d_v");
  // Deterministic: a second backward gives the same bits.
  auto first = fetch(gk, wk.size()).first;
  ASSERT_EQ(gpu::flash::backward(t, dq, dk, dv, y, lse.get(), ddy, gq, gk, gv, scratch.get(),
                                 B, T, C, heads, causal, kv, 0, impl),
            cudaSuccess);
  expectBitwise(fetch(gk, wk.size()).first, first, "flash d_k run twice");
  for (void *p : {dq, dk, dv, ddy, y, gq, gk, gv})
    cudaFree(p);
}

TEST_F(CudaFastKernelsTest, FlashAttentionAgainstCpuF32AndBf16) {
  for (FloatKind t : {FloatKind::F32, FloatKind::BF16})
    for (bool causal : {true, false}) {
      flashCase(t, 2, 9, 4, 4, 8, causal, 15);      // smaller than a tile
      flashCase(t, 1, 100, 4, 2, 64, causal, 31);   // tails, grouped-query
      flashCase(t, 1, 130, 2, 1, 128, causal, 47);  // the largest head dim, MQA
      flashCase(t, 2, 256, 12, 12, 64, causal, 59); // GPT-2's head shape
      // Run-time head dims: 30 (not whole 16-byte chunks: the tiles' zero
      // columns), 36 (an even chunk count: the padded stride).
      flashCase(t, 1, 70, 3, 3, 30, causal, 53);
      flashCase(t, 1, 66, 2, 1, 36, causal, 57);
    }
}

TEST_F(CudaFastKernelsTest, TensorCoreFlashAttentionAgainstCpu) {
  // The WMMA kernels (bf16, D a multiple of 16), the same shapes as the
  // CUDA-core kernels' test where they apply, plus the tail of a long
  // causal sequence; and Impl::Auto (the mma.sync kernels for bf16) once.
  using gpu::flash::Impl;
  for (bool causal : {true, false}) {
    flashCase(FloatKind::BF16, 2, 9, 4, 4, 16, causal, 15, Impl::Wmma);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, causal, 31, Impl::Wmma);
    flashCase(FloatKind::BF16, 1, 130, 2, 1, 128, causal, 47, Impl::Wmma);
    flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, causal, 59, Impl::Wmma);
    flashCase(FloatKind::BF16, 1, 200, 3, 3, 32, causal, 61, Impl::Auto);
  }
  flashCase(FloatKind::BF16, 1, 1100, 2, 2, 64, true, 67, Impl::Wmma);
}

TEST_F(CudaFastKernelsTest, RegisterTileFlashAttentionAgainstCpu) {
  // The mma.sync kernels (bf16, D a multiple of 16; what Impl::Auto runs
  // for bf16): every fragment of theirs is read and written by lane, so a
  // wrong fragment layout gives wrong rows or columns here. Shapes: a tile
  // smaller than one n-tile pair, tails and grouped-query, D = 128 (the
  // compile-time 128 kernels), GPT-2's heads, a run-time D (48: three k
  // steps, three n-tile pairs), the long causal tail.
  using gpu::flash::Impl;
  for (bool causal : {true, false}) {
    flashCase(FloatKind::BF16, 2, 9, 4, 4, 16, causal, 15, Impl::Mma);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, causal, 31, Impl::Mma);
    flashCase(FloatKind::BF16, 1, 130, 2, 1, 128, causal, 47, Impl::Mma);
    flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, causal, 59, Impl::Mma);
    flashCase(FloatKind::BF16, 1, 77, 2, 2, 48, causal, 63, Impl::Mma);
  }
  flashCase(FloatKind::BF16, 1, 1100, 2, 2, 64, true, 67, Impl::Mma);
  // MmaTight (and MmaTight2): two m-tiles a warp in the forward (and dq),
  // launch bounds, at D = 64 (their only different instances): GPT-2's
  // heads, the long causal tail, grouped-query with a partial tile.
  // MmaFused (the one-pass backward, dq from per-key-block partials): the
  // Mma shapes (D = 128 and run-time D: 64-row key blocks).
  for (bool causal : {true, false}) {
    flashCase(FloatKind::BF16, 2, 9, 4, 4, 16, causal, 15, Impl::MmaFused);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, causal, 31, Impl::MmaFused);
    flashCase(FloatKind::BF16, 1, 130, 2, 1, 128, causal, 47, Impl::MmaFused);
    flashCase(FloatKind::BF16, 1, 77, 2, 2, 48, causal, 63, Impl::MmaFused);
  }
  for (Impl impl :
       {Impl::MmaTight, Impl::MmaTight2, Impl::MmaTight3, Impl::MmaFused, Impl::MmaFused64}) {
    flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, true, 59, impl);
    flashCase(FloatKind::BF16, 1, 1100, 2, 2, 64, true, 67, impl);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, false, 31, impl);
  }
  // f16 storage: the f16 mma.sync and the f16 packing of P and dS (bounds
  // with f16's unit roundoff), and WMMA's f16 instance beside it.
  for (Impl impl : {Impl::Mma, Impl::MmaFused, Impl::Wmma}) {
    flashCase(FloatKind::F16, 1, 100, 4, 2, 64, true, 73, impl);
    flashCase(FloatKind::F16, 1, 70, 2, 2, 32, false, 79, impl);
  }
}

TEST_F(CudaFastKernelsTest, WgmmaProductsMatchTheCpu) {
  // The warpgroup product under Impl::Wgmma, one instruction at a time, in
  // every operand layout the PTX ISA names for 16-bit types (no swizzle,
  // 128-, 64- and 32-byte swizzles; B K-major and N-major; A K-major or
  // M-major in shared memory, or in registers), N = 32, 64 and 128, bf16
  // and f16 (N = 32 N-major 128-byte swizzled: the upper half of a 64-wide
  // tile, WgmmaFused's dq). A misread layout (descriptor fields, swizzle,
  // fragment order) moves whole products to other rows, columns or k:
  // errors of the size of the values, where the bound below is a few f32
  // units in the last place.
  for (FloatKind t : {FloatKind::BF16, FloatKind::F16})
    for (int n : {32, 64, 128})
      for (int swizzle = 0; swizzle < 4; ++swizzle)
        for (int aMode = 0; aMode < 3; ++aMode)
          for (bool bN : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << (t == FloatKind::BF16 ? "bf16" : "f16") << " n=" << n
                         << " swizzle=" << swizzle
                         << (aMode == 2   ? " A in registers"
                             : aMode == 1 ? " A M-major in smem"
                                          : " A K-major in smem")
                         << (bN ? " B N-major" : " B K-major"));
            bool half = t == FloatKind::F16;
            uint32_t seed = 1000 + n + 10 * swizzle + 3 * aMode + bN;
            Bf16Vec a(randomVec(64 * 16, seed), half), b(randomVec(16 * n, seed + 7), half);
            Dev<uint16_t> da(64 * 16), db(16 * n);
            Dev<float> dd(64 * n);
            ASSERT_EQ(cudaMemcpy(da.get(), a.bits.data(), 2 * a.bits.size(),
                                 cudaMemcpyHostToDevice),
                      cudaSuccess);
            ASSERT_EQ(cudaMemcpy(db.get(), b.bits.data(), 2 * b.bits.size(),
                                 cudaMemcpyHostToDevice),
                      cudaSuccess);
            ASSERT_EQ(gpu::flash::wgmmaProduct(t, da.get(), db.get(), dd.get(), n, swizzle,
                                               aMode, bN, nullptr),
                      cudaSuccess);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<float> d(64 * n);
            ASSERT_EQ(cudaMemcpy(d.data(), dd.get(), 4 * d.size(), cudaMemcpyDeviceToHost),
                      cudaSuccess);
            // Products of 16-bit values are exact in f32; the 16 additions
            // each round (to nearest, or toward zero where the tensor core
            // truncates: under 2 units each), so |d - exact| <= 32 u32
            // sum_k |a b| (u32 = 2^-24), with margin for the bound's
            // second-order terms.
            int bad = 0;
            for (int r = 0; r < 64; ++r)
              for (int c = 0; c < n; ++c) {
                double exact = 0, mag = 0;
                for (int k = 0; k < 16; ++k) {
                  double p = (double)a.wide[r * 16 + k] * b.wide[k * n + c];
                  exact += p;
                  mag += std::fabs(p);
                }
                double err = std::fabs(d[r * n + c] - exact);
                if (err > 33.0 * std::ldexp(1.0, -24) * mag && bad++ < 3)
                  ADD_FAILURE() << "d[" << r << "][" << c << "] = " << d[r * n + c]
                                << ", exact " << exact;
              }
            EXPECT_EQ(bad, 0);
          }
  // Refused, not run: f32, an N the kernel has no instance of, a swizzle
  // mode outside the descriptor's two bits, an A source it does not have.
  Dev<float> any(64 * 128);
  EXPECT_EQ(gpu::flash::wgmmaProduct(FloatKind::F32, any.get(), any.get(), any.get(), 64, 0, 0,
                                     false, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::wgmmaProduct(FloatKind::BF16, any.get(), any.get(), any.get(), 96, 0, 0,
                                     false, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::wgmmaProduct(FloatKind::BF16, any.get(), any.get(), any.get(), 64, 4, 0,
                                     false, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::wgmmaProduct(FloatKind::BF16, any.get(), any.get(), any.get(), 64, 0, 3,
                                     false, nullptr),
            cudaErrorInvalidValue);
}

TEST_F(CudaFastKernelsTest, WgmmaFlashAttentionAgainstCpu) {
  // The wgmma forward (D = 64 and 128; Wgmma's backward is MmaTight3's,
  // WgmmaFused's MmaFused's): GPT-2's heads (several key tiles of 128 and the diagonal
  // inside one), grouped-query with a partial query block and a partial
  // key tile, a sequence shorter than one tile, the long causal tail
  // (1100 = 8 tiles of 128 + 76), f16 storage; D = 128 below.
  // (FlashAttentionReadsPackedQkv: the packed layout's strides.)
  using gpu::flash::Impl;
  for (bool causal : {true, false}) {
    flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, causal, 59, Impl::Wgmma);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, causal, 31, Impl::Wgmma);
    flashCase(FloatKind::BF16, 2, 9, 2, 2, 64, causal, 15, Impl::Wgmma);
  }
  flashCase(FloatKind::BF16, 1, 1100, 2, 2, 64, true, 67, Impl::Wgmma);
  flashCase(FloatKind::F16, 1, 200, 4, 2, 64, true, 73, Impl::Wgmma);
  // D = 128 (key tiles of 64, rows of two column blocks): several tiles
  // and a partial one, grouped-query heads, f16; the wgmma backward there
  // (WgmmaFused and WgmmaFused64: one warpgroup per key block of 64, dq
  // in two halves).
  for (Impl impl : {Impl::Wgmma, Impl::WgmmaFused})
    flashCase(FloatKind::BF16, 1, 130, 2, 1, 128, true, 47, impl);
  flashCase(FloatKind::BF16, 2, 200, 4, 4, 128, false, 53, Impl::Wgmma);
  flashCase(FloatKind::F16, 1, 100, 4, 2, 128, true, 61, Impl::WgmmaSerial);
  flashCase(FloatKind::BF16, 2, 200, 4, 4, 128, false, 53, Impl::WgmmaFused);
  flashCase(FloatKind::F16, 1, 100, 4, 2, 128, true, 61, Impl::WgmmaFused64);
  // WgmmaFused's backward on wgmma (D = 64): the same shapes; and
  // WgmmaFused64's (one warpgroup per key block of 64) on three.
  for (bool causal : {true, false}) {
    flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, causal, 59, Impl::WgmmaFused);
    flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, causal, 31, Impl::WgmmaFused);
    flashCase(FloatKind::BF16, 2, 9, 2, 2, 64, causal, 15, Impl::WgmmaFused);
  }
  flashCase(FloatKind::BF16, 1, 1100, 2, 2, 64, true, 67, Impl::WgmmaFused);
  flashCase(FloatKind::F16, 1, 200, 4, 2, 64, true, 73, Impl::WgmmaFused);
  flashCase(FloatKind::BF16, 1, 100, 4, 2, 64, true, 31, Impl::WgmmaFused64);
  flashCase(FloatKind::F16, 1, 200, 4, 2, 64, false, 73, Impl::WgmmaFused64);
  flashCase(FloatKind::BF16, 1, 130, 2, 1, 128, true, 47, Impl::WgmmaFused64);
  // WgmmaSerial (the forward without the overlap) on two.
  flashCase(FloatKind::BF16, 2, 256, 12, 12, 64, true, 59, Impl::WgmmaSerial);
  flashCase(FloatKind::F16, 1, 200, 4, 2, 64, false, 73, Impl::WgmmaSerial);
}

TEST_F(CudaFastKernelsTest, WgmmaPipelinedForwardGivesTheSerialBits) {
  // Wgmma's forward overlaps tile it's softmax with tile it - 1's P V and
  // rescales O after it; WgmmaSerial's waits for each product. The same
  // products and roundings in the same order: y and lse must be equal bit
  // for bit (a wrong alpha, a P from the wrong tile or a V buffer copied
  // over while its product still reads it changes them). One key tile,
  // two, the diagonal inside a tile, a partial last tile, grouped-query
  // heads, the long causal tail, f16; D = 128 (key tiles of 64).
  // (WgmmaFlashAttentionAgainstCpu holds WgmmaSerial against the CPU.)
  using gpu::flash::Impl;
  struct Shape {
    int64_t B, T, heads, kv;
    bool causal, half;
    int64_t D = 64;
  };
  for (const Shape &sh : {Shape{2, 256, 12, 12, true, false}, Shape{2, 256, 12, 12, false, false},
                          Shape{1, 300, 4, 2, false, false}, Shape{1, 100, 4, 2, true, false},
                          Shape{2, 9, 2, 2, false, false}, Shape{1, 1100, 2, 2, true, false},
                          Shape{1, 200, 4, 2, true, true}, Shape{1, 300, 4, 2, true, false, 128},
                          Shape{2, 70, 2, 2, false, true, 128}}) {
    SCOPED_TRACE("B=" + std::to_string(sh.B) + " T=" + std::to_string(sh.T) + " heads=" +
                 std::to_string(sh.heads) + "/" + std::to_string(sh.kv) +
                 (sh.causal ? " causal" : "") + (sh.half ? " f16" : "") +
                 " D=" + std::to_string(sh.D));
    const int64_t D = sh.D, C = sh.heads * D, n = sh.B * sh.T * C, nkv = sh.B * sh.T * sh.kv * D,
                  rows = sh.B * sh.heads * sh.T;
    FloatKind t = sh.half ? FloatKind::F16 : FloatKind::BF16;
    Bf16Vec q(randomVec(n, 191, 2.f), sh.half), k(randomVec(nkv, 192, 2.f), sh.half),
        v(randomVec(nkv, 193), sh.half);
    Dev<uint16_t> dq(q.bits), dk(k.bits), dv(v.bits);
    auto run = [&](Impl impl, std::vector<uint16_t> &y, std::vector<float> &lse) {
      Dev<uint16_t> dy(n);
      Dev<float> dl(rows);
      ASSERT_EQ(gpu::flash::forward(t, dq.get(), dk.get(), dv.get(), dy.get(), dl.get(), sh.B,
                                    sh.T, C, sh.heads, sh.causal, sh.kv, 0, impl),
                cudaSuccess);
      y = dy.host();
      lse = dl.host();
    };
    std::vector<uint16_t> yp, ys;
    std::vector<float> lp, ls;
    run(Impl::Wgmma, yp, lp);
    run(Impl::WgmmaSerial, ys, ls);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
      if (yp[i] != ys[i] && bad++ < 5)
        ADD_FAILURE() << "y[" << i << "]: pipelined bits " << yp[i] << ", serial " << ys[i];
    for (int64_t i = 0; i < rows; ++i)
      if (std::memcmp(&lp[i], &ls[i], sizeof(float)) && bad++ < 5)
        ADD_FAILURE() << "lse[" << i << "]: pipelined " << lp[i] << ", serial " << ls[i];
    EXPECT_EQ(bad, 0);
  }
}

TEST_F(CudaFastKernelsTest, WgmmaPipelinedBackwardGivesTheSerialBits) {
  // WgmmaFused's backward at D = 64 computes query tile it + 1's P^T while
  // tile it's dV, dK and dq run, with P^T and dS^T through shared memory
  // (two buffers each) and Q / dY in three; WgmmaFusedSerial's waits for
  // each step's products (P^T and dS^T from registers). The same products,
  // roundings and order: dq, dk and dv must be equal bit for bit (a P^T
  // from the wrong step, a buffer overwritten while a product still reads
  // it, a dq stored before its wait change them). Both block shapes (two
  // warpgroups a key block of 128, and WgmmaFused64's one a block of 64),
  // from the same y and lse; one query tile (the pipeline's last step
  // only), several, the diagonal inside a tile, a partial last tile,
  // grouped-query heads (steps across heads), the long causal tail, f16.
  using gpu::flash::Impl;
  struct Shape {
    int64_t B, T, heads, kv;
    bool causal, half;
  };
  for (const Shape &sh : {Shape{2, 256, 12, 12, true, false}, Shape{1, 256, 4, 4, false, false},
                          Shape{1, 300, 4, 2, false, false}, Shape{1, 100, 4, 2, true, false},
                          Shape{2, 9, 2, 2, false, false}, Shape{1, 1100, 2, 2, true, false},
                          Shape{1, 200, 4, 2, true, true}}) {
    SCOPED_TRACE("B=" + std::to_string(sh.B) + " T=" + std::to_string(sh.T) + " heads=" +
                 std::to_string(sh.heads) + "/" + std::to_string(sh.kv) +
                 (sh.causal ? " causal" : "") + (sh.half ? " f16" : ""));
    const int64_t D = 64, C = sh.heads * D, n = sh.B * sh.T * C, nkv = sh.B * sh.T * sh.kv * D,
                  rows = sh.B * sh.heads * sh.T;
    FloatKind t = sh.half ? FloatKind::F16 : FloatKind::BF16;
    Bf16Vec q(randomVec(n, 201, 2.f), sh.half), k(randomVec(nkv, 202, 2.f), sh.half),
        v(randomVec(nkv, 203), sh.half), dy(randomVec(n, 204), sh.half);
    Dev<uint16_t> dq(q.bits), dk(k.bits), dv(v.bits), ddy(dy.bits), y(n);
    Dev<float> lse(rows);
    ASSERT_EQ(gpu::flash::forward(t, dq.get(), dk.get(), dv.get(), y.get(), lse.get(), sh.B,
                                  sh.T, C, sh.heads, sh.causal, sh.kv, 0, Impl::WgmmaFused),
              cudaSuccess);
    auto run = [&](Impl impl) {
      Dev<uint16_t> gq(n), gk(nkv), gv(nkv);
      Dev<float> scratch(gpu::flash::backwardScratch(t, sh.B, sh.T, C, sh.heads, sh.kv,
                                                     sh.causal, impl));
      EXPECT_EQ(gpu::flash::backward(t, dq.get(), dk.get(), dv.get(), y.get(), lse.get(),
                                     ddy.get(), gq.get(), gk.get(), gv.get(), scratch.get(),
                                     sh.B, sh.T, C, sh.heads, sh.causal, sh.kv, 0, impl),
                cudaSuccess);
      return std::vector<std::vector<uint16_t>>{gq.host(), gk.host(), gv.host()};
    };
    for (auto [pipe, serial] : {std::pair{Impl::WgmmaFused, Impl::WgmmaFusedSerial},
                                std::pair{Impl::WgmmaFused64, Impl::WgmmaFused64Serial}}) {
      SCOPED_TRACE(pipe == Impl::WgmmaFused ? "wgmma fused" : "wgmma fused64");
      auto a = run(pipe), b = run(serial);
      const char *what[3] = {"dq", "dk", "dv"};
      for (int o = 0; o < 3; ++o) {
        expectBitwise(a[o], b[o], what[o]);
        // Not all zero: the products really ran.
        EXPECT_NE(std::count(a[o].begin(), a[o].end(), uint16_t(0)), (long)a[o].size());
      }
    }
  }
}

/// Per (b, h, t) row of attention's backward, scale * sum_j |dS_tj| |k_j|
/// (dS = P (dP - delta), max over k's dimensions), in double from the
/// values the GPU reads: what rounding dS and summing it in another order
/// can move dq by.
std::vector<double> dqTermSums(const std::vector<float> &q, const std::vector<float> &k,
                               const std::vector<float> &v, const std::vector<float> &dy,
                               int64_t B, int64_t T, int64_t heads, int64_t kv, int64_t D,
                               bool causal) {
  const int64_t C = heads * D, KC = kv * D;
  const double scale = 1 / std::sqrt((double)D);
  std::vector<double> out(B * heads * T), p(T), dp(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      int64_t kh = h / (heads / kv);
      for (int64_t t = 0; t < T; ++t) {
        const float *qt = &q[(b * T + t) * C + h * D], *dyt = &dy[(b * T + t) * C + h * D];
        int64_t n = causal ? t + 1 : T;
        double mx = -1e300, sum = 0, delta = 0, kmax = 0, acc = 0;
        for (int64_t j = 0; j < n; ++j) {
          const float *kj = &k[(b * T + j) * KC + kh * D], *vj = &v[(b * T + j) * KC + kh * D];
          double s = 0, d = 0;
          for (int64_t e = 0; e < D; ++e)
            s += (double)qt[e] * kj[e], d += (double)dyt[e] * vj[e];
          p[j] = s * scale;
          dp[j] = d;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j < n; ++j)
          sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j < n; ++j)
          delta += (p[j] /= sum) * dp[j];
        for (int64_t j = 0; j < n; ++j) {
          kmax = 0;
          for (int64_t e = 0; e < D; ++e)
            kmax = std::max(kmax, (double)std::fabs(k[(b * T + j) * KC + kh * D + e]));
          acc += std::fabs(p[j] * (dp[j] - delta)) * kmax;
        }
        out[(b * heads + h) * T + t] = scale * acc;
      }
    }
  return out;
}

TEST_F(CudaFastKernelsTest, RegisterTileVariantsGiveTheMmaBits) {
  // MmaTight (32 query rows a warp in the forward), MmaTight2 (also in
  // dq, each key tile in two 32-key halves) and MmaTight3 (also 32 key rows
  // a warp in dk / dv, query tiles in halves) run every row's products,
  // exponentials and sums in Mma's order: the same bits for y, lse, dq,
  // dk and dv. (The CPU bounds above are loose enough to miss a wrong key
  // half in dq; this is not.) MmaFused runs MmaTight3's forward and dk / dv
  // (the same bits) and sums dq in another order: per key block of 128,
  // then the blocks (MmaFused64: blocks of 64, MmaTight's dk / dv). Their
  // dq is held to what that allows against Mma's:
  // each side's f32 sum of at most T + 16 terms (error <= (T + 16) u32 S
  // each, S = scale sum_j |dS_tj| |k_j|, dqTermSums), a dS that could round
  // the other way (one bf16 step, <= 2 u16 |dS|, if the scores' products
  // differ in their last bit: <= 2 u16 S), and the two final roundings to
  // bf16 (<= u16 (|a| + |b|)).
  // Shapes: GPT-2's heads, a grouped-query partial tile, the long causal
  // tail past one 128-row block (nine key blocks), a D = 128 one (the
  // fused kernel's 64-row key blocks).
  using gpu::flash::Impl;
  struct Shape {
    int64_t B, T, heads, kv, D;
    bool causal;
  };
  for (Shape sh : {Shape{2, 256, 12, 12, 64, true}, Shape{1, 100, 4, 2, 64, false},
                   Shape{1, 1100, 2, 2, 64, true}, Shape{1, 200, 2, 1, 128, true}}) {
    SCOPED_TRACE("T " + std::to_string(sh.T) + ", heads " + std::to_string(sh.heads) + ", D " +
                 std::to_string(sh.D));
    const int64_t D = sh.D, C = sh.heads * D, KC = sh.kv * D, n = sh.B * sh.T * C,
                  nkv = sh.B * sh.T * KC, rows = sh.B * sh.heads * sh.T;
    Bf16Vec q(randomVec(n, 81)), k(randomVec(nkv, 82)), v(randomVec(nkv, 83)), dy(randomVec(n, 84));
    Dev<uint16_t> dq(q.bits), dk(k.bits), dv(v.bits), ddy(dy.bits);
    constexpr int kImpls = 6, kFirstFused = 4;
    std::vector<uint16_t> got[kImpls][4];
    std::vector<float> lses[kImpls];
    const Impl impls[kImpls] = {Impl::Mma,       Impl::MmaTight, Impl::MmaTight2,
                                Impl::MmaTight3, Impl::MmaFused, Impl::MmaFused64};
    for (int i = 0; i < kImpls; ++i) {
      Dev<uint16_t> y(n), gq(n), gk(nkv), gv(nkv);
      Dev<float> lse(rows), scratch(gpu::flash::backwardScratch(
                                FloatKind::BF16, sh.B, sh.T, C, sh.heads, sh.kv, sh.causal,
                                impls[i]));
      ASSERT_EQ(gpu::flash::forward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), y.get(),
                                    lse.get(), sh.B, sh.T, C, sh.heads, sh.causal, sh.kv, 0,
                                    impls[i]),
                cudaSuccess);
      ASSERT_EQ(gpu::flash::backward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), y.get(),
                                     lse.get(), ddy.get(), gq.get(), gk.get(), gv.get(),
                                     scratch.get(), sh.B, sh.T, C, sh.heads, sh.causal, sh.kv, 0,
                                     impls[i]),
                cudaSuccess);
      got[i][0] = y.host();
      got[i][1] = gq.host();
      got[i][2] = gk.host();
      got[i][3] = gv.host();
      lses[i] = lse.host();
    }
    const char *what[4] = {"y", "dq", "dk", "dv"};
    // The tight variants exist at D = 64 only (elsewhere they are Mma).
    for (int j = 1; j < kImpls; ++j) {
      SCOPED_TRACE(j == 4 ? "fused" : j == 5 ? "fused64" : "tight " + std::to_string(j));
      for (int o = 0; o < 4; ++o)
        if (j < kFirstFused || o != 1)
          expectBitwise(got[j][o], got[0][o], what[o]);
      expectBitwise(lses[j], lses[0], "lse");
    }
    std::vector<double> S =
        dqTermSums(q.wide, k.wide, v.wide, dy.wide, sh.B, sh.T, sh.heads, sh.kv, D, sh.causal);
    for (int j = kFirstFused; j < kImpls; ++j) {
      SCOPED_TRACE(j == 4 ? "fused dq" : "fused64 dq");
      const std::vector<float> a = widen(got[j][1]), b = widen(got[0][1]);
      int64_t bad = 0;
      double worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        int64_t bt = i / C, h = (i % C) / D, bb = bt / sh.T, t = bt % sh.T;
        double s = S[(bb * sh.heads + h) * sh.T + t];
        double tol = 1.01 * ((2 * kUb + 2 * (sh.T + 16) * kU) * s +
                             kUb * (std::fabs(a[i]) + std::fabs(b[i]))) +
                     1e-30;
        double err = std::fabs((double)a[i] - b[i]);
        worst = std::max(worst, err / tol);
        if (err > tol && bad++ < 5)
          ADD_FAILURE() << "fused dq[" << i << "] = " << a[i] << ", Mma's " << b[i] << ", allowed "
                        << tol;
      }
      EXPECT_EQ(bad, 0) << "fused dq elements outside the bound (worst " << worst << " of it)";
      std::printf("%s dq: worst difference %.3f of its bound\n", j == 4 ? "fused" : "fused64",
                  worst);
    }
  }
}

/// What rounding and summation order can move each attention output by,
/// in double from the values the GPU reads (P = softmax(q k^T scale),
/// dS = P (dP - delta)): per (b, h, t) row Y = sum_j P_tj vmax_j and
/// DQ = scale sum_j M_tj kmax_j; per (b, kv head, j) key row DK = scale
/// sum_(h, t) M_tj qmax_t and DV = sum_(h, t) P_tj dymax_t (over the
/// group's query heads); max over each vector's dimensions. M_tj = |dS_tj| +
/// 2 (D + 16) u32 P_tj (sum_d |dy_td v_jd| + |delta_t|): |dS| and what its
/// f32 inputs' other summation orders (dP over D, delta) may move it by.
/// sigma: the largest |score| bound scale sum_d |q_td k_jd|.
struct AttentionTermSums {
  std::vector<double> Y, DQ, DK, DV;
  double sigma = 0;
};
AttentionTermSums attentionTermSums(const std::vector<float> &q, const std::vector<float> &k,
                                    const std::vector<float> &v, const std::vector<float> &dy,
                                    int64_t B, int64_t T, int64_t heads, int64_t kv, int64_t D,
                                    bool causal) {
  const int64_t C = heads * D, KC = kv * D;
  const double scale = 1 / std::sqrt((double)D), u32 = std::ldexp(1.0, -24);
  AttentionTermSums r;
  r.Y.assign(B * heads * T, 0);
  r.DQ.assign(B * heads * T, 0);
  r.DK.assign(B * kv * T, 0);
  r.DV.assign(B * kv * T, 0);
  auto vmax = [&](const float *x) {
    double m = 0;
    for (int64_t e = 0; e < D; ++e)
      m = std::max(m, (double)std::fabs(x[e]));
    return m;
  };
  std::vector<double> p(T), dp(T), dpAbs(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      int64_t kh = h / (heads / kv);
      for (int64_t t = 0; t < T; ++t) {
        const float *qt = &q[(b * T + t) * C + h * D], *dyt = &dy[(b * T + t) * C + h * D];
        int64_t n = causal ? t + 1 : T;
        double mx = -1e300, sum = 0, delta = 0;
        for (int64_t j = 0; j < n; ++j) {
          const float *kj = &k[(b * T + j) * KC + kh * D], *vj = &v[(b * T + j) * KC + kh * D];
          double s = 0, sa = 0, d = 0, da = 0;
          for (int64_t e = 0; e < D; ++e) {
            s += (double)qt[e] * kj[e], sa += std::fabs((double)qt[e] * kj[e]);
            d += (double)dyt[e] * vj[e], da += std::fabs((double)dyt[e] * vj[e]);
          }
          p[j] = s * scale;
          r.sigma = std::max(r.sigma, sa * scale);
          dp[j] = d;
          dpAbs[j] = da;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j < n; ++j)
          sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j < n; ++j)
          delta += (p[j] /= sum) * dp[j];
        double qm = vmax(qt), dym = vmax(dyt);
        int64_t row = (b * heads + h) * T + t;
        for (int64_t j = 0; j < n; ++j) {
          const float *kj = &k[(b * T + j) * KC + kh * D], *vj = &v[(b * T + j) * KC + kh * D];
          double m = std::fabs(p[j] * (dp[j] - delta)) +
                     2 * (D + 16) * u32 * p[j] * (dpAbs[j] + std::fabs(delta));
          int64_t key = (b * kv + kh) * T + j;
          r.Y[row] += p[j] * vmax(vj);
          r.DQ[row] += scale * m * vmax(kj);
          r.DK[key] += scale * m * qm;
          r.DV[key] += p[j] * dym;
        }
      }
    }
  return r;
}

TEST_F(CudaFastKernelsTest, WgmmaAgreesWithMma) {
  // The CPU bounds of WgmmaFlashAttentionAgainstCpu are worst cases loose
  // enough to miss a wrong column block of dq; this holds the wgmma
  // kernels to what their other instructions and orders allow against
  // MmaFused's (the mma.sync kernels with dq partials in the same key
  // blocks of 128). Forward: Wgmma's y and lse against MmaFused's (P
  // rounded at other running maxima: each side's rounding, 2 u16 of Y;
  // the scores' and sums' f32 orders; the final roundings). Backward:
  // WgmmaFused's dq, dk, dv from MmaFused's own y and lse (the same
  // inputs), against MmaFused's: each side's f32 sums of N terms (N = T
  // for dq, T x group for dk / dv), a dS or P that may round the other
  // way (2 u16), the scores' orders (sigma), the final roundings. At D =
  // 128 MmaFused's and MmaFused64's partials are both key blocks of 64.
  using gpu::flash::Impl;
  struct Shape {
    int64_t B, T, heads, kv;
    bool causal;
    int64_t D = 64;
  };
  const double kU32 = std::ldexp(1.0, -24);
  for (Shape sh : {Shape{2, 256, 12, 12, true}, Shape{1, 100, 4, 2, false},
                   Shape{1, 1100, 2, 2, true}, Shape{1, 9, 2, 2, false},
                   Shape{2, 200, 4, 4, true, 128}, Shape{1, 130, 4, 2, false, 128}}) {
    SCOPED_TRACE("T " + std::to_string(sh.T) + ", heads " + std::to_string(sh.heads) +
                 ", kv " + std::to_string(sh.kv) + (sh.causal ? ", causal" : "") + ", D " +
                 std::to_string(sh.D));
    const int64_t D = sh.D, C = sh.heads * D, KC = sh.kv * D, n = sh.B * sh.T * C,
                  nkv = sh.B * sh.T * KC, rows = sh.B * sh.heads * sh.T,
                  group = sh.heads / sh.kv;
    Bf16Vec q(randomVec(n, 181)), k(randomVec(nkv, 182)), v(randomVec(nkv, 183)),
        dy(randomVec(n, 184));
    Dev<uint16_t> dq(q.bits), dk(k.bits), dv(v.bits), ddy(dy.bits);
    auto scratchFor = [&](Impl impl) {
      return gpu::flash::backwardScratch(FloatKind::BF16, sh.B, sh.T, C, sh.heads, sh.kv,
                                         sh.causal, impl);
    };
    // MmaFused's forward and Wgmma's; the backwards of MmaFused and
    // WgmmaFused (MmaFused64 and WgmmaFused64) from MmaFused's y and lse.
    Dev<uint16_t> y(n), yw(n);
    Dev<float> lse(rows), lsew(rows);
    auto fwd = [&](Impl impl, uint16_t *out, float *l) {
      ASSERT_EQ(gpu::flash::forward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), out, l, sh.B,
                                    sh.T, C, sh.heads, sh.causal, sh.kv, 0, impl),
                cudaSuccess);
    };
    auto bwd = [&](Impl impl, uint16_t *a, uint16_t *b, uint16_t *c, float *sc) {
      ASSERT_EQ(gpu::flash::backward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), y.get(),
                                     lse.get(), ddy.get(), a, b, c, sc, sh.B, sh.T, C, sh.heads,
                                     sh.causal, sh.kv, 0, impl),
                cudaSuccess);
    };
    fwd(Impl::MmaFused, y.get(), lse.get());
    fwd(Impl::Wgmma, yw.get(), lsew.get());
    AttentionTermSums S =
        attentionTermSums(q.wide, k.wide, v.wide, dy.wide, sh.B, sh.T, sh.heads, sh.kv, D,
                          sh.causal);
    // Compares a (wgmma) with b (mma.sync) element by element: rows of
    // `width` elements, the row's (or key row's) term sum from `sums` at
    // index sumOf(element), N terms summed.
    auto compare = [&](const char *what, const std::vector<float> &a,
                       const std::vector<float> &b, const std::vector<double> &sums,
                       const std::function<int64_t(int64_t)> &sumOf, double N, double u16) {
      double rel = 2 * kUb + 2 * (N + D + 32) * kU32 * (1 + S.sigma);
      int64_t bad = 0;
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        double tol = 1.01 * (rel * sums[sumOf(i)] + u16 * (std::fabs(a[i]) + std::fabs(b[i]))) +
                     1e-30;
        double err = std::fabs((double)a[i] - b[i]);
        worst = std::max(worst, err / tol);
        if (!(err <= tol) && bad++ < 5)
          ADD_FAILURE() << what << "[" << i << "] = " << a[i] << ", mma.sync's " << b[i]
                        << ", allowed " << tol;
      }
      EXPECT_EQ(bad, 0) << what << " elements outside the bound (worst " << worst << " of it)";
      std::printf("wgmma %s: worst difference %.3f of its bound\n", what, worst);
    };
    // [B, T, C] element i -> row (b, h, t); [B, T, KC] element i -> (b, kv head, j).
    auto qRow = [&](int64_t i) {
      int64_t bt = i / C, h = (i % C) / D;
      return ((bt / sh.T) * sh.heads + h) * sh.T + bt % sh.T;
    };
    auto kRow = [&](int64_t i) {
      int64_t bt = i / KC, h = (i % KC) / D;
      return ((bt / sh.T) * sh.kv + h) * sh.T + bt % sh.T;
    };
    compare("y", widen(yw.host()), widen(y.host()), S.Y, qRow, (double)sh.T, kUb);
    for (auto [wgImpl, ref] : {std::pair{Impl::WgmmaFused, Impl::MmaFused},
                               std::pair{Impl::WgmmaFused64, Impl::MmaFused64}}) {
      SCOPED_TRACE(wgImpl == Impl::WgmmaFused ? "wgmma fused" : "wgmma fused64");
      Dev<uint16_t> gq(n), gk(nkv), gv(nkv), wq(n), wk(nkv), wv(nkv);
      Dev<float> scratch(scratchFor(ref)), scratchW(scratchFor(wgImpl));
      bwd(ref, gq.get(), gk.get(), gv.get(), scratch.get());
      bwd(wgImpl, wq.get(), wk.get(), wv.get(), scratchW.get());
      compare("dq", widen(wq.host()), widen(gq.host()), S.DQ, qRow, (double)sh.T, kUb);
      compare("dk", widen(wk.host()), widen(gk.host()), S.DK, kRow, (double)(sh.T * group),
              kUb);
      compare("dv", widen(wv.host()), widen(gv.host()), S.DV, kRow, (double)(sh.T * group),
              kUb);
    }
    // lse (f32, natural log): the scores' and the sum's orders, relative
    // to the row's terms (1 + sigma), and one f32 rounding each side.
    std::vector<float> la = lsew.host(), lb = lse.host();
    for (int64_t i = 0; i < rows; ++i) {
      double tol = 1.01 * (2 * (sh.T + D + 32) * kU32 * (1 + S.sigma) +
                           2 * kU32 * (std::fabs(la[i]) + std::fabs(lb[i])));
      if (!(std::fabs((double)la[i] - lb[i]) <= tol)) {
        ADD_FAILURE() << "lse[" << i << "] = " << la[i] << ", mma.sync's " << lb[i];
        break;
      }
    }
  }
}

TEST_F(CudaFastKernelsTest, FusedBackwardChunksAndFallsBack) {
  // MmaFused's dq partials grow as T^2, so the (b, kv head) pairs run in
  // chunks that fit the scratch cap: any chunking gives the same bits (the
  // same sums in the same order), the last chunk shorter (6 pairs by 4);
  // one pair over the cap runs MmaTight3's kernels (their dq bits) with
  // MmaTight3's scratch. Grouped-query (2 query heads a pair), a partial
  // tile: T = 300 is 5 query tiles and 3 key blocks of 128, 576 partial
  // rows a head: 2 x 576 x 64 floats a pair.
  using gpu::flash::Impl;
  const int64_t B = 3, T = 300, heads = 4, kv = 2, D = 64, C = heads * D, KC = kv * D,
                n = B * T * C, nkv = B * T * KC, rows = B * heads * T;
  const int64_t pairBytes = 4 * 2 * 576 * D, delta = (rows + 3) / 4 * 4;
  Bf16Vec q(randomVec(n, 85)), k(randomVec(nkv, 86)), v(randomVec(nkv, 87)),
      dy(randomVec(n, 88));
  Dev<uint16_t> dq(q.bits), dk(k.bits), dv(v.bits), ddy(dy.bits);
  auto run = [&](Impl impl, int64_t cap, int64_t wantScratch) {
    int64_t was = gpu::flash::setFusedScratchCap(cap);
    int64_t floats =
        gpu::flash::backwardScratch(FloatKind::BF16, B, T, C, heads, kv, true, impl);
    EXPECT_EQ(floats, wantScratch) << "scratch floats at a cap of " << cap;
    Dev<uint16_t> y(n), gq(n), gk(nkv), gv(nkv);
    Dev<float> lse(rows), scratch(floats);
    EXPECT_EQ(gpu::flash::forward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), y.get(),
                                  lse.get(), B, T, C, heads, true, kv, 0, impl),
              cudaSuccess);
    EXPECT_EQ(gpu::flash::backward(FloatKind::BF16, dq.get(), dk.get(), dv.get(), y.get(),
                                   lse.get(), ddy.get(), gq.get(), gk.get(), gv.get(),
                                   scratch.get(), B, T, C, heads, true, kv, 0, impl),
              cudaSuccess);
    gpu::flash::setFusedScratchCap(was);
    return std::vector<std::vector<uint16_t>>{gq.host(), gk.host(), gv.host()};
  };
  const int64_t big = int64_t(1) << 40;
  // WgmmaFused (the wgmma one-pass backward: the same partials, chunks and
  // fallback; over the cap Wgmma's backward, MmaTight3's kernels, after
  // the same wgmma forward).
  for (auto [fused, unfused] : {std::pair{Impl::MmaFused, Impl::MmaTight3},
                                std::pair{Impl::WgmmaFused, Impl::Wgmma}}) {
    SCOPED_TRACE(fused == Impl::MmaFused ? "mma.sync fused" : "wgmma fused");
    auto whole = run(fused, big, delta + 6 * pairBytes / 4);
    auto fours = run(fused, 4 * pairBytes + 100, delta + 4 * pairBytes / 4);
    auto ones = run(fused, pairBytes, delta + pairBytes / 4);
    auto over = run(fused, pairBytes - 1, rows);
    auto tight = run(unfused, big, rows);
    const char *what[3] = {"dq", "dk", "dv"};
    for (int o = 0; o < 3; ++o) {
      expectBitwise(fours[o], whole[o], (std::string(what[o]) + ", chunks of 4 pairs").c_str());
      expectBitwise(ones[o], whole[o], (std::string(what[o]) + ", one pair a chunk").c_str());
      expectBitwise(over[o], tight[o], (std::string(what[o]) + ", over the cap").c_str());
    }
    // The fused dq is not MmaTight3's bits (another order): the fallback
    // really ran the other kernels.
    EXPECT_NE(whole[0], tight[0]);
  }
}

TEST_F(CudaFastKernelsTest, FlashAttentionImplNames) {
  using gpu::flash::Impl;
  Impl impl = Impl::CudaCores;
  const std::pair<const char *, Impl> names[] = {
      {"mma", Impl::Mma},           {"wmma", Impl::Wmma},
      {"mma-tight", Impl::MmaTight}, {"mma-tight2", Impl::MmaTight2},
      {"mma-tight3", Impl::MmaTight3}, {"mma-fused", Impl::MmaFused},
      {"mma-fused64", Impl::MmaFused64}, {"wgmma", Impl::Wgmma},
      {"wgmma-fused", Impl::WgmmaFused}, {"wgmma-fused64", Impl::WgmmaFused64},
      {"wgmma-serial", Impl::WgmmaSerial}, {"wgmma-fused-serial", Impl::WgmmaFusedSerial},
      {"wgmma-fused64-serial", Impl::WgmmaFused64Serial}, {"cores", Impl::CudaCores},
      {"auto", Impl::Auto}};
  for (const auto &[name, want] : names) {
    ASSERT_TRUE(gpu::flash::parseImpl(name, impl)) << name;
    EXPECT_EQ(impl, want) << name;
  }
  EXPECT_TRUE(gpu::flash::tensorCoreImpl(Impl::MmaFused));
  EXPECT_FALSE(gpu::flash::tensorCoreImpl(Impl::Auto));
  EXPECT_FALSE(gpu::flash::tensorCoreImpl(Impl::CudaCores));
  // impl is Auto (the table's last name): a refused name leaves it.
  EXPECT_FALSE(gpu::flash::parseImpl("flash3", impl));
  EXPECT_FALSE(gpu::flash::parseImpl(nullptr, impl));
  EXPECT_EQ(impl, Impl::Auto); // unchanged by a refused name
}

/// Forward and backward of one attention with every operand and result
/// `off` elements past an allocation's (256-byte aligned) start.
template <typename E>
std::vector<std::vector<E>> flashAtOffset(FloatKind t, gpu::flash::Impl impl,
                                          const std::vector<std::vector<E>> &in, int64_t B,
                                          int64_t T, int64_t heads, int64_t C, int64_t off) {
  const size_t n = in[0].size();
  std::vector<std::unique_ptr<Dev<E>>> d; // Dev owns its memory: not copied
  for (auto &x : in) {
    std::vector<E> bits(n + off, E(0));
    std::copy(x.begin(), x.end(), bits.begin() + off);
    d.push_back(std::make_unique<Dev<E>>(bits));
  }
  Dev<E> y(n + off), dq(n + off), dk(n + off), dv(n + off);
  Dev<float> lse(B * heads * T),
      scratch(gpu::flash::backwardScratch(t, B, T, C, heads, heads, true, impl));
  E *p[8] = {d[0]->get() + off, d[1]->get() + off, d[2]->get() + off, d[3]->get() + off,
             y.get() + off,     dq.get() + off,     dk.get() + off,     dv.get() + off};
  EXPECT_EQ(gpu::flash::forward(t, p[0], p[1], p[2], p[4], lse.get(), B, T, C, heads, true,
                                heads, 0, impl),
            cudaSuccess);
  EXPECT_EQ(gpu::flash::backward(t, p[0], p[1], p[2], p[4], lse.get(), p[3], p[5], p[6], p[7],
                                 scratch.get(), B, T, C, heads, true, heads, 0, impl),
            cudaSuccess);
  std::vector<std::vector<E>> out;
  for (Dev<E> *o : {&y, &dq, &dk, &dv}) {
    auto h = o->host();
    out.emplace_back(h.begin() + off, h.end());
  }
  return out;
}

TEST_F(CudaFastKernelsTest, FlashAttentionMisalignedOperands) {
  // The tile loads move 16 bytes at a time where the operands allow it and
  // one element at a time where they do not (a base one element off): the
  // same arithmetic, so the same bits. Tensor cores (bf16) and CUDA cores
  // (f32).
  const int64_t B = 1, T = 80, heads = 2, D = 32, C = heads * D, n = B * T * C;
  const char *what[] = {"y", "d_q", "d_k", "d_v"};
  std::vector<std::vector<uint16_t>> bits;
  std::vector<std::vector<float>> wide;
  for (uint32_t seed : {81u, 82u, 83u, 84u}) {
    bits.push_back(Bf16Vec(randomVec(n, seed)).bits);
    wide.push_back(randomVec(n, seed));
  }
  using gpu::flash::Impl;
  auto a16 = flashAtOffset(FloatKind::BF16, Impl::Wmma, bits, B, T, heads, C, 0);
  auto s16 = flashAtOffset(FloatKind::BF16, Impl::Wmma, bits, B, T, heads, C, 1);
  auto a32 = flashAtOffset(FloatKind::F32, Impl::CudaCores, wide, B, T, heads, C, 0);
  auto s32 = flashAtOffset(FloatKind::F32, Impl::CudaCores, wide, B, T, heads, C, 1);
  auto am = flashAtOffset(FloatKind::BF16, Impl::Mma, bits, B, T, heads, C, 0);
  auto sm = flashAtOffset(FloatKind::BF16, Impl::Mma, bits, B, T, heads, C, 1);
  for (int i = 0; i < 4; ++i) {
    expectBitwise(s16[i], a16[i], what[i]);
    expectBitwise(s32[i], a32[i], what[i]);
    expectBitwise(sm[i], am[i], what[i]);
  }
}

/// Forward and backward of one attention on q, k, v as column ranges of a
/// packed [B, T, C + 2 KC] tensor (fsdp.attention_qkv: row strides, no
/// copies) and on dense copies of them: y, lse, and dq, dk, dv (written
/// into the packed gradient's column ranges, which start poisoned) the
/// same bits.
template <typename E>
void expectPackedEqualsDense(FloatKind t, gpu::flash::Impl impl, const std::vector<E> &qkv,
                             const std::vector<E> &dyBits, int64_t B, int64_t T, int64_t heads,
                             int64_t kvHeads, int64_t C, bool causal) {
  const int64_t D = C / heads, KC = kvHeads * D, W = C + 2 * KC, rows = B * T;
  // Dense copies of the three column ranges.
  std::vector<E> q(rows * C), k(rows * KC), v(rows * KC);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(qkv.begin() + r * W, C, q.begin() + r * C);
    std::copy_n(qkv.begin() + r * W + C, KC, k.begin() + r * KC);
    std::copy_n(qkv.begin() + r * W + C + KC, KC, v.begin() + r * KC);
  }
  Dev<E> dq_(q), dk_(k), dv_(v), dy(dyBits), y(rows * C), gq(rows * C), gk(rows * KC),
      gv(rows * KC);
  Dev<float> lse(B * heads * T),
      scratch(gpu::flash::backwardScratch(t, B, T, C, heads, kvHeads, causal, impl));
  ASSERT_EQ(gpu::flash::forward(t, dq_.get(), dk_.get(), dv_.get(), y.get(), lse.get(), B, T, C,
                                heads, causal, kvHeads, 0, impl),
            cudaSuccess);
  ASSERT_EQ(gpu::flash::backward(t, dq_.get(), dk_.get(), dv_.get(), y.get(), lse.get(),
                                 dy.get(), gq.get(), gk.get(), gv.get(), scratch.get(), B, T, C,
                                 heads, causal, kvHeads, 0, impl),
            cudaSuccess);
  const E poison = (E)0x7fc1; // bf16 / f16 bits: a NaN
  Dev<E> packed(qkv), py(rows * C), pg(std::vector<E>(rows * W, poison));
  Dev<float> plse(B * heads * T);
  gpu::flash::Layout L{W, W, 0};
  E *base = packed.get(), *g = pg.get();
  ASSERT_EQ(gpu::flash::forward(t, base, base + C, base + C + KC, py.get(), plse.get(), B, T, C,
                                heads, causal, kvHeads, 0, impl, L),
            cudaSuccess);
  ASSERT_EQ(gpu::flash::backward(t, base, base + C, base + C + KC, py.get(), plse.get(),
                                 dy.get(), g, g + C, g + C + KC, scratch.get(), B, T, C, heads,
                                 causal, kvHeads, 0, impl, L),
            cudaSuccess);
  expectBitwise(py.host(), y.host(), "y");
  EXPECT_EQ(plse.host(), lse.host()) << "lse";
  std::vector<E> got = pg.host(), wq = gq.host(), wk = gk.host(), wv = gv.host();
  std::vector<E> want(rows * W);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(wq.begin() + r * C, C, want.begin() + r * W);
    std::copy_n(wk.begin() + r * KC, KC, want.begin() + r * W + C);
    std::copy_n(wv.begin() + r * KC, KC, want.begin() + r * W + C + KC);
  }
  expectBitwise(got, want, "dqkv");
}

TEST_F(CudaFastKernelsTest, FlashAttentionReadsPackedQkv) {
  using gpu::flash::Impl;
  struct Case {
    int64_t B, T, heads, kv, D;
    bool causal;
  };
  // GPT-2's heads (D = 64, a tail tile), grouped-query with a run-time D
  // of 48, D = 128.
  for (Case c : {Case{2, 80, 4, 4, 64, true}, Case{1, 70, 4, 2, 48, false},
                 Case{1, 65, 2, 1, 128, true}}) {
    SCOPED_TRACE("B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " heads=" +
                 std::to_string(c.heads) + " kv=" + std::to_string(c.kv) + " D=" +
                 std::to_string(c.D));
    const int64_t C = c.heads * c.D, W = C + 2 * c.kv * c.D, rows = c.B * c.T;
    std::vector<float> qkv = randomVec(rows * W, 91, 2.f), dy = randomVec(rows * C, 92);
    for (Impl impl : {Impl::Mma, Impl::MmaFused, Impl::WgmmaFused, Impl::Wmma,
                      Impl::CudaCores}) {
      SCOPED_TRACE(impl == Impl::Mma          ? "mma.sync"
                   : impl == Impl::MmaFused   ? "mma.sync fused"
                   : impl == Impl::WgmmaFused ? "wgmma fused"
                   : impl == Impl::Wmma     ? "WMMA"
                                            : "CUDA cores");
      expectPackedEqualsDense(FloatKind::BF16, impl, Bf16Vec(qkv).bits, Bf16Vec(dy).bits, c.B,
                              c.T, c.heads, c.kv, C, c.causal);
    }
    expectPackedEqualsDense(FloatKind::F32, Impl::CudaCores, qkv, dy, c.B, c.T, c.heads, c.kv,
                            C, c.causal);
  }
  // A stride shorter than its rows is refused.
  EXPECT_FALSE(gpu::flash::check(1, 8, 64, 4, 4, gpu::flash::Layout{32, 0, 0}).isOk());
  EXPECT_FALSE(gpu::flash::check(1, 8, 64, 4, 2, gpu::flash::Layout{0, 16, 0}).isOk());
  EXPECT_TRUE(gpu::flash::check(1, 8, 64, 4, 2, gpu::flash::Layout{128, 128, 64}).isOk());
}

TEST_F(CudaFastKernelsTest, FlashAttentionBeyondTheRowKernelsLimit) {
  // Longer than attentionMaxT(): the reference kernels refuse it, the
  // tiled one runs it (CudaDevice takes it there for f32 too).
  int64_t T = gpu::attentionMaxT() + 70;
  flashCase(FloatKind::F32, 1, T, 1, 1, 64, true, 71);
}

TEST_F(CudaFastKernelsTest, FlashAttentionRejectsBadShapes) {
  EXPECT_FALSE(gpu::flash::check(1, 8, 30, 4, 4).isOk());   // heads do not divide C
  EXPECT_FALSE(gpu::flash::check(1, 8, 32, 4, 3).isOk());   // kv_heads do not divide heads
  EXPECT_FALSE(gpu::flash::check(1, 8, 512, 2, 2).isOk());  // D = 256 > 128
  EXPECT_EQ(gpu::flash::forward(FloatKind::F32, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                                8, 30, 4, false, 4, 0),
            cudaErrorInvalidValue);
  // The tensor-core kernels take neither f32 nor D % 16 != 0 (D = 8).
  using gpu::flash::Impl;
  EXPECT_EQ(gpu::flash::forward(FloatKind::F32, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                                8, 64, 4, false, 4, 0, Impl::Wmma),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::backward(FloatKind::BF16, nullptr, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 32, 4,
                                 false, 4, 0, Impl::Wmma),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::forward(FloatKind::F32, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                                8, 64, 4, false, 4, 0, Impl::Mma),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::flash::backward(FloatKind::BF16, nullptr, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 32, 4,
                                 false, 4, 0, Impl::Mma),
            cudaErrorInvalidValue);
}

TEST_F(CudaFastKernelsTest, FusedAdamWFoundInfAndGradScale) {
  const int64_t n = 100003;
  auto p = randomVec(n, 26), g = randomVec(n, 27), m = randomVec(n, 28), v0 = randomVec(n, 29);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = v0[i] * v0[i];
  for (float step : {1.f, 7.f}) {
    Dev<float> lr(std::vector<float>{3e-3f}), st(std::vector<float>{step});
    // f32 gradient: bitwise the reference kernel.
    Dev<float> ap(p), am(m), av(v), dg(g), rp(p), rm(m), rv(v);
    ASSERT_EQ(nat::adamw(ap.get(), dg.get(), FloatKind::F32, am.get(), av.get(), ap.get(),
                         am.get(), av.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         nullptr, nullptr, 0),
              cudaSuccess);
    ASSERT_EQ(gpu::adamwUpdate(rp.get(), dg.get(), rm.get(), rv.get(), rp.get(), rm.get(),
                               rv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1, 0),
              cudaSuccess);
    expectBitwise(ap.host(), rp.host(), "adamw param");
    expectBitwise(am.host(), rm.host(), "adamw exp_avg");
    expectBitwise(av.host(), rv.host(), "adamw exp_avg_sq");
    {
      // One float past 16-byte alignment (a shard's flat slice can start
      // anywhere): the element-at-a-time path, the same bits.
      std::vector<float> p1(n + 1), g1(n + 1), m1(n + 1), v1(n + 1);
      std::copy(p.begin(), p.end(), p1.begin() + 1);
      std::copy(g.begin(), g.end(), g1.begin() + 1);
      std::copy(m.begin(), m.end(), m1.begin() + 1);
      std::copy(v.begin(), v.end(), v1.begin() + 1);
      Dev<float> op(p1), og(g1), om(m1), ov(v1);
      ASSERT_EQ(nat::adamw(op.get() + 1, og.get() + 1, FloatKind::F32, om.get() + 1,
                           ov.get() + 1, op.get() + 1, om.get() + 1, ov.get() + 1, n, lr.get(),
                           st.get(), 0.9, 0.95, 1e-8, 0.1, nullptr, nullptr, 0),
                cudaSuccess);
      auto got = op.host();
      expectBitwise(std::vector<float>(got.begin() + 1, got.end()), rp.host(),
                    "adamw param, misaligned");
    }
    // bf16 gradient times a scale: the CPU update on the widened, scaled
    // gradient (the f32 product is the same on both sides).
    Bf16Vec gb(g);
    const float scale = 0.25f;
    std::vector<float> gs(n), wp(n), wm(n), wv(n);
    for (int64_t i = 0; i < n; ++i)
      gs[i] = gb.wide[i] * scale;
    Dev<uint16_t> dgb(gb.bits);
    Dev<float> bp(p), bm(m), bv(v), np(n), nm(n), nv(n), sc(std::vector<float>{scale}),
        fi(std::vector<float>{0.f});
    ASSERT_EQ(nat::adamw(bp.get(), dgb.get(), FloatKind::BF16, bm.get(), bv.get(), np.get(),
                         nm.get(), nv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         sc.get(), fi.get(), 0),
              cudaSuccess);
    cpu::adamwUpdate(p.data(), gs.data(), m.data(), v.data(), wp.data(), wm.data(), wv.data(),
                     n, 3e-3f, (int64_t)step, 0.9, 0.95, 1e-8, 0.1);
    // Both round every operation on its own in the same order
    // (CudaCommon.cuh's adamwElement); the scalars come from CUDA's and
    // glibc's double pow, which may differ in the last double ulp, so the
    // bound of test/unit/CudaKernelsTest.cpp's OptimizersNormAndClip (one
    // that also allows an FMA contraction) is kept rather than bitwise.
    fsdp::test::AdamwSlack sl(p, gs, m, v, 3e-3, step, 0.9, 0.95, 1e-8);
    expectF32Near(np.host(), wp, 8, sl.p, "adamw bf16 grad param");
    expectF32Near(nm.host(), wm, 4, sl.m, "adamw bf16 grad exp_avg");
    expectF32Near(nv.host(), wv, 4, sl.v, "adamw bf16 grad exp_avg_sq");
    // skip_nonfinite inf (an overflowed loss-scaled step): the step is
    // skipped, out of place and in place; a finite one (0 above) is not.
    Dev<float> inf(std::vector<float>{INFINITY});
    ASSERT_EQ(nat::adamw(bp.get(), dgb.get(), FloatKind::BF16, bm.get(), bv.get(), np.get(),
                         nm.get(), nv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         sc.get(), inf.get(), 0),
              cudaSuccess);
    expectBitwise(np.host(), p, "skipped step: param");
    expectBitwise(nm.host(), m, "skipped step: exp_avg");
    expectBitwise(nv.host(), v, "skipped step: exp_avg_sq");
    ASSERT_EQ(nat::adamw(bp.get(), dgb.get(), FloatKind::BF16, bm.get(), bv.get(), bp.get(),
                         bm.get(), bv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         nullptr, inf.get(), 0),
              cudaSuccess);
    expectBitwise(bp.host(), p, "skipped step in place: param");
    // grad_scale on an f32 gradient (the clipping mul folded into the
    // update): bitwise the update of the product rounded to f32.
    const float clip = 0.3712f;
    std::vector<float> prod(n);
    for (int64_t i = 0; i < n; ++i)
      prod[i] = g[i] * clip;
    Dev<float> cp(p), cm(m), cv(v), qp(p), qm(m), qv(v), dprod(prod),
        dclip(std::vector<float>{clip});
    ASSERT_EQ(nat::adamw(cp.get(), dg.get(), FloatKind::F32, cm.get(), cv.get(), cp.get(),
                         cm.get(), cv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         dclip.get(), nullptr, 0),
              cudaSuccess);
    ASSERT_EQ(nat::adamw(qp.get(), dprod.get(), FloatKind::F32, qm.get(), qv.get(), qp.get(),
                         qm.get(), qv.get(), n, lr.get(), st.get(), 0.9, 0.95, 1e-8, 0.1,
                         nullptr, nullptr, 0),
              cudaSuccess);
    expectBitwise(cp.host(), qp.host(), "grad_scale: param");
    expectBitwise(cm.host(), qm.host(), "grad_scale: exp_avg");
    expectBitwise(cv.host(), qv.host(), "grad_scale: exp_avg_sq");
  }
}

} // namespace
