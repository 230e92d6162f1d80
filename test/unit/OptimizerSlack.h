//===- OptimizerSlack.h - GPU vs CPU optimizer updates: FMA slack ---------===//
//
// nvcc contracts a * b + c into one fused multiply-add; the CPU kernels
// (built without FMA) round the product first. A contracted update thus
// differs from the CPU's by up to one rounding of each product it fused
// (u |product|, u = 2^-24, either side's; 2u allowed), before the final
// rounding both sides share (the tests' ulps * |want| term). These are the
// per-element slacks that follows for AdamW and SGD, propagated through the
// later arithmetic of the same element (first H100 run, 2026-11-26: SGD's
// momentum buffer off by 31 ulps of a nearly cancelled sum, which a bound
// relative to the result alone could not allow).
//
//===----------------------------------------------------------------------===//
#ifndef FSDP_TEST_OPTIMIZERSLACK_H
#define FSDP_TEST_OPTIMIZERSLACK_H

#include <cmath>
#include <cstdint>
#include <vector>

namespace fsdp::test {

/// torch.optim.AdamW's update of p, exp_avg m and exp_avg_sq v on gradient g.
struct AdamwSlack {
  std::vector<double> p, m, v;
  AdamwSlack(const std::vector<float> &p0, const std::vector<float> &g,
             const std::vector<float> &m0, const std::vector<float> &v0, double lr, double step,
             double beta1, double beta2, double eps) {
    const double u = std::ldexp(1.0, -24);
    double stepSize = lr / (1 - std::pow(beta1, step));
    double bc2Sqrt = std::sqrt(1 - std::pow(beta2, step));
    for (size_t i = 0; i < p0.size(); ++i) {
      double gi = g[i];
      double mi = beta1 * m0[i] + (1 - beta1) * gi, vi = beta2 * v0[i] + (1 - beta2) * gi * gi;
      double sm = 2 * u * (std::fabs(beta1 * m0[i]) + std::fabs((1 - beta1) * gi));
      double sv = 2 * u * (std::fabs(beta2 * v0[i]) + (1 - beta2) * gi * gi);
      double denom = std::sqrt(vi) / bc2Sqrt + eps;
      // d sqrt(v) = dv / (2 sqrt(v)); the quotient m / denom moves by
      // dm / denom + |m| d denom / denom^2; the last step p - s q fused.
      double sDenom = vi > 0 ? sv / (2 * std::sqrt(vi) * bc2Sqrt) : std::sqrt(sv) / bc2Sqrt;
      double q = mi / denom;
      m.push_back(sm);
      v.push_back(sv);
      p.push_back(stepSize * (sm / denom + std::fabs(q) * sDenom / denom) +
                  2 * u * std::fabs(stepSize * q));
    }
  }
};

/// torch.optim.SGD with momentum (dampening, weight decay, Nesterov) at
/// `step` (step 1 clones the gradient into the buffer).
struct SgdMomentumSlack {
  std::vector<double> p, buf;
  SgdMomentumSlack(const std::vector<float> &p0, const std::vector<float> &g,
                   const std::vector<float> &buf0, double lr, int64_t step, double momentum,
                   double dampening, double wd, bool nesterov) {
    const double u = std::ldexp(1.0, -24);
    for (size_t i = 0; i < p0.size(); ++i) {
      double d = g[i] + wd * p0[i];
      double sd = 2 * u * std::fabs(wd * p0[i]);
      double b = step <= 1 ? d : momentum * buf0[i] + (1 - dampening) * d;
      double sb = step <= 1 ? sd
                            : 2 * u * (std::fabs(momentum * buf0[i]) +
                                       std::fabs((1 - dampening) * d)) +
                                  (1 - dampening) * sd;
      double upd = nesterov ? d + momentum * b : b;
      double su = nesterov ? sd + momentum * sb + 2 * u * std::fabs(momentum * b) : sb;
      buf.push_back(sb);
      p.push_back(lr * su + 2 * u * std::fabs(lr * upd));
    }
  }
};

} // namespace fsdp::test

#endif // FSDP_TEST_OPTIMIZERSLACK_H
