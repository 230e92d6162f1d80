//===- KernelsTest.cpp - CPU kernels against finite differences -----------===//
//
// Every backward kernel is checked in double precision against central
// finite differences of its forward kernel: for a random upstream gradient
// dy, <dy, f(x + h e_i) - f(x - h e_i)> / 2h must equal the kernel's
// d/dx_i. Forward kernels are checked against hand-computed values, and the
// optimizers against the formulas of torch.optim.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Kernels.h"
#include "runtime/core/Dropout.h"
#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/OpRules.h"
#include "runtime/core/Plan.h"
#include "runtime/core/ShapeRules.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/cpu/Dispatch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

using namespace fsdp;
using namespace fsdp::cpu;

namespace {

std::vector<double> randomVec(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double &x : v)
    x = d(g);
  return v;
}

/// Checks `grad` (the kernel's VJP w.r.t. `x` for upstream `dy`) against
/// central differences of `forward`, which maps the current x to outputs.
void checkVjp(std::vector<double> &x, const std::vector<double> &dy,
              const std::function<std::vector<double>()> &forward,
              const std::vector<double> &grad, const char *what) {
  ASSERT_EQ(grad.size(), x.size()) << what;
  const double h = 1e-6;
  double maxAbs = 0;
  for (double g : grad)
    maxAbs = std::max(maxAbs, std::fabs(g));
  for (size_t i = 0; i < x.size(); ++i) {
    double v = x[i];
    x[i] = v + h;
    std::vector<double> yp = forward();
    x[i] = v - h;
    std::vector<double> ym = forward();
    x[i] = v;
    double fd = 0;
    for (size_t j = 0; j < yp.size(); ++j)
      fd += dy[j] * (yp[j] - ym[j]) / (2 * h);
    EXPECT_NEAR(grad[i], fd, 1e-6 * std::max(1.0, maxAbs))
        << what << " element " << i;
  }
}

// Dropout: the dropped fraction is p within 6 standard deviations of a
// binomial count, every kept element is x * f32(1 / (1 - p)) exactly, the
// mask is a pure function of (key, global index) (a shifted window reads
// the same elements), and another key (step, seed or id) draws another
// mask: elements agree at the rate two independent masks do.
/// The 8-bit moments' codes (Moments8.h) against their definition by
/// search: the code values increase from 0 to kMax (480 for E4M3, 496 for
/// E4M4), 2^-6 is the first normal, and encodeMagnitude(y) is the code
/// nearest y (ties to the even code, above the largest the largest) for
/// every code value, every midpoint between neighbours (the ties), a
/// float either side of each midpoint, and random magnitudes over 40
/// binades. exp_avg's sign is its top bit.
/// The 8-bit update's AVX2 build stores the baseline (SSE2) build's bytes:
/// parameters and both packed moments, over 5 steps of 3000 elements in
/// blocks of 256 (a short last block), a decayed prefix ending mid-block,
/// moments over 40 binades and a gradient scale. The DeviceConformance
/// test holds the build the CPU picks to the f32 update encoded once.
TEST(KernelsTest, EightBitUpdateIsTheSameOnEveryIsa) {
  if (!cpu::cpuHasAvx2())
    GTEST_SKIP() << "this CPU has no AVX2: only the baseline build runs here";
  namespace m8 = moments8;
  const int64_t n = 3000, block = 256, bytes = m8::scalesOffset(n) + 4 * ((n + block - 1) / block);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1), e(-20, 20);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = u(rng);
    m[i] = u(rng) * std::exp2(e(rng));
    v[i] = std::exp2(2 * e(rng));
  }
  std::vector<uint8_t> mq(bytes), vq(bytes);
  m8::encodeShard(m.data(), n, block, false, mq.data());
  m8::encodeShard(v.data(), n, block, true, vq.data());
  std::vector<float> pa = p, pb = p;
  std::vector<uint8_t> ma = mq, va = vq, mb = mq, vb = vq;
  for (int step = 1; step <= 5; ++step) {
    for (int64_t i = 0; i < n; ++i)
      g[i] = u(rng) * std::exp2(e(rng) / 2);
    cpu::adamwUpdate8bitState(pa.data(), g.data(), ma.data(), va.data(), pa.data(), ma.data(),
                              va.data(), n, block, 1e-3, step, 0.9, 0.999, 1e-8, 0.1, 1000, 0.5f,
                              cpu::Isa::Baseline);
    cpu::adamwUpdate8bitState(pb.data(), g.data(), mb.data(), vb.data(), pb.data(), mb.data(),
                              vb.data(), n, block, 1e-3, step, 0.9, 0.999, 1e-8, 0.1, 1000, 0.5f,
                              cpu::Isa::Avx2);
    ASSERT_EQ(0, std::memcmp(pa.data(), pb.data(), n * 4)) << "parameters, step " << step;
    ASSERT_EQ(ma, mb) << "exp_avg, step " << step;
    ASSERT_EQ(va, vb) << "exp_avg_sq, step " << step;
  }
  EXPECT_NE(0, std::memcmp(pa.data(), p.data(), n * 4)); // it updated
}

/// SGD's momentum buffer in 8 bits (state-dtype=8bit): each step is
/// sgdMomentumUpdate<float> on the decoded buffer (weight decay on a
/// prefix that ends inside a block, none after), the new buffer encoded
/// once as exp_avg is; bitwise, parameters and bytes, over steps 1 (the
/// buffer a clone of the gradient) to 4. Two pieces (whole blocks) store
/// what one call stores, and the baseline build what the best one stores.
TEST(KernelsTest, EightBitMomentumBufferIsTheF32UpdateEncodedOnce) {
  namespace m8 = moments8;
  const int64_t n = 3000, block = 256, decayed = 1000,
                bytes = m8::scalesOffset(n) + 4 * ((n + block - 1) / block);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1, 1), e(-12, 12);
  std::vector<float> p(n), g(n);
  for (float &x : p)
    x = u(rng);
  std::vector<uint8_t> q(bytes, 0), pieces(bytes, 0);
  std::vector<float> pq = p, pp = p;
  for (int step = 1; step <= 4; ++step) {
    for (int64_t i = 0; i < n; ++i)
      g[i] = u(rng) * std::exp2(e(rng));
    // the reference: the f32 update of the decoded buffer, encoded
    std::vector<float> buf(n), ref = pq, nb(n);
    m8::decodeShard(q.data(), n, block, false, buf.data());
    cpu::sgdMomentumUpdate<float>(pq.data(), g.data(), buf.data(), ref.data(), nb.data(), decayed,
                                  0.05, step, 0.9, 0.1, 0.01, true, 0.5f);
    cpu::sgdMomentumUpdate<float>(pq.data() + decayed, g.data() + decayed, buf.data() + decayed,
                                  ref.data() + decayed, nb.data() + decayed, n - decayed, 0.05,
                                  step, 0.9, 0.1, 0.0, true, 0.5f);
    std::vector<uint8_t> want(bytes, 0);
    m8::encodeShard(nb.data(), n, block, false, want.data());
    const std::vector<float> pq0 = pq;
    const std::vector<uint8_t> q0 = q;
    cpu::sgdMomentumUpdate8bitState(pq.data(), g.data(), q.data(), pq.data(), q.data(), n, block,
                                    0.05, step, 0.9, 0.1, 0.01, true, decayed, 0.5f);
    ASSERT_EQ(0, std::memcmp(pq.data(), ref.data(), n * 4)) << "parameters, step " << step;
    ASSERT_EQ(q, want) << "buffer, step " << step;
    for (int64_t from : {int64_t(0), 4 * block})
      cpu::sgdMomentumUpdate8bitStatePiece(
          pp.data() + from, pp.data() + from, from, from ? n - from : 4 * block, g.data(),
          pieces.data(), pieces.data(), n, block, 0.05, step, 0.9, 0.1, 0.01, true, decayed, 0.5f);
    ASSERT_EQ(0, std::memcmp(pp.data(), pq.data(), n * 4)) << "pieces, step " << step;
    ASSERT_EQ(pieces, q) << "pieces, step " << step;
    // the baseline build stores the same bytes as the AVX2 one (Best, where
    // the CPU has it)
    std::vector<float> pb = pq0;
    std::vector<uint8_t> qb = q0;
    cpu::sgdMomentumUpdate8bitState(pb.data(), g.data(), qb.data(), pb.data(), qb.data(), n, block,
                                    0.05, step, 0.9, 0.1, 0.01, true, decayed, 0.5f,
                                    cpu::Isa::Baseline);
    ASSERT_EQ(0, std::memcmp(pb.data(), pq.data(), n * 4)) << "baseline, step " << step;
    ASSERT_EQ(qb, q) << "baseline, step " << step;
  }
  EXPECT_NE(0, std::memcmp(pq.data(), p.data(), n * 4)); // it updated
}

// LAMB with 8-bit moments (state-dtype=8bit): the norms are lambNorms'
// over the decoded moments, and the update is lambUpdate's f32 step on
// them, its new moments encoded once, bitwise, over four steps. The unit
// holds parameters smaller than a block and blocks holding several (each
// with its own trust ratio), the last parameter without weight decay
// (decayNumel inside a block), padding after, a gradient scale; the
// second rank's shard (base != 0) as well as the whole unit, in place;
// the baseline build and the AVX2 one (where the CPU has it) alike.
TEST(KernelsTest, LambEightBitMomentsAreTheF32UpdateEncodedOnce) {
  namespace m8 = moments8;
  const int64_t block = 64;
  const std::vector<int64_t> seg = {0, 20, 50, 300, 310, 700};
  const int64_t numel = 720, decayed = 310; // the unit padded to 720: two shards of 360
  const double lr = 0.01, b1 = 0.9, b2 = 0.99, eps = 1e-6, wd = 0.05;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1), e(-10, 4);
  for (const auto &[base, n] : {std::pair<int64_t, int64_t>{0, numel}, {360, 360}}) {
    SCOPED_TRACE("shard from " + std::to_string(base));
    const LambLayout layout{seg, base, decayed};
    const int64_t K = (int64_t)seg.size() - 1,
                  bytes = m8::scalesOffset(n) + 4 * ((n + block - 1) / block);
    std::vector<float> p(n), g(n);
    for (int64_t i = 0; i < n; ++i)
      p[i] = base + i < seg.back() ? u(rng) : 0.f;
    const std::vector<float> p0 = p;
    std::vector<uint8_t> m(bytes, 0), v(bytes, 0);
    for (int step = 1; step <= 4; ++step) {
      for (int64_t i = 0; i < n; ++i)
        g[i] = base + i < seg.back() ? u(rng) * std::exp2(e(rng)) : 0.f;
      std::vector<float> md(n), vd(n);
      m8::decodeShard(m.data(), n, block, false, md.data());
      m8::decodeShard(v.data(), n, block, true, vd.data());
      std::vector<float> want(2 * K), got(2 * K);
      cpu::lambNorms<float>(p.data(), g.data(), md.data(), vd.data(), want.data(), n, layout, step,
                            b1, b2, eps, wd, 0.5f);
      cpu::lambNorms8bitState(p.data(), g.data(), m.data(), v.data(), got.data(), n, block, layout,
                              step, b1, b2, eps, wd, 0.5f);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), 8 * K)) << "norms, step " << step;
      // (a shard's sums stand in for the all-reduced ones: the update's
      // arithmetic is what is compared)
      std::vector<float> rp(n), rm(n), rv(n);
      cpu::lambUpdate<float>(p.data(), g.data(), md.data(), vd.data(), want.data(), rp.data(),
                             rm.data(), rv.data(), n, layout, lr, step, b1, b2, eps, wd, 0.5f);
      std::vector<uint8_t> wm(bytes, 0), wv(bytes, 0);
      m8::encodeShard(rm.data(), n, block, false, wm.data());
      m8::encodeShard(rv.data(), n, block, true, wv.data());
      // the baseline build stores the same bytes as the AVX2 one (Best,
      // where the CPU has it)
      std::vector<float> bp = p;
      std::vector<uint8_t> bm = m, bv = v;
      cpu::lambUpdate8bitState(bp.data(), g.data(), bm.data(), bv.data(), got.data(), bp.data(),
                               bm.data(), bv.data(), n, block, layout, lr, step, b1, b2, eps, wd,
                               0.5f, cpu::Isa::Baseline);
      cpu::lambUpdate8bitState(p.data(), g.data(), m.data(), v.data(), got.data(), p.data(),
                               m.data(), v.data(), n, block, layout, lr, step, b1, b2, eps, wd,
                               0.5f);
      ASSERT_EQ(0, std::memcmp(p.data(), rp.data(), 4 * n)) << "parameters, step " << step;
      ASSERT_EQ(m, wm) << "exp_avg, step " << step;
      ASSERT_EQ(v, wv) << "exp_avg_sq, step " << step;
      ASSERT_EQ(0, std::memcmp(bp.data(), p.data(), 4 * n)) << "baseline, step " << step;
      ASSERT_EQ(bm, m) << "baseline, step " << step;
      ASSERT_EQ(bv, v) << "baseline, step " << step;
    }
    EXPECT_NE(p, p0); // it updated
  }
}

TEST(KernelsTest, EightBitMomentCodesAreTheNearest) {
  namespace m8 = moments8;
  for (int k : {m8::kMantM, m8::kMantV}) {
    const uint32_t top = (16u << k) - 1;
    std::vector<double> value(top + 1);
    for (uint32_t c = 0; c <= top; ++c) {
      value[c] = m8::codeValue(c, k);
      if (c)
        ASSERT_GT(value[c], value[c - 1]) << "k " << k << " code " << c;
    }
    EXPECT_EQ(value[0], 0.0);
    EXPECT_EQ(value[top], (double)m8::maxValue(k));
    EXPECT_EQ(value[1u << k], std::ldexp(1.0, -6));
    auto nearest = [&](float y) {
      uint32_t best = 0;
      for (uint32_t c = 1; c <= top; ++c) {
        double d = std::fabs(value[c] - y), b = std::fabs(value[best] - y);
        if (d < b || (d == b && c % 2 == 0))
          best = c;
      }
      return best;
    };
    std::vector<float> ys;
    for (uint32_t c = 0; c <= top; ++c) {
      ys.push_back((float)value[c]);
      if (c < top) {
        float mid = (float)((value[c] + value[c + 1]) / 2); // exact: one more bit
        ys.push_back(mid);
        ys.push_back(std::nextafter(mid, 0.0f));
        ys.push_back(std::nextafter(mid, 1e9f));
      }
    }
    ys.push_back(std::nextafter(m8::maxValue(k), 1e9f)); // a rounding above the largest
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> e(-34.0, 9.0);
    for (int i = 0; i < 20000; ++i)
      ys.push_back((float)std::min(std::exp2(e(rng)), (double)m8::maxValue(k)));
    for (float y : ys)
      ASSERT_EQ(m8::encodeMagnitude(y, k), nearest(y)) << "k " << k << " y " << y;
  }
  const float inv = m8::maxValue(m8::kMantM) / 2.0f;
  EXPECT_EQ(m8::encodeM(-0.75f, inv), m8::encodeM(0.75f, inv) | 0x80);
  EXPECT_EQ(m8::decodeM(m8::encodeM(-0.5f, 4.0f), 0.25f), -0.5f); // code value 2, exact
}

/// The 4-bit moments' codes (Moments4.h) against their definition by
/// search: the levels increase (exp_avg's from -0.8875 through 0 to 1,
/// exp_avg_sq's roots 2^(-(15 - c) / 2), sqrt(2) apart), and encodeM / encodeV give the
/// nearest level (a tie the lower) for every level, every midpoint, a
/// float either side of each, and random values over 30 binades; a
/// block's bytes pack element 2i low, 2i + 1 high; a block of zeros, one
/// below 2^-100 (zeros), and one holding a NaN or an infinity (NaN)
/// decode as the header says, and a shard's range decodes from any
/// element, odd or even.
TEST(KernelsTest, FourBitMomentCodesAreTheNearest) {
  namespace m4 = moments4;
  for (bool root : {false, true}) {
    auto level = [&](uint32_t c) { return root ? m4::levelV(c) : m4::levelM(c); };
    for (uint32_t c = 1; c < 16; ++c)
      ASSERT_GT(level(c), level(c - 1)) << "root " << root << " code " << c;
    EXPECT_EQ(level(15), 1.0f);
    EXPECT_EQ(level(root ? 0 : m4::kZeroM), root ? (float)std::exp2(-7.5) : 0.0f);
    if (root)
      for (uint32_t c = 1; c < 16; ++c)
        ASSERT_NEAR(level(c) / level(c - 1), std::sqrt(2.0), 1e-6) << "code " << c;
    auto nearest = [&](float y) {
      uint32_t best = 0;
      for (uint32_t c = 1; c < 16; ++c)
        if (std::fabs((double)level(c) - y) < std::fabs((double)level(best) - y))
          best = c; // (a tie keeps the lower)
      return best;
    };
    std::vector<float> ys = {-2.0f, 2.0f, 0.0f, -0.0f};
    for (uint32_t c = 0; c < 16; ++c) {
      ys.push_back(level(c));
      if (c < 15) {
        const float mid = (float)(((double)level(c) + level(c + 1)) / 2); // exact: f32 + 1 bit
        ys.push_back(mid);
        ys.push_back(std::nextafter(mid, -1e9f));
        ys.push_back(std::nextafter(mid, 1e9f));
      }
    }
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> e(-30.0, 0.1);
    for (int i = 0; i < 20000; ++i)
      ys.push_back((float)((i % 2 && !root ? -1 : 1) * std::exp2(e(rng))));
    for (float y : ys)
      ASSERT_EQ(root ? m4::encodeV(y) : m4::encodeM(y), nearest(y))
          << "root " << root << " y " << y;
  }
  // Blocks of 32 over 101 elements (a short, odd last block): the bytes and
  // scales, and decoding every range.
  const int64_t n = 101, block = 32;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i)
    x[i] = (float)(std::sin(0.7 * double(i)) * std::pow(10.0, -(i % 4)));
  for (int64_t i = 32; i < 64; ++i)
    x[i] = 0;     // zeros
  x[64] = 1e-31f; // block 2: below 2^-100 but for its NaN below
  x[70] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> xr = x;
  xr[70] = 0.5f, xr[64] = 0.25f; // the roots' block 2 plain
  for (int64_t i = 0; i < n; ++i)
    xr[i] = xr[i] * xr[i];
  xr[96] = std::numeric_limits<float>::infinity(); // the roots' last block: infinite
  for (bool root : {false, true}) {
    const std::vector<float> &in = root ? xr : x;
    std::vector<uint8_t> q(shapes::packedStateBytes(n, block, 4), 0xff);
    m4::encodeShard(in.data(), n, block, root, q.data());
    ASSERT_EQ((int64_t)q.size(), 52 + 16);
    for (int64_t j = 0; j * block < n; ++j) {
      const int64_t o = j * block, len = std::min(block, n - o);
      float a = 0, s;
      bool bad = false;
      for (int64_t i = 0; i < len; ++i) {
        const float v = root ? std::sqrt(in[o + i]) : in[o + i];
        bad |= !std::isfinite(v);
        a = std::max(a, std::fabs(v));
      }
      std::memcpy(&s, q.data() + m4::scalesOffset(n) + 4 * j, 4);
      if (bad)
        EXPECT_TRUE(std::isnan(s)) << "root " << root << " block " << j;
      else
        EXPECT_EQ(s, a >= 7.888609052210118e-31f ? a : 0.0f) << "root " << root << " block " << j;
      for (int64_t i = 0; i < len; ++i) {
        const float v = root ? std::sqrt(in[o + i]) : in[o + i];
        const uint32_t want =
            bad || !(a >= 7.888609052210118e-31f)
                ? (root ? 0u : m4::kZeroM)
                : (root ? m4::encodeV(v * (1.0f / a)) : m4::encodeM(v * (1.0f / a)));
        const int64_t e = o + i;
        ASSERT_EQ((q[e / 2] >> (4 * (e % 2))) & 15u, want) << "root " << root << " element " << e;
      }
    }
    EXPECT_EQ(q[50] >> 4, 0) << "the odd last element's high nibble";
    EXPECT_EQ(q[51], 0) << "the codes' padding";
    std::vector<float> all(n);
    m4::decodeShard(q.data(), n, block, root, all.data());
    for (int64_t i = 0; i < n; ++i) {
      float s;
      std::memcpy(&s, q.data() + m4::scalesOffset(n) + 4 * (i / block), 4);
      const float l = (root ? m4::levelV((q[i / 2] >> (4 * (i % 2))) & 15u)
                            : m4::levelM((q[i / 2] >> (4 * (i % 2))) & 15u)) *
                      s;
      const float want = root ? l * l : l;
      if (std::isnan(want))
        ASSERT_TRUE(std::isnan(all[i])) << i;
      else
        ASSERT_EQ(all[i], want) << "root " << root << " element " << i;
    }
    EXPECT_EQ(all[40], 0.0f) << "a block of zeros";
    EXPECT_TRUE(std::isnan(all[root ? 100 : 65])) << "a block holding a NaN or an infinity";
    for (int64_t first : {int64_t(0), int64_t(1), int64_t(33), int64_t(63), int64_t(100)})
      for (int64_t len : {int64_t(1), int64_t(2), int64_t(37)}) {
        if (first + len > n)
          continue;
        std::vector<float> part(len);
        m4::decodeRange(q.data() + first / 2, q.data() + m4::scalesOffset(n) + 4 * (first / block),
                        first, len, block, root, part.data());
        for (int64_t i = 0; i < len; ++i)
          if (!std::isnan(all[first + i]))
            ASSERT_EQ(part[i], all[first + i]) << "from " << first << " element " << i;
      }
  }
  EXPECT_EQ(x[64], 1e-31f);
}

/// AdamW with 4-bit moments (state-dtype=4bit): each step is
/// adamwUpdate<float> on the decoded moments (exp_avg_sq as its root's
/// level squared), the new moments encoded once (encodeShard of the f32
/// update's, exp_avg_sq's roots); bitwise, parameters and bytes, over 4
/// steps of 1001 elements in blocks of 128 (a short, odd last block), a
/// decayed prefix ending mid-block and a gradient scale. Two pieces store
/// what one call stores, and the AVX2 build what the baseline stores.
TEST(KernelsTest, FourBitMomentsAreTheF32UpdateEncodedOnce) {
  namespace m4 = moments4;
  const int64_t n = 1001, block = 128, decayed = 300, bytes = shapes::packedStateBytes(n, block, 4);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1), e(-12, 0);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = u(rng);
    m[i] = u(rng) * std::exp2(e(rng)) * 1e-3f;
    v[i] = std::exp2(2 * e(rng)) * 1e-6f;
  }
  std::vector<uint8_t> mq(bytes), vq(bytes);
  m4::encodeShard(m.data(), n, block, false, mq.data());
  m4::encodeShard(v.data(), n, block, true, vq.data());
  std::vector<float> pr = p, pa = p, pb = p, pc = p;
  std::vector<uint8_t> ma = mq, va = vq, mb = mq, vb = vq, mc = mq, vc = vq;
  std::vector<float> mf(n), vf(n), nmf(n), nvf(n);
  for (int step = 1; step <= 4; ++step) {
    for (int64_t i = 0; i < n; ++i)
      g[i] = u(rng) * std::exp2(e(rng) / 2);
    const float gs = 0.5f;
    // the reference: decode, the f32 update (two parts: decayed, not), encode
    m4::decodeShard(ma.data(), n, block, false, mf.data());
    m4::decodeShard(va.data(), n, block, true, vf.data());
    adamwUpdate<float>(pr.data(), g.data(), mf.data(), vf.data(), pr.data(), nmf.data(), nvf.data(),
                       decayed, 1e-3, step, 0.9, 0.999, 1e-8, 0.1, gs);
    adamwUpdate<float>(pr.data() + decayed, g.data() + decayed, mf.data() + decayed,
                       vf.data() + decayed, pr.data() + decayed, nmf.data() + decayed,
                       nvf.data() + decayed, n - decayed, 1e-3, step, 0.9, 0.999, 1e-8, 0.0, gs);
    std::vector<uint8_t> wantM(bytes), wantV(bytes);
    m4::encodeShard(nmf.data(), n, block, false, wantM.data());
    m4::encodeShard(nvf.data(), n, block, true, wantV.data());
    cpu::adamwUpdate4bitState(pa.data(), g.data(), ma.data(), va.data(), pa.data(), ma.data(),
                              va.data(), n, block, 1e-3, step, 0.9, 0.999, 1e-8, 0.1, decayed, gs,
                              cpu::Isa::Baseline);
    ASSERT_EQ(0, std::memcmp(pa.data(), pr.data(), n * 4)) << "parameters, step " << step;
    ASSERT_EQ(ma, wantM) << "exp_avg, step " << step;
    ASSERT_EQ(va, wantV) << "exp_avg_sq, step " << step;
    cpu::adamwUpdate4bitState(pb.data(), g.data(), mb.data(), vb.data(), pb.data(), mb.data(),
                              vb.data(), n, block, 1e-3, step, 0.9, 0.999, 1e-8, 0.1, decayed, gs,
                              cpu::Isa::Avx2);
    ASSERT_EQ(0, std::memcmp(pb.data(), pr.data(), n * 4)) << "AVX2 parameters, step " << step;
    ASSERT_EQ(mb, wantM) << "AVX2 exp_avg, step " << step;
    ASSERT_EQ(vb, wantV) << "AVX2 exp_avg_sq, step " << step;
    for (int64_t from : {int64_t(0), int64_t(512)}) // two pieces of whole blocks
      cpu::adamwUpdate4bitStatePiece(pc.data() + from, pc.data() + from, from,
                                     from ? n - from : 512, g.data(), mc.data(), vc.data(),
                                     mc.data(), vc.data(), n, block, 1e-3, step, 0.9, 0.999, 1e-8,
                                     0.1, decayed, gs);
    ASSERT_EQ(0, std::memcmp(pc.data(), pr.data(), n * 4)) << "pieces' parameters, step " << step;
    ASSERT_EQ(mc, wantM) << "pieces' exp_avg, step " << step;
    ASSERT_EQ(vc, wantV) << "pieces' exp_avg_sq, step " << step;
  }
  EXPECT_NE(ma, mq) << "the moments moved";
  EXPECT_NE(0, std::memcmp(pa.data(), p.data(), n * 4));
}

TEST(KernelsTest, DropoutMaskStatisticsAndDeterminism) {
  const int64_t n = 1 << 20;
  const double p = 0.3;
  std::vector<float> x(n), y(n), y2(n), w(n / 2);
  for (int64_t i = 0; i < n; ++i)
    x[i] = 1.0f + (float)(i % 97) / 97.0f; // never 0: a 0 output is a drop
  uint64_t key = dropoutKey(1234, 5, 0);
  dropout<float>(x.data(), y.data(), n, key, 0, dropoutThreshold(p), 1.0 / (1.0 - p));
  int64_t dropped = 0;
  const float s = (float)(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] == 0.0f)
      ++dropped;
    else
      ASSERT_EQ(y[i], x[i] * s) << i;
  }
  double sigma = std::sqrt(p * (1 - p) / n);
  EXPECT_NEAR((double)dropped / n, p, 6 * sigma);
  // Global indices: the second half seen as its own window starting at n/2.
  dropout<float>(x.data() + n / 2, w.data(), n / 2, key, n / 2, dropoutThreshold(p),
                 1.0 / (1.0 - p));
  for (int64_t i = 0; i < n / 2; ++i)
    ASSERT_EQ(w[i], y[n / 2 + i]) << i;
  for (uint64_t other : {dropoutKey(1234, 6, 0), dropoutKey(1235, 5, 0), dropoutKey(1234, 5, 1)}) {
    dropout<float>(x.data(), y2.data(), n, other, 0, dropoutThreshold(p), 1.0 / (1.0 - p));
    int64_t same = 0;
    for (int64_t i = 0; i < n; ++i)
      same += (y[i] == 0.0f) == (y2[i] == 0.0f);
    double agree = p * p + (1 - p) * (1 - p);
    EXPECT_NEAR((double)same / n, agree, 6 * std::sqrt(agree * (1 - agree) / n));
  }
  // p = 0 keeps everything; the threshold is p in 24-bit units.
  EXPECT_EQ(dropoutThreshold(0.0), 0u);
  EXPECT_EQ(dropoutThreshold(0.5), 1u << 23);
}

TEST(KernelsTest, GeluMatchesTanhFormAndItsGradient) {
  std::vector<double> x = randomVec(17, 1), y(17), dy = randomVec(17, 2), dx(17);
  gelu<double>(x.data(), y.data(), 17);
  double v = x[3];
  double want = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  EXPECT_NEAR(y[3], want, 1e-12);
  geluGrad<double>(x.data(), dy.data(), dx.data(), 17);
  checkVjp(x, dy, [&] {
    std::vector<double> o(17);
    gelu<double>(x.data(), o.data(), 17);
    return o;
  }, dx, "gelu");
}

TEST(KernelsTest, GeluExactMatchesErfFormAndItsGradient) {
  std::vector<double> x = randomVec(17, 3, 2.0), y(17), dy = randomVec(17, 4), dx(17);
  geluExact<double>(x.data(), y.data(), 17);
  for (int i : {0, 5, 11}) {
    double v = x[i];
    EXPECT_NEAR(y[i], 0.5 * v * std::erfc(-v / std::sqrt(2.0)), 1e-12) << i;
  }
  // differs from the tanh form by up to ~1e-3 near |x| ~ 2: the two are not
  // interchangeable
  std::vector<double> t(17);
  gelu<double>(x.data(), t.data(), 17);
  double most = 0;
  for (int i = 0; i < 17; ++i)
    most = std::max(most, std::fabs(t[i] - y[i]));
  EXPECT_GT(most, 1e-5);
  geluExactGrad<double>(x.data(), dy.data(), dx.data(), 17);
  checkVjp(x, dy, [&] {
    std::vector<double> o(17);
    geluExact<double>(x.data(), o.data(), 17);
    return o;
  }, dx, "gelu exact");
}

TEST(KernelsTest, SoftmaxGradient) {
  int64_t r = 3, c = 5;
  std::vector<double> x = randomVec(r * c, 3), y(r * c), dy = randomVec(r * c, 4),
                      dx(r * c);
  softmax<double>(x.data(), y.data(), r, c);
  double sum = 0;
  for (int i = 0; i < c; ++i)
    sum += y[i];
  EXPECT_NEAR(sum, 1.0, 1e-12);
  softmaxGrad<double>(y.data(), dy.data(), dx.data(), r, c);
  checkVjp(x, dy, [&] {
    std::vector<double> o(r * c);
    softmax<double>(x.data(), o.data(), r, c);
    return o;
  }, dx, "softmax");
}

TEST(KernelsTest, LayerNormGradientsOfInputGammaBeta) {
  int64_t r = 4, c = 6;
  std::vector<double> x = randomVec(r * c, 5), g = randomVec(c, 6), b = randomVec(c, 7);
  std::vector<double> dy = randomVec(r * c, 8), dx(r * c), dg(c), db(c);
  layerNormGrad<double>(x.data(), g.data(), dy.data(), dx.data(), dg.data(),
                        db.data(), r, c, 1e-5);
  auto fwd = [&] {
    std::vector<double> o(r * c);
    layerNorm<double>(x.data(), g.data(), b.data(), o.data(), r, c, 1e-5);
    return o;
  };
  checkVjp(x, dy, fwd, dx, "layer_norm d_input");
  checkVjp(g, dy, fwd, dg, "layer_norm d_gamma");
  checkVjp(b, dy, fwd, db, "layer_norm d_beta");
}

class AttentionTest : public ::testing::TestWithParam<bool> {};

TEST_P(AttentionTest, GradientsOfQKV) {
  bool causal = GetParam();
  int64_t B = 2, T = 4, C = 6, H = 2, n = B * T * C;
  std::vector<double> q = randomVec(n, 9), k = randomVec(n, 10), v = randomVec(n, 11);
  std::vector<double> dy = randomVec(n, 12), dq(n), dk(n), dv(n), y(n), lse(B * H * T);
  attention<double>(q.data(), k.data(), v.data(), y.data(), lse.data(), B, T, C, H, causal);
  // The log-sum-exp the forward saves, from its definition:
  // lse[b, h, t] = log sum_{s visible from t} exp(q_t . k_s / sqrt(D)).
  int64_t D = C / H;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        double sum = 0;
        for (int64_t s = 0; s < (causal ? t + 1 : T); ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += q[(b * T + t) * C + h * D + d] * k[(b * T + s) * C + h * D + d];
          sum += std::exp(dot / std::sqrt(double(D)));
        }
        EXPECT_NEAR(lse[(b * H + h) * T + t], std::log(sum), 1e-12)
            << "b " << b << " h " << h << " t " << t;
      }
  attentionGrad<double>(q.data(), k.data(), v.data(), lse.data(), dy.data(), dq.data(),
                        dk.data(), dv.data(), B, T, C, H, causal);
  auto fwd = [&] {
    std::vector<double> o(n);
    attention<double>(q.data(), k.data(), v.data(), o.data(), nullptr, B, T, C, H, causal);
    return o;
  };
  EXPECT_EQ(fwd(), y) << "the output does not depend on whether lse is written";
  checkVjp(q, dy, fwd, dq, "attention dq");
  checkVjp(k, dy, fwd, dk, "attention dk");
  checkVjp(v, dy, fwd, dv, "attention dv");
  if (causal) {
    // Position 0 attends only to itself: its output is v[0].
    std::vector<double> o = fwd();
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(o[c], v[c], 1e-12);
  }
}
INSTANTIATE_TEST_SUITE_P(CausalAndNot, AttentionTest, ::testing::Bool());

class GroupedAttentionTest : public ::testing::TestWithParam<bool> {};

TEST_P(GroupedAttentionTest, GradientsOfQKVAndTheRepeatKvMapping) {
  // 4 query heads of D = 2 over 2 key/value heads: query heads 0 and 1 read
  // key/value head 0, heads 2 and 3 read head 1.
  bool causal = GetParam();
  int64_t B = 2, T = 3, H = 4, G = 2, D = 2, C = H * D, Ck = G * D;
  int64_t n = B * T * C, nk = B * T * Ck;
  std::vector<double> q = randomVec(n, 21), k = randomVec(nk, 22), v = randomVec(nk, 23);
  std::vector<double> dy = randomVec(n, 24), dq(n), dk(nk), dv(nk), y(n), lse(B * H * T);
  attention<double>(q.data(), k.data(), v.data(), y.data(), lse.data(), B, T, C, H, causal, G);
  attentionGrad<double>(q.data(), k.data(), v.data(), lse.data(), dy.data(), dq.data(),
                        dk.data(), dv.data(), B, T, C, H, causal, G);
  auto fwd = [&] {
    std::vector<double> o(n);
    attention<double>(q.data(), k.data(), v.data(), o.data(), nullptr, B, T, C, H, causal, G);
    return o;
  };
  checkVjp(q, dy, fwd, dq, "grouped attention dq");
  checkVjp(k, dy, fwd, dk, "grouped attention dk");
  checkVjp(v, dy, fwd, dv, "grouped attention dv");
  // The same as multi-head attention on keys and values repeated per head
  // (HF's repeat_kv): kv head h / (H / G) for query head h.
  std::vector<double> kr(n), vr(n), want(n);
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        kr[bt * C + h * D + d] = k[bt * Ck + (h / (H / G)) * D + d];
        vr[bt * C + h * D + d] = v[bt * Ck + (h / (H / G)) * D + d];
      }
  std::vector<double> wantLse(B * H * T);
  attention<double>(q.data(), kr.data(), vr.data(), want.data(), wantLse.data(), B, T, C, H,
                    causal);
  std::vector<double> got = fwd();
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(got[i], want[i], 1e-12) << "element " << i;
  for (int64_t i = 0; i < B * H * T; ++i)
    EXPECT_NEAR(lse[i], wantLse[i], 1e-12) << "lse element " << i;
}
INSTANTIATE_TEST_SUITE_P(CausalAndNot, GroupedAttentionTest, ::testing::Bool());

TEST(KernelsTest, RmsNormValuesAndGradientsOfInputAndWeight) {
  int64_t r = 4, c = 6;
  double eps = 1e-5;
  std::vector<double> x = randomVec(r * c, 25), w = randomVec(c, 26);
  std::vector<double> y(r * c), dy = randomVec(r * c, 27), dx(r * c), dw(c);
  rmsNorm<double>(x.data(), w.data(), y.data(), r, c, eps);
  double ss = 0;
  for (int64_t j = 0; j < c; ++j)
    ss += x[c + j] * x[c + j];
  EXPECT_NEAR(y[c + 2], x[c + 2] / std::sqrt(ss / c + eps) * w[2], 1e-12);
  rmsNormGrad<double>(x.data(), w.data(), dy.data(), dx.data(), dw.data(), r, c, eps);
  auto fwd = [&] {
    std::vector<double> o(r * c);
    rmsNorm<double>(x.data(), w.data(), o.data(), r, c, eps);
    return o;
  };
  checkVjp(x, dy, fwd, dx, "rms_norm d_input");
  checkVjp(w, dy, fwd, dw, "rms_norm d_weight");
}

TEST(KernelsTest, RopeRotatesHalvesAndItsGradientTurnsBack) {
  int64_t B = 2, T = 5, H = 2, D = 4, C = H * D, n = B * T * C;
  double theta = 100.0;
  std::vector<double> x = randomVec(n, 28), y(n), dy = randomVec(n, 29), dx(n);
  rope<double>(x.data(), y.data(), B, T, C, H, theta);
  // Position 0 is not rotated.
  for (int64_t j = 0; j < C; ++j)
    EXPECT_NEAR(y[j], x[j], 1e-15);
  // Batch 1, position 3, head 1, pair i = 1: elements 1 and 3 of the head,
  // angle 3 * theta^(-2/4) (rotate-half, not interleaved pairs).
  int64_t base = (1 * T + 3) * C + 1 * D;
  double a = 3 * std::pow(theta, -0.5);
  EXPECT_NEAR(y[base + 1], x[base + 1] * std::cos(a) - x[base + 3] * std::sin(a), 1e-12);
  EXPECT_NEAR(y[base + 3], x[base + 3] * std::cos(a) + x[base + 1] * std::sin(a), 1e-12);
  ropeGrad<double>(dy.data(), dx.data(), B, T, C, H, theta);
  checkVjp(x, dy, [&] {
    std::vector<double> o(n);
    rope<double>(x.data(), o.data(), B, T, C, H, theta);
    return o;
  }, dx, "rope");
  // The gradient rotation inverts the forward one.
  std::vector<double> back(n);
  ropeGrad<double>(y.data(), back.data(), B, T, C, H, theta);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(back[i], x[i], 1e-12);
}

TEST(KernelsTest, SiluAndItsGradient) {
  std::vector<double> x = randomVec(17, 30, 3.0), y(17), dy = randomVec(17, 31), dx(17);
  x[0] = -800; // exp(800) overflows: silu must give -0, not NaN
  silu<double>(x.data(), y.data(), 17);
  EXPECT_EQ(y[0], 0.0);
  EXPECT_NEAR(y[3], x[3] / (1 + std::exp(-x[3])), 1e-15);
  siluGrad<double>(x.data(), dy.data(), dx.data(), 17);
  EXPECT_EQ(dx[0], 0.0);
  checkVjp(x, dy, [&] {
    std::vector<double> o(17);
    silu<double>(x.data(), o.data(), 17);
    return o;
  }, dx, "silu");
}

TEST(KernelsTest, SwigluAndItsGradient) {
  const int64_t n = 19;
  std::vector<double> g = randomVec(n, 32, 3.0), u = randomVec(n, 33), dy = randomVec(n, 34);
  std::vector<double> y(n), s(n), dg(n), du(n);
  g[0] = -800; // silu(-800) = -0: no NaN in either gradient
  swiglu<double>(g.data(), u.data(), y.data(), n);
  silu<double>(g.data(), s.data(), n);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(y[i], s[i] * u[i]) << i; // silu then mul, bitwise
  swigluGrad<double>(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  EXPECT_EQ(dg[0], 0.0);
  checkVjp(g, dy, [&] {
    std::vector<double> o(n);
    swiglu<double>(g.data(), u.data(), o.data(), n);
    return o;
  }, dg, "swiglu d_gate");
  checkVjp(u, dy, [&] {
    std::vector<double> o(n);
    swiglu<double>(g.data(), u.data(), o.data(), n);
    return o;
  }, du, "swiglu d_up");
}

// Label smoothing e (PyTorch's label_smoothing): the loss is (1 - e) of
// -log p[label] plus e of the mean over the classes of -log p[c], here
// written out from log-softmax independently of the kernel's lse - mean(x)
// form; its gradient matches finite differences, each row's gradient sums
// to 0 (softmax and the target both sum to 1), the padding columns are left
// out (classes 7 of 8 columns) and e = 0 is the unsmoothed loss bit for bit.
TEST(KernelsTest, CrossEntropyLabelSmoothing) {
  const int64_t r = 5, c = 7, stride = 8;
  std::vector<double> logits = randomVec(r * stride, 41, 2.0), dl{1.3};
  for (int64_t i = 0; i < r; ++i)
    logits[i * stride + c] = 50.0; // padding: outside the softmax
  std::vector<int32_t> labels{0, 3, 6, 3, 1};
  for (double e : {0.0, 0.1, 0.5, 1.0}) {
    SCOPED_TRACE("smoothing " + std::to_string(e));
    double want = 0;
    for (int64_t i = 0; i < r; ++i) {
      const double *x = logits.data() + i * stride;
      double mx = *std::max_element(x, x + c), z = 0;
      for (int64_t j = 0; j < c; ++j)
        z += std::exp(x[j] - mx);
      double nllLabel = -(x[labels[i]] - mx - std::log(z)), nllMean = 0;
      for (int64_t j = 0; j < c; ++j)
        nllMean += -(x[j] - mx - std::log(z)) / c;
      want += ((1 - e) * nllLabel + e * nllMean) / r;
    }
    double got;
    ASSERT_EQ((crossEntropy<double, int32_t>(logits.data(), labels.data(), &got, r, c, stride, e)),
              -1);
    EXPECT_NEAR(got, want, 1e-14 * std::abs(want));
    std::vector<double> g(r * stride, NAN);
    ASSERT_EQ((crossEntropyGrad<double, int32_t>(logits.data(), labels.data(), dl.data(), g.data(),
                                                 r, c, stride, e)),
              -1);
    for (int64_t i = 0; i < r; ++i) {
      double rowSum = 0;
      for (int64_t j = 0; j < c; ++j)
        rowSum += g[i * stride + j];
      EXPECT_NEAR(rowSum, 0.0, 1e-14) << "row " << i; // 7 terms of |g| < 1, rounded
      EXPECT_EQ(g[i * stride + c], 0.0) << "padding of row " << i;
    }
    checkVjp(
        logits, dl,
        [&] {
          std::vector<double> o(1);
          crossEntropy<double, int32_t>(logits.data(), labels.data(), o.data(), r, c, stride, e);
          return o;
        },
        g, "cross_entropy label_smoothing");
    if (e == 0) {
      double plain;
      std::vector<double> pg(r * stride);
      crossEntropy<double, int32_t>(logits.data(), labels.data(), &plain, r, c, stride);
      crossEntropyGrad<double, int32_t>(logits.data(), labels.data(), dl.data(), pg.data(), r, c,
                                        stride);
      EXPECT_EQ(got, plain);
      EXPECT_EQ(g, pg);
    }
  }
  // Smoothing moves the loss: e = 0.1 differs from e = 0 by more than
  // rounding (the test above would pass a kernel that ignored e only if
  // the two coincided).
  double l0, l1;
  crossEntropy<double, int32_t>(logits.data(), labels.data(), &l0, r, c, stride, 0.0);
  crossEntropy<double, int32_t>(logits.data(), labels.data(), &l1, r, c, stride, 0.1);
  EXPECT_GT(std::abs(l1 - l0), 1e-3);
}

// ignore_index (PyTorch's): a row whose label is the index adds nothing
// to the loss and gets a zero gradient row (padding included), its label
// is not range-checked (-100), and the loss is the kept rows' sum over the
// normalizer. With the normalizer the kept count the result is the plain
// loss of the kept rows alone (bit for bit with one kept row set and the
// same order of summation: computed here on the kept rows as a batch of
// their own); with another normalizer (a global count) the loss and
// gradient scale by count / normalizer; a normalizer of 0 gives 0 and a
// zero gradient. The gradient matches finite differences, with smoothing
// too. countLabels counts what differs from the index, over the divisor.
TEST(KernelsTest, CrossEntropyIgnoreIndex) {
  const int64_t r = 6, c = 7, stride = 8;
  std::vector<double> logits = randomVec(r * stride, 43, 2.0), dl{1.3};
  for (int64_t i = 0; i < r; ++i)
    logits[i * stride + c] = 50.0; // padding
  std::vector<int32_t> labels{2, -100, 6, -100, 0, 5};
  std::vector<int64_t> kept{0, 2, 4, 5};
  EXPECT_EQ(countLabels(labels.data(), r, -100, 1), 4.0f);
  EXPECT_EQ(countLabels(labels.data(), r, -100, 3), (float)(4.0 / 3.0));
  EXPECT_EQ(countLabels(labels.data(), r, 5, 1), 5.0f);
  std::vector<int64_t> labels64(labels.begin(), labels.end());
  EXPECT_EQ(countLabels(labels64.data(), r, -100, 2), 2.0f);
  // The kept rows as a batch of their own.
  std::vector<double> keptLogits;
  std::vector<int32_t> keptLabels;
  for (int64_t i : kept) {
    keptLogits.insert(keptLogits.end(), logits.begin() + i * stride,
                      logits.begin() + (i + 1) * stride);
    keptLabels.push_back(labels[i]);
  }
  for (double e : {0.0, 0.1}) {
    SCOPED_TRACE("smoothing " + std::to_string(e));
    double want, got;
    crossEntropy<double, int32_t>(keptLogits.data(), keptLabels.data(), &want, 4, c, stride, e);
    const double four = 4;
    ASSERT_EQ((crossEntropy<double, int32_t>(logits.data(), labels.data(), &got, r, c, stride, e,
                                             &four, -100)),
              -1);
    EXPECT_NEAR(got, want, 1e-15 * std::abs(want));
    std::vector<double> g(r * stride, NAN), wantG(4 * stride);
    ASSERT_EQ((crossEntropyGrad<double, int32_t>(logits.data(), labels.data(), dl.data(), g.data(),
                                                 r, c, stride, e, &four, -100)),
              -1);
    crossEntropyGrad<double, int32_t>(keptLogits.data(), keptLabels.data(), dl.data(), wantG.data(),
                                      4, c, stride, e);
    for (int64_t i = 0, k = 0; i < r; ++i) {
      bool isKept = labels[i] != -100;
      for (int64_t j = 0; j < stride; ++j)
        if (isKept)
          EXPECT_EQ(g[i * stride + j], wantG[k * stride + j]) << i << "," << j;
        else
          EXPECT_EQ(g[i * stride + j], 0.0) << "ignored row " << i << ", column " << j;
      k += isKept;
    }
    checkVjp(
        logits, dl,
        [&] {
          std::vector<double> o(1);
          crossEntropy<double, int32_t>(logits.data(), labels.data(), o.data(), r, c, stride, e,
                                        &four, -100);
          return o;
        },
        g, "cross_entropy ignore_index");
    // A global count of 10 (other ranks' rows): 4/10 of the local mean.
    const double ten = 10;
    double scaled;
    std::vector<double> g10(r * stride);
    crossEntropy<double, int32_t>(logits.data(), labels.data(), &scaled, r, c, stride, e, &ten,
                                  -100);
    crossEntropyGrad<double, int32_t>(logits.data(), labels.data(), dl.data(), g10.data(), r, c,
                                      stride, e, &ten, -100);
    EXPECT_NEAR(scaled, want * 0.4, 1e-15 * std::abs(want));
    for (int64_t i = 0; i < r * stride; ++i)
      EXPECT_NEAR(g10[i], g[i] * 0.4, 1e-15) << i;
  }
  // Every label ignored: count 0, loss 0, gradient 0.
  std::vector<int32_t> none(r, -100);
  const double zero = 0;
  double l = NAN;
  std::vector<double> g0(r * stride, NAN);
  ASSERT_EQ(
      (crossEntropy<double, int32_t>(logits.data(), none.data(), &l, r, c, stride, 0, &zero, -100)),
      -1);
  ASSERT_EQ((crossEntropyGrad<double, int32_t>(logits.data(), none.data(), dl.data(), g0.data(), r,
                                               c, stride, 0, &zero, -100)),
            -1);
  EXPECT_EQ(l, 0.0);
  for (double v : g0)
    EXPECT_EQ(v, 0.0);
  // Without ignore_index -100 is a bad label (row 1); with it, a label
  // outside the classes that is not the index still is (row 3: 7).
  double loss;
  EXPECT_EQ((crossEntropy<double, int32_t>(logits.data(), labels.data(), &loss, r, c, stride)), 1);
  std::vector<int32_t> bad = labels;
  bad[3] = 7;
  const double three = 3;
  EXPECT_EQ((crossEntropy<double, int32_t>(logits.data(), bad.data(), &loss, r, c, stride, 0,
                                           &three, -100)),
            3);
  std::vector<double> gb(r * stride);
  EXPECT_EQ((crossEntropyGrad<double, int32_t>(logits.data(), bad.data(), dl.data(), gb.data(), r,
                                               c, stride, 0, &three, -100)),
            3);
  // An ignore_index inside the classes (a pad token's id) leaves those
  // rows out too.
  std::vector<int32_t> pad{2, 3, 6, 3, 0, 5};
  const double four = 4;
  double padded, want;
  crossEntropy<double, int32_t>(logits.data(), pad.data(), &padded, r, c, stride, 0, &four, 3);
  crossEntropy<double, int32_t>(keptLogits.data(), keptLabels.data(), &want, 4, c, stride);
  EXPECT_NEAR(padded, want, 1e-15 * std::abs(want));
}

TEST(KernelsTest, LossGradients) {
  int64_t r = 5, c = 7;
  std::vector<double> logits = randomVec(r * c, 13), dl{1.7}, dlog(r * c);
  std::vector<int32_t> labels{0, 3, 6, 3, 1};
  crossEntropyGrad<double, int32_t>(logits.data(), labels.data(), dl.data(),
                                    dlog.data(), r, c);
  checkVjp(logits, dl, [&] {
    std::vector<double> o(1);
    crossEntropy<double, int32_t>(logits.data(), labels.data(), o.data(), r, c);
    return o;
  }, dlog, "cross_entropy");
  std::vector<int32_t> bad{0, 7, 0, 0, 0};
  double loss;
  EXPECT_EQ((crossEntropy<double, int32_t>(logits.data(), bad.data(), &loss, r, c)), 1);
  {
    // Rows padded to 8 columns (fsdp-pad-classes: classes = 7, stride 8):
    // the padding, holding a large value, is outside the softmax (the same
    // loss and gradient bit for bit) and its gradient is written 0; a
    // label in the padding is a bad label.
    const int64_t stride = 8;
    std::vector<double> padded(r * stride, 40.0), pg(r * stride, NAN);
    for (int64_t i = 0; i < r; ++i)
      std::copy_n(logits.begin() + i * c, c, padded.begin() + i * stride);
    double unpadded, got;
    crossEntropy<double, int32_t>(logits.data(), labels.data(), &unpadded, r, c);
    ASSERT_EQ((crossEntropy<double, int32_t>(padded.data(), labels.data(), &got, r, c, stride)),
              -1);
    EXPECT_EQ(got, unpadded);
    crossEntropyGrad<double, int32_t>(padded.data(), labels.data(), dl.data(), pg.data(), r, c,
                                      stride);
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j)
        EXPECT_EQ(pg[i * stride + j], dlog[i * c + j]) << i << "," << j;
      EXPECT_EQ(pg[i * stride + c], 0.0) << "padding of row " << i;
    }
    EXPECT_EQ((crossEntropy<double, int32_t>(padded.data(), bad.data(), &got, r, c, stride)), 1);
  }

  std::vector<double> x = randomVec(9, 14, 3.0), t(9), dx(9);
  for (int i = 0; i < 9; ++i)
    t[i] = i % 2;
  bceWithLogitsGrad<double>(x.data(), t.data(), dl.data(), dx.data(), 9);
  checkVjp(x, dl, [&] {
    std::vector<double> o(1);
    bceWithLogits<double>(x.data(), t.data(), o.data(), 9);
    return o;
  }, dx, "bce_with_logits");
  mseLossGrad<double>(x.data(), t.data(), dl.data(), dx.data(), 9);
  checkVjp(x, dl, [&] {
    std::vector<double> o(1);
    mseLoss<double>(x.data(), t.data(), o.data(), 9);
    return o;
  }, dx, "mse_loss");
  // A large logit must not overflow the stable BCE.
  double big = 800, one = 1, out;
  bceWithLogits<double>(&big, &one, &out, 1);
  EXPECT_NEAR(out, 0.0, 1e-12);
}

TEST(KernelsTest, EmbeddingScatterAddsRepeatedIds) {
  int64_t V = 5, W = 3;
  std::vector<double> table = randomVec(V * W, 15), dy = randomVec(4 * W, 16), dt(V * W);
  std::vector<int64_t> ids{1, 4, 1, 0};
  ASSERT_EQ((embeddingGrad<double, int64_t>(ids.data(), dy.data(), dt.data(), 4, V, W)), -1);
  checkVjp(table, dy, [&] {
    std::vector<double> o(4 * W);
    embedding<double, int64_t>(table.data(), ids.data(), o.data(), 4, V, W);
    return o;
  }, dt, "embedding");
  std::vector<int64_t> bad{1, 5};
  std::vector<double> o(2 * W);
  EXPECT_EQ((embedding<double, int64_t>(table.data(), bad.data(), o.data(), 2, V, W)), 1);
}

// The row-repeat fast paths (a suffix shape: bias, position table) give
// the bits of the general broadcast walk: each element's one operation,
// and a sum over rows in row order. References written out here in that
// order, in float (the kernels' type in training), on shapes that take the
// fast path and ones that do not.
TEST(KernelsTest, BroadcastFastPathsAreTheGeneralWalkBitwise) {
  struct Case {
    Shape big, small;
  } cases[] = {{{3, 5, 4}, {5, 4}}, {{7, 9}, {9}}, {{2, 3, 4}, {1, 1, 4}},
               {{6, 4}, {6, 1}}, {{2, 3, 4}, {3, 1}}, {{5, 3}, {1, 3}}};
  for (const Case &cs : cases) {
    int64_t nb = numel(cs.big), ns = numel(cs.small);
    std::vector<float> big(nb), small(ns);
    for (int64_t i = 0; i < nb; ++i)
      big[i] = (float)std::sin(1.3 * i + 0.2) * 3.0f;
    for (int64_t i = 0; i < ns; ++i)
      small[i] = (float)std::cos(0.7 * i) * 1e-3f;
    // Index of `small` each element of `big` meets, by broadcasting rules.
    std::vector<int64_t> at(nb);
    Shape sb = cs.big, ss = cs.small;
    for (int64_t i = 0; i < nb; ++i) {
      int64_t rem = i, off = 0, stride = 1;
      for (int64_t d = (int64_t)sb.size() - 1, e = (int64_t)ss.size() - 1; d >= 0; --d, --e) {
        int64_t idx = rem % sb[d];
        rem /= sb[d];
        if (e >= 0) {
          if (ss[e] != 1)
            off += idx * stride;
          stride *= ss[e];
        }
      }
      at[i] = off;
    }
    std::vector<float> sum(ns, 0.0f), got(ns), add(nb), addGot(nb), sub(nb), subGot(nb),
        bc(nb), bcGot(nb);
    for (int64_t i = 0; i < nb; ++i) {
      sum[at[i]] += big[i];
      add[i] = big[i] + small[at[i]];
      sub[i] = small[at[i]] - big[i];
      bc[i] = small[at[i]];
    }
    sumTo<float>(big.data(), cs.big, got.data(), cs.small);
    binary<float>(BinaryKind::Add, big.data(), cs.big, small.data(), cs.small, addGot.data(),
                  cs.big);
    binary<float>(BinaryKind::Sub, small.data(), cs.small, big.data(), cs.big, subGot.data(),
                  cs.big);
    broadcastTo<float>(small.data(), cs.small, bcGot.data(), cs.big);
    std::string what = rules::shapeStr(cs.big) + " / " + rules::shapeStr(cs.small);
    EXPECT_EQ(std::memcmp(sum.data(), got.data(), 4 * ns), 0) << "sum_to " << what;
    EXPECT_EQ(std::memcmp(add.data(), addGot.data(), 4 * nb), 0) << "add " << what;
    EXPECT_EQ(std::memcmp(sub.data(), subGot.data(), 4 * nb), 0) << "sub " << what;
    EXPECT_EQ(std::memcmp(bc.data(), bcGot.data(), 4 * nb), 0) << "broadcast " << what;
  }
}

TEST(KernelsTest, BroadcastAndSumToAreAdjoint) {
  Shape small{3, 1, 4}, big{2, 3, 5, 4};
  std::vector<double> x = randomVec(12, 17), dy = randomVec(120, 18), dx(12);
  sumTo<double>(dy.data(), big, dx.data(), small);
  checkVjp(x, dy, [&] {
    std::vector<double> o(120);
    broadcastTo<double>(x.data(), small, o.data(), big);
    return o;
  }, dx, "broadcast");
  // Binary with broadcasting on both sides.
  Shape sa{2, 1, 4}, sb{3, 1}, so{2, 3, 4};
  std::vector<double> a = randomVec(8, 19), b = randomVec(3, 20), out(24);
  binary<double>(BinaryKind::Mul, a.data(), sa, b.data(), sb, out.data(), so);
  EXPECT_NEAR(out[1 * 12 + 2 * 4 + 3], a[1 * 4 + 3] * b[2], 1e-15);
}

TEST(KernelsTest, TransposeSliceAndTheirAdjoints) {
  Shape s{2, 3, 4};
  std::vector<double> x = randomVec(24, 21), y(24);
  transpose<double>(x.data(), s, {2, 0, 1}, y.data());
  // y[k][i][j] = x[i][j][k]
  EXPECT_EQ(y[(3 * 2 + 1) * 3 + 2], x[(1 * 3 + 2) * 4 + 3]);
  std::vector<double> dy = randomVec(2 * 2 * 4, 22), dx(24);
  sliceGrad<double>(dy.data(), dx.data(), 2, 3, 2, 4, 1);
  checkVjp(x, dy, [&] {
    std::vector<double> o(16);
    slice<double>(x.data(), o.data(), 2, 3, 2, 4, 1);
    return o;
  }, dx, "slice");
}

TEST(KernelsTest, MatmulTransposeFlags) {
  // C = A^T B^T with A [k=3, m=2], B [n=4, k=3].
  std::vector<double> a = randomVec(6, 23), b = randomVec(12, 24), c(8);
  matmul<double>(a.data(), b.data(), c.data(), 1, 2, 4, 3, true, true);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      double want = 0;
      for (int k = 0; k < 3; ++k)
        want += a[k * 2 + i] * b[j * 3 + k];
      EXPECT_NEAR(c[i * 4 + j], want, 1e-12);
    }
}

TEST(KernelsTest, AdamWMatchesTorchFormulas) {
  std::vector<double> p{0.5, -1.0}, g{0.1, 0.2}, m{0.0, 0.0}, v{0.0, 0.0};
  double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  std::vector<double> want = p, mw = m, vw = v;
  for (int step = 1; step <= 3; ++step) {
    for (int i = 0; i < 2; ++i) {
      want[i] *= 1 - lr * wd;
      mw[i] = b1 * mw[i] + (1 - b1) * g[i];
      vw[i] = b2 * vw[i] + (1 - b2) * g[i] * g[i];
      double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
      want[i] -= lr / bc1 * mw[i] / (std::sqrt(vw[i]) / std::sqrt(bc2) + eps);
    }
    adamwUpdate<double>(p.data(), g.data(), m.data(), v.data(), p.data(), m.data(),
                        v.data(), 2, lr, step, b1, b2, eps, wd);
  }
  EXPECT_NEAR(p[0], want[0], 1e-14);
  EXPECT_NEAR(p[1], want[1], 1e-14);
  // After the first step Adam moves each weight by about lr.
  EXPECT_NEAR(std::fabs(0.5 * (1 - lr * wd) - 0.5), lr * wd * 0.5, 1e-15);
}


// The f32 update is vectorized (omp simd, -fno-math-errno). Each element
// must still round exactly as torch's scalar sequence of f32 operations:
// packed sqrt / divide round like the scalar ones, and an FMA contraction
// (-march with FMA) or -ffast-math reassociation would change the last
// bits. The reference forces every rounding through a volatile float, so
// no contraction can hide in it either. Sizes cover the vector tail, the
// parallel path (n > 2^15) and both in-place and separate outputs.
TEST(KernelsTest, AdamWFloatIsTheScalarRoundingBitwise) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f), e(-12.f, 2.f);
  auto draw = [&](size_t n, bool positive) {
    std::vector<float> x(n);
    for (float &y : x) {
      float mag = std::pow(10.f, e(rng));
      y = positive ? mag * mag : u(rng) * mag;
    }
    return x;
  };
  const double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  for (size_t n : {size_t(1), size_t(37), size_t(1003), size_t(40000)}) {
    for (int64_t step : {int64_t(1), int64_t(7), int64_t(1000)}) {
      std::vector<float> p = draw(n, false), g = draw(n, false), m = draw(n, false),
                         v = draw(n, true);
      std::vector<float> wp(n), wm(n), wv(n);
      double bc1 = 1 - std::pow(beta1, (double)step), bc2 = 1 - std::pow(beta2, (double)step);
      const float stepSize = (float)(lr / bc1), bc2Sqrt = (float)std::sqrt(bc2),
                  decay = (float)(1 - lr * wd), b1 = (float)beta1, b2 = (float)beta2,
                  c1 = (float)(1 - beta1), c2 = (float)(1 - beta2), fe = (float)eps;
      for (size_t i = 0; i < n; ++i) {
        volatile float pi = p[i] * decay;
        volatile float a = m[i] * b1, b = c1 * g[i];
        volatile float mi = a + b;
        volatile float c = v[i] * b2, d = c2 * g[i];
        volatile float d2 = d * g[i];
        volatile float vi = c + d2;
        volatile float s = std::sqrt((float)vi);
        volatile float q = s / bc2Sqrt;
        volatile float den = q + fe;
        volatile float r = mi / den;
        volatile float upd = stepSize * r;
        wp[i] = pi - upd;
        wm[i] = mi;
        wv[i] = vi;
      }
      std::vector<float> np(n), nm(n), nv(n);
      adamwUpdate<float>(p.data(), g.data(), m.data(), v.data(), np.data(), nm.data(),
                         nv.data(), (int64_t)n, lr, step, beta1, beta2, eps, wd);
      adamwUpdate<float>(p.data(), g.data(), m.data(), v.data(), p.data(), m.data(),
                         v.data(), (int64_t)n, lr, step, beta1, beta2, eps, wd);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(&np[i], &wp[i], 4), 0)
            << "param " << i << " of " << n << ", step " << step << ": " << np[i]
            << " vs " << wp[i];
        ASSERT_EQ(std::memcmp(&nm[i], &wm[i], 4), 0) << "exp_avg " << i << " of " << n;
        ASSERT_EQ(std::memcmp(&nv[i], &wv[i], 4), 0) << "exp_avg_sq " << i << " of " << n;
        ASSERT_EQ(std::memcmp(&p[i], &wp[i], 4), 0) << "in-place param " << i;
        ASSERT_EQ(std::memcmp(&m[i], &wm[i], 4), 0) << "in-place exp_avg " << i;
        ASSERT_EQ(std::memcmp(&v[i], &wv[i], 4), 0) << "in-place exp_avg_sq " << i;
      }
    }
  }
}
TEST(KernelsTest, SgdMomentumFirstStepClonesTheGradient) {
  std::vector<double> p{1.0}, g{0.5}, buf{123.0};
  sgdMomentumUpdate<double>(p.data(), g.data(), buf.data(), p.data(), buf.data(),
                            1, 0.1, 1, 0.9, 0.5, 0.0, false);
  EXPECT_DOUBLE_EQ(buf[0], 0.5); // not 0.9 * 123 + 0.5 * 0.5
  EXPECT_DOUBLE_EQ(p[0], 1.0 - 0.1 * 0.5);
  sgdMomentumUpdate<double>(p.data(), g.data(), buf.data(), p.data(), buf.data(),
                            1, 0.1, 2, 0.9, 0.5, 0.0, true);
  double b2 = 0.9 * 0.5 + 0.5 * 0.5;
  EXPECT_DOUBLE_EQ(buf[0], b2);
  EXPECT_DOUBLE_EQ(p[0], 0.95 - 0.1 * (0.5 + 0.9 * b2));
}

// grad_scale: each update of g with a scale is bitwise the update of the
// product g * scale rounded to f32 (the clipping mul it replaces).
TEST(KernelsTest, UpdatesWithGradScaleUpdateTheRoundedProduct) {
  const int64_t n = 1000;
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = d(rng);
    g[i] = d(rng);
    m[i] = d(rng);
    v[i] = std::fabs(d(rng));
  }
  auto same = [](const std::vector<float> &x, const std::vector<float> &y) {
    return std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
  };
  for (float scale : {0.3712f, 1.f / 65536, 0.f}) {
    std::vector<float> prod(n);
    for (int64_t i = 0; i < n; ++i)
      prod[i] = g[i] * scale;
    std::vector<float> a(n), am(n), av(n), b(n), bm(n), bv(n);
    adamwUpdate<float>(p.data(), g.data(), m.data(), v.data(), a.data(), am.data(), av.data(),
                       n, 1e-3, 3, 0.9, 0.95, 1e-8, 0.1, scale);
    adamwUpdate<float>(p.data(), prod.data(), m.data(), v.data(), b.data(), bm.data(),
                       bv.data(), n, 1e-3, 3, 0.9, 0.95, 1e-8, 0.1);
    EXPECT_TRUE(same(a, b) && same(am, bm) && same(av, bv)) << "adamw, scale " << scale;
    sgdMomentumUpdate<float>(p.data(), g.data(), m.data(), a.data(), am.data(), n, 1e-2, 3, 0.9,
                             0.1, 0.1, true, scale);
    sgdMomentumUpdate<float>(p.data(), prod.data(), m.data(), b.data(), bm.data(), n, 1e-2, 3,
                             0.9, 0.1, 0.1, true);
    EXPECT_TRUE(same(a, b) && same(am, bm)) << "sgd momentum, scale " << scale;
    sgdUpdate<float>(p.data(), g.data(), a.data(), n, 1e-2, 0.1, scale);
    sgdUpdate<float>(p.data(), prod.data(), b.data(), n, 1e-2, 0.1);
    EXPECT_TRUE(same(a, b)) << "sgd, scale " << scale;
    // and not the update of the unscaled gradient
    sgdUpdate<float>(p.data(), g.data(), b.data(), n, 1e-2, 0.1);
    EXPECT_FALSE(same(a, b)) << "sgd, scale " << scale << " ignored";
  }
}

// LAMB against a reference written per parameter, as timm's Lamb steps
// each tensor: its own moments, update direction, norms and trust ratio.
// The unit: A [0, 6), B [6, 10) (all zero at first: trust 1), C [10, 13)
// decayed (decay_numel 13, a segment bound), D [13, 20) not, then 4
// elements of padding, large so that summing them would show.
TEST(KernelsTest, LambMatchesAPerParameterReference) {
  const std::vector<int64_t> seg{0, 6, 10, 13, 20};
  const int64_t K = 4, n = 24, decayed = 13;
  const double lr = 2e-2, b1 = 0.9, b2 = 0.99, eps = 1e-6, wd = 0.05;
  std::vector<double> p = randomVec(n, 61), m(n), v(n);
  for (int64_t i = 6; i < 10; ++i)
    p[i] = 0;
  for (int64_t i = 20; i < n; ++i)
    p[i] = 1e3 * (i - 19);
  std::vector<double> want = p, wm = m, wv = v;
  LambLayout layout{seg, 0, decayed};
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<double> g = randomVec(n, 70 + step);
    double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    std::vector<double> wantNorms(2 * K), u(n);
    for (int64_t k = 0; k <= K; ++k) { // k == K: the padding
      int64_t lo = seg[std::min(k, K)], hi = k < K ? seg[k + 1] : n;
      bool decays = lo < decayed;
      double pn = 0, un = 0;
      for (int64_t i = lo; i < hi; ++i) {
        wm[i] = b1 * wm[i] + (1 - b1) * g[i];
        wv[i] = b2 * wv[i] + (1 - b2) * g[i] * g[i];
        u[i] =
            wm[i] / bc1 / (std::sqrt(wv[i]) / std::sqrt(bc2) + eps) + (decays ? wd * want[i] : 0.0);
        pn += want[i] * want[i];
        un += u[i] * u[i];
      }
      double trust = k < K && decays && pn > 0 && un > 0 ? std::sqrt(pn / un) : 1.0;
      if (k < K) {
        wantNorms[k] = pn;
        wantNorms[K + k] = un;
      }
      for (int64_t i = lo; i < hi; ++i)
        want[i] -= lr * trust * u[i];
    }
    std::vector<double> norms(2 * K, -1.0);
    lambNorms<double>(p.data(), g.data(), m.data(), v.data(), norms.data(), n, layout, step, b1, b2,
                      eps, wd);
    for (int64_t k = 0; k < 2 * K; ++k)
      EXPECT_NEAR(norms[k], wantNorms[k], 1e-12 * (1 + wantNorms[k]))
          << "sum " << k << ", step " << step;
    if (step == 1) {
      EXPECT_EQ(norms[1], 0.0); // B is zero: trust 1, not 0 / ||u||
    }
    lambUpdate<double>(p.data(), g.data(), m.data(), v.data(), norms.data(), p.data(), m.data(),
                       v.data(), n, layout, lr, step, b1, b2, eps, wd);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(p[i], want[i], 1e-12 * (1 + std::fabs(want[i])))
          << "param " << i << ", step " << step;
      EXPECT_NEAR(m[i], wm[i], 1e-14) << "exp_avg " << i;
      EXPECT_NEAR(v[i], wv[i], 1e-14) << "exp_avg_sq " << i;
    }
  }
  // Not AdamW: the trust ratio rescales the decayed parameters' steps.
  std::vector<double> q = randomVec(n, 61, 3.0), g = randomVec(n, 90), qm(n), qv(n), am(n), av(n),
                      a(n), norms(2 * K);
  lambNorms<double>(q.data(), g.data(), qm.data(), qv.data(), norms.data(), n, layout, 1, b1, b2,
                    eps, wd);
  lambUpdate<double>(q.data(), g.data(), qm.data(), qv.data(), norms.data(), a.data(), am.data(),
                     av.data(), n, layout, lr, 1, b1, b2, eps, wd);
  double trustA = std::sqrt(norms[0] / norms[K]);
  EXPECT_GT(std::fabs(trustA - 1), 0.1);
  for (int64_t i = 0; i < 6; ++i) { // step 1: m_hat / sqrt(v_hat) = sign(g)
    double u = (g[i] > 0 ? 1 : -1) / (1 + eps / std::fabs(g[i])) + wd * q[i];
    EXPECT_NEAR(a[i], q[i] - lr * trustA * u, 1e-12) << i;
  }
}

/// Bitwise equal.
template <typename T> bool sameBits(const std::vector<T> &x, const std::vector<T> &y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

// FSDP runs LAMB on shards: each rank's lamb_norms, an all-reduce of the
// sums, each rank's lamb_update. Three parameters (the last without decay)
// and 3 elements of padding in 4 shards of 651, the shard bounds inside
// parameters: the moments are the whole unit's bitwise, and so is the
// parameter when the summed sums are the whole unit's. They may not be:
// each shard's double sum is rounded to f32 before the (f32) all-reduce.
// Each rounding is within u = 2^-24 relative and the terms are >= 0, so a
// summed sum is within 4u (+ 3u for the 3 additions) of the exact one and
// the whole unit's within u: 8u apart; trust = sqrt(pn) / sqrt(un), so
// the two trusts are within 8u (halved by the roots, twice) plus one
// rounding each: 10u. The step lr * (u * trust) then differs by < 12u of
// itself, and the parameter by that plus one rounding: 16u |p - p'| + ulp.
TEST(KernelsTest, LambShardsAreTheWholeUnit) {
  const std::vector<int64_t> seg{0, 1000, 2500, 2601};
  const int64_t S = 4, stride = 651, n = S * stride, K = 3, decayed = 2500;
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = i < seg[K] ? d(rng) : 0.f;
    g[i] = i < seg[K] ? d(rng) * 1e-2f : 0.f;
    m[i] = d(rng) * 1e-3f;
    v[i] = std::fabs(d(rng)) * 1e-5f;
  }
  std::vector<float> whole(2 * K), wp(n), wm(n), wv(n);
  lambNorms<float>(p.data(), g.data(), m.data(), v.data(), whole.data(), n,
                   LambLayout{seg, 0, decayed}, 5, b1, b2, eps, wd);
  lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), whole.data(), wp.data(), wm.data(),
                    wv.data(), n, LambLayout{seg, 0, decayed}, lr, 5, b1, b2, eps, wd);
  std::vector<float> summed(2 * K, 0.f);
  for (int64_t s = 0; s < S; ++s) {
    std::vector<float> part(2 * K, -1.f);
    int64_t at = s * stride;
    lambNorms<float>(p.data() + at, g.data() + at, m.data() + at, v.data() + at, part.data(),
                     stride, LambLayout{seg, at, decayed}, 5, b1, b2, eps, wd);
    for (int64_t k = 0; k < 2 * K; ++k)
      summed[k] += part[k];
  }
  for (int64_t k = 0; k < 2 * K; ++k)
    EXPECT_NEAR(summed[k], whole[k], 8.0 / (1 << 24) * whole[k]) << "sum " << k;
  std::vector<float> sp(n), sm(n), sv(n);
  for (int64_t s = 0; s < S; ++s) {
    int64_t at = s * stride;
    lambUpdate<float>(p.data() + at, g.data() + at, m.data() + at, v.data() + at, summed.data(),
                      sp.data() + at, sm.data() + at, sv.data() + at, stride,
                      LambLayout{seg, at, decayed}, lr, 5, b1, b2, eps, wd);
  }
  EXPECT_TRUE(sameBits(sm, wm) && sameBits(sv, wv));
  if (sameBits(summed, whole)) {
    EXPECT_TRUE(sameBits(sp, wp));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      double ulp = std::nextafter(std::fabs(wp[i]), INFINITY) - std::fabs(wp[i]);
      EXPECT_LE(std::fabs((double)sp[i] - wp[i]),
                16.0 / (1 << 24) * std::fabs((double)p[i] - wp[i]) + ulp)
          << "param " << i;
    }
  }
  // The third parameter does not decay: AdamW's direction, trust 1
  // whatever the sums.
  for (int64_t i = 2500; i < 2601; ++i)
    EXPECT_EQ(wp[i], sp[i]) << i;
  // Given the whole unit's sums, each shard's update is the whole one's
  // bitwise (the trust ratios are; each element's arithmetic is).
  for (int64_t s = 0; s < S; ++s) {
    int64_t at = s * stride;
    lambUpdate<float>(p.data() + at, g.data() + at, m.data() + at, v.data() + at, whole.data(),
                      sp.data() + at, sm.data() + at, sv.data() + at, stride,
                      LambLayout{seg, at, decayed}, lr, 5, b1, b2, eps, wd);
  }
  EXPECT_TRUE(sameBits(sp, wp) && sameBits(sm, wm) && sameBits(sv, wv));
  // And the decayed ones do move by their trust ratios: parameters 0
  // and 1 with each other's sum of p^2 move otherwise.
  std::vector<float> swapped = whole, xp(n), xm(n), xv(n);
  std::swap(swapped[0], swapped[1]);
  lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), swapped.data(), xp.data(), xm.data(),
                    xv.data(), n, LambLayout{seg, 0, decayed}, lr, 5, b1, b2, eps, wd);
  EXPECT_FALSE(sameBits(xp, wp));
}

// grad_scale is the update of the rounded product g * scale (bitwise, both
// passes); the norms pass reads p, g, m, v and writes only the sums; a
// decay_numel at a bound (0, or the end) is none or all of the unit.
TEST(KernelsTest, LambGradScaleAndDecayBounds) {
  const std::vector<int64_t> seg{0, 300, 301, 777};
  const int64_t n = 800, K = 3;
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = d(rng);
    g[i] = d(rng);
    m[i] = d(rng) * 0.1f;
    v[i] = std::fabs(d(rng)) * 0.01f;
  }
  const std::vector<float> p0 = p, g0 = g, m0 = m, v0 = v;
  LambLayout all{seg, 0, INT64_MAX};
  for (float scale : {0.3712f, 1.f / 65536}) {
    std::vector<float> prod(n);
    for (int64_t i = 0; i < n; ++i)
      prod[i] = g[i] * scale;
    std::vector<float> na(2 * K), nb(2 * K), a(n), am(n), av(n), b(n), bm(n), bv(n);
    lambNorms<float>(p.data(), g.data(), m.data(), v.data(), na.data(), n, all, 4, 0.9, 0.999, 1e-6,
                     0.01, scale);
    lambNorms<float>(p.data(), prod.data(), m.data(), v.data(), nb.data(), n, all, 4, 0.9, 0.999,
                     1e-6, 0.01);
    EXPECT_TRUE(sameBits(na, nb)) << "norms, scale " << scale;
    lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), na.data(), a.data(), am.data(),
                      av.data(), n, all, 1e-3, 4, 0.9, 0.999, 1e-6, 0.01, scale);
    lambUpdate<float>(p.data(), prod.data(), m.data(), v.data(), na.data(), b.data(), bm.data(),
                      bv.data(), n, all, 1e-3, 4, 0.9, 0.999, 1e-6, 0.01);
    EXPECT_TRUE(sameBits(a, b) && sameBits(am, bm) && sameBits(av, bv)) << "scale " << scale;
    lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), na.data(), b.data(), bm.data(),
                      bv.data(), n, all, 1e-3, 4, 0.9, 0.999, 1e-6, 0.01);
    EXPECT_FALSE(sameBits(am, bm)) << "scale " << scale << " ignored";
  }
  EXPECT_TRUE(sameBits(p, p0) && sameBits(g, g0) && sameBits(m, m0) && sameBits(v, v0))
      << "lamb_norms wrote an operand";
  // decay_numel = 777 (the last bound) is every parameter, 0 none of them;
  // none is weight decay 0.
  std::vector<float> x(2 * K), y(2 * K), z(2 * K);
  lambNorms<float>(p.data(), g.data(), m.data(), v.data(), x.data(), n, all, 2, 0.9, 0.999, 1e-6,
                   0.01);
  lambNorms<float>(p.data(), g.data(), m.data(), v.data(), y.data(), n, LambLayout{seg, 0, 777}, 2,
                   0.9, 0.999, 1e-6, 0.01);
  EXPECT_TRUE(sameBits(x, y));
  lambNorms<float>(p.data(), g.data(), m.data(), v.data(), y.data(), n, LambLayout{seg, 0, 0}, 2,
                   0.9, 0.999, 1e-6, 0.01);
  lambNorms<float>(p.data(), g.data(), m.data(), v.data(), z.data(), n, all, 2, 0.9, 0.999, 1e-6,
                   0.0);
  EXPECT_TRUE(sameBits(y, z));
  EXPECT_FALSE(sameBits(x, y));
  std::vector<float> a(n), am(n), av(n), b(n), bm(n), bv(n);
  lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), x.data(), a.data(), am.data(),
                    av.data(), n, LambLayout{seg, 0, 0}, 1e-3, 2, 0.9, 0.999, 1e-6, 0.01);
  lambUpdate<float>(p.data(), g.data(), m.data(), v.data(), x.data(), b.data(), bm.data(),
                    bv.data(), n, all, 1e-3, 2, 0.9, 0.999, 1e-6, 0.0);
  EXPECT_TRUE(sameBits(a, b) && sameBits(am, bm) && sameBits(av, bv));
}

TEST(KernelsTest, HalfAndBfloat16RoundToNearestEven) {
  EXPECT_EQ(floatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16ToFloat(floatToBf16(3.140625f)), 3.140625f);
  EXPECT_EQ(floatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(halfToFloat(floatToHalf(65504.0f)), 65504.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(1e-7f)), halfToFloat(floatToHalf(1e-7f)));
  EXPECT_TRUE(std::isinf(halfToFloat(floatToHalf(1e6f))));
}

/// A plan with one buffer per shape, for dispatch checks.
Plan planWith(std::vector<std::vector<int64_t>> shapes) {
  Plan plan;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Buffer b;
    b.id = (int64_t)i;
    b.shape = shapes[i];
    b.bytes = b.numel() * 4;
    plan.buffers.push_back(b);
  }
  return plan;
}

TEST(DispatchTest, RejectsMalformedInstructions) {
  Plan plan = planWith({{4, 8}, {4, 8}, {4, 4}});
  Instruction mm{"matmul", {0, 1}, {2}};
  Status st = checkInstruction(plan, mm);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("matmul: expected contracting sizes to agree, found 8 (lhs) and 4 "
                              "(rhs)"),
            std::string::npos)
      << st.message();
  mm.attrs["transpose_rhs"] = true;
  EXPECT_TRUE(checkInstruction(plan, mm).isOk());
  // The dialect verifier's words (runtime/core/ShapeRules.h holds both).
  Plan batched = planWith({{2, 4, 8}, {3, 8, 4}, {2, 4, 4}, {8, 4}});
  Instruction bmm{"matmul", {0, 1}, {2}};
  EXPECT_NE(checkInstruction(batched, bmm)
                .message()
                .find("matmul: expected equal batch sizes, found 2 and 3"),
            std::string::npos);
  bmm.in = {0, 3};
  EXPECT_NE(checkInstruction(batched, bmm)
                .message()
                .find("matmul: expected operands of equal rank 2 or 3, found ranks 3 and 2"),
            std::string::npos);
  Instruction unknown{"conv2d", {0}, {1}};
  EXPECT_NE(checkInstruction(plan, unknown).message().find("unknown op 'conv2d'"),
            std::string::npos);
  Instruction arity{"relu", {0, 1}, {2}};
  EXPECT_NE(checkInstruction(plan, arity).message().find("expected 1 inputs"),
            std::string::npos);
}

/// The message of checkInstruction, "" when it accepts.
std::string checkMessage(const Plan &plan, const Instruction &inst) {
  Status st = checkInstruction(plan, inst);
  return st.isOk() ? "" : st.message();
}

TEST(DispatchTest, ChecksTheLlamaOps) {
  // q [2, 3, 8], k and v [2, 3, 4] (2 of 4 heads of 2), a wrong k [2, 3, 6],
  // the log-sum-exp [2, 4, 3] (id 7).
  Plan plan =
      planWith({{2, 3, 8}, {2, 3, 4}, {2, 3, 4}, {2, 3, 8}, {2, 3, 6}, {8}, {4}, {2, 4, 3}});
  Instruction att{"attention", {0, 1, 2}, {3}, {{"heads", 4}, {"kv_heads", 2}}};
  EXPECT_EQ(checkMessage(plan, att), "");
  att.out = {3, 7};
  EXPECT_EQ(checkMessage(plan, att), "");
  att.out = {3, 1};
  EXPECT_NE(checkMessage(plan, att).find("expected lse of shape 2x4x3, found 2x3x4"),
            std::string::npos);
  att.out = {3, 7, 7};
  EXPECT_NE(checkMessage(plan, att).find("expected 3 inputs and 1-2 outputs, found 3 and 3"),
            std::string::npos);
  att.out = {3};
  att.attrs["kv_heads"] = 3;
  EXPECT_NE(checkMessage(plan, att).find("expected kv_heads to divide heads = 4"),
            std::string::npos);
  att.attrs["kv_heads"] = 2.5;
  EXPECT_NE(checkMessage(plan, att).find("attribute kv_heads: expected an integer"),
            std::string::npos);
  att.attrs.erase("kv_heads"); // then k must have the shape of q
  EXPECT_NE(checkMessage(plan, att).find("expected k of shape 2x3x8, found 2x3x4"),
            std::string::npos);
  // q, k, v, y, lse, dy -> dq, dk, dv.
  Instruction attGrad{"attention_grad", {0, 1, 2, 3, 7, 3}, {3, 1, 2},
                      {{"heads", 4}, {"kv_heads", 2}}};
  EXPECT_EQ(checkMessage(plan, attGrad), "");
  attGrad.out = {3, 1, 4};
  EXPECT_NE(checkMessage(plan, attGrad).find("expected d_v of shape 2x3x4, found 2x3x6"),
            std::string::npos);
  attGrad.out = {3, 1, 2};
  attGrad.in[4] = 1;
  EXPECT_NE(checkMessage(plan, attGrad).find("expected lse of shape 2x4x3, found 2x3x4"),
            std::string::npos);
  attGrad.in[4] = 7;
  attGrad.in[3] = 4;
  EXPECT_NE(checkMessage(plan, attGrad).find("expected y of shape 2x3x8, found 2x3x6"),
            std::string::npos);
  attGrad.in = {0, 1, 2, 3}; // a plan from before the log-sum-exp
  EXPECT_NE(checkMessage(plan, attGrad).find("expected 6 inputs and 3 outputs, found 4"),
            std::string::npos);

  Instruction rope{"rope", {0}, {3}, {{"heads", 2}, {"theta", 1e4}}};
  EXPECT_EQ(checkMessage(plan, rope), "");
  rope.attrs["heads"] = 8; // heads of 1: not even
  EXPECT_NE(checkMessage(plan, rope).find("heads of even size"), std::string::npos);
  rope.attrs["heads"] = 2;
  rope.attrs["theta"] = "10000";
  EXPECT_NE(checkMessage(plan, rope).find("attribute theta: expected a finite number"),
            std::string::npos);
  rope.attrs["theta"] = 0.5;
  EXPECT_NE(checkMessage(plan, rope).find("expected a number > 1"), std::string::npos);
  rope.attrs.erase("theta");
  EXPECT_NE(checkMessage(plan, rope).find("missing attribute theta"), std::string::npos);

  Instruction rms{"rms_norm", {0, 5}, {3}, {{"epsilon", 1e-6}}};
  EXPECT_EQ(checkMessage(plan, rms), "");
  rms.in[1] = 6;
  EXPECT_NE(checkMessage(plan, rms).find("expected a weight of shape 8, found 4"),
            std::string::npos);
  rms.in[1] = 5;
  rms.attrs["epsilon"] = -1.0;
  EXPECT_NE(checkMessage(plan, rms).find("expected a positive number"), std::string::npos);
  rms.attrs.erase("epsilon");
  EXPECT_NE(checkMessage(plan, rms).find("missing attribute epsilon"), std::string::npos);
  Instruction rmsGrad{"rms_norm_grad", {0, 5, 3}, {3, 6}, {{"epsilon", 1e-6}}};
  EXPECT_NE(checkMessage(plan, rmsGrad).find("expected d_weight of shape 8, found 4"),
            std::string::npos);
}

/// A plan of f32 buffers placed one after the other in a host arena, to
/// run instructions on with the CPU dispatch.
struct HostArena {
  Plan plan;
  std::vector<uint8_t> arena;
  explicit HostArena(Plan p) : plan(std::move(p)) {
    int64_t off = 0;
    for (Buffer &b : plan.buffers) {
      b.offset = off;
      off += b.bytes;
    }
    arena.resize(off);
  }
  float *buf(int id) {
    return reinterpret_cast<float *>(arena.data() + plan.buffers[id].offset);
  }
  /// Fills buffers `ids` with f(i, id).
  void fill(std::initializer_list<int> ids, const std::function<float(int64_t, int)> &f) {
    for (int id : ids)
      for (int64_t i = 0; i < plan.buffers[id].numel(); ++i)
        buf(id)[i] = f(i, id);
  }
  /// Checks and runs `inst`; the failure message when it fails.
  std::string run(const Instruction &inst) {
    Status st = checkInstruction(plan, inst);
    if (st.isOk())
      st = runInstruction(plan, inst, arena.data(), 0);
    return st.isOk() ? "" : inst.op + ": " + st.message();
  }
  bool same(int x, int y) {
    return std::memcmp(buf(x), buf(y), plan.buffers[x].bytes) == 0;
  }
};

TEST(DispatchTest, FusedMatmulsAreTheUnfusedOpsBitwise) {
  // 0 x [5,3], 1 w [4,3], 2 b [4], 3 y [5,4], 4 pre [5,4], 5-7 the unfused
  // matmul / bias_add / gelu [5,4]; 8 dz [5,6], 9 w2 [6,4], 10 dx [5,4],
  // 11 db [4], 12-13 the unfused matmul / gelu_grad [5,4], 14 sum_to [4],
  // 15 a rank-3 x [1,5,3], 16 y without gelu [5,4].
  HostArena h(planWith({{5, 3}, {4, 3}, {4}, {5, 4}, {5, 4}, {5, 4}, {5, 4}, {5, 4}, {5, 6},
                        {6, 4}, {5, 4}, {4}, {5, 4}, {5, 4}, {4}, {1, 5, 3}, {5, 4}}));
  const Plan &plan = h.plan;
  h.fill({0, 1, 2, 8, 9}, [](int64_t i, int id) { return std::sin(0.7 * i + id) * 1.5f; });
  auto run = [&](const Instruction &inst) { ASSERT_EQ(h.run(inst), ""); };
  auto same = [&](int x, int y) { return h.same(x, y); };
  nlohmann::json tr = {{"transpose_rhs", true}};
  nlohmann::json trGelu = {{"transpose_rhs", true}, {"gelu", true}};
  run({"matmul_bias", {0, 1, 2}, {3, 4}, trGelu});
  run({"matmul_bias", {0, 1, 2}, {16}, tr});
  run({"matmul", {0, 1}, {5}, tr});
  run({"bias_add", {5, 2}, {6}});
  run({"gelu", {6}, {7}});
  EXPECT_TRUE(same(4, 6)); // the pre-activation
  EXPECT_TRUE(same(3, 7)); // the GELU
  EXPECT_TRUE(same(16, 6));
  EXPECT_FALSE(same(3, 4));
  run({"matmul_gelu_grad", {8, 9, 4}, {10, 11}});
  run({"matmul", {8, 9}, {12}});
  run({"gelu_grad", {4, 12}, {13}});
  run({"sum_to", {13}, {14}});
  EXPECT_TRUE(same(10, 13));
  EXPECT_TRUE(same(11, 14));
  // The rules: a pre-activation needs gelu, the bias is [N], rank 2 only,
  // the bias gradient [N].
  EXPECT_NE(checkMessage(plan, {"matmul_bias", {0, 1, 2}, {3, 4}, tr})
                .find("a pre-activation output needs the gelu attribute"),
            std::string::npos);
  EXPECT_EQ(checkMessage(plan, {"matmul_bias", {0, 1, 14}, {3}, tr}), "");
  EXPECT_NE(checkMessage(plan, {"matmul_bias", {0, 1, 8}, {3}, tr})
                .find("matmul_bias: expected a bias of shape 4, found 5x6"),
            std::string::npos);
  EXPECT_NE(checkMessage(plan, {"matmul_bias", {15, 1, 2}, {3}, tr})
                .find("matmul_bias: expected rank-2 operands, found 1x5x3 and 4x3"),
            std::string::npos);
  EXPECT_NE(checkMessage(plan, {"matmul_gelu_grad", {8, 9, 4}, {10, 3}})
                .find("matmul_gelu_grad: expected a bias gradient of shape 4, found 5x4"),
            std::string::npos);
  EXPECT_NE(checkMessage(plan, {"matmul_gelu_grad", {8, 9, 8}, {10}})
                .find("matmul_gelu_grad: expected a pre-activation of shape 5x4, found 5x6"),
            std::string::npos);
}

TEST(DispatchTest, FusedResidualLayerNormsAreTheUnfusedOpsBitwise) {
  // 0 a, 1 b [3,5]; 2 gamma, 3 beta [5]; 4 sum, 5 y [3,5]; 6-7 the unfused
  // add and layer_norm; 8 dy, 9 acc [3,5]; 10 dx [3,5], 11 dg, 12 db [5];
  // 13 the unfused dx, 14 dg, 15 db, 16 the add; 17 a [5,3].
  HostArena h(planWith({{3, 5}, {3, 5}, {5}, {5}, {3, 5}, {3, 5}, {3, 5}, {3, 5}, {3, 5},
                        {3, 5}, {3, 5}, {5}, {5}, {3, 5}, {5}, {5}, {3, 5}, {5, 3}}));
  const Plan &plan = h.plan;
  h.fill({0, 1, 2, 3, 8, 9}, [](int64_t i, int id) { return std::cos(0.9 * i + 3 * id) * 2.f; });
  auto run = [&](const Instruction &inst) { ASSERT_EQ(h.run(inst), ""); };
  auto same = [&](int x, int y) { return h.same(x, y); };
  run({"residual_layer_norm", {0, 1, 2, 3}, {4, 5}});
  run({"add", {0, 1}, {6}});
  run({"layer_norm", {6, 2, 3}, {7}});
  EXPECT_TRUE(same(4, 6));
  EXPECT_TRUE(same(5, 7));
  run({"layer_norm_grad_acc", {4, 2, 8, 9}, {10, 11, 12}});
  run({"layer_norm_grad", {4, 2, 8}, {13, 14, 15}});
  run({"add", {13, 9}, {16}});
  EXPECT_TRUE(same(10, 16));
  EXPECT_TRUE(same(11, 14));
  EXPECT_TRUE(same(12, 15));
  EXPECT_FALSE(same(10, 13));
  EXPECT_NE(checkMessage(plan, {"residual_layer_norm", {0, 17, 2, 3}, {4, 5}})
                .find("residual_layer_norm: expected a right operand of shape 3x5, found 5x3"),
            std::string::npos);
  EXPECT_NE(checkMessage(plan, {"layer_norm_grad_acc", {4, 2, 8, 2}, {10, 11, 12}})
                .find("layer_norm_grad_acc: expected an accumulated gradient of shape 3x5"),
            std::string::npos);
  EXPECT_NE(checkMessage(plan, {"residual_layer_norm", {0, 1, 2, 3}, {4}})
                .find("expected 4 inputs and 2 outputs, found 4 and 1"),
            std::string::npos);
}

TEST(DispatchTest, BadTokenIdIsAnErrorNotACrash) {
  Plan plan = planWith({{5, 3}, {2}, {2, 3}});
  plan.buffers[1].dtype = DType::I32;
  int64_t off = 0;
  for (Buffer &b : plan.buffers) {
    b.offset = off;
    off += b.bytes;
  }
  std::vector<uint8_t> arena(off);
  int32_t *ids = reinterpret_cast<int32_t *>(arena.data() + plan.buffers[1].offset);
  ids[0] = 2;
  ids[1] = 9;
  Instruction emb{"embedding", {0, 1}, {2}};
  ASSERT_TRUE(checkInstruction(plan, emb).isOk());
  Status st = runInstruction(plan, emb, arena.data(), 0);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("token id 9 at position 1 is outside the vocabulary"),
            std::string::npos)
      << st.message();
}

// master-dtype=bf16: an update of bf16 parameters with an f32 gradient
// widens them, steps in f32 with the f32 kernel and rounds the new
// parameters once, stochastically with the parameter cast's draws
// (stochastic_param: key K, element at rank * shard_stride + i of its
// unit) or to nearest. Rank 1 of a shard of 70,000 elements: two of the
// dispatch's f32 pieces (65,536), the decayed prefix ending inside the
// first; f32, bf16 and 8-bit moments. A tiny step (below half a bf16 ulp)
// moves no parameter to nearest and some stochastically (a step of size
// s moves one of ulp u with probability about s / u).
TEST(DispatchTest, Bf16ParametersStepInF32AndRoundOnce) {
  const int64_t n = 70000, decay = n + 1000; // rank 1 holds [n, 2n): 1000 decayed
  const int64_t block = 256, q = ::fsdp::shapes::quantizedBytes(n, block);
  // 0 p bf16, 1 g, 2 m, 3 v, 4 lr, 5 step, 6 new p bf16, 7 new m, 8 new v,
  // 9-10 8-bit m, v, 11-12 new 8-bit m, v, 13-14 bf16 m, v, 15-16 new ones
  Plan plan =
      planWith({{n}, {n}, {n}, {n}, {}, {}, {n}, {n}, {n}, {q}, {q}, {q}, {q}, {n}, {n}, {n}, {n}});
  for (int id : {0, 6, 13, 14, 15, 16}) {
    plan.buffers[id].dtype = DType::BF16;
    plan.buffers[id].bytes = 2 * n;
  }
  for (int id : {9, 10, 11, 12}) {
    plan.buffers[id].dtype = DType::I8;
    plan.buffers[id].bytes = q;
  }
  HostArena a(std::move(plan));
  auto p16 = [&](int id) { return reinterpret_cast<uint16_t *>(a.buf(id)); };
  std::vector<float> pf(n);
  for (int64_t i = 0; i < n; ++i) {
    p16(0)[i] = floatToBf16(std::sin(0.37f * (float)i) * 0.5f);
    pf[i] = bf16ToFloat(p16(0)[i]);
    a.buf(1)[i] = std::cos(0.11f * (float)i) * 1e-2f;
    a.buf(2)[i] = std::sin(0.05f * (float)i) * 1e-3f;
    a.buf(3)[i] = 1e-6f * (float)(i % 5 + 1);
    p16(13)[i] = floatToBf16(a.buf(2)[i]);
    p16(14)[i] = floatToBf16(a.buf(3)[i]);
  }
  moments8::encodeShard(a.buf(2), n, block, false, reinterpret_cast<uint8_t *>(a.buf(9)));
  moments8::encodeShard(a.buf(3), n, block, true, reinterpret_cast<uint8_t *>(a.buf(10)));
  *a.buf(5) = 4.f;
  DropoutContext ctx;
  ctx.seed = 1234;
  ctx.step = 4;
  const uint64_t key = stochasticRoundingKey(1234, 4, 7);
  const double b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  nlohmann::json attrs = {{"beta1", b1},         {"beta2", b2}, {"eps", eps},
                          {"weight_decay", wd},  {"key", 7},    {"shard_stride", n},
                          {"decay_numel", decay}};
  // The f32 step on the widened parameters, the decayed prefix and the
  // rest, as the reference; `moments` runs the kernel of that state.
  auto reference = [&](auto &&moments) {
    std::vector<float> np(n);
    moments(pf.data(), np.data(), 0, 1000, wd);
    moments(pf.data() + 1000, np.data() + 1000, 1000, n - 1000, 0.0);
    return np;
  };
  auto rounded = [&](const std::vector<float> &np, bool stochastic) {
    std::vector<uint16_t> out(n);
    for (int64_t i = 0; i < n; ++i)
      out[i] =
          stochastic ? roundToBf16Stochastic(np[i], key, (uint64_t)(n + i)) : floatToBf16(np[i]);
    return out;
  };
  auto newP = [&] { return std::vector<uint16_t>(p16(6), p16(6) + n); };
  for (float lr : {1e-2f, 2e-5f}) {
    *a.buf(4) = lr;
    std::vector<float> wm(n), wv(n);
    const std::vector<float> f32 =
        reference([&](const float *p, float *np, int64_t at, int64_t len, double w) {
          adamwUpdate<float>(p, a.buf(1) + at, a.buf(2) + at, a.buf(3) + at, np, wm.data() + at,
                             wv.data() + at, len, lr, 4, b1, b2, eps, w);
        });
    for (bool stochastic : {true, false}) {
      nlohmann::json at = attrs;
      if (stochastic)
        at["stochastic_param"] = true;
      Instruction upd{"adamw_update", {0, 1, 2, 3, 4, 5}, {6, 7, 8}, at};
      ASSERT_EQ(checkMessage(a.plan, upd), "");
      ASSERT_TRUE(runInstruction(a.plan, upd, a.arena.data(), 1, ctx).isOk());
      EXPECT_EQ(newP(), rounded(f32, stochastic))
          << "f32 moments, lr " << lr << " stochastic " << stochastic;
      EXPECT_EQ(std::memcmp(a.buf(7), wm.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(a.buf(8), wv.data(), 4 * n), 0);
      // (|p| >= 1/16: half an ulp >= 2^-13, far above a step of about lr)
      int64_t moved = 0;
      for (int64_t i = 0; i < n; ++i)
        moved += std::fabs(pf[i]) >= 0.0625f && p16(6)[i] != p16(0)[i];
      if (lr < 1e-4f)
        EXPECT_TRUE(stochastic ? moved > 100 : moved == 0)
            << moved << " parameters moved by a step below half an ulp, stochastic " << stochastic;
    }
  }
  // 8-bit and bf16 moments: the same composition with their kernels.
  *a.buf(4) = 1e-2f;
  attrs["stochastic_param"] = true;
  {
    std::vector<uint8_t> wm(q), wv(q);
    std::vector<float> np(n);
    adamwUpdate8bitState(pf.data(), a.buf(1), reinterpret_cast<uint8_t *>(a.buf(9)),
                         reinterpret_cast<uint8_t *>(a.buf(10)), np.data(), wm.data(), wv.data(), n,
                         block, 1e-2f, 4, b1, b2, eps, wd, 1000, 1.f);
    nlohmann::json at = attrs;
    at["state_block"] = block;
    Instruction upd{"adamw_update", {0, 1, 9, 10, 4, 5}, {6, 11, 12}, at};
    ASSERT_EQ(checkMessage(a.plan, upd), "");
    ASSERT_TRUE(runInstruction(a.plan, upd, a.arena.data(), 1, ctx).isOk());
    EXPECT_EQ(newP(), rounded(np, true)) << "8-bit moments";
    EXPECT_EQ(std::memcmp(a.buf(11), wm.data(), q), 0);
    EXPECT_EQ(std::memcmp(a.buf(12), wv.data(), q), 0);
  }
  {
    std::vector<uint16_t> wm(n), wv(n);
    MomentRounding nearest;
    const std::vector<float> f32 =
        reference([&](const float *p, float *np, int64_t at, int64_t len, double w) {
          adamwUpdateBf16State(p, a.buf(1) + at, p16(13) + at, p16(14) + at, np, wm.data() + at,
                               wv.data() + at, len, 1e-2f, 4, b1, b2, eps, w, 1.f, nearest);
        });
    Instruction upd{"adamw_update", {0, 1, 13, 14, 4, 5}, {6, 15, 16}, attrs};
    ASSERT_EQ(checkMessage(a.plan, upd), "");
    ASSERT_TRUE(runInstruction(a.plan, upd, a.arena.data(), 1, ctx).isOk());
    EXPECT_EQ(newP(), rounded(f32, true)) << "bf16 moments";
    EXPECT_EQ(std::vector<uint16_t>(p16(15), p16(15) + n), wm);
  }
  // SGD (plain and momentum) the same way.
  {
    const std::vector<float> f32 =
        reference([&](const float *p, float *np, int64_t at, int64_t len, double w) {
          sgdUpdate<float>(p, a.buf(1) + at, np, len, 1e-2f, w);
        });
    nlohmann::json at = {{"weight_decay", wd},
                         {"key", 7},
                         {"shard_stride", n},
                         {"decay_numel", decay},
                         {"stochastic_param", true}};
    Instruction upd{"sgd_update", {0, 1, 4}, {6}, at};
    ASSERT_EQ(checkMessage(a.plan, upd), "");
    ASSERT_TRUE(runInstruction(a.plan, upd, a.arena.data(), 1, ctx).isOk());
    EXPECT_EQ(newP(), rounded(f32, true)) << "sgd";
  }
  // Refused: a stochastic_param update of f32 parameters, and one without
  // its key.
  Instruction f32p{"adamw_update", {1, 1, 2, 3, 4, 5}, {7, 7, 8}, attrs};
  EXPECT_NE(checkMessage(a.plan, f32p).find("stochastic_param rounds the parameters to bf16"),
            std::string::npos)
      << checkMessage(a.plan, f32p);
  nlohmann::json noKey = attrs;
  noKey.erase("key");
  Instruction keyless{"adamw_update", {0, 1, 2, 3, 4, 5}, {6, 7, 8}, noKey};
  EXPECT_NE(checkMessage(a.plan, keyless).find("stochastic_param needs an integer key"),
            std::string::npos)
      << checkMessage(a.plan, keyless);
}

// lamb_norms / lamb_update through the dispatch: the attributes reach the
// kernels (segments, decay_numel, shard_stride with the rank as the shard
// index, the hyperparameters, grad_scale), and skip_nonfinite copies p, m
// and v through when its scalar is not finite.
TEST(DispatchTest, LambRunsItsAttributes) {
  const int64_t n = 50, K = 3;
  const std::vector<int64_t> seg{0, 40, 70, 97}; // shard 1 of 2: [50, 100)
  // 0 p, 1 g, 2 m, 3 v, 4 sums, 5 lr, 6 step, 7 skip, 8 grad scale,
  // 9-11 new p, m, v
  HostArena a(planWith({{n}, {n}, {n}, {n}, {2 * K}, {}, {}, {}, {}, {n}, {n}, {n}}));
  a.fill({0, 1, 2, 3}, [](int64_t i, int id) {
    return id == 3 ? 1e-3f * (float)(i % 7 + 1) : std::sin(0.37f * (float)(i + 13 * id));
  });
  *a.buf(5) = 5e-3f;
  *a.buf(6) = 3.f;
  *a.buf(7) = 1.f;
  *a.buf(8) = 0.5f;
  nlohmann::json attrs = {{"segments", seg},     {"decay_numel", 70}, {"shard_stride", n},
                          {"beta1", 0.8},        {"beta2", 0.99},     {"eps", 1e-5},
                          {"weight_decay", 0.1}, {"grad_scale", true}};
  Instruction norms{"lamb_norms", {0, 1, 2, 3, 6, 8}, {4}, attrs};
  ASSERT_EQ(checkMessage(a.plan, norms), "");
  ASSERT_TRUE(runInstruction(a.plan, norms, a.arena.data(), 1).isOk());
  std::vector<float> got(a.buf(4), a.buf(4) + 2 * K), want(2 * K);
  LambLayout layout{seg, n, 70};
  lambNorms<float>(a.buf(0), a.buf(1), a.buf(2), a.buf(3), want.data(), n, layout, 3, 0.8, 0.99,
                   1e-5, 0.1, 0.5f);
  EXPECT_TRUE(sameBits(got, want));
  EXPECT_EQ(got[0], 0.f); // parameter 0 lies in shard 0
  EXPECT_GT(got[1], 0.f);
  attrs["skip_nonfinite"] = true;
  Instruction update{"lamb_update", {0, 1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11}, attrs};
  ASSERT_EQ(checkMessage(a.plan, update), "");
  ASSERT_TRUE(runInstruction(a.plan, update, a.arena.data(), 1).isOk());
  std::vector<float> wp(n), wm(n), wv(n);
  lambUpdate<float>(a.buf(0), a.buf(1), a.buf(2), a.buf(3), a.buf(4), wp.data(), wm.data(),
                    wv.data(), n, layout, 5e-3f, 3, 0.8, 0.99, 1e-5, 0.1, 0.5f);
  EXPECT_EQ(std::memcmp(a.buf(9), wp.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp(a.buf(10), wm.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp(a.buf(11), wv.data(), 4 * n), 0);
  EXPECT_NE(std::memcmp(a.buf(9), a.buf(0), 4 * n), 0);
  for (float skip : {INFINITY, NAN}) {
    *a.buf(7) = skip;
    ASSERT_TRUE(runInstruction(a.plan, update, a.arena.data(), 1).isOk());
    EXPECT_TRUE(a.same(9, 0) && a.same(10, 2) && a.same(11, 3)) << "skip " << skip;
  }
  *a.buf(6) = 0.5f; // not a step count
  EXPECT_NE(runInstruction(a.plan, norms, a.arena.data(), 1).message().find("the step operand"),
            std::string::npos);
}

} // namespace
