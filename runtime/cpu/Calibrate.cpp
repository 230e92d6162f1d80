//===- Calibrate.cpp - measures this machine for the cost model -----------===//
//
// Each figure is a least-squares fit of time = fixed + size x rate over a
// few sizes, each size timed as the median of 5 rounds: the cost model
// predicts a typical (median) step, which meets the same disturbances on
// a shared machine (the fastest round, used before, was 3-27% optimistic
// on this project's noisy 2-core VM; docs/BENCHMARKS.md). The cost model in
// tools/fsdp-sim then predicts an instruction as
//   overhead + max(flops / gemm_flops, bytes / mem_bw)
// and a ring collective over n ranks as
//   all-reduce:              2 (n-1) alpha + 2 (n-1)/n x bytes x beta
//   all-gather, reduce-scatter: (n-1) alpha +   (n-1)/n x bytes x beta.
// A GEMM also pays for the operand bytes that miss the cache, from the
// curve gemmCacheCurve measures ([Note: the cache model], CostModel.cpp).
// The kernels timed are the ones fsdp-run runs (runtime/cpu/Kernels.h).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Calibrate.h"

#include "runtime/cpu/Kernels.h"

#include "runtime/core/ShapeRules.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fsdp::cpu {

namespace {

/// Seconds per call of `f`: the median of 5 rounds, each long enough
/// (>= 2 ms) to make the clock's resolution irrelevant.
double timeIt(const std::function<void()> &f) {
  using clock = std::chrono::steady_clock;
  f(); // warm caches and thread pools
  int reps = 1;
  for (;;) {
    auto t0 = clock::now();
    for (int i = 0; i < reps; ++i)
      f();
    double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (s >= 2e-3 || reps >= (1 << 20))
      break;
    reps *= 2;
  }
  std::vector<double> rounds;
  for (int round = 0; round < 5; ++round) {
    auto t0 = clock::now();
    for (int i = 0; i < reps; ++i)
      f();
    rounds.push_back(std::chrono::duration<double>(clock::now() - t0).count() / reps);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

/// Seconds per call of the collective `f` as a training step sees it: the
/// calling thread hands it to a communication thread and sleeps until it
/// is done (fsdp-run's comm stream: [Note: the CPU comm stream] in
/// CpuDevice.cpp), after an idle gap standing in for the compute between
/// two collectives, so both threads' wake-ups are counted as they are in a
/// step (timed back to back on the calling thread, the collectives of the
/// 2-rank MLP ran 2x faster than in its steps). Every rank makes the same
/// calls, so the repetitions are fixed (not adapted to the clock as in
/// timeIt, which would let ranks disagree); each is timed alone, after a
/// barrier, and the median is returned.
Status timeCollective(Communicator &comm, const std::function<Status()> &f,
                      double &secs) {
  using clock = std::chrono::steady_clock;
  const int reps = 25;
  FSDP_RETURN_IF_ERROR(f()); // warm: connections, buffers
  std::mutex mu;
  std::condition_variable cv;
  bool posted = false, finished = false, stop = false;
  Status result = Status::ok();
  std::thread worker([&] {
    std::unique_lock<std::mutex> l(mu);
    for (;;) {
      cv.wait(l, [&] { return stop || posted; });
      if (stop)
        return;
      posted = false;
      l.unlock();
      Status st = f();
      l.lock();
      result = std::move(st);
      finished = true;
      cv.notify_all();
    }
  });
  std::vector<double> times;
  Status st = Status::ok();
  for (int i = 0; i < reps && st; ++i) {
    st = comm.barrier();
    if (!st)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto t0 = clock::now();
    std::unique_lock<std::mutex> l(mu);
    posted = true;
    finished = false;
    cv.notify_all();
    cv.wait(l, [&] { return finished; });
    times.push_back(std::chrono::duration<double>(clock::now() - t0).count());
    st = result;
  }
  {
    std::lock_guard<std::mutex> l(mu);
    stop = true;
  }
  cv.notify_all();
  worker.join();
  FSDP_RETURN_IF_ERROR(st);
  std::sort(times.begin(), times.end());
  secs = times[times.size() / 2];
  return Status::ok();
}

/// Least squares for y = a + b x.
void fitLine(const std::vector<double> &x, const std::vector<double> &y, double &a,
             double &b) {
  double n = (double)x.size(), sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  b = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  a = (sy - b * sx) / n;
}

/// Least squares for t = c1 alpha + c2 beta (no intercept).
void fit2(const std::vector<std::pair<double, double>> &c, const std::vector<double> &t,
          double &alpha, double &beta) {
  double s11 = 0, s12 = 0, s22 = 0, r1 = 0, r2 = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    s11 += c[i].first * c[i].first;
    s12 += c[i].first * c[i].second;
    s22 += c[i].second * c[i].second;
    r1 += c[i].first * t[i];
    r2 += c[i].second * t[i];
  }
  double det = s11 * s22 - s12 * s12;
  alpha = (r1 * s22 - r2 * s12) / det;
  beta = (s11 * r2 - s12 * r1) / det;
}

/// How a GEMM slows when its operands are not in the cache (the cost
/// model's [Note: the cache model] in passes/CostModel.cpp and
/// tools/fsdp-sim). One GEMM shape, a linear layer's forward (64 x 256 x
/// 256, B transposed, 384 KiB of operands), runs over a rotation of `sets`
/// copies of its operands, so every operand is touched again after
/// sets x 384 KiB of other data: its reuse distance. From 1 set (warm: the
/// GEMM roofline) to 256 sets (96 MiB, beyond any last-level cache of a
/// machine this runs on) the time rises from t(1) to t(256); the extra
/// time over the operand bytes is the rate at which a GEMM streams what
/// missed (cold_bytes_per_s), and (t(d) - t(1)) / (t(256) - t(1)), clamped
/// to [0, 1] and made non-decreasing, the fraction of an operand that
/// misses at reuse distance d. Null when the slowdown is under 2% (no
/// cache effect to model).
nlohmann::json gemmCacheCurve() {
  const int64_t m = 64, n = 256, k = 256;
  const int64_t setBytes = 4 * (m * k + k * n + m * n);
  const int maxSets = 256;
  std::vector<std::vector<float>> a(maxSets), b(maxSets), c(maxSets);
  for (int s = 0; s < maxSets; ++s) { // every page touched before timing
    a[s].assign(m * k, 0.5f);
    b[s].assign(k * n, 0.25f);
    c[s].assign(m * n, 0.0f);
  }
  std::vector<double> dist, secs;
  for (int sets = 1; sets <= maxSets; sets *= 2) {
    int next = 0;
    auto call = [&] {
      matmul<float>(a[next].data(), b[next].data(), c[next].data(), 1, m, n, k, false,
                    true);
      next = (next + 1) % sets;
    };
    for (int s = 0; s < sets; ++s) // one rotation first: every distance is `sets`
      call();
    secs.push_back(timeIt(call));
    dist.push_back(double(sets * setBytes));
  }
  double warm = secs.front(), cold = secs.back();
  if (!(cold > 1.02 * warm))
    return nullptr;
  std::vector<double> frac;
  double run = 0;
  for (double t : secs) {
    run = std::max(run, std::min(1.0, std::max(0.0, (t - warm) / (cold - warm))));
    frac.push_back(run);
  }
  return {{"cold_bytes_per_s", double(setBytes) / (cold - warm)},
          {"bytes", dist},
          {"cold_fraction", frac},
          {"seconds", secs}};
}

/// Fits t = c1 alpha + c2 beta to all-reduces and all-gathers of four
/// sizes over `group` (the ring model's coefficients at its size); `world`
/// (the job, of which `group` may be a part) separates the timings.
Status fitLink(Communicator &group, Communicator &world, nlohmann::json &link) {
  const int64_t n = group.size();
  std::vector<std::pair<double, double>> coef;
  std::vector<double> secs;
  nlohmann::json samples = nlohmann::json::array();
  for (int64_t elems : {16, 4096, 65536, 524288}) {
    int64_t shard = (elems + n - 1) / n;
    std::vector<float> buf(shard * n, 1.0f), out(shard * n);
    double bytes = 4.0 * shard * n;
    double ar = 0, ag = 0;
    FSDP_RETURN_IF_ERROR(timeCollective(
        world,
        [&] {
          return group.allReduce(buf.data(), buf.data(), shard * n, DType::F32, ReduceOp::Sum);
        },
        ar));
    FSDP_RETURN_IF_ERROR(timeCollective(
        world, [&] { return group.allGather(buf.data(), out.data(), shard, DType::F32); }, ag));
    coef.push_back({2.0 * (n - 1), 2.0 * (n - 1) / n * bytes});
    secs.push_back(ar);
    coef.push_back({1.0 * (n - 1), 1.0 * (n - 1) / n * bytes});
    secs.push_back(ag);
    samples.push_back({{"bytes", bytes}, {"all_reduce_s", ar}, {"all_gather_s", ag}});
  }
  double alpha, beta;
  fit2(coef, secs, alpha, beta);
  link = {{"ranks", n},
          {"backend", group.backend()},
          {"alpha_s", std::max(alpha, 0.0)},
          {"beta_s_per_byte", std::max(beta, 0.0)},
          {"samples", samples}};
  return Status::ok();
}

} // namespace

Status calibrate(Communicator &comm, int threads, nlohmann::json &profile) {
  // Compute: rank 0 alone, the others wait at the barrier (so the figures
  // are those of an uncontended core set; fsdp-sim scales them when N
  // ranks share the machine's cores).
  nlohmann::json compute;
  if (comm.rank() == 0) {
    std::vector<double> flops, secs;
    for (int64_t n : {32, 64, 128, 256, 384}) {
      std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
      flops.push_back(2.0 * n * n * n);
      secs.push_back(timeIt([&] {
        matmul<float>(a.data(), b.data(), c.data(), 1, n, n, n, false, true);
      }));
    }
    double gemmFixed, gemmRate;
    fitLine(flops, secs, gemmFixed, gemmRate);
    std::vector<double> bytes, esecs;
    for (int64_t n : {1024, 16384, 262144, 2097152}) {
      std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n);
      Shape s{n};
      bytes.push_back(12.0 * n);
      esecs.push_back(timeIt([&] {
        binary<float>(BinaryKind::Add, a.data(), s, b.data(), s, c.data(), s);
      }));
    }
    double memFixed, memRate;
    fitLine(bytes, esecs, memFixed, memRate);
    // Kernels far from the roofline (transcendentals, row reductions,
    // scalar loops): seconds per unit of work, timed alone. The unit is an
    // element of the first operand, or for attention B x T x T x C.
    nlohmann::json perUnit;
    {
      const int64_t rows = 512, cols = 512, n = rows * cols;
      std::vector<float> x(n), y(n), dy(n, 0.5f), dx(n), g(cols, 1.0f), b(cols, 0.0f),
          dg(cols), db(cols), m(n, 0.0f), v(n, 0.0f);
      for (int64_t i = 0; i < n; ++i)
        x[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
      std::vector<int32_t> labels(rows);
      for (int64_t r = 0; r < rows; ++r)
        labels[r] = (int32_t)(r % cols);
      float loss = 0, one = 1.0f;
      auto per = [&](const char *op, double units, const std::function<void()> &f) {
        perUnit[op] = timeIt(f) / units;
      };
      per("gelu", n, [&] { gelu<float>(x.data(), y.data(), n); });
      per("gelu_grad", n, [&] { geluGrad<float>(x.data(), dy.data(), dx.data(), n); });
      per("silu", n, [&] { silu<float>(x.data(), y.data(), n); });
      per("silu_grad", n, [&] { siluGrad<float>(x.data(), dy.data(), dx.data(), n); });
      per("softmax", n, [&] { softmax<float>(x.data(), y.data(), rows, cols); });
      per("softmax_grad", n,
          [&] { softmaxGrad<float>(y.data(), dy.data(), dx.data(), rows, cols); });
      per("layer_norm", n, [&] {
        layerNorm<float>(x.data(), g.data(), b.data(), y.data(), rows, cols, 1e-5);
      });
      per("layer_norm_grad", n, [&] {
        layerNormGrad<float>(x.data(), g.data(), dy.data(), dx.data(), dg.data(),
                             db.data(), rows, cols, 1e-5);
      });
      per("cross_entropy", n, [&] {
        crossEntropy<float, int32_t>(x.data(), labels.data(), &loss, rows, cols);
      });
      per("cross_entropy_grad", n, [&] {
        crossEntropyGrad<float, int32_t>(x.data(), labels.data(), &one, dx.data(), rows,
                                         cols);
      });
      per("adamw_update", n, [&] {
        adamwUpdate<float>(y.data(), dy.data(), m.data(), v.data(), y.data(), m.data(),
                           v.data(), n, 1e-3, 1, 0.9, 0.999, 1e-8, 0.01);
      });
      // LAMB: one parameter per row, its two passes timed apart.
      LambLayout lamb;
      for (int64_t r = 0; r <= rows; ++r)
        lamb.segments.push_back(r * cols);
      std::vector<float> norms(2 * rows);
      per("lamb_norms", n, [&] {
        lambNorms<float>(y.data(), dy.data(), m.data(), v.data(), norms.data(), n, lamb, 1, 0.9,
                         0.999, 1e-6, 0.01);
      });
      per("lamb_update", n, [&] {
        lambUpdate<float>(y.data(), dy.data(), m.data(), v.data(), norms.data(), y.data(), m.data(),
                          v.data(), n, lamb, 1e-3, 1, 0.9, 0.999, 1e-6, 0.01);
      });
      // ZeRO++'s qwZ passes (weight-quantization=int8), blocks of 256: a
      // unit is a value quantized, or a byte of the gathered parts read.
      std::vector<uint8_t> qbytes((size_t)shapes::quantizedBytes(n, 256));
      per("quantize", n, [&] { quantize(x.data(), n, 256, qbytes.data()); });
      per("dequantize", (double)qbytes.size(),
          [&] { dequantize(qbytes.data(), 1, n, 256, y.data(), DequantizeTo::F32); });
      Shape big{rows, cols}, row{cols};
      per("sum_to", n, [&] { sumTo<float>(dy.data(), big, dg.data(), row); });
      // Attention: B = 2, T = 128, C = 128 in 4 heads, causal.
      const int64_t B = 2, T = 128, C = 128, H = 4;
      std::vector<float> q(B * T * C, 0.1f), k(B * T * C, 0.2f), vv(B * T * C, 0.3f),
          o(B * T * C), dq(B * T * C), dk(B * T * C), dv(B * T * C), dout(B * T * C, 1.0f),
          lse(B * H * T);
      double units = (double)B * T * T * C;
      per("attention", units, [&] {
        attention<float>(q.data(), k.data(), vv.data(), o.data(), lse.data(), B, T, C, H, true);
      });
      per("attention_grad", units, [&] {
        attentionGrad<float>(q.data(), k.data(), vv.data(), lse.data(), dout.data(), dq.data(),
                             dk.data(), dv.data(), B, T, C, H, true);
      });
    }
    nlohmann::json cache = gemmCacheCurve();
    compute = {{"seconds_per_unit", perUnit},
               {"gemm_flops_per_s", 1.0 / gemmRate},
               {"mem_bytes_per_s", 1.0 / memRate},
               // The fixed cost of a call: the smaller of the two fits'
               // intercepts, never below zero (a fit can dip under it).
               {"op_overhead_s", std::max(0.0, std::min(gemmFixed, memFixed))},
               {"gemm_samples", {{"flops", flops}, {"seconds", secs}}},
               {"elementwise_samples", {{"bytes", bytes}, {"seconds", esecs}}}};
    if (!cache.is_null()) {
      compute["gemm_cold_bytes_per_s"] = cache["cold_bytes_per_s"];
      compute["cache_curve"] = {{"bytes", cache["bytes"]},
                                {"cold_fraction", cache["cold_fraction"]}};
      compute["cache_samples"] = {{"bytes", cache["bytes"]}, {"seconds", cache["seconds"]}};
    }
  }
  FSDP_RETURN_IF_ERROR(comm.barrier());

  nlohmann::json link = nullptr;
  Communicator *node = nullptr, *cross = nullptr;
  int64_t perNode = 0;
  if (comm.levels(node, cross, perNode)) {
    // Two levels ([Note: hybrid collectives]): each link fitted on its own
    // groups, every node's (every place's) at once, as in a collective.
    // The whole communicator's collectives are fitted too, as one ring
    // ("whole": what a profile held before, and a check of the two-level
    // formula against the collectives it prices).
    nlohmann::json inter, whole;
    FSDP_RETURN_IF_ERROR(fitLink(*node, comm, link));
    FSDP_RETURN_IF_ERROR(fitLink(*cross, comm, inter));
    FSDP_RETURN_IF_ERROR(fitLink(comm, comm, whole));
    whole.erase("ranks");
    whole.erase("backend");
    link["whole"] = whole;
    link["ranks"] = comm.size();
    link["backend"] = comm.backend();
    link["two_level"] = true;
    link["ranks_per_node"] = perNode;
    link["node_backend"] = node->backend();
    link["inter_backend"] = cross->backend();
    link["inter_alpha_s"] = inter["alpha_s"];
    link["inter_beta_s_per_byte"] = inter["beta_s_per_byte"];
    link["inter_samples"] = inter["samples"];
  } else if (comm.size() > 1) {
    FSDP_RETURN_IF_ERROR(fitLink(comm, comm, link));
  }
  // Every rank's comm timings differ a little; rank 0's are the profile.
  std::string text = compute.dump();
  int64_t len = (int64_t)text.size();
  FSDP_RETURN_IF_ERROR(comm.broadcast(&len, sizeof len, 0));
  text.resize(len);
  FSDP_RETURN_IF_ERROR(comm.broadcast(text.data(), len, 0));
  compute = nlohmann::json::parse(text);
  unsigned cores = std::thread::hardware_concurrency();
  profile = {{"name", "cpu"},
             {"kind", "cpu"},
             {"cores", cores ? cores : 1},
             {"threads_per_rank", threads},
             {"compute", compute},
             {"link", link}};
  return Status::ok();
}

} // namespace fsdp::cpu
