//===- GlooComm.cpp - CPU collectives through Gloo ------------------------===//
//
// [Note: Gloo's reduce-scatter]
// ReduceScatterHalvingDoubling reduces a whole buffer in place and leaves
// this rank's chunk at the START of the buffer, not at its own offset. The
// input is therefore copied to a scratch buffer first (the plan's input
// must stay intact: the memory planner may still read it) and the first
// `shard` elements are copied out. With a world size that is not a power
// of two, training with halving-doubling gave wrong results (3 ranks,
// ZeRO-2: parameters off by 1e-3 after two steps, reproducible), although
// CommTest, which checks the collective alone with skewed ranks and mixed
// sizes, does not reproduce it; the cause is not understood. For those
// sizes the reduce-scatter is therefore an all-reduce of the whole buffer:
// correct, at twice the volume. test/e2e/shard_equivalence.py covers N = 3.
//
// [Note: failures]
// Gloo reports a dead peer by throwing (gloo::IoException "Connection
// closed by peer") and a silent one by timing out. Every call is wrapped so
// that either becomes a Status naming the collective; the timeout bounds
// how long a rank can wait for a peer that will never come. Gloo's message
// names the peer this rank was talking to, which in a ring is usually a
// neighbour that was itself waiting; the flight recorder
// (FlightRecorder.h) names the rank the collective actually waited for.
// FSDP_FLIGHT_RECORDER=0 turns it off.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/GlooComm.h"

#include "runtime/comm/FlightRecorder.h"
#include "runtime/core/Bf16.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <map>
#include <cstdlib>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace fsdp {

namespace {

/// Gloo's connectFullMesh returns on a rank once its own pairs are
/// connected, while a peer may still be completing its side of one of
/// them: a rank that then closed its connections at once (a job failing
/// right after connecting, a probe) could cut that peer's rendezvous short
/// ("Connection closed by peer"). Every rank leaves only once all have
/// connected: a barrier, within the timeout like every collective.
void meetAfterConnecting(const std::shared_ptr<gloo::Context> &ctx,
                         std::chrono::milliseconds timeout) {
  gloo::BarrierOptions opts(ctx);
  opts.setTimeout(timeout);
  gloo::barrier(opts);
}

/// Gloo's reduction for bf16 buffers: c = a + b summed in f32 and rounded
/// once to bf16 (each step of Gloo's ring / halving-doubling rounds, as
/// NCCL's bf16 reductions do).
void sumBf16(void *c, const void *a, const void *b, size_t n) {
  auto *pc = static_cast<uint16_t *>(c);
  auto *pa = static_cast<const uint16_t *>(a);
  auto *pb = static_cast<const uint16_t *>(b);
  for (size_t i = 0; i < n; ++i)
    pc[i] = roundToBf16(widenBf16(pa[i]) + widenBf16(pb[i]));
}

/// The same for f16 (loss-scaled gradients: an overflow becomes inf, which
/// the step's norm then reports).
void sumF16(void *c, const void *a, const void *b, size_t n) {
  auto *pc = static_cast<uint16_t *>(c);
  auto *pa = static_cast<const uint16_t *>(a);
  auto *pb = static_cast<const uint16_t *>(b);
  for (size_t i = 0; i < n; ++i)
    pc[i] = roundToHalf(widenHalf(pa[i]) + widenHalf(pb[i]));
}

/// The reduce function and element size for `dtype`; false when this
/// communicator cannot sum it.
bool reduction(DType dtype, void (*&fn)(void *, const void *, const void *, size_t)) {
  if (dtype == DType::F32) {
    fn = static_cast<void (*)(void *, const void *, const void *, size_t)>(
        &gloo::sum<float>);
    return true;
  }
  if (dtype == DType::BF16) {
    fn = &sumBf16;
    return true;
  }
  if (dtype == DType::F16) {
    fn = &sumF16;
    return true;
  }
  return false;
}

/// [Note: f16 means] A mean of f16 buffers divides each rank's input by N
/// BEFORE the sum, as NCCL's ncclAvg does (a pre-multiplied sum): loss-
/// scaled f16 gradients sit near f16's largest value (65504) by design, and
/// a sum of N of them would overflow where their mean does not, making
/// every step "overflow" at N > 1. f32 and bf16 (f32's range) keep the
/// sum-then-divide they always had.
bool preDivides(DType dtype, bool mean) { return mean && dtype == DType::F16; }

/// data[i] /= n in the buffer's dtype (f32, bf16 or f16, rounded once).
void divide(void *data, int64_t count, DType dtype, int64_t n) {
  if (dtype == DType::F32) {
    auto *d = static_cast<float *>(data);
    for (int64_t i = 0; i < count; ++i)
      d[i] /= (float)n;
    return;
  }
  auto *d = static_cast<uint16_t *>(data);
  if (dtype == DType::F16) {
    for (int64_t i = 0; i < count; ++i)
      d[i] = roundToHalf(widenHalf(d[i]) / (float)n);
    return;
  }
  for (int64_t i = 0; i < count; ++i)
    d[i] = roundToBf16(widenBf16(d[i]) / (float)n);
}

/// [Note: Gloo buffers] Gloo's collectives register the caller's memory as
/// transport::UnboundBuffers, and the tcp transport's buffer destructor
/// waits (spinning on sched_yield) until Gloo's event-loop thread has let
/// go of it. With ranks sharing cores that thread is often not running, and
/// the wait lasted a scheduler tick or more: a 0.3 ms all-gather took 3-7
/// ms every few calls, most of a 2-rank CPU step (measured: the MLP of
/// bench/simulator.py, 37 ms/step of which ~17 ms such stalls). The
/// buffers are therefore kept, keyed by (address, bytes): the plan's
/// collectives run on fixed arena addresses, so each is registered once
/// and never destroyed inside a step. The options classes below hand a
/// cached buffer to Gloo and take it back after the call (the members are
/// protected in Gloo's headers, for this kind of reuse). Unbound buffers
/// hold no collective state (the new-style collectives derive their slots
/// from their tags), so a rank may hit the cache where another misses.
class BufferCache {
public:
  using Buffer = std::unique_ptr<gloo::transport::UnboundBuffer>;
  Buffer take(gloo::Context &ctx, const void *ptr, size_t bytes) {
    auto it = cache.find({ptr, bytes});
    if (it != cache.end()) {
      Buffer b = std::move(it->second);
      cache.erase(it);
      return b;
    }
    return ctx.createUnboundBuffer(const_cast<void *>(ptr), bytes);
  }
  void give(const void *ptr, size_t bytes, Buffer b) {
    if (!b)
      return;
    // Host-side callers (checkpoints, calibration) use passing addresses:
    // bound the cache; a full flush costs the old waits once.
    if (cache.size() >= 1024)
      cache.clear();
    cache[{ptr, bytes}] = std::move(b);
  }

private:
  std::map<std::pair<const void *, size_t>, Buffer> cache;
};

/// Gloo's all-gather or all-to-all options (`Options`: their protected
/// `in` and `out` unbound buffers) lent the cache's buffers for one call
/// and handing them back after it.
template <typename Options> struct CachedInOut : Options {
  using Options::Options;
  void lend(BufferCache::Buffer i, BufferCache::Buffer o) {
    this->elementSize = 1;
    this->in = std::move(i);
    this->out = std::move(o);
  }
  BufferCache::Buffer takeIn() { return std::move(this->in); }
  BufferCache::Buffer takeOut() { return std::move(this->out); }
};
using CachedAllgather = CachedInOut<gloo::AllgatherOptions>;
using CachedAlltoall = CachedInOut<gloo::AlltoallOptions>;

struct CachedAllreduce : gloo::AllreduceOptions {
  using gloo::AllreduceOptions::AllreduceOptions;
  template <typename T> void lend(BufferCache::Buffer o) {
    std::vector<BufferCache::Buffer> v;
    v.push_back(std::move(o));
    setOutputs<T>(std::move(v));
  }
  BufferCache::Buffer takeOut() {
    return impl_.out.empty() ? nullptr : std::move(impl_.out[0]);
  }
};

class GlooComm final : public Communicator {
public:
  GlooComm(std::shared_ptr<gloo::rendezvous::Context> ctx,
           std::chrono::milliseconds timeout,
           std::unique_ptr<FlightRecorder> recorder,
           std::shared_ptr<gloo::transport::Device> dev,
           std::shared_ptr<gloo::rendezvous::Store> store, std::string prefix)
      : ctx(std::move(ctx)), timeout(timeout), recorder(std::move(recorder)),
        dev(std::move(dev)), store(std::move(store)), prefix(std::move(prefix)) {}

  /// A Gloo context of its own over the group's ranks, met through the
  /// job's store under a key prefix naming the group. No flight recorder:
  /// the group's collectives are still bounded by the timeout, but a stall
  /// is reported without naming the rank waited for.
  Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                  std::unique_ptr<Communicator> &out) override {
    int64_t me = 0;
    FSDP_RETURN_IF_ERROR(checkGroup(ranks, tag, me));
    if (ranks.size() == 1)
      return Communicator::subgroup(ranks, tag, out);
    std::string name = prefix + "/" + tag;
    try {
      gloo::rendezvous::PrefixStore ps(name, *store);
      auto sub = std::make_shared<gloo::rendezvous::Context>(
          (int)me, (int)ranks.size());
      sub->setTimeout(timeout);
      sub->connectFullMesh(ps, dev);
      meetAfterConnecting(sub, timeout);
      out = std::make_unique<GlooComm>(sub, timeout, nullptr, dev, store, name);
    } catch (const std::exception &e) {
      return FSDP_ERROR("rank ", rank(), ": connecting group '", tag, "' (", ranks.size(),
                        " ranks) failed: ", e.what());
    }
    return Status::ok();
  }

  int64_t rank() const override { return ctx->rank; }
  const char *backend() const override { return "gloo"; }
  int64_t size() const override { return ctx->size; }

  Status allReduce(const void *in, void *data, int64_t n, DType dtype, ReduceOp op,
                   Stream *) override {
    void (*fn)(void *, const void *, const void *, size_t);
    if (!reduction(dtype, fn))
      return FSDP_ERROR("all_reduce: this communicator sums f32, bf16 and f16, not ",
                        dtypeName(dtype));
    const int64_t es = dtypeSize(dtype);
    const bool mean = op == ReduceOp::Mean;
    if (in != data) // Gloo reduces in place
      std::memmove(data, in, n * es);
    const bool pre = preDivides(dtype, mean); // [Note: f16 means]
    if (pre)
      divide(data, n, dtype, size());
    Status st = guard("all_reduce", [&] { sumInPlace(data, n, dtype, fn); });
    if (st && mean && !pre)
      divide(data, n, dtype, size());
    bytesSent_ += 2 * (size() - 1) * n * es / size();
    return st;
  }

  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype,
                       ReduceOp op, Stream *) override {
    const bool mean = op == ReduceOp::Mean;
    void (*fn)(void *, const void *, const void *, size_t);
    if (!reduction(dtype, fn))
      return FSDP_ERROR("reduce_scatter: this communicator sums f32, bf16 and "
                        "f16, not ", dtypeName(dtype));
    const int64_t es = dtypeSize(dtype);
    // See [Note: Gloo's reduce-scatter].
    // The scratch copy is kept per size, with the halving-doubling object
    // built on it ([Note: Gloo buffers]). Per size, not per address: an
    // algorithm object takes its pair slots from the context when it is
    // built, so every rank must build (and reuse) the same objects in the
    // same order; the sizes of a job's collectives are the same on every
    // rank, in the same order, where addresses are not (a cache keyed by
    // address hung CommTest). Bounded by the number of distinct sizes,
    // flushed at the same call on every rank.
    const int64_t bytes = shard * size() * es;
    if (!reduceScratch.count(bytes) && reduceScratch.size() >= 64) {
      halvingDoubling.clear(); // they point into the scratch buffers
      reduceScratch.clear();
    }
    std::vector<uint8_t> &scratch = reduceScratch[bytes];
    scratch.resize(bytes);
    std::memcpy(scratch.data(), in, scratch.size());
    const bool pre = preDivides(dtype, mean); // [Note: f16 means]
    if (pre)
      divide(scratch.data(), shard * size(), dtype, size());
    // Gloo's halving-doubling is a template over arithmetic types; bf16
    // (no C++ type) takes the all-reduce route at every world size.
    bool viaAllReduce = (size() & (size() - 1)) || dtype != DType::F32;
    Status st = guard("reduce_scatter", [&] {
      if (viaAllReduce) {
        // See [Note: Gloo's reduce-scatter]: for a world size that is not
        // a power of two the reduction is an all-reduce of the whole buffer.
        sumInPlace(scratch.data(), shard * size(), dtype, fn);
        std::memmove(scratch.data(), scratch.data() + rank() * shard * es,
                     shard * es);
        return;
      }
      auto &rs = halvingDoubling[bytes];
      if (!rs) {
        std::vector<int> counts(size(), (int)shard);
        rs = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
            ctx, std::vector<float *>{reinterpret_cast<float *>(scratch.data())},
            (int)(shard * size()), counts);
      }
      rs->run();
    });
    if (!st)
      return st;
    if (dtype == DType::F32) {
      // f32 as it always was: times 1/N.
      const auto *sum = reinterpret_cast<const float *>(scratch.data());
      float f = mean ? 1.0f / (float)size() : 1.0f;
      for (int64_t i = 0; i < shard; ++i)
        static_cast<float *>(out)[i] = sum[i] * f;
    } else {
      if (mean && !pre)
        divide(scratch.data(), shard, dtype, size());
      std::memcpy(out, scratch.data(), shard * es);
    }
    // The ring volume of the reduce-scatter the plan asked for (Comm.h),
    // though the all-reduce route moves twice that.
    bytesSent_ += (size() - 1) * shard * es;
    return Status::ok();
  }

  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *) override {
    // Moves bytes: any dtype.
    const int64_t bytes = shard * dtypeSize(dtype);
    bytesSent_ += (size() - 1) * bytes;
    return guard("all_gather", [&] {
      // See [Note: Gloo buffers].
      CachedAllgather opts(ctx);
      size_t outBytes = (size_t)(bytes * size());
      opts.lend(buffers.take(*ctx, in, (size_t)bytes), buffers.take(*ctx, out, outBytes));
      opts.setTimeout(timeout);
      gloo::allgather(opts);
      buffers.give(in, (size_t)bytes, opts.takeIn());
      buffers.give(out, outBytes, opts.takeOut());
    });
  }

  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *) override {
    // Moves bytes: any dtype. Gloo's pairwise exchange: chunk j to rank
    // j, the own chunk a memcpy.
    const int64_t bytes = chunk * dtypeSize(dtype);
    bytesSent_ += (size() - 1) * bytes;
    if (bytes == 0)
      return Status::ok(); // nothing to move (every rank skips alike)
    return guard("all_to_all", [&] {
      // See [Note: Gloo buffers].
      CachedAlltoall opts(ctx);
      size_t total = (size_t)(bytes * size());
      opts.lend(buffers.take(*ctx, in, total), buffers.take(*ctx, out, total));
      opts.setTimeout(timeout);
      gloo::alltoall(opts);
      buffers.give(in, total, opts.takeIn());
      buffers.give(out, total, opts.takeOut());
    });
  }

  Status broadcast(void *data, int64_t bytes, int64_t root) override {
    return guard("broadcast", [&] {
      gloo::BroadcastOptions opts(ctx);
      opts.setOutput(static_cast<uint8_t *>(data), (size_t)bytes);
      opts.setRoot((int)root);
      opts.setTimeout(timeout);
      gloo::broadcast(opts);
    });
  }

  Status barrier() override {
    return guard("barrier", [&] {
      gloo::BarrierOptions opts(ctx);
      opts.setTimeout(timeout);
      gloo::barrier(opts);
    });
  }

private:
  /// Gloo's ring all-reduce of `n` elements at `data`, through a cached
  /// buffer ([Note: Gloo buffers]). Gloo sizes elements by the pointer
  /// type: bf16 / f16 travel as uint16_t.
  void sumInPlace(void *data, int64_t n, DType dtype,
                  void (*fn)(void *, const void *, const void *, size_t)) {
    CachedAllreduce opts(ctx);
    size_t bytes = (size_t)(n * dtypeSize(dtype));
    if (dtype == DType::F32)
      opts.lend<float>(buffers.take(*ctx, data, bytes));
    else
      opts.lend<uint16_t>(buffers.take(*ctx, data, bytes));
    opts.setReduceFunction(fn);
    opts.setTimeout(timeout);
    gloo::allreduce(opts);
    buffers.give(data, bytes, opts.takeOut());
  }

  template <typename F> Status guard(const char *what, F f) {
    // See [Note: failures].
    int64_t seq = recorder ? recorder->enter(what) : 0;
    try {
      f();
      if (recorder)
        recorder->complete(seq);
      return Status::ok();
    } catch (const std::exception &e) {
      std::string why =
          recorder ? recorder->explain(seq, what, e.what()) + ". Gloo: " : "";
      return FSDP_ERROR("rank ", rank(), ": ", what,
                        " failed (a peer died or timed out after ",
                        timeout.count() / 1000.0, " s): ", why, e.what());
    }
  }

  std::shared_ptr<gloo::rendezvous::Context> ctx;
  // After ctx: destroyed before the context.
  BufferCache buffers;
  std::map<int64_t, std::vector<uint8_t>> reduceScratch; // by bytes
  // f32 at power-of-two sizes, by bytes; after reduceScratch: destroyed first.
  std::map<int64_t, std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>>>
      halvingDoubling;
  std::chrono::milliseconds timeout;
  std::unique_ptr<FlightRecorder> recorder;
  // What subgroups are connected through: this rank's transport device and
  // the job's rendezvous store (kept open for the job's lifetime).
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::string prefix;
};

} // namespace

Status makeGlooCommunicator(const JobEnv &job, double timeoutSeconds,
                            std::unique_ptr<Communicator> &out) {
  if (job.worldSize == 1) {
    out = makeSingleProcessCommunicator();
    return Status::ok();
  }
  auto timeout = std::chrono::milliseconds((int64_t)(timeoutSeconds * 1000));
  std::shared_ptr<gloo::rendezvous::Store> base;
  try {
    base = openRendezvousStore(job, timeout);
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, " of ", job.worldSize, ": rendezvous through '",
                      rendezvousName(job), "' failed (", job.source, "): ", e.what());
  }
  return makeGlooCommunicatorOn(job, base, timeoutSeconds, /*withRecorder=*/true, out);
}

Status makeGlooCommunicatorOn(const JobEnv &job, std::shared_ptr<gloo::rendezvous::Store> base,
                              double timeoutSeconds, bool withRecorder,
                              std::unique_ptr<Communicator> &out) {
  auto timeout = std::chrono::milliseconds((int64_t)(timeoutSeconds * 1000));
  const std::string where = rendezvousName(job);
  try {
    gloo::transport::tcp::attr attr;
    // Loopback for local jobs; otherwise this machine's name, so that peers
    // on other machines can reach it (FSDP_HOSTNAME overrides).
    attr.hostname = "127.0.0.1";
    bool local = job.masterAddr.empty() || job.masterAddr == "127.0.0.1" ||
                 job.masterAddr == "localhost";
    char name[256];
    if (!local && ::gethostname(name, sizeof name) == 0)
      attr.hostname = name;
    if (const char *h = std::getenv("FSDP_HOSTNAME"))
      attr.hostname = h;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::PrefixStore store("fsdp", *base);
    auto ctx = std::make_shared<gloo::rendezvous::Context>((int)job.rank,
                                                           (int)job.worldSize);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(store, dev);
    meetAfterConnecting(ctx, timeout);
    std::unique_ptr<FlightRecorder> recorder =
        withRecorder ? makeJobFlightRecorder(job, timeout) : nullptr;
    out = std::make_unique<GlooComm>(ctx, timeout, std::move(recorder), dev, base,
                                     "fsdp");
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, " of ", job.worldSize,
                      ": rendezvous through '", where, "' failed (",
                      job.source, "): ", e.what());
  }
  return Status::ok();
}

} // namespace fsdp
