//===- CudaComm.cpp - NCCL and host-staged communicators ------------------===//

#include "runtime/cuda/CudaComm.h"

#include "runtime/cuda/CudaCheck.h"
#include "runtime/cuda/CudaDevice.h"
#include "runtime/cuda/CudaLibs.h"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::cuda {

namespace {

std::mutex asyncMu;
Status asyncError;              // first failure of a staged collective
std::atomic<bool> asyncFailed{false};

void recordAsyncError(const Status &st) {
  std::lock_guard<std::mutex> l(asyncMu);
  if (asyncError)
    asyncError = st;
  asyncFailed = true;
}

cudaStream_t streamOf(Stream *s) {
  return s ? static_cast<cudaStream_t>(s->nativeHandle()) : nullptr;
}

int64_t elementBytes(DType t) { return dtypeSize(t); }

// --- host-staged -----------------------------------------------------------------

/// Device buffers through pinned host memory and the wrapped host
/// communicator. One pinned in/out pair per communicator, grown (after the
/// stream drains) when a collective needs more; collectives on the stream
/// run one after another, so one pair serves them all.
class StagedComm final : public Communicator {
public:
  explicit StagedComm(std::unique_ptr<Communicator> host) : host(std::move(host)) {}
  ~StagedComm() override {
    if (hin)
      cudaFreeHost(hin);
    if (hout)
      cudaFreeHost(hout);
  }
  int64_t rank() const override { return host->rank(); }
  int64_t size() const override { return host->size(); }
  // The data moves over the host communicator.
  const char *backend() const override { return host->backend(); }
  std::string describe() const override { return "host-staged over " + host->describe(); }

  Status allReduce(const void *in, void *out, int64_t count, DType dtype, ReduceOp op,
                   Stream *stream) override {
    if (!streamOf(stream))
      return host->allReduce(in, out, count, dtype, op, nullptr);
    bytesSent_ += 2 * (size() - 1) * count * elementBytes(dtype) / std::max<int64_t>(size(), 1);
    return staged(Kind::AllReduce, in, count, out, count, dtype, op, streamOf(stream));
  }
  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype, ReduceOp op,
                       Stream *stream) override {
    if (!streamOf(stream))
      return host->reduceScatter(in, out, shard, dtype, op, nullptr);
    bytesSent_ += (size() - 1) * shard * elementBytes(dtype);
    return staged(Kind::ReduceScatter, in, shard * size(), out, shard, dtype, op,
                  streamOf(stream));
  }
  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *stream) override {
    if (!streamOf(stream))
      return host->allGather(in, out, shard, dtype, nullptr);
    bytesSent_ += (size() - 1) * shard * elementBytes(dtype);
    return staged(Kind::AllGather, in, shard, out, shard * size(), dtype, ReduceOp::Sum,
                  streamOf(stream));
  }
  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *stream) override {
    if (!streamOf(stream))
      return host->allToAll(in, out, chunk, dtype, nullptr);
    bytesSent_ += (size() - 1) * chunk * elementBytes(dtype);
    return staged(Kind::AllToAll, in, chunk * size(), out, chunk * size(), dtype, ReduceOp::Sum,
                  streamOf(stream));
  }
  Status broadcast(void *data, int64_t bytes, int64_t root) override {
    return host->broadcast(data, bytes, root);
  }
  Status barrier() override { return host->barrier(); }
  Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                  std::unique_ptr<Communicator> &out) override {
    std::unique_ptr<Communicator> sub;
    FSDP_RETURN_IF_ERROR(host->subgroup(ranks, tag, sub));
    out = std::make_unique<StagedComm>(std::move(sub));
    return Status::ok();
  }

private:
  enum class Kind { AllReduce, ReduceScatter, AllGather, AllToAll };
  struct Call {
    Communicator *host;
    Kind kind;
    void *in, *out;
    int64_t inCount, outCount;
    DType dtype;
    ReduceOp op;
  };
  static void CUDART_CB run(void *p) {
    std::unique_ptr<Call> c(static_cast<Call *>(p));
    if (asyncFailed)
      return; // a peer failed earlier: the job is stopping
    Status st =
        c->kind == Kind::AllReduce
            ? c->host->allReduce(c->in, c->out, c->outCount, c->dtype, c->op, nullptr)
        : c->kind == Kind::ReduceScatter
            ? c->host->reduceScatter(c->in, c->out, c->outCount, c->dtype, c->op, nullptr)
        : c->kind == Kind::AllGather
            ? c->host->allGather(c->in, c->out, c->inCount, c->dtype, nullptr)
            : c->host->allToAll(c->in, c->out, c->inCount / c->host->size(), c->dtype, nullptr);
    if (!st)
      recordAsyncError(st);
  }
  Status reserve(size_t inB, size_t outB, cudaStream_t s) {
    if (inB <= inCap && outB <= outCap)
      return Status::ok();
    FSDP_CUDA_CHECK(cudaStreamSynchronize(s)); // the old buffers may be in use
    if (inB > inCap) {
      if (hin)
        FSDP_CUDA_CHECK(cudaFreeHost(hin));
      hin = nullptr;
      FSDP_CUDA_CHECK(cudaMallocHost(&hin, inB));
      inCap = inB;
    }
    if (outB > outCap) {
      if (hout)
        FSDP_CUDA_CHECK(cudaFreeHost(hout));
      hout = nullptr;
      FSDP_CUDA_CHECK(cudaMallocHost(&hout, outB));
      outCap = outB;
    }
    return Status::ok();
  }
  Status staged(Kind kind, const void *in, int64_t inCount, void *out, int64_t outCount,
                DType dtype, ReduceOp op, cudaStream_t s) {
    size_t es = (size_t)elementBytes(dtype);
    size_t inB = es * inCount, outB = es * outCount;
    if (size() == 1) { // sum, mean or gather over one rank: a copy
      if (in != out)
        FSDP_CUDA_CHECK(cudaMemcpyAsync(out, in, outB, cudaMemcpyDeviceToDevice, s));
      return Status::ok();
    }
    FSDP_RETURN_IF_ERROR(reserve(inB, outB, s));
    FSDP_CUDA_CHECK(cudaMemcpyAsync(hin, in, inB, cudaMemcpyDeviceToHost, s));
    auto *call = new Call{host.get(), kind, hin, hout, inCount, outCount, dtype, op};
    cudaError_t e = cudaLaunchHostFunc(s, &StagedComm::run, call);
    if (e != cudaSuccess) {
      delete call;
      return cudaStatus(e, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
    FSDP_CUDA_CHECK(cudaMemcpyAsync(out, hout, outB, cudaMemcpyHostToDevice, s));
    return Status::ok();
  }

  std::unique_ptr<Communicator> host;
  void *hin = nullptr, *hout = nullptr;
  size_t inCap = 0, outCap = 0;
};

// --- NCCL ----------------------------------------------------------------------------

Status ncclStatus(ncclResult_t r, const char *call, const char *file, int line) {
  if (r == ncclSuccess)
    return Status::ok();
  return makeError(file, line, call, " failed: ", ncclGetErrorString(r), " (",
                   ncclGetLastError(nullptr), ")");
}
#define FSDP_NCCL_CHECK(call)                                                  \
  FSDP_RETURN_IF_ERROR(ncclStatus((call), #call, __FILE__, __LINE__))

bool ncclType(DType t, ncclDataType_t &out) {
  switch (t) {
  case DType::F32:
    out = ncclFloat32;
    return true;
  case DType::BF16:
    out = ncclBfloat16;
    return true;
  case DType::F16:
    out = ncclFloat16;
    return true;
  default:
    return false;
  }
}

// [Note: the NCCL watchdog]
// NCCL's collectives never time out: with a peer dead or stalled, its
// kernels spin and cudaStreamSynchronize waits forever (Comm.h promises an
// error). As PyTorch's ProcessGroupNCCL watchdog does, the CUDA device
// waits for its streams by polling (CudaDevice::idle): it asks every live
// NCCL communicator for an asynchronous error (a peer's network failure,
// ncclCommGetAsyncError) and gives the streams the job's collective
// timeout (fsdp-run's FSDP_COMM_TIMEOUT_S, 60 s by default; a whole step's queued
// work must drain within it, as a step is synchronized once). Past it, or
// on an error, every communicator is aborted (ncclCommAbort ends their
// pending kernels, so the streams drain) and the step fails naming the
// cause. Communicators register themselves here.
std::mutex ncclMu;
std::vector<ncclComm_t> liveComms; // registered, not yet destroyed or aborted
double watchdogSeconds = 0;

class NcclComm final : public Communicator {
public:
  /// `host` (the same ranks' host communicator) carries host-buffer collectives.
  NcclComm(ncclComm_t comm, std::shared_ptr<Communicator> host, int64_t rank, int64_t size)
      : comm(comm), host(std::move(host)), r(rank), n(size) {
    std::lock_guard<std::mutex> l(ncclMu);
    liveComms.push_back(comm);
  }
  ~NcclComm() override {
    std::lock_guard<std::mutex> l(ncclMu);
    auto it = std::find(liveComms.begin(), liveComms.end(), comm);
    if (it != liveComms.end()) { // not aborted: still ours to destroy
      liveComms.erase(it);
      ncclCommDestroy(comm);
    }
  }
  int64_t rank() const override { return r; }
  int64_t size() const override { return n; }
  const char *backend() const override { return "nccl"; }
  std::string describe() const override { return ncclDescription(); }

  Status allReduce(const void *in, void *out, int64_t count, DType dtype, ReduceOp op,
                   Stream *stream) override {
    if (!streamOf(stream))
      return host->allReduce(in, out, count, dtype, op, nullptr);
    ncclDataType_t t;
    if (!ncclType(dtype, t))
      return FSDP_ERROR("all_reduce: NCCL cannot reduce ", dtypeName(dtype));
    bytesSent_ += 2 * (n - 1) * count * elementBytes(dtype) / n;
    FSDP_NCCL_CHECK(ncclAllReduce(in, out, (size_t)count, t, redOp(op), comm,
                                  streamOf(stream)));
    return Status::ok();
  }
  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype, ReduceOp op,
                       Stream *stream) override {
    if (!streamOf(stream))
      return host->reduceScatter(in, out, shard, dtype, op, nullptr);
    ncclDataType_t t;
    if (!ncclType(dtype, t))
      return FSDP_ERROR("reduce_scatter: NCCL cannot reduce ", dtypeName(dtype));
    bytesSent_ += (n - 1) * shard * elementBytes(dtype);
    FSDP_NCCL_CHECK(ncclReduceScatter(in, out, (size_t)shard, t, redOp(op), comm,
                                      streamOf(stream)));
    return Status::ok();
  }
  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *stream) override {
    if (!streamOf(stream))
      return host->allGather(in, out, shard, dtype, nullptr);
    bytesSent_ += (n - 1) * shard * elementBytes(dtype);
    // bytes: any dtype
    FSDP_NCCL_CHECK(ncclAllGather(in, out, (size_t)(shard * elementBytes(dtype)), ncclUint8,
                                  comm, streamOf(stream)));
    return Status::ok();
  }
  /// One group of point-to-point calls, as PyTorch's all_to_all_single:
  /// NCCL runs the group's sends and receives together. Bytes: any dtype.
  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *stream) override {
    if (!streamOf(stream))
      return host->allToAll(in, out, chunk, dtype, nullptr);
    const size_t bytes = (size_t)(chunk * elementBytes(dtype));
    bytesSent_ += (n - 1) * (int64_t)bytes;
    if (bytes == 0)
      return Status::ok();
    cudaStream_t s = streamOf(stream);
    const auto *src = static_cast<const uint8_t *>(in);
    auto *dst = static_cast<uint8_t *>(out);
    FSDP_CUDA_CHECK(
        cudaMemcpyAsync(dst + r * bytes, src + r * bytes, bytes, cudaMemcpyDeviceToDevice, s));
    if (n == 1)
      return Status::ok();
    FSDP_NCCL_CHECK(ncclGroupStart());
    Status st;
    for (int64_t k = 1; k < n && st; ++k) {
      const int64_t to = (r + k) % n, from = (r + n - k) % n;
      st = ncclStatus(ncclSend(src + to * bytes, bytes, ncclUint8, (int)to, comm, s), "ncclSend",
                      __FILE__, __LINE__);
      if (st)
        st = ncclStatus(ncclRecv(dst + from * bytes, bytes, ncclUint8, (int)from, comm, s),
                        "ncclRecv", __FILE__, __LINE__);
    }
    // Closed even after a failed call: NCCL's group depth is per thread,
    // and an open group would swallow every later collective.
    Status end = ncclStatus(ncclGroupEnd(), "ncclGroupEnd", __FILE__, __LINE__);
    return st ? end : st;
  }
  Status broadcast(void *data, int64_t bytes, int64_t root) override {
    if (n == host->size())
      return host->broadcast(data, bytes, root);
    return FSDP_ERROR("broadcast on an NCCL subgroup is not supported");
  }
  Status barrier() override { return host->barrier(); }
  bool capturable() const override { return true; }
  Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                  std::unique_ptr<Communicator> &out) override {
    // Every rank of this communicator calls subgroup for each axis in the
    // same order (Executor), so the split is collective as NCCL needs:
    // the group's smallest rank names it, ranks keep their order.
    // Host-buffer collectives of the group (Executor::gatherParams on the
    // shard group) go to the host communicator's own group, as StagedComm's.
    std::unique_ptr<Communicator> hostSub;
    FSDP_RETURN_IF_ERROR(host->subgroup(ranks, tag, hostSub));
    int color = (int)ranks.front();
    int key = (int)(std::find(ranks.begin(), ranks.end(), r) - ranks.begin());
    ncclComm_t sub = nullptr;
    FSDP_NCCL_CHECK(ncclCommSplit(comm, color, key, &sub, nullptr));
    out = std::make_unique<NcclComm>(sub, std::shared_ptr<Communicator>(std::move(hostSub)),
                                     key, (int64_t)ranks.size());
    return Status::ok();
  }

private:
  static ncclRedOp_t redOp(ReduceOp op) { return op == ReduceOp::Mean ? ncclAvg : ncclSum; }
  static std::string dtypeName(DType t) { return std::string(dtypeInfo(t).name); }
  ncclComm_t comm;
  std::shared_ptr<Communicator> host;
  int64_t r, n;
};

Status makeNccl(const JobEnv &job, double timeoutSeconds, std::unique_ptr<Communicator> host,
                std::unique_ptr<Communicator> &out) {
  FSDP_RETURN_IF_ERROR(loadNccl());
  ncclUniqueId id;
  std::shared_ptr<Communicator> shared(std::move(host));
  if (job.rank == 0)
    FSDP_NCCL_CHECK(ncclGetUniqueId(&id));
  // Rank 0's id reaches every rank through the host communicator (which
  // met through the job's rendezvous store).
  FSDP_RETURN_IF_ERROR(shared->broadcast(&id, sizeof(id), 0));
  ncclComm_t comm = nullptr;
  FSDP_NCCL_CHECK(ncclCommInitRank(&comm, (int)job.worldSize, id, (int)job.rank));
  {
    std::lock_guard<std::mutex> l(ncclMu);
    watchdogSeconds = timeoutSeconds;
  }
  out = std::make_unique<NcclComm>(comm, shared, job.rank, job.worldSize);
  return Status::ok();
}

} // namespace

double ncclWatchdogSeconds() {
  std::lock_guard<std::mutex> l(ncclMu);
  return liveComms.empty() ? 0.0 : watchdogSeconds;
}

Status ncclAsyncError() {
  std::lock_guard<std::mutex> l(ncclMu);
  for (ncclComm_t c : liveComms) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c, &async);
    if (r != ncclSuccess)
      return FSDP_ERROR("ncclCommGetAsyncError failed: ", ncclGetErrorString(r));
    if (async != ncclSuccess && async != ncclInProgress)
      return FSDP_ERROR("NCCL reports an asynchronous error: ", ncclGetErrorString(async),
                        " (", ncclGetLastError(c), ")");
  }
  return Status::ok();
}

void abortNcclComms() {
  std::lock_guard<std::mutex> l(ncclMu);
  for (ncclComm_t c : liveComms)
    ncclCommAbort(c);
  liveComms.clear();
}

Status takeAsyncCommError() {
  std::lock_guard<std::mutex> l(asyncMu);
  return asyncError;
}

Status makeCudaCommunicator(const JobEnv &job, double timeoutSeconds,
                            std::unique_ptr<Communicator> host,
                            std::unique_ptr<Communicator> &out) {
  const char *choice = std::getenv("FSDP_CUDA_COMM");
  std::string c = choice ? choice : "";
  if (!c.empty() && c != "nccl" && c != "staged")
    return FSDP_ERROR("FSDP_CUDA_COMM='", c, "': expected nccl or staged");
  bool ownGpu = cudaDeviceCount() >= job.localWorldSize;
  if (c == "nccl" && !ownGpu)
    return FSDP_ERROR("FSDP_CUDA_COMM=nccl: ", job.localWorldSize, " ranks on this node but ",
                      cudaDeviceCount(),
                      " GPUs; NCCL needs a GPU per rank (use FSDP_CUDA_COMM=staged)");
  if (c == "nccl" || (c.empty() && ownGpu && job.worldSize > 1))
    return makeNccl(job, timeoutSeconds, std::move(host), out);
  out = std::make_unique<StagedComm>(std::move(host));
  return Status::ok();
}

} // namespace fsdp::cuda
