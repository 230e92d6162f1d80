//===- CudaDevice.cpp - the CUDA implementation of Device -----------------===//
//
// prepare() turns every compute instruction into a launcher (device
// pointers, dimensions and attributes resolved once); run(i) calls it on
// the compute stream. An instruction on bf16 / f16 operands runs on its
// storage directly when CudaNative.h / CudaFlash.h / cuBLASLt have a kernel
// for it in that dtype (buildNative: f32 math, one rounding per output, the
// semantics of [Note: bf16 storage, f32 compute] in
// runtime/core/OpRules.cpp); any other one runs, as on the CPU, as its f32
// kernel over widened copies in a device scratch buffer. FSDP_CUDA_NATIVE=0
// turns the native path off (every narrow instruction widened), for
// comparisons.
// Runtime scratch outside the arena (cuBLASLt workspace, reduction
// partials, attention statistics, the widened copies) is allocated once at
// prepare and reported by scratchHighWater().
//
// Errors: a launch failure is returned at once; a kernel's data error (a
// token id or label out of range) is recorded in a device flag and
// reported by synchronize(), the step's one host wait. Failures inside the
// communication stream's host functions (host-staged collectives) are
// reported there too (CudaComm.h).
//
// [Note: the CUDA host stream]
// The offloaded optimizer's async updates run on a host thread
// (HostWorker.h), the CPU kernels on the pinned host arena. An event is a
// cudaEvent (compute, comm) or a marker in the host thread's queue. The
// host stream waits for a cudaEvent (its gradient's to_host copy) in a job
// that polls it under the NCCL watchdog, as idle() does, so a stalled rank
// is an error, not a hang; the job holds the event (shared ownership: the
// executor drops its handle right after the wait). A device stream waits
// for a marker by blocking the caller until the host work is done, so
// whatever is enqueued after it (the copies of the new parameters to the
// device) is issued after the update wrote them.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaDevice.h"

#include "runtime/core/HostWorker.h"
#include "runtime/core/OpRules.h"
#include "runtime/core/ShapeRules.h"
#include "runtime/cpu/Dispatch.h" // fsdp-offload's host instructions
#include "runtime/cuda/CudaCheck.h"
#include "runtime/cuda/CudaComm.h"
#include "runtime/cuda/CudaFlash.h"
#include "runtime/cuda/CudaGemm.h"
#include "runtime/cuda/CudaKernels.h"
#include "runtime/cuda/CudaLibs.h"
#include "runtime/cuda/CudaNative.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fsdp::cuda {

int cudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

Status checkCudaDevice() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return FSDP_ERROR("--device cuda: no usable CUDA GPU (", cudaGetErrorName(e), ": ",
                      cudaGetErrorString(e),
                      "); a driver for CUDA 13 and an NVIDIA GPU are needed; use --device cpu");
  }
  if (n == 0)
    return FSDP_ERROR("--device cuda: the CUDA driver sees no GPU; use --device cpu");
  return loadCublasLt(); // NCCL loads with the first NCCL communicator (CudaComm.cpp)
}

namespace {

class CudaStream final : public Stream {
public:
  cudaStream_t s = nullptr;
  Status sticky;
  void *nativeHandle() const override { return s; }
};

/// A cudaEvent, alive while an event or a host-stream job refers to it.
struct EventHandle {
  cudaEvent_t e = nullptr;
  ~EventHandle() {
    if (e)
      cudaEventDestroy(e);
  }
};

/// A point in a device stream (a cudaEvent) or in a host thread's stream
/// (the host or a swap stream: a marker, valid `host`, in `on`'s queue).
class CudaEvent final : public Event {
public:
  std::shared_ptr<EventHandle> h = std::make_shared<EventHandle>();
  std::shared_future<Status> host;
  const Stream *on = nullptr;
};

/// The host stream or a swap stream: its work runs on a HostWorker of the
/// device's.
class HostStream final : public Stream {};

using Launch = std::function<Status(cudaStream_t)>;
using rules::Op;

FloatKind floatKind(DType t) {
  return t == DType::BF16 ? FloatKind::BF16 : t == DType::F16 ? FloatKind::F16 : FloatKind::F32;
}

/// Device scratch the launchers share (they run one at a time on the
/// compute stream). Sizes are the maxima over the plan's instructions.
struct Scratch {
  float *f = nullptr;      // attention statistics, norm row statistics, pack staging
  double *d = nullptr;     // reduction partials, per-row losses
  uint8_t *wide = nullptr; // widened f32 copies of bf16 instructions
  int64_t fN = 0, dN = 0, wideBytes = 0;
};

struct Ptrs;

class CudaDevice final : public Device {
public:
  explicit CudaDevice(int ordinal) : ordinal(ordinal) {}
  ~CudaDevice() override {
    cudaSetDevice(ordinal);
    // Each joins once its queued work has run.
    swapOutWorker.reset();
    hostWorker.reset();
    swapInWorker.reset();
    if (compute.s)
      cudaStreamSynchronize(compute.s);
    if (comm.s)
      cudaStreamSynchronize(comm.s);
    if (nodeComm.s)
      cudaStreamSynchronize(nodeComm.s);
    if (copy.s)
      cudaStreamSynchronize(copy.s);
    if (stepGraph)
      cudaGraphExecDestroy(stepGraph);
    for (cudaEvent_t e : stamps)
      cudaEventDestroy(e);
    gemm.reset();
    for (void *p : {(void *)arena, (void *)scratch.f, (void *)scratch.d, (void *)scratch.wide,
                    (void *)badPos, (void *)stepCtx})
      if (p)
        cudaFree(p);
    for (auto &[key, t] : ropeTables) {
      cudaFree(t.first);
      cudaFree(t.second);
    }
    if (hostArena)
      cudaFreeHost(hostArena);
    if (compute.s)
      cudaStreamDestroy(compute.s);
    if (comm.s)
      cudaStreamDestroy(comm.s);
    if (nodeComm.s)
      cudaStreamDestroy(nodeComm.s);
    if (copy.s)
      cudaStreamDestroy(copy.s);
  }

  Status init(bool allowTf32) {
    FSDP_CUDA_CHECK(cudaSetDevice(ordinal));
    int lo = 0, hi = 0;
    FSDP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    // Collectives on the higher priority: a ready all-gather is not stuck
    // behind a queue of compute kernels.
    FSDP_CUDA_CHECK(cudaStreamCreateWithPriority(&compute.s, cudaStreamNonBlocking, lo));
    FSDP_CUDA_CHECK(cudaStreamCreateWithPriority(&comm.s, cudaStreamNonBlocking, hi));
    // [Note: node comm stream]: the node group's exchanges beside the rest.
    FSDP_CUDA_CHECK(cudaStreamCreateWithPriority(&nodeComm.s, cudaStreamNonBlocking, hi));
    // Activation offload's copies between the arenas: DMA on the copy
    // engines, beside the kernels and NCCL (its priority orders kernels
    // only; a copy stream launches none).
    FSDP_CUDA_CHECK(cudaStreamCreateWithPriority(&copy.s, cudaStreamNonBlocking, lo));
    const int dev = ordinal;
    hostWorker = std::make_unique<HostWorker>([dev] { cudaSetDevice(dev); });
    // The swap streams poll cudaEvents too (a read's wait for compute).
    swapInWorker = std::make_unique<HostWorker>([dev] { cudaSetDevice(dev); });
    swapOutWorker = std::make_unique<HostWorker>([dev] { cudaSetDevice(dev); });
    FSDP_CUDA_CHECK(cudaMalloc(&badPos, sizeof(long long)));
    FSDP_RETURN_IF_ERROR(resetBadPos());
    gemm = std::make_unique<Gemm>();
    const char *tune = std::getenv("FSDP_CUDA_GEMM_TUNE"); // CudaGemm.h: setTuning
    gemm->setTuning(tune && std::string(tune) == "1");
    const char *splitK = std::getenv("FSDP_CUDA_BGRAD_SPLITK"); // CudaGemm.h
    gemm->setBiasGradSplitK(!(splitK && std::string(splitK) == "0"));
    // The attention kernels (CudaFlash.h): auto unless the user A/Bs them.
    if (const char *attn = std::getenv("FSDP_CUDA_ATTENTION"))
      if (!flash::parseImpl(attn, attention))
        return FSDP_ERROR("FSDP_CUDA_ATTENTION=", attn,
                          " is not one of auto, cores, wmma, mma, mma-tight, mma-tight2, "
                          "mma-tight3, mma-fused, mma-fused64, wgmma, wgmma-fused, "
                          "wgmma-fused64, wgmma-serial, wgmma-fused-serial, "
                          "wgmma-fused64-serial");
    if (const char *ce = std::getenv("FSDP_CUDA_CE_CACHE"))
      ceCacheRow = std::string(ce) == "1";
    if (const char *bg = std::getenv("FSDP_CUDA_DGELU_BGRAD"))
      dgeluBgrad = std::string(bg) == "1";
    if (const char *bg = std::getenv("FSDP_CUDA_BIAS_BGRAD"))
      biasBgrad = std::string(bg) != "0";
    // A race check (cuda_emu.py): each host-stream update starts this many
    // microseconds late, so a device stream that reads what an update
    // writes without waiting for it reads the old values.
    if (const char *d = std::getenv("FSDP_CUDA_HOST_DELAY_US")) {
      char *end = nullptr;
      long v = std::strtol(d, &end, 10);
      if (!*d || *end || v < 0 || v > 10000000)
        return FSDP_ERROR("FSDP_CUDA_HOST_DELAY_US=", d,
                          ": expected microseconds in [0, 10000000]");
      hostDelayUs = v;
    }
    return gemm->init(32ull << 20, allowTf32);
  }

  const char *name() const override { return "cuda"; }
  std::string describe() const override {
    // "cuda:0 NVIDIA H200 (sm_90, 139.8 GiB, driver 13.0, runtime 13.0),
    // cuBLASLt 13.1.0 (/path/libcublasLt.so.13)"; CUDA encodes a version as
    // 1000 major + 10 minor.
    std::vector<std::string> facts;
    char buf[64];
    cudaDeviceProp p{};
    std::string s = "cuda:" + std::to_string(ordinal);
    bool failed = false;
    if (cudaGetDeviceProperties(&p, ordinal) != cudaSuccess) {
      failed = true;
    } else {
      s += std::string(" ") + p.name;
      facts.push_back("sm_" + std::to_string(p.major) + std::to_string(p.minor));
      std::snprintf(buf, sizeof buf, "%.1f GiB", (double)p.totalGlobalMem / (1 << 30));
      facts.push_back(buf);
    }
    int v = 0;
    for (auto [what, query] : {std::pair{"driver", &cudaDriverGetVersion},
                               std::pair{"runtime", &cudaRuntimeGetVersion}}) {
      if (query(&v) != cudaSuccess) {
        failed = true;
        continue;
      }
      std::snprintf(buf, sizeof buf, "%s %d.%d", what, v / 1000, v % 1000 / 10);
      facts.push_back(buf);
    }
    if (failed)
      cudaGetLastError(); // (a failed query here is not the next call's error)
    for (size_t i = 0; i < facts.size(); ++i)
      s += (i ? ", " : " (") + facts[i] + (i + 1 == facts.size() ? ")" : "");
    std::string lt = cublasLtDescription();
    return lt.empty() ? s : s + ", " + lt;
  }

  Status allocateArena(int64_t bytes, int64_t hostBytes) override {
    size_t n;
    FSDP_RETURN_IF_ERROR(arenaSize(bytes, arena != nullptr, n));
    if (hostBytes < 0)
      return FSDP_ERROR("cannot allocate a host arena of ", hostBytes, " bytes");
    FSDP_CUDA_CHECK(cudaSetDevice(ordinal));
    if (hostBytes > 0) {
      // fsdp-offload's host arena: pinned, so the copies to and from it
      // are asynchronous DMA at full PCIe speed ([Note: two arenas]).
      cudaError_t h = cudaMallocHost(&hostArena, (size_t)hostBytes);
      if (h != cudaSuccess) {
        cudaGetLastError();
        hostArena = nullptr;
        return FSDP_ERROR("cannot pin ", hostBytes,
                          " bytes of host memory for the "
                          "offloaded optimizer (",
                          cudaGetErrorString(h), ")");
      }
      hostStart = hostArenaStart(bytes);
      hostBytes_ = hostBytes;
    }
    cudaError_t e = cudaMalloc(&arena, n);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t freeB = 0, total = 0;
      cudaMemGetInfo(&freeB, &total);
      return FSDP_ERROR("out of GPU memory: the plan's arena needs ", n, " bytes (",
                        (double)n / (1 << 30), " GiB); GPU ", ordinal, " has ", freeB,
                        " bytes free of ", total,
                        " (compile for more ranks, a higher ZeRO stage, recompute, or "
                        "memory-budget=)");
    }
    FSDP_CUDA_CHECK(e);
    size = (int64_t)n;
    return Status::ok();
  }
  uint8_t *arenaBase() const override { return arena; }
  int64_t arenaBytes() const override { return size; }
  uint8_t *address(int64_t offset) const override {
    return hostArena && offset >= hostStart ? hostArena + (offset - hostStart) : arena + offset;
  }

  // cudaMemcpyDefault: either side may be the pinned host arena.
  Status copyToDevice(void *dst, const void *src, int64_t bytes) override {
    FSDP_RETURN_IF_ERROR(idle());
    if (bytes > 0)
      FSDP_RETURN_IF_ERROR(hostToDevice(dst, src, (size_t)bytes));
    return Status::ok();
  }
  Status setDropoutContext(const DropoutContext &c) override {
    FSDP_RETURN_IF_ERROR(Device::setDropoutContext(c));
    if (!stepCtx)
      return Status::ok();
    uint64_t v[2] = {c.seed, (uint64_t)c.step};
    return copyToDevice(stepCtx, v, sizeof v);
  }
  Status copyToHost(void *dst, const void *src, int64_t bytes) override {
    FSDP_RETURN_IF_ERROR(idle());
    if (bytes > 0)
      FSDP_CUDA_CHECK(cudaMemcpy(dst, src, (size_t)bytes, cudaMemcpyDefault));
    return Status::ok();
  }
  Status pinHost(void *p, int64_t bytes) override {
    FSDP_CUDA_CHECK(cudaHostRegister(p, (size_t)bytes, cudaHostRegisterDefault));
    return Status::ok();
  }
  Status unpinHost(void *p) override {
    FSDP_CUDA_CHECK(cudaHostUnregister(p));
    return Status::ok();
  }
  /// A kernel on the device arena (a 70 GB arena's sentinel: tens of ms,
  /// not 70k copies); the pinned host arena is filled by the host.
  Status fillWords(void *dst, uint32_t word, int64_t bytes) override {
    FSDP_RETURN_IF_ERROR(idle());
    auto *p = static_cast<uint8_t *>(dst);
    if (hostArena && p >= hostArena && p < hostArena + hostBytes_) {
      std::fill_n(reinterpret_cast<uint32_t *>(p), bytes / 4, word);
      return Status::ok();
    }
    FSDP_CUDA_CHECK(
        ::fsdp::cuda::fillWords(reinterpret_cast<uint32_t *>(p), bytes / 4, word, compute.s));
    FSDP_CUDA_CHECK(cudaStreamSynchronize(compute.s));
    return Status::ok();
  }

  Status prepare(const Plan &p, int64_t shard) override;
  Status run(int64_t index) override {
    if (index < 0 || index >= (int64_t)launches.size() || !launches[index])
      return FSDP_ERROR("instruction #", index, " is not a prepared compute instruction");
    if (!compute.sticky)
      return compute.sticky;
    Status st = launches[index](compute.s);
    if (!st)
      compute.sticky = st;
    return st;
  }
  Status runOn(Stream &stream, int64_t index, std::unique_ptr<Event> &done) override {
    if (&stream == &host) {
      if (index < 0 || index >= (int64_t)hostRuns.size() || !hostRuns[index])
        return FSDP_ERROR("instruction #", index, " is not a prepared host instruction");
      // [Note: the CUDA host stream]: the update on the host thread,
      // without draining a device stream (the executor made the host
      // stream wait for the compute that copied its gradient).
      hostWorker->pushWork([run = hostRuns[index], ctx = dropoutContext(), d = hostDelayUs] {
        if (d > 0)
          std::this_thread::sleep_for(std::chrono::microseconds(d));
        return run(ctx);
      });
      done = record(host);
      return Status::ok();
    }
    if (index < 0 || index >= (int64_t)launches.size() || !launches[index])
      return FSDP_ERROR("instruction #", index, " is not a prepared instruction");
    auto *s = &static_cast<CudaStream &>(stream);
    // A copy's launch is cudaMemcpyAsync on the stream it is given.
    enqueue(stream, [this, index, s] { return launches[index](s->s); });
    done = record(stream);
    return Status::ok();
  }
  bool implementsOp(const std::string &op) const override;
  /// Whether `op` has a kernel on bf16 / f16 storage (nativeBuilders()).
  static bool hasNativeKernel(const std::string &op) { return nativeBuilders().count(op) > 0; }

  Stream &computeStream() override { return compute; }
  Stream &commStream() override { return comm; }
  Stream &nodeCommStream() override { return nodeComm; }
  Stream &hostStream() override { return host; }
  Stream &copyStream() override { return copy; }
  Stream &swapInStream() override { return swapIn; }
  Stream &swapOutStream() override { return swapOut; }

  void enqueue(Stream &stream, std::function<Status()> work) override {
    if (HostWorker *w = hostWorkerOf(stream)) {
      w->pushWork(std::move(work));
      return;
    }
    // The work launches device work on the stream (NCCL, or the host-staged
    // copies and host function) and returns at once.
    auto &s = static_cast<CudaStream &>(stream);
    if (s.sticky)
      s.sticky = work();
  }
  std::unique_ptr<Event> record(Stream &stream) override {
    auto ev = std::make_unique<CudaEvent>();
    if (HostWorker *w = hostWorkerOf(stream)) {
      ev->host = w->marker();
      ev->on = &stream;
      return ev;
    }
    auto &s = static_cast<CudaStream &>(stream);
    cudaError_t e = cudaEventCreateWithFlags(&ev->h->e, cudaEventDisableTiming);
    if (e == cudaSuccess)
      e = cudaEventRecord(ev->h->e, s.s);
    if (e != cudaSuccess && s.sticky)
      s.sticky = cudaStatus(e, "cudaEventRecord", __FILE__, __LINE__);
    return ev;
  }
  Status wait(Stream &stream, Event &event) override {
    auto &ev = static_cast<CudaEvent &>(event);
    if (HostWorker *w = hostWorkerOf(stream)) {
      if (ev.host.valid()) {
        if (ev.on == &stream)
          return Status::ok(); // ordered on its own stream anyway
        // One host thread waits for another's marker: a job blocking it,
        // failing it if the other had failed (an update does not run on
        // state its read did not bring, nor is it written back).
        w->pushWork([f = ev.host] { return f.get(); });
        return Status::ok();
      }
      if (!ev.h->e)
        return Status::ok();
      // [Note: the CUDA host stream]: a job polling the event.
      w->pushWork([this, h = ev.h] { return waitForEvent(h->e); });
      return Status::ok();
    }
    auto &s = static_cast<CudaStream &>(stream);
    if (ev.host.valid()) {
      // Compute joins host work on the issuing thread: once it is done,
      // later device work sees it. Another device stream (fsdp-offload's
      // copy-stream join of the previous step's update) must not hold the
      // thread that issues compute: a host function on that stream waits
      // instead, and only the stream stalls.
      using namespace std::chrono_literals;
      if (&stream == &compute || ev.host.wait_for(0s) == std::future_status::ready)
        return ev.host.get();
      auto *job = new HostJoin{ev.host, this};
      cudaError_t e = cudaLaunchHostFunc(s.s, &CudaDevice::joinHost, job);
      if (e != cudaSuccess) {
        delete job;
        return cudaStatus(e, "cudaLaunchHostFunc", __FILE__, __LINE__);
      }
      return Status::ok();
    }
    if (ev.h->e)
      FSDP_CUDA_CHECK(cudaStreamWaitEvent(s.s, ev.h->e, 0));
    // Failures on the event's stream are known only at synchronize().
    return Status::ok();
  }
  Status synchronize() override { return drain(true); }
  Status synchronizeDevice() override { return drain(false); }
  /// The device streams idle, and the host stream too with `host`.
  Status drain(bool withHost) {
    Status st = idle();
    if (st) {
      std::lock_guard<std::mutex> l(hostJoinMu);
      st = hostJoinError;
      hostJoinError = Status::ok();
    }
    // The update waits for its reads, its writes for it: drained in that
    // order, nothing is queued behind a drained stream.
    Status hostSt;
    if (withHost)
      for (HostWorker *w : {swapInWorker.get(), hostWorker.get(), swapOutWorker.get()}) {
        Status wSt = w->drain();
        if (hostSt)
          hostSt = wSt;
      }
    if (!compute.sticky)
      st = compute.sticky;
    else if (!comm.sticky)
      st = comm.sticky;
    else if (!nodeComm.sticky)
      st = nodeComm.sticky;
    else if (!copy.sticky)
      st = copy.sticky;
    else if (st)
      st = hostSt;
    compute.sticky = comm.sticky = nodeComm.sticky = copy.sticky = Status::ok();
    if (!st)
      return st;
    long long bad = LLONG_MAX;
    FSDP_CUDA_CHECK(cudaMemcpy(&bad, badPos, sizeof(bad), cudaMemcpyDeviceToHost));
    if (bad != LLONG_MAX) {
      FSDP_RETURN_IF_ERROR(resetBadPos());
      return FSDP_ERROR("a token id or label at position ", bad,
                        " of its batch is outside the vocabulary / class range "
                        "(embedding or cross_entropy)");
    }
    return Status::ok();
  }

  // [Note: step capture] in runtime/core/Executor.cpp. Thread-local capture
  // mode: this thread may not make unsafe calls (a synchronous copy, a
  // cudaMalloc) while recording, which would fail the capture loudly.
  bool canCapture() const override { return true; }
  bool enqueuesAsync() const override { return true; }
  Status beginCapture() override {
    FSDP_RETURN_IF_ERROR(idle());
    FSDP_CUDA_CHECK(cudaStreamBeginCapture(compute.s, cudaStreamCaptureModeThreadLocal));
    return Status::ok();
  }
  Status endCapture(bool keep) override {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(compute.s, &graph);
    if (e == cudaSuccess && keep) {
      if (stepGraph)
        cudaGraphExecDestroy(stepGraph);
      stepGraph = nullptr;
      e = cudaGraphInstantiate(&stepGraph, graph, 0);
    }
    if (graph)
      cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      cudaGetLastError(); // not sticky: the capture failed, nothing ran
      return cudaStatus(e, keep ? "capturing the step as a CUDA graph" : "cudaStreamEndCapture",
                        __FILE__, __LINE__);
    }
    return Status::ok();
  }
  Status replay() override {
    if (!stepGraph)
      return FSDP_ERROR("no captured step to replay");
    if (!compute.sticky)
      return compute.sticky;
    FSDP_CUDA_CHECK(cudaGraphLaunch(stepGraph, compute.s));
    return Status::ok();
  }

  // [Note: stamped trace] in runtime/core/Executor.cpp: timing events on
  // the compute stream, created on first use and kept (one per stamp).
  bool stampsCompute() const override { return true; }
  Status stampCompute(int64_t k) override {
    if (k < 0)
      return FSDP_ERROR("timing stamp ", k, " is negative");
    while ((int64_t)stamps.size() <= k) {
      cudaEvent_t e = nullptr;
      FSDP_CUDA_CHECK(cudaEventCreate(&e)); // with timing
      stamps.push_back(e);
    }
    FSDP_CUDA_CHECK(cudaEventRecord(stamps[k], compute.s));
    return Status::ok();
  }
  Status stampGapMs(int64_t a, int64_t b, double &ms) override {
    if (a < 0 || b < 0 || a >= (int64_t)stamps.size() || b >= (int64_t)stamps.size())
      return FSDP_ERROR("timing stamps ", a, " and ", b, ": only ", stamps.size(), " exist");
    float f = 0;
    FSDP_CUDA_CHECK(cudaEventElapsedTime(&f, stamps[a], stamps[b]));
    ms = f;
    return Status::ok();
  }

  int64_t scratchHighWater() const override {
    return scratch.fN * (int64_t)sizeof(float) + scratch.dN * (int64_t)sizeof(double) +
           scratch.wideBytes + (int64_t)(gemm ? gemm->workspaceBytes() + gemm->stagingBytes() : 0);
  }

private:
  /// The device streams idle; a CUDA error (asynchronous kernel faults, failed
  /// host-staged collectives) returned.
  Status idle() {
    const double limit = ncclWatchdogSeconds();
    if (limit <= 0) {
      FSDP_CUDA_CHECK(cudaStreamSynchronize(compute.s));
      FSDP_CUDA_CHECK(cudaStreamSynchronize(comm.s));
      FSDP_CUDA_CHECK(cudaStreamSynchronize(nodeComm.s));
      FSDP_CUDA_CHECK(cudaStreamSynchronize(copy.s));
      return takeAsyncCommError();
    }
    // NCCL in use: poll, so that a dead or stalled peer is an error, not a
    // hang ([Note: the NCCL watchdog] in CudaComm.cpp).
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(limit));
    for (cudaStream_t s : {compute.s, comm.s, nodeComm.s, copy.s})
      FSDP_RETURN_IF_ERROR(pollUnderWatchdog([s] { return cudaStreamQuery(s); }, deadline, limit,
                                             "the GPU streams did not drain"));
    return takeAsyncCommError();
  }
  /// The host stream's wait for a device event: polled, like idle(), under
  /// the NCCL watchdog (a dead or stalled rank is an error, not a hang).
  Status waitForEvent(cudaEvent_t ev) {
    const double limit = ncclWatchdogSeconds();
    if (limit <= 0) {
      FSDP_CUDA_CHECK(cudaEventSynchronize(ev));
      return Status::ok();
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(limit));
    return pollUnderWatchdog([ev] { return cudaEventQuery(ev); }, deadline, limit,
                             "the host stream's offloaded update did not see its gradient "
                             "copy complete");
  }
  /// Polls `query` (a cudaStreamQuery / cudaEventQuery) until it reports
  /// done: an NCCL communicator's asynchronous error or the deadline
  /// aborts every NCCL communicator (so the work stuck behind a dead
  /// peer's collective fails instead of hanging) and names `stalled`.
  Status pollUnderWatchdog(const std::function<cudaError_t()> &query,
                           std::chrono::steady_clock::time_point deadline, double limit,
                           const char *stalled) {
    for (int polls = 0;; ++polls) {
      cudaError_t e = query();
      if (e == cudaSuccess)
        return Status::ok();
      if (e != cudaErrorNotReady)
        FSDP_CUDA_CHECK(e);
      Status async = (polls & 63) == 0 ? ncclAsyncError() : Status::ok();
      if (!async || std::chrono::steady_clock::now() > deadline) {
        abortNcclComms();
        if (!async)
          return FSDP_ERROR(async.message(), "; NCCL communicators aborted");
        return FSDP_ERROR(stalled, " within ", limit,
                          " s (the collective timeout, FSDP_COMM_TIMEOUT_S): a rank is dead or "
                          "stalled in a collective; NCCL communicators aborted");
      }
      if (polls < 1000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  /// A host -> device copy complete before any later work on either stream.
  /// Not a plain cudaMemcpy: from pageable memory it may return before its
  /// DMA has landed, and the non-blocking streams are not ordered after the
  /// NULL stream it runs on.
  Status hostToDevice(void *dst, const void *src, size_t bytes) {
    FSDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, compute.s));
    FSDP_CUDA_CHECK(cudaStreamSynchronize(compute.s));
    return Status::ok();
  }
  Status resetBadPos() {
    long long none = LLONG_MAX;
    return hostToDevice(badPos, &none, sizeof(none));
  }
  /// Sets `out` to the f32 launch of one instruction over `base`: the
  /// builder of its op's family (builders()).
  Status build(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  using Builder = Status (CudaDevice::*)(const Op &, uint8_t *, int64_t, Launch &);
  static const std::unordered_map<std::string, Builder> &builders();
  Status buildElementwise(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildMatmul(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildLayerNorm(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildNativeF32(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildLayout(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildPack(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildLoss(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  Status buildUpdate(const Op &op, uint8_t *base, int64_t rank, Launch &out);
  struct StateUpdate;
  StateUpdate stateUpdate(const Op &op, const Ptrs &r, int64_t rank) const;
  /// swiglu / swiglu_grad in storage type t (f32 plans and narrow ones alike).
  void swigluLaunch(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  /// Sets `out` to the launch of one instruction on storage of dtype t:
  /// the builder of its op's family (nativeBuilders()).
  Status buildNative(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  using NativeBuilder = Status (CudaDevice::*)(const Op &, FloatKind, uint8_t *, int64_t, Launch &);
  static const std::unordered_map<std::string, NativeBuilder> &nativeBuilders();
  Status buildNativeElementwise(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                Launch &out);
  Status buildNativeNorm(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildNativeMatmul(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildAttention(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildRope(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildNativeLayout(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildNativeLoss(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildFusedMatmul(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);
  Status buildResidualNorm(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out);

  int ordinal;
  uint8_t *arena = nullptr;
  int64_t size = 0;
  CudaStream compute, comm, nodeComm, copy;
  HostStream host, swapIn, swapOut;
  /// The host stream's thread ([Note: the CUDA host stream]).
  std::unique_ptr<HostWorker> hostWorker;
  /// The swap streams' threads (Device.h's swapInStream / swapOutStream).
  std::unique_ptr<HostWorker> swapInWorker, swapOutWorker;
  HostWorker *hostWorkerOf(Stream &s) const {
    return &s == &host      ? hostWorker.get()
           : &s == &swapIn  ? swapInWorker.get()
           : &s == &swapOut ? swapOutWorker.get()
                            : nullptr;
  }
  /// A device stream's wait for host work (wait() on a stream other than
  /// compute): run by CUDA's host-function thread; the host work's failure
  /// is kept for the next drain.
  struct HostJoin {
    std::shared_future<Status> done;
    CudaDevice *dev;
  };
  static void CUDART_CB joinHost(void *p) {
    std::unique_ptr<HostJoin> j(static_cast<HostJoin *>(p));
    Status st;
    try {
      st = j->done.get();
    } catch (const std::exception &e) {
      st = FSDP_ERROR("the host work a device stream waited for never finished: ", e.what());
    }
    if (!st) {
      std::lock_guard<std::mutex> l(j->dev->hostJoinMu);
      if (j->dev->hostJoinError)
        j->dev->hostJoinError = st;
    }
  }
  std::mutex hostJoinMu;
  Status hostJoinError;
  long hostDelayUs = 0; ///< FSDP_CUDA_HOST_DELAY_US (a race check)
  std::unique_ptr<Gemm> gemm;
  cudaGraphExec_t stepGraph = nullptr;       ///< the captured step (beginCapture)
  std::vector<cudaEvent_t> stamps;           ///< stampCompute's timing events
  flash::Impl attention = flash::Impl::Auto; ///< FSDP_CUDA_ATTENTION
  /// The cross-entropy gradient reads the logits twice from global memory
  /// (a statistics pass, then the gradient) rather than once into a 98 KB
  /// shared-memory copy of the row: the same bits, and on the H200 GPT-2's
  /// bf16 [16384, 50304] took 2.08 ms against 3.47 (two blocks an SM with
  /// the copy). FSDP_CUDA_CE_CACHE=1 takes the copy (an A/B).
  bool ceCacheRow = false;
  /// matmul_gelu_grad's bias gradient as a column sum after the DGELU GEMM
  /// rather than cuBLASLt's DGELU_BGRAD epilogue: GPT-2's 12 took 2.62 ms
  /// against 5.24 on the H200 (the epilogue's reduction ran the GEMM at a
  /// third of its rate). FSDP_CUDA_DGELU_BGRAD=1 takes the epilogue.
  bool dgeluBgrad = false;
  /// matmul_bias_grad's bias gradient from cuBLASLt's BGRADB epilogue
  /// (default), or with FSDP_CUDA_BIAS_BGRAD=0 from sum_to's column-sum
  /// kernel after a plain GEMM: an A/B. On the H200 the epilogue's GEMMs
  /// ran split-K with a separate bias-gradient kernel and split-K
  /// reduction (1.15 ms of GPT-2's B=16 step, session 11); the DGELU case
  /// above was twice as fast without its epilogue. Not yet measured.
  bool biasBgrad = true;
  long long *badPos = nullptr;
  /// {seed, step} of the running step in device memory, for the kernels a
  /// replayed graph must see the step of (dropout, stochastic casts);
  /// allocated by prepare() when the plan has one, written by
  /// setDropoutContext.
  uint64_t *stepCtx = nullptr;
  /// The rotary embedding's cos / sin tables in device memory, one per (T,
  /// head dim, theta) the plan's rope instructions use (native::ropeAngles).
  std::map<std::tuple<int64_t, int64_t, double>, std::pair<float *, float *>> ropeTables;
  Status ropeTable(int64_t T, int64_t D, double theta, const float *&cs, const float *&sn);
  Scratch scratch;
  std::vector<Launch> launches;
  /// Per host instruction (fsdp-offload's update): its body on the host
  /// stream (runOn), without the device drain of its launch.
  std::vector<std::function<Status(const DropoutContext &)>> hostRuns;
  /// fsdp-offload's pinned host arena, at offsets from hostStart on.
  uint8_t *hostArena = nullptr;
  int64_t hostStart = 0, hostBytes_ = 0;
};

// --- launchers ------------------------------------------------------------

/// Typed operand pointers of one instruction over a base address.
struct Ptrs {
  const Op &op;
  uint8_t *base;
  int64_t rank;
  template <typename T = float> T *in(size_t i) const {
    return reinterpret_cast<T *>(base + bufferOffset(op.plan, op.inst.in[i], rank));
  }
  template <typename T = float> T *out(size_t i) const {
    return reinterpret_cast<T *>(base + bufferOffset(op.plan, op.inst.out[i], rank));
  }
  /// Untyped, for the 16-bit kernels that take the dtype as an argument.
  void *v(size_t i) const { return in<void>(i); }
  void *w(size_t i) const { return out<void>(i); }
};

/// A cross-entropy's ignore_index for the kernels (off without one).
CeIgnore ceIgnoreOf(const Ptrs &r) {
  rules::CeIgnore c = rules::ceIgnore(r.op);
  return c.on ? CeIgnore{r.in(c.normalizer), c.index} : CeIgnore{};
}

Launch fromCuda(std::function<cudaError_t(cudaStream_t)> f, std::string what) {
  return [f = std::move(f), what = std::move(what)](cudaStream_t s) {
    return cudaStatus(f(s), what.c_str(), __FILE__, __LINE__);
  };
}

/// pack: for each input, whether it partly overlaps its destination in the
/// packed buffer (memory the plan shares with it, a view of it). Such an
/// input is copied through scratch: cudaMemcpyAsync is undefined on
/// overlapping ranges. One exactly in place is not (it is skipped), nor one
/// disjoint from its destination (a plain copy, in input order as the CPU's
/// memmoves). By arena offsets, as build() and prepare() both see them.
std::vector<bool> packStaged(const Op &op, int64_t rank) {
  std::vector<int64_t> offs = op.iv("offsets");
  int64_t out = bufferOffset(op.plan, op.inst.out[0], rank);
  std::vector<bool> staged(offs.size());
  for (size_t i = 0; i < offs.size(); ++i) {
    int64_t src = bufferOffset(op.plan, op.inst.in[i], rank),
            dst = out + (int64_t)sizeof(float) * offs[i],
            bytes = (int64_t)sizeof(float) * op.in(i).numel();
    staged[i] = src != dst && src < dst + bytes && dst < src + bytes;
  }
  return staged;
}

/// Scratch sizes an instruction needs (floats, doubles), by the reference
/// kernels or the native ones, whichever runs it, on shard `rank`.
void scratchNeeds(const Op &op, int64_t rank, flash::Impl attention, int64_t &f, int64_t &d) {
  const std::string &n = op.inst.op;
  f = d = 0;
  if (n == "pack") {
    std::vector<bool> staged = packStaged(op, rank);
    for (size_t i = 0; i < staged.size(); ++i)
      if (staged[i])
        f = std::max(f, op.in(i).numel());
  } else if (n == "attention_grad" || n == "attention_qkv_grad") {
    // The tiled kernels run it, on its storage (a widened f32 copy runs the
    // CUDA-core kernels, whose need is the smaller).
    const Buffer &y = op.in(n == "attention_grad" ? 0 : 1); // q or y: [B, T, C]
    if (y.shape.size() == 3)
      f = flash::backwardScratch(floatKind(y.dtype), y.shape[0], y.shape[1], y.shape[2],
                                 op.i("heads", 1), op.i("kv_heads", op.i("heads", 1)),
                                 op.b("causal"), attention);
  } else if (n == "layer_norm_grad" || n == "layer_norm_grad_acc") {
    f = std::max(2 * rules::rowsOf(op.in(0)),
                 native::layerNormGradScratch(rules::rowsOf(op.in(0)), rules::lastDim(op.in(0))));
  } else if (n == "sum_to") {
    f = native::sumToScratch(op.in(0).shape, op.out(0).shape);
  } else if (n == "matmul_bias_grad") { // the unfused fallback's bias gradient
    f = native::sumToScratch(op.in(0).shape, op.out(1).shape);
    if (op.inst.in.size() > 2) // and with accumulators its column sums, added after
      f += op.out(1).numel();
  } else if (n == "matmul_gelu_grad") { // the unfused fallback's bias gradient
    f = native::sumToScratch({rules::rowsOf(op.out(0)), rules::lastDim(op.out(0))},
                             {rules::lastDim(op.out(0))});
  } else if (n == "embedding_grad") {
    f = native::embeddingGradScratch(op.in(0).numel());
  } else if (n == "rms_norm_grad" || n == "rms_norm_grad_acc") {
    f = std::max(rules::rowsOf(op.in(0)),
                 native::rmsNormGradScratch(rules::rowsOf(op.in(0)), rules::lastDim(op.in(0))));
  } else if (n == "cross_entropy" || n == "cross_entropy_fused") {
    d = std::max<int64_t>(rules::rowsOf(op.in(0)), reductionScratch());
  } else if (n == "mse_loss" || n == "bce_with_logits") {
    d = reductionScratch();
  } else if (n == "squared_norm") {
    d = squaredNormScratch((int64_t)op.inst.in.size());
  } else if (n == "lamb_norms") {
    d = lambScratch();
  }
}

/// attention(_grad) and attention_qkv(_grad): B, T, C (= heads * D, q's
/// and y's width) and kv_heads * D; `packed` for the qkv forms (q, k, v
/// side by side in one tensor, whose row stride is C + 2 kv_heads D).
struct AttentionShape {
  int64_t B = 0, T = 0, C = 0, heads = 1, kv = 1, KC = 0;
  bool packed = false;
};
bool attentionShape(const Plan &plan, const Instruction &inst, AttentionShape &a) {
  a.packed = inst.op == "attention_qkv" || inst.op == "attention_qkv_grad";
  // y: the result of attention_qkv, the second operand of its gradient.
  int64_t id = !a.packed ? inst.in[0] : inst.op == "attention_qkv" ? inst.out[0] : inst.in[1];
  const std::vector<int64_t> &y = plan.buffers[id].shape;
  a.heads = inst.attrs.value("heads", (int64_t)1);
  a.kv = inst.attrs.value("kv_heads", a.heads);
  if (y.size() != 3 || a.heads <= 0 || a.kv <= 0)
    return false;
  a.B = y[0];
  a.T = y[1];
  a.C = y[2];
  a.KC = a.kv * (a.C / a.heads);
  return true;
}
flash::Layout attentionLayout(const AttentionShape &a) {
  int64_t w = a.C + 2 * a.KC;
  return a.packed ? flash::Layout{w, w, 0} : flash::Layout{};
}

/// Whether output `i` of `inst` is an f32 result of narrow operands that
/// the native kernels write (the dialect's widened products): every
/// result of a matmul / matmul_bias_grad (all of them f32), d_gamma
/// and d_beta of a layer norm gradient (both f32), or the result of a
/// sum_to or embedding_grad. Anything else with an f32 output runs widened.
bool productF32(const Plan &plan, const Instruction &inst, size_t i) {
  auto dtype = [&](int64_t id) {
    return id >= 0 && id < (int64_t)plan.buffers.size() ? plan.buffers[id].dtype : DType::I64;
  };
  // embedding_grad's float operand is its second (the first: the ids).
  const size_t data = inst.op == "embedding_grad" ? 1 : 0;
  if (inst.in.size() <= data || !rules::isNarrowFloat(dtype(inst.in[data])))
    return false;
  if (inst.op == "sum_to" || inst.op == "embedding_grad")
    return i == 0 && inst.out.size() == 1 && dtype(inst.out[0]) == DType::F32;
  if (inst.op == "matmul" || inst.op == "matmul_bias_grad") {
    for (int64_t id : inst.out)
      if (dtype(id) != DType::F32)
        return false;
    return true;
  }
  if (inst.op == "matmul_gelu_grad" && i == 1) // the bias gradient (a column sum)
    return inst.out.size() == 2 && dtype(inst.out[1]) == DType::F32;
  if ((inst.op == "layer_norm_grad" || inst.op == "layer_norm_grad_acc") && (i == 1 || i == 2))
    return inst.out.size() == 3 && dtype(inst.out[1]) == DType::F32 &&
           dtype(inst.out[2]) == DType::F32;
  return false;
}

/// The types of an instruction's GEMM on narrow storage t: t, or an f32
/// product (productF32) when its first result is f32.
GemmType gemmTypeOf(FloatKind t, const Buffer &result) {
  return {t, t != FloatKind::F32 && result.dtype == DType::F32 ? FloatKind::F32 : t};
}

/// Whether `inst` can run natively on its narrow storage: every float
/// operand has one dtype t (bf16 or f16), but the loss (cross_entropy's
/// output) and its incoming gradient (cross_entropy_grad's third input),
/// which are f32 scalars, as cross_entropy_fused's loss and gradient are,
/// and so is the kept-label count after them (ignore_index).
/// And the f32 results of productF32.
bool nativeKind(const Plan &plan, const Instruction &inst, FloatKind &t) {
  static const bool enabled = [] {
    const char *e = std::getenv("FSDP_CUDA_NATIVE");
    return !e || std::string(e) != "0";
  }();
  if (!enabled || !CudaDevice::hasNativeKernel(inst.op))
    return false;
  DType narrow = DType::F32;
  auto visit = [&](int64_t id, bool scalarF32) {
    if (id < 0 || id >= (int64_t)plan.buffers.size())
      return false;
    DType d = plan.buffers[id].dtype;
    if (d == DType::I32)
      return true; // ids / labels: checked by the op's rule
    if (d == DType::I64)
      return false; // the native kernels read int32 ids; build() reports int64
    if (scalarF32)
      return d == DType::F32;
    if (d == DType::F32)
      return false;
    if (narrow != DType::F32 && d != narrow)
      return false;
    narrow = d;
    return true;
  };
  // f32 whatever the storage dtype: the loss scalars and attention's
  // log-sum-exp.
  for (size_t i = 0; i < inst.in.size(); ++i)
    if (!visit(inst.in[i],
               ((inst.op == "cross_entropy_grad" || inst.op == "cross_entropy_fused") && i >= 2) ||
                   (inst.op == "cross_entropy" && i == 2) ||
                   (inst.op == "attention_grad" && i == 4) ||
                   (inst.op == "attention_qkv_grad" && i == 2) ||
                   // an f32 product's accumulator is f32 too
                   (inst.op == "matmul" && i == 2 && productF32(plan, inst, 0)) ||
                   (inst.op == "matmul_bias_grad" && i >= 2 && productF32(plan, inst, 0))))
      return false;
  for (size_t i = 0; i < inst.out.size(); ++i) {
    // An f32 result of narrow operands (fsdp-fuse-epilogues' widened
    // parameter gradients): cuBLASLt (GemmType) or the layer-norm kernel
    // writes it.
    if (productF32(plan, inst, i))
      continue;
    if (!visit(inst.out[i],
               ((inst.op == "cross_entropy" || inst.op == "cross_entropy_fused") && i == 0) ||
                   ((inst.op == "attention" || inst.op == "attention_qkv") && i == 1)))
      return false;
  }
  if (narrow == DType::F32)
    return false;
  if (inst.op.rfind("attention", 0) == 0) {
    // Beyond the tiled kernel's limits (head dimension > 128, its grid)
    // the widened f32 kernels run it: decided here, so prepare sizes the
    // widening scratch for it.
    AttentionShape a;
    if (!attentionShape(plan, inst, a) ||
        !flash::check(a.B, a.T, a.C, a.heads, a.kv, attentionLayout(a)).isOk())
      return false;
  }
  t = floatKind(narrow);
  return true;
}

} // namespace

/// matmul_bias, matmul_gelu_grad and matmul_bias_grad (fsdp-fuse-epilogues)
/// on storage of dtype t: one cuBLASLt GEMM with its epilogue (BIAS,
/// GELU_AUX_BIAS / GELU_BIAS, DGELU / DGELU_BGRAD, BGRADB) where cuBLASLt has an algorithm for it,
/// chosen at prepare; otherwise the GEMM, then the unfused ops' kernels
/// over the result, as runtime/cpu does.
Status CudaDevice::buildFusedMatmul(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                    Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  rules::MM d;
  FSDP_RETURN_IF_ERROR(rules::matmulDims(op, d));
  const void *a = r.v(0), *b = r.v(1), *third = op.inst.in.size() > 2 ? r.v(2) : nullptr;
  void *c = r.w(0);
  void *second = op.inst.out.size() > 1 ? r.w(1) : nullptr;
  bool ta = op.b("transpose_lhs"), tb = op.b("transpose_rhs");
  int64_t m = d.m, nn = d.n, k = d.k;
  float *sf = scratch.f;
  EpilogueArgs e;
  bool gelu = op.b("gelu");
  if (n == "matmul_bias") {
    e.kind = gelu ? Epilogue::GeluAuxBias : Epilogue::Bias;
    e.bias = third;
    e.aux = second;
  } else if (n == "matmul_bias_grad") {
    e.kind = Epilogue::BGradA; // the sum over k of op(A) = dy^T: dy's column sums
    e.biasGrad = second;
  } else {
    e.kind = Epilogue::DGelu;
    e.aux = const_cast<void *>(third);
    // DGELU_BGRAD's bias gradient has the product's type: an f32 one
    // (productF32) is sum_to's, after the epilogue.
    e.biasGrad = dgeluBgrad && !productF32(op.plan, op.inst, 1) ? second : nullptr;
  }
  Gemm *g = gemm.get();
  // matmul_bias_grad may return f32 from narrow operands (productF32).
  const GemmType gt = gemmTypeOf(t, op.out(0));
  const bool f32Out = gt.out != gt.in;
  // matmul_gelu_grad's bias gradient in f32 from a narrow dh (a widened
  // parameter gradient): sum_to writes it unrounded.
  const bool f32BiasGrad =
      n == "matmul_gelu_grad" && t != FloatKind::F32 && second && productF32(op.plan, op.inst, 1);
  Shape full{m, nn}, row{nn};
  if (n == "matmul_bias_grad" && op.inst.in.size() > 2) {
    // With accumulators aw, ab (fsdp-fuse-epilogues' gradient-accumulation
    // fusion): the GEMM with beta = 1 reading aw (Gemm::run's acc) and
    // BGRADB writing this micro-batch's bias gradient into scratch (it
    // cannot add to ab), then one add into ab, as the unfused plan's add.
    // Without the epilogue (no algorithm, FSDP_CUDA_BIAS_BGRAD=0) the
    // bias gradient is sum_to's column sum, a second pass over dy.
    const void *aw = third, *ab = r.v(3);
    const FloatKind ot = f32Out ? FloatKind::F32 : t;
    float *term = sf + native::sumToScratch(Shape{k, m}, Shape{m});
    EpilogueArgs eb = e;
    eb.biasGrad = term; // m elements of ot (the bias type is C's)
    const bool withEpilogue = biasBgrad && g->warmEpilogue(gt, m, nn, k, ta, tb, a, b, c, eb, aw);
    if (!withEpilogue)
      FSDP_RETURN_IF_ERROR(g->warm(gt, 1, m, nn, k, ta, tb, a, b, c, aw));
    out = [=](cudaStream_t s) -> Status {
      cudaError_t err = cudaSuccess;
      if (withEpilogue) {
        FSDP_RETURN_IF_ERROR(g->run(gt, a, b, c, m, nn, k, ta, tb, eb, s, aw));
      } else {
        FSDP_RETURN_IF_ERROR(g->run(gt, a, b, c, 1, m, nn, k, ta, tb, s, aw));
        err = native::sumTo(t, a, Shape{k, m}, term, Shape{m}, sf, s, f32Out);
      }
      if (err == cudaSuccess)
        err =
            native::binary(ot, BinaryKind::Add, ab, Shape{m}, term, Shape{m}, second, Shape{m}, s);
      return cudaStatus(err, n.c_str(), __FILE__, __LINE__);
    };
    return Status::ok();
  }
  // FSDP_CUDA_BIAS_BGRAD=0: matmul_bias_grad as the GEMM, then sum_to.
  const bool epilogue = n != "matmul_bias_grad" || biasBgrad;
  if (epilogue && g->warmEpilogue(gt, m, nn, k, ta, tb, a, b, c, e)) {
    if (e.kind == Epilogue::DGelu && second && !e.biasGrad) { // the bias gradient after
      out = [=](cudaStream_t s) -> Status {
        FSDP_RETURN_IF_ERROR(g->run(gt, a, b, c, m, nn, k, ta, tb, e, s));
        return cudaStatus(native::sumTo(t, c, full, second, row, sf, s, f32BiasGrad), n.c_str(),
                          __FILE__, __LINE__);
      };
      return Status::ok();
    }
    out = [=](cudaStream_t s) { return g->run(gt, a, b, c, m, nn, k, ta, tb, e, s); };
    return Status::ok();
  }
  FSDP_RETURN_IF_ERROR(g->warm(gt, 1, m, nn, k, ta, tb, a, b, c));
  out = [=](cudaStream_t s) -> Status {
    FSDP_RETURN_IF_ERROR(g->run(gt, a, b, c, 1, m, nn, k, ta, tb, s));
    cudaError_t err;
    if (n == "matmul_bias") {
      void *pre = second ? second : c;
      err = native::biasAdd(t, c, third, pre, m, nn, s);
      if (err == cudaSuccess && gelu)
        err = native::unary(t, native::UnaryKind::Gelu, pre, c, m * nn, 1.0, s);
    } else if (n == "matmul_bias_grad") {
      err = native::sumTo(t, a, Shape{k, m}, second, Shape{m}, sf, s, f32Out); // a = dy [k, m]
    } else {
      err = native::unaryGrad(t, native::UnaryGradKind::Gelu, third, c, c, m * nn, s);
      if (err == cudaSuccess && second)
        err = native::sumTo(t, c, full, second, row, sf, s, f32BiasGrad);
    }
    return cudaStatus(err, n.c_str(), __FILE__, __LINE__);
  };
  return Status::ok();
}

/// residual_layer_norm and layer_norm_grad_acc (fsdp-fuse-epilogues) on
/// storage of dtype t: the native layer norm kernels with the residual add
/// in the same pass (f32 plans use them too, with t = F32).
Status CudaDevice::buildResidualNorm(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                     Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &x = op.in(0);
  int64_t rows = rules::rowsOf(x), cols = rules::lastDim(x);
  double eps = op.f("epsilon", 1e-5);
  const void *i0 = r.v(0), *i1 = r.v(1), *i2 = r.v(2), *i3 = r.v(3);
  void *o0 = r.w(0), *o1 = r.w(1);
  if (n == "residual_layer_norm") {
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::residualLayerNorm(t, i0, i1, i2, i3, o0, o1, rows, cols, eps, s);
        },
        n);
  } else {
    void *o2 = r.w(2);
    float *sf = scratch.f;
    const bool f32Params = t != FloatKind::F32 && op.out(1).dtype == DType::F32; // widened
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::layerNormGrad(t, i0, i1, i2, o0, o1, o2, sf, rows, cols, eps, s, i3,
                                       native::LayerNormImpl::Auto, f32Params);
        },
        n);
  }
  return Status::ok();
}

/// The builders on narrow storage by op name (CudaNative.h, CudaFlash.h,
/// cuBLASLt): which ops run natively (nativeKind) and which family builds
/// each. f32 plans take some of them too (buildNativeF32).
const std::unordered_map<std::string, CudaDevice::NativeBuilder> &CudaDevice::nativeBuilders() {
  static const std::unordered_map<std::string, NativeBuilder> table = [] {
    std::unordered_map<std::string, NativeBuilder> m;
    auto add = [&m](NativeBuilder b, std::initializer_list<const char *> ops) {
      for (const char *op : ops)
        m.emplace(op, b);
    };
    add(&CudaDevice::buildNativeElementwise,
        {"add", "sub", "mul", "div", "neg", "scale", "relu", "gelu", "silu", "fill", "relu_grad",
         "gelu_grad", "silu_grad", "swiglu", "swiglu_grad", "bias_add", "softmax", "softmax_grad"});
    add(&CudaDevice::buildNativeNorm, {"layer_norm", "layer_norm_grad", "rms_norm", "rms_norm_grad",
                                       "rms_norm_grad_acc", "residual_rms_norm"});
    add(&CudaDevice::buildResidualNorm, {"residual_layer_norm", "layer_norm_grad_acc"});
    add(&CudaDevice::buildNativeMatmul, {"matmul"});
    add(&CudaDevice::buildFusedMatmul, {"matmul_bias", "matmul_gelu_grad", "matmul_bias_grad"});
    add(&CudaDevice::buildAttention,
        {"attention", "attention_grad", "attention_qkv", "attention_qkv_grad"});
    add(&CudaDevice::buildRope, {"rope", "rope_grad"});
    add(&CudaDevice::buildNativeLayout,
        {"copy", "reshape", "transpose", "broadcast", "sum_to", "slice", "slice_grad", "concat",
         "embedding", "embedding_grad"});
    add(&CudaDevice::buildNativeLoss,
        {"cross_entropy", "cross_entropy_grad", "cross_entropy_fused"});
    return m;
  }();
  return table;
}

Status CudaDevice::buildNative(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                               Launch &out) {
  auto it = nativeBuilders().find(op.inst.op);
  if (it == nativeBuilders().end())
    return FSDP_ERROR("op '", op.inst.op, "' has no native ", t == FloatKind::BF16 ? "bf16" : "f16",
                      " CUDA kernel");
  return (this->*(it->second))(op, t, base, rank, out);
}

/// Elementwise arithmetic and activations, their gradients, fill, the bias
/// add and softmax, on storage of dtype t.
Status CudaDevice::buildNativeElementwise(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                          Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &o0 = op.out(0);
  int64_t numel = o0.numel();
  auto binaryKind = [&](BinaryKind k) {
    const void *a = r.v(0), *b = r.v(1);
    auto sa = op.in(0).shape, sb = op.in(1).shape, so = o0.shape;
    void *y = r.w(0);
    out = fromCuda([=](cudaStream_t s) { return native::binary(t, k, a, sa, b, sb, y, so, s); }, n);
  };
  auto unary = [&](native::UnaryKind k, double factor) {
    const void *x = r.v(0);
    void *y = r.w(0);
    out = fromCuda([=](cudaStream_t s) { return native::unary(t, k, x, y, numel, factor, s); }, n);
  };
  auto unaryGrad = [&](native::UnaryGradKind k) {
    const void *x = r.v(0), *dy = r.v(1);
    void *dx = r.w(0);
    out = fromCuda([=](cudaStream_t s) { return native::unaryGrad(t, k, x, dy, dx, numel, s); }, n);
  };
  using UK = native::UnaryKind;
  using UG = native::UnaryGradKind;
  if (n == "add")
    binaryKind(BinaryKind::Add);
  else if (n == "sub")
    binaryKind(BinaryKind::Sub);
  else if (n == "mul")
    binaryKind(BinaryKind::Mul);
  else if (n == "div")
    binaryKind(BinaryKind::Div);
  else if (n == "neg")
    unary(UK::Neg, 1.0);
  else if (n == "scale")
    unary(UK::Scale, op.f("factor", 1.0));
  else if (n == "relu")
    unary(UK::Relu, 1.0);
  else if (n == "gelu")
    unary(rules::geluExact(op) ? UK::GeluExact : UK::Gelu, 1.0);
  else if (n == "silu")
    unary(UK::Silu, 1.0);
  else if (n == "relu_grad")
    unaryGrad(UG::Relu);
  else if (n == "gelu_grad")
    unaryGrad(rules::geluExact(op) ? UG::GeluExact : UG::Gelu);
  else if (n == "silu_grad")
    unaryGrad(UG::Silu);
  else if (n == "swiglu" || n == "swiglu_grad")
    swigluLaunch(op, t, base, rank, out);
  else if (n == "fill") {
    void *y = r.w(0);
    double val = op.f("value", 0);
    out = fromCuda([=](cudaStream_t s) { return native::fill(t, y, numel, val, s); }, n);
  } else if (n == "bias_add") {
    const void *x = r.v(0), *b = r.v(1);
    void *y = r.w(0);
    int64_t rows = rules::rowsOf(o0), cols = rules::lastDim(o0);
    out = fromCuda([=](cudaStream_t s) { return native::biasAdd(t, x, b, y, rows, cols, s); }, n);
  } else if (n == "softmax" || n == "softmax_grad") {
    int64_t rows = rules::rowsOf(o0), cols = rules::lastDim(o0);
    const void *a = r.v(0), *b = n == "softmax" ? nullptr : r.v(1);
    void *y = r.w(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return b ? native::softmaxGrad(t, a, b, y, rows, cols, s)
                   : native::softmax(t, a, y, rows, cols, s);
        },
        n);
  } else {
    return FSDP_ERROR("op '", n, "' is not elementwise"); // a bug in nativeBuilders()
  }
  return Status::ok();
}

/// layer_norm and RMSNorm, forward and gradient, and the residual RMSNorm
/// (the residual layer norms: buildResidualNorm).
Status CudaDevice::buildNativeNorm(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                   Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &x = op.in(0);
  int64_t rows = rules::rowsOf(x), cols = rules::lastDim(x);
  float *sf = scratch.f;
  if (n == "rms_norm") {
    const void *xp = r.v(0), *g = r.v(1);
    void *y = r.w(0);
    double eps = op.f("epsilon", 1e-6);
    out = fromCuda([=](cudaStream_t s) { return native::rmsNorm(t, xp, g, y, rows, cols, eps, s); },
                   n);
  } else if (n == "rms_norm_grad" || n == "rms_norm_grad_acc") {
    const void *xp = r.v(0), *g = r.v(1), *dy = r.v(2);
    const void *acc = n == "rms_norm_grad_acc" ? r.v(3) : nullptr;
    void *dx = r.w(0), *dg = r.w(1);
    double eps = op.f("epsilon", 1e-6);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::rmsNormGrad(t, xp, g, dy, dx, dg, sf, rows, cols, eps, s, acc);
        },
        n);
  } else if (n == "residual_rms_norm") {
    const void *a = r.v(0), *b = r.v(1), *g = r.v(2);
    void *sum = r.w(0), *y = r.w(1);
    double eps = op.f("epsilon", 1e-6);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::residualRmsNorm(t, a, b, g, sum, y, rows, cols, eps, s);
        },
        n);
  } else if (n == "layer_norm") {
    const void *xp = r.v(0), *g = r.v(1), *b = r.v(2);
    void *y = r.w(0);
    double eps = op.f("epsilon", 1e-5);
    out = fromCuda(
        [=](cudaStream_t s) { return native::layerNorm(t, xp, g, b, y, rows, cols, eps, s); }, n);
  } else if (n == "layer_norm_grad") {
    const void *xp = r.v(0), *g = r.v(1), *dy = r.v(2);
    void *dx = r.w(0), *dg = r.w(1), *db = r.w(2);
    double eps = op.f("epsilon", 1e-5);
    const bool f32Params = op.out(1).dtype == DType::F32; // widened (t is narrow here)
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::layerNormGrad(t, xp, g, dy, dx, dg, db, sf, rows, cols, eps, s, nullptr,
                                       native::LayerNormImpl::Auto, f32Params);
        },
        n);
  } else {
    return FSDP_ERROR("op '", n, "' is not a norm"); // a bug in nativeBuilders()
  }
  return Status::ok();
}

/// matmul on storage of dtype t (an f32 product where its result is f32,
/// gemmTypeOf), its algorithm chosen at prepare.
Status CudaDevice::buildNativeMatmul(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                     Launch &out) {
  Ptrs r{op, base, rank};
  rules::MM d;
  FSDP_RETURN_IF_ERROR(rules::matmulDims(op, d));
  const void *a = r.v(0), *b = r.v(1);
  void *c = r.w(0);
  bool ta = op.b("transpose_lhs"), tb = op.b("transpose_rhs");
  Gemm *g = gemm.get();
  const GemmType gt = gemmTypeOf(t, op.out(0));
  // acc + a b: Gemm::run reads acc where it lies (in place where the plan put C on it).
  const void *acc = op.inst.in.size() > 2 ? r.v(2) : nullptr;
  FSDP_RETURN_IF_ERROR(g->warm(gt, d.batch, d.m, d.n, d.k, ta, tb, a, b, c, acc));
  out = [=](cudaStream_t s) -> Status {
    return g->run(gt, a, b, c, d.batch, d.m, d.n, d.k, ta, tb, s, acc);
  };
  return Status::ok();
}

/// attention, attention_qkv and their gradients: the tiled kernels
/// (CudaFlash.h) in the implementation FSDP_CUDA_ATTENTION names, or Auto.
Status CudaDevice::buildAttention(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                  Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  float *sf = scratch.f;
  AttentionShape a;
  if (!attentionShape(op.plan, op.inst, a))
    return FSDP_ERROR(n, ": not a [B, T, C] attention"); // OpRules checked it
  const int64_t B = a.B, T = a.T, C = a.C, heads = a.heads, kv = a.kv;
  const flash::Layout rows = attentionLayout(a);
  bool causal = op.b("causal");
  FSDP_RETURN_IF_ERROR(flash::check(B, T, C, heads, kv, rows));
  // An implementation named by FSDP_CUDA_ATTENTION that cannot take this
  // op's dtype or head dimension: refused at build, not at run.
  flash::Impl impl = attention;
  if (flash::tensorCoreImpl(impl) && (t == FloatKind::F32 || (C / heads) % 16))
    return FSDP_ERROR(n,
                      ": FSDP_CUDA_ATTENTION names tensor-core kernels, which take bf16 / "
                      "f16 storage with a head dimension that is a multiple of 16 (this op: ",
                      t == FloatKind::F32 ? "f32" : "16-bit", ", head dimension ", C / heads, ")");
  // The packed forms: q, k, v (and dq, dk, dv) are the column ranges
  // [0, C), [C, C + KC), [C + KC, C + 2 KC) of one tensor, in place.
  const int64_t esz = t == FloatKind::F32 ? 4 : 2;
  auto cols = [&](uint8_t *p, int64_t c) { return (void *)(p + c * esz); };
  uint8_t *in0 = r.in<uint8_t>(0);
  const void *q = in0, *k = a.packed ? cols(in0, C) : r.v(1),
             *vv = a.packed ? cols(in0, C + a.KC) : r.v(2);
  if (n == "attention" || n == "attention_qkv") {
    void *y = r.w(0);
    float *lse = op.inst.out.size() > 1 ? r.out<float>(1) : nullptr;
    out = fromCuda(
        [=](cudaStream_t s) {
          return flash::forward(t, q, k, vv, y, lse, B, T, C, heads, causal, kv, s, impl, rows);
        },
        n);
    return Status::ok();
  }
  const void *y = a.packed ? r.v(1) : r.v(3), *dy = a.packed ? r.v(3) : r.v(5);
  const float *lse = r.in<float>(a.packed ? 2 : 4);
  uint8_t *out0 = r.out<uint8_t>(0);
  void *dq = out0, *dk = a.packed ? cols(out0, C) : r.w(1),
       *dv = a.packed ? cols(out0, C + a.KC) : r.w(2);
  out = fromCuda(
      [=](cudaStream_t s) {
        return flash::backward(t, q, k, vv, y, lse, dy, dq, dk, dv, sf, B, T, C, heads, causal, kv,
                               s, impl, rows);
      },
      n);
  return Status::ok();
}

/// rope and its gradient: the rotation by the cached cos / sin tables
/// (ropeTable).
Status CudaDevice::buildRope(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const auto &sh = op.in(0).shape;
  int64_t B = sh[0], T = sh[1], C = sh[2], heads = op.i("heads", 1);
  const float *cs = nullptr, *sn = nullptr;
  FSDP_RETURN_IF_ERROR(ropeTable(T, C / heads, op.f("theta", 1e4), cs, sn));
  const void *x = r.v(0);
  void *y = r.w(0);
  bool grad = n == "rope_grad";
  out = fromCuda(
      [=](cudaStream_t s) { return native::rope(t, x, y, B, T, C, heads, cs, sn, grad, s); }, n);
  return Status::ok();
}

/// Copies and views, transposes, broadcasts and column sums, slices and
/// concatenation (pitched copies), the embedding lookup and its sorted
/// gradient sum.
Status CudaDevice::buildNativeLayout(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                     Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &o0 = op.out(0);
  float *sf = scratch.f;
  long long *bad = badPos;
  if (n == "copy" || n == "reshape") {
    uint8_t *dst = r.out<uint8_t>(0);
    const uint8_t *src = r.in<uint8_t>(0);
    size_t bytes = (size_t)o0.bytes;
    out = fromCuda(
        [=](cudaStream_t s) {
          return dst == src ? cudaSuccess
                            : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
        },
        n);
  } else if (n == "embedding") {
    const Buffer &tb = op.in(0);
    int64_t vocab = tb.shape[0], width = tb.shape[1], cnt = op.in(1).numel();
    const void *table = r.v(0);
    const int32_t *ids = r.in<int32_t>(1);
    void *y = r.w(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::embedding(t, table, ids, y, cnt, vocab, width, bad, s);
        },
        n);
  } else if (n == "embedding_grad") {
    int64_t vocab = o0.shape[0], width = o0.shape[1], cnt = op.in(0).numel();
    const int32_t *ids = r.in<int32_t>(0);
    const void *dy = r.v(1);
    void *dt = r.w(0);
    const bool f32Out = productF32(op.plan, op.inst, 0); // the sums unrounded
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::embeddingGrad(t, ids, dy, dt, sf, cnt, vocab, width, bad, s, f32Out);
        },
        n);
  } else if (n == "transpose") {
    const void *x = r.v(0);
    void *y = r.w(0);
    auto sx = op.in(0).shape;
    auto perm = op.iv("perm");
    out = fromCuda([=](cudaStream_t s) { return native::transpose(t, x, sx, perm, y, s); }, n);
  } else if (n == "slice" || n == "slice_grad") {
    bool grad = n == "slice_grad";
    const Buffer &whole = grad ? o0 : op.in(0), &part = grad ? op.in(0) : o0;
    int64_t dim = op.i("dim", 0), outer, inner, off = op.i("offset", 0);
    rules::around(whole.shape, dim, outer, inner);
    int64_t full = whole.shape[dim], len = part.shape[dim];
    const void *x = r.v(0);
    void *y = r.w(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return grad ? native::sliceGrad(t, x, y, outer, full, len, inner, off, s)
                      : native::slice(t, x, y, outer, full, len, inner, off, s);
        },
        n);
  } else if (n == "concat") {
    int64_t dim = op.i("dim", 0), outer, inner;
    rules::around(o0.shape, dim, outer, inner);
    int64_t full = o0.shape[dim];
    std::vector<std::tuple<const void *, int64_t, int64_t>> parts; // ptr, len, offset
    int64_t off = 0;
    for (size_t i = 0; i < op.inst.in.size(); ++i) {
      int64_t len = op.in(i).shape[dim];
      parts.emplace_back(r.v(i), len, off);
      off += len;
    }
    void *y = r.w(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          for (auto [p, len, o] : parts)
            if (cudaError_t e = native::place(t, p, y, outer, full, len, inner, o, s))
              return e;
          return cudaSuccess;
        },
        n);
  } else if (n == "broadcast" || n == "sum_to") {
    const void *x = r.v(0);
    void *y = r.w(0);
    auto si = op.in(0).shape, so = o0.shape;
    bool sum = n == "sum_to";
    const bool f32Out = sum && productF32(op.plan, op.inst, 0); // the sum unrounded
    out = fromCuda(
        [=](cudaStream_t s) {
          return sum ? native::sumTo(t, x, si, y, so, sf, s, f32Out)
                     : native::broadcastTo(t, x, si, y, so, s);
        },
        n);
  } else {
    return FSDP_ERROR("op '", n, "' is not a layout op"); // a bug in nativeBuilders()
  }
  return Status::ok();
}

/// Cross entropy over the vocabulary on narrow logits (the loss and its
/// incoming gradient f32): the loss, its gradient, or both in one read of
/// the logits (cross_entropy_fused).
Status CudaDevice::buildNativeLoss(const Op &op, FloatKind t, uint8_t *base, int64_t rank,
                                   Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  double *sd = scratch.d;
  long long *bad = badPos;
  const Buffer &l = op.in(0);
  int64_t stride = rules::lastDim(l), rows = rules::rowsOf(l);
  int64_t classes = rules::ceClasses(op);
  double e = rules::ceSmoothing(op);
  CeIgnore ig = ceIgnoreOf(r);
  const void *logits = r.v(0);
  const int32_t *labels = r.in<int32_t>(1);
  const bool cache = ceCacheRow;
  if (n == "cross_entropy_fused") {
    const float *dl = r.in(2);
    float *loss = r.out(0);
    void *y = r.w(1);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::crossEntropyFused(t, logits, labels, dl, loss, y, sd, rows, classes,
                                           stride, bad, s, cache, e, ig);
        },
        n);
  } else if (n == "cross_entropy") {
    float *y = r.out(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::crossEntropy(t, logits, labels, y, sd, rows, classes, stride, bad, s, e,
                                      ig);
        },
        n);
  } else {
    const float *dl = r.in(2);
    void *y = r.w(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::crossEntropyGrad(t, logits, labels, dl, y, rows, classes, stride, bad, s,
                                          cache, e, ig);
        },
        n);
  }
  return Status::ok();
}

Status CudaDevice::ropeTable(int64_t T, int64_t D, double theta, const float *&cs,
                             const float *&sn) {
  auto key = std::make_tuple(T, D, theta);
  auto it = ropeTables.find(key);
  if (it == ropeTables.end()) {
    std::vector<float> c, s;
    native::ropeAngles(T, D, theta, c, s);
    float *dc = nullptr, *ds = nullptr;
    size_t bytes = sizeof(float) * std::max<size_t>(c.size(), 1);
    FSDP_CUDA_CHECK(cudaMalloc(&dc, bytes));
    FSDP_CUDA_CHECK(cudaMalloc(&ds, bytes));
    it = ropeTables.emplace(key, std::make_pair(dc, ds)).first;
    FSDP_CUDA_CHECK(cudaMemcpy(dc, c.data(), sizeof(float) * c.size(), cudaMemcpyHostToDevice));
    FSDP_CUDA_CHECK(cudaMemcpy(ds, s.data(), sizeof(float) * s.size(), cudaMemcpyHostToDevice));
  }
  cs = it->second.first;
  sn = it->second.second;
  return Status::ok();
}

void CudaDevice::swigluLaunch(const Op &op, FloatKind t, uint8_t *base, int64_t rank, Launch &out) {
  auto at = [&](int64_t id) { return base + bufferOffset(op.plan, id, rank); };
  const void *g = at(op.inst.in[0]), *u = at(op.inst.in[1]);
  void *y = at(op.inst.out[0]);
  int64_t n = op.out(0).numel();
  if (op.inst.op == "swiglu") {
    out = fromCuda([=](cudaStream_t s) { return native::swiglu(t, g, u, y, n, s); }, "swiglu");
    return;
  }
  const void *dy = at(op.inst.in[2]);
  void *du = at(op.inst.out[1]);
  out = fromCuda([=](cudaStream_t s) { return native::swigluGrad(t, g, u, dy, y, du, n, s); },
                 "swiglu_grad");
}

/// The f32 builders by op name: which family builds each op, and so which
/// ops the device implements (implementsOp). A family builder resolves the
/// instruction's pointers, dimensions and attributes over `base` (the
/// arena, or the widening scratch) and sets `out` to its launch.
const std::unordered_map<std::string, CudaDevice::Builder> &CudaDevice::builders() {
  static const std::unordered_map<std::string, Builder> table = [] {
    std::unordered_map<std::string, Builder> m;
    auto add = [&m](Builder b, std::initializer_list<const char *> ops) {
      for (const char *op : ops)
        m.emplace(op, b);
    };
    add(&CudaDevice::buildElementwise,
        {"add", "sub", "mul", "div", "neg", "relu", "gelu", "silu", "relu_grad", "gelu_grad",
         "silu_grad", "scale", "dropout", "fill", "softmax", "softmax_grad", "bias_add"});
    add(&CudaDevice::buildMatmul,
        {"matmul", "matmul_bias", "matmul_gelu_grad", "matmul_bias_grad"});
    add(&CudaDevice::buildLayerNorm,
        {"layer_norm", "layer_norm_grad", "residual_layer_norm", "layer_norm_grad_acc"});
    // The native kernels (CudaNative.h, CudaFlash.h) run f32 plans too:
    // - rms_norm*: warp-per-row kernels with partial column sums; the
    //   reference kernel's one thread per column over every row (the tests'
    //   baseline) leaves most of the GPU idle for dw;
    // - attention*: the tiled kernels at every T; the one-row-per-block
    //   reference kernels (CudaKernels.h, the tests' baseline) took 28 ms
    //   forward and 137 ms backward per GPT-2 layer at B=16, T=1024 on an H100;
    // - rope*: the table-driven kernel; the reference kernels compute the
    //   angles per pair;
    // - embedding_grad: the sorted sum; sum_to: the column sum for bias
    //   gradients; slice / slice_grad / concat: pitched copies; swiglu*.
    add(&CudaDevice::buildNativeF32,
        {"rms_norm", "rms_norm_grad", "rms_norm_grad_acc", "residual_rms_norm", "attention",
         "attention_grad", "attention_qkv", "attention_qkv_grad", "rope", "rope_grad",
         "embedding_grad", "sum_to", "slice", "slice_grad", "concat", "swiglu", "swiglu_grad"});
    add(&CudaDevice::buildLayout, {"copy", "reshape", "transpose", "broadcast", "reduce_sum",
                                   "reduce_mean", "cast", "embedding", "quantize", "dequantize"});
    add(&CudaDevice::buildPack, {"pack"});
    add(&CudaDevice::buildLoss,
        {"cross_entropy", "cross_entropy_grad", "cross_entropy_fused", "mse_loss", "mse_loss_grad",
         "bce_with_logits", "bce_with_logits_grad", "count_labels"});
    add(&CudaDevice::buildUpdate,
        {"sgd_update", "sgd_momentum_update", "adamw_update", "lamb_norms", "lamb_update",
         "squared_norm", "clip_coef", "grad_coef"});
    return m;
  }();
  return table;
}

Status CudaDevice::build(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  const std::string &n = op.inst.op;
  for (size_t i = 0; i < op.inst.in.size(); ++i)
    if (op.in(i).dtype == DType::I64)
      return FSDP_ERROR(n, ": int64 ids / labels are not supported on CUDA yet (the compiler "
                           "emits i32)");
  auto it = builders().find(n);
  if (it == builders().end())
    return FSDP_ERROR("op '", n, "' has no CUDA kernel");
  return (this->*(it->second))(op, base, rank, out);
}

/// Elementwise arithmetic and activations, their gradients, dropout, fill,
/// softmax and the bias add (CudaKernels.h).
Status CudaDevice::buildElementwise(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &o0 = op.out(0);
  int64_t numel = o0.numel();
  auto binaryKind = [&](BinaryKind k) {
    auto a = r.in(0), b = r.in(1);
    auto sa = op.in(0).shape, sb = op.in(1).shape, so = o0.shape;
    float *y = r.out(0);
    out = fromCuda([=](cudaStream_t s) { return binary(k, a, sa, b, sb, y, so, s); }, n);
  };
  auto unary = [&](cudaError_t (*f)(const float *, float *, int64_t, cudaStream_t)) {
    const float *x = r.in(0);
    float *y = r.out(0);
    out = fromCuda([=](cudaStream_t s) { return f(x, y, numel, s); }, n);
  };
  auto unaryGrad =
      [&](cudaError_t (*f)(const float *, const float *, float *, int64_t, cudaStream_t)) {
        const float *x = r.in(0), *dy = r.in(1);
        float *dx = r.out(0);
        out = fromCuda([=](cudaStream_t s) { return f(x, dy, dx, numel, s); }, n);
      };
  if (n == "add")
    binaryKind(BinaryKind::Add);
  else if (n == "sub")
    binaryKind(BinaryKind::Sub);
  else if (n == "mul")
    binaryKind(BinaryKind::Mul);
  else if (n == "div")
    binaryKind(BinaryKind::Div);
  else if (n == "neg")
    unary(neg);
  else if (n == "relu")
    unary(relu);
  else if (n == "gelu")
    unary(rules::geluExact(op) ? geluExact : gelu);
  else if (n == "silu")
    unary(silu);
  else if (n == "relu_grad")
    unaryGrad(reluGrad);
  else if (n == "gelu_grad")
    unaryGrad(rules::geluExact(op) ? geluExactGrad : geluGrad);
  else if (n == "silu_grad")
    unaryGrad(siluGrad);
  else if (n == "scale") {
    const float *x = r.in(0);
    float *y = r.out(0);
    double f = op.f("factor", 1.0);
    out = fromCuda([=](cudaStream_t s) { return scale(x, y, numel, f, s); }, n);
  } else if (n == "dropout") {
    // The mask's key changes every step: the kernel reads the step from the
    // device's context word (a replayed graph draws the step's mask); an
    // evaluation (never captured) is the identity.
    const float *x = r.in(0);
    float *y = r.out(0);
    double p = op.f("p", 0);
    int64_t id = op.i("id", 0), micro = op.i("micro", 0), count = op.i("micro_count", 1);
    uint32_t threshold = dropoutThreshold(p);
    const uint64_t *ctx = stepCtx;
    out = fromCuda(
        [=](cudaStream_t s) {
          const DropoutContext &c = dropoutContext();
          if (!c.training || p == 0)
            return scale(x, y, numel, 1.0, s);
          return dropout(x, y, numel, ctx, id, (uint64_t)((c.dataRank * count + micro) * numel),
                         threshold, 1.0 / (1.0 - p), s);
        },
        n);
  } else if (n == "fill") {
    float *y = r.out(0);
    double v = op.f("value", 0);
    out = fromCuda([=](cudaStream_t s) { return fill(y, numel, v, s); }, n);
  } else if (n == "softmax" || n == "softmax_grad") {
    int64_t rows = rules::rowsOf(o0), cols = rules::lastDim(o0);
    const float *a = r.in(0), *b = n == "softmax" ? nullptr : r.in(1);
    float *y = r.out(0);
    out = fromCuda(
        [=](cudaStream_t s) {
          return b ? softmaxGrad(a, b, y, rows, cols, s) : softmax(a, y, rows, cols, s);
        },
        n);
  } else if (n == "bias_add") {
    const float *x = r.in(0), *b = r.in(1);
    float *y = r.out(0);
    int64_t rows = rules::rowsOf(o0), cols = rules::lastDim(o0);
    out = fromCuda([=](cudaStream_t s) { return biasAdd(x, b, y, rows, cols, s); }, n);
  } else {
    return FSDP_ERROR("op '", n, "' is not elementwise"); // a bug in builders()
  }
  return Status::ok();
}

/// matmul (cuBLASLt through Gemm), and the fused ones with their epilogues.
Status CudaDevice::buildMatmul(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  if (op.inst.op != "matmul")
    return buildFusedMatmul(op, FloatKind::F32, base, rank, out);
  Ptrs r{op, base, rank};
  rules::MM d;
  FSDP_RETURN_IF_ERROR(rules::matmulDims(op, d));
  const float *a = r.in(0), *b = r.in(1);
  float *c = r.out(0);
  bool ta = op.b("transpose_lhs"), tb = op.b("transpose_rhs");
  Gemm *g = gemm.get();
  // acc + a b: Gemm::run reads acc where it lies (in place where the plan put C on it).
  const float *acc = op.inst.in.size() > 2 ? r.in(2) : nullptr;
  out = [=](cudaStream_t s) { return g->run(a, b, c, d.batch, d.m, d.n, d.k, ta, tb, s, acc); };
  return Status::ok();
}

/// layer_norm and its gradient (CudaKernels.h); the fused residual forms on
/// the native kernels (buildResidualNorm).
Status CudaDevice::buildLayerNorm(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  const std::string &n = op.inst.op;
  if (n == "residual_layer_norm" || n == "layer_norm_grad_acc")
    return buildResidualNorm(op, FloatKind::F32, base, rank, out);
  Ptrs r{op, base, rank};
  const Buffer &x = op.in(0);
  int64_t rows = rules::rowsOf(x), cols = rules::lastDim(x);
  double eps = op.f("epsilon", 1e-5);
  if (n == "layer_norm") {
    const float *xp = r.in(0), *g = r.in(1), *b = r.in(2);
    float *y = r.out(0);
    out = fromCuda([=](cudaStream_t s) { return layerNorm(xp, g, b, y, rows, cols, eps, s); }, n);
    return Status::ok();
  }
  const float *xp = r.in(0), *g = r.in(1), *dy = r.in(2);
  float *dx = r.out(0), *dg = r.out(1), *db = r.out(2);
  float *sf = scratch.f;
  out = fromCuda(
      [=](cudaStream_t s) { return layerNormGrad(xp, g, dy, dx, dg, db, sf, rows, cols, eps, s); },
      n);
  return Status::ok();
}

/// The ops whose f32 kernels are the native ones (the reasons in builders()).
Status CudaDevice::buildNativeF32(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  if (op.inst.op == "swiglu" || op.inst.op == "swiglu_grad") {
    swigluLaunch(op, FloatKind::F32, base, rank, out);
    return Status::ok();
  }
  return buildNative(op, FloatKind::F32, base, rank, out);
}

/// Copies, views, transposes, broadcasts and reductions over dimensions,
/// casts between float dtypes (stochastic rounding included), and the
/// embedding lookup.
Status CudaDevice::buildLayout(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  const Buffer &o0 = op.out(0);
  int64_t numel = o0.numel();
  if (n == "copy" || n == "reshape") {
    uint8_t *dst = r.out<uint8_t>(0);
    const uint8_t *src = r.in<uint8_t>(0);
    size_t bytes = (size_t)o0.bytes;
    out = fromCuda(
        [=](cudaStream_t s) {
          return dst == src ? cudaSuccess
                            : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
        },
        n);
  } else if (n == "embedding") {
    const Buffer &t = op.in(0);
    int64_t vocab = t.shape[0], width = t.shape[1], cnt = op.in(1).numel();
    const float *table = r.in(0);
    const int32_t *ids = r.in<int32_t>(1);
    float *y = r.out(0);
    long long *bad = badPos;
    out = fromCuda(
        [=](cudaStream_t s) { return embedding(table, ids, y, cnt, vocab, width, bad, s); }, n);
  } else if (n == "transpose") {
    const float *x = r.in(0);
    float *y = r.out(0);
    auto sx = op.in(0).shape;
    auto perm = op.iv("perm");
    out = fromCuda([=](cudaStream_t s) { return transpose(x, sx, perm, y, s); }, n);
  } else if (n == "reduce_sum" || n == "reduce_mean") {
    auto si = op.in(0).shape, dims = op.iv("dims");
    auto kept = shapes::kept(si, dims);
    int64_t count = shapes::reducedCount(si, dims);
    const float *x = r.in(0);
    float *y = r.out(0);
    bool mean = n == "reduce_mean";
    out = fromCuda(
        [=](cudaStream_t s) {
          cudaError_t e = sumTo(x, si, y, kept, s);
          return e || !mean ? e : scale(y, y, numel, 1.0 / (double)count, s);
        },
        n);
  } else if (n == "broadcast") {
    const float *x = r.in(0);
    float *y = r.out(0);
    auto si = op.in(0).shape, so = o0.shape;
    out = fromCuda([=](cudaStream_t s) { return broadcastTo(x, si, y, so, s); }, n);
  } else if (n == "cast") {
    const void *x = r.in<uint8_t>(0);
    void *y = r.out<uint8_t>(0);
    DType from = op.in(0).dtype, to = o0.dtype;
    size_t bytes = (size_t)o0.bytes;
    // Stochastic (f32 -> bf16, checked at load): the key from the device's
    // step context; an evaluation rounds to nearest, as on the CPU.
    const bool stochastic = op.b("stochastic");
    const int64_t unit = op.i("key", 0);
    const uint64_t first = op.b("sharded") ? (uint64_t)(rank * numel) : 0;
    const uint64_t *ctx = stepCtx;
    out = fromCuda(
        [=](cudaStream_t s) {
          if (stochastic && dropoutContext().training)
            return castBf16Stochastic(static_cast<const float *>(x), y, numel, ctx, unit, first, s);
          if (from == to)
            return x == y ? cudaSuccess : cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s);
          return cast(x, floatKind(from), y, floatKind(to), numel, s);
        },
        n);
  } else if (n == "quantize") { // ZeRO++'s qwZ (runtime/core/Quantize.h)
    const void *x = r.in<uint8_t>(0);
    uint8_t *y = r.out<uint8_t>(0);
    const FloatKind from = floatKind(op.in(0).dtype);
    // chunks (hierarchical qgZ): part p is chunks p, p + parts, ...
    const int64_t parts = op.i("parts", 1), block = op.i("block", 1),
                  len = op.in(0).numel() / parts, chunk = op.in(0).numel() / op.i("chunks", parts);
    out = fromCuda(
        [=](cudaStream_t s) { return quantize(x, from, parts, len, chunk, block, y, s); }, n);
  } else if (n == "dequantize") {
    const uint8_t *x = r.in<uint8_t>(0);
    void *y = r.out<uint8_t>(0);
    const FloatKind to = floatKind(o0.dtype);
    // reduce (qgZ): the parts summed into this rank's shard.
    const char *reduce = !op.has("reduce")                 ? nullptr
                         : op.s("reduce", "sum") == "mean" ? "mean"
                                                           : "sum";
    const int64_t parts = op.i("parts", 1), block = op.i("block", 1),
                  len = reduce ? numel : numel / parts;
    out = fromCuda(
        [=](cudaStream_t s) { return dequantize(x, parts, len, block, y, to, reduce, s); }, n);
  } else {
    return FSDP_ERROR("op '", n, "' is not a layout op"); // a bug in builders()
  }
  return Status::ok();
}

/// pack: inputs the memory plan placed inside the packed buffer are there
/// already; the others are copied, in input order (the CPU's memmoves),
/// through scratch where the source partly overlaps its destination
/// (packStaged); the padding is zeroed.
Status CudaDevice::buildPack(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  float *dst = r.out(0);
  float *sf = scratch.f;
  int64_t total = op.out(0).numel();
  std::vector<int64_t> offs = op.iv("offsets");
  std::vector<bool> staged = packStaged(op, rank);
  std::vector<std::tuple<const float *, int64_t, int64_t, bool>> parts; // src, off, len, staged
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (size_t i = 0; i < offs.size(); ++i) {
    int64_t len = op.in(i).numel();
    if (staged[i] && len > scratch.fN) // scratchNeeds sized it: a bug if not
      return FSDP_ERROR("pack: input ", i, " overlaps its destination and needs ", len,
                        " floats of scratch, ", scratch.fN, " allocated");
    parts.emplace_back(r.in(i), offs[i], len, staged[i]);
    covered.push_back({offs[i], offs[i] + len});
  }
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<int64_t, int64_t>> gaps;
  int64_t at = 0;
  for (auto [lo, hi] : covered) {
    if (lo > at)
      gaps.push_back({at, lo});
    at = std::max(at, hi);
  }
  if (at < total)
    gaps.push_back({at, total});
  out = fromCuda(
      [=](cudaStream_t s) {
        for (auto [src, off, len, viaScratch] : parts) {
          if (src == dst + off)
            continue;
          if (viaScratch) {
            if (cudaError_t e =
                    cudaMemcpyAsync(sf, src, sizeof(float) * len, cudaMemcpyDeviceToDevice, s))
              return e;
            src = sf;
          }
          if (cudaError_t e =
                  cudaMemcpyAsync(dst + off, src, sizeof(float) * len, cudaMemcpyDeviceToDevice, s))
            return e;
        }
        for (auto [lo, hi] : gaps)
          if (cudaError_t e = cudaMemsetAsync(dst + lo, 0, sizeof(float) * (hi - lo), s))
            return e;
        return cudaSuccess;
      },
      op.inst.op);
  return Status::ok();
}

/// The losses and their gradients: cross entropy (unfused, or both halves
/// of cross_entropy_fused in turn), MSE, BCE with logits.
Status CudaDevice::buildLoss(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  double *sd = scratch.d;
  if (n == "cross_entropy" || n == "cross_entropy_grad" || n == "cross_entropy_fused") {
    // f32: cross_entropy_fused runs the two kernels in turn (the same bits
    // as unfused; the fused one-read kernel is the narrow dtypes' speed
    // path, CudaNative.h).
    const Buffer &l = op.in(0);
    int64_t stride = rules::lastDim(l), rows = rules::rowsOf(l);
    int64_t classes = rules::ceClasses(op);
    double e = rules::ceSmoothing(op);
    CeIgnore ig = ceIgnoreOf(r);
    const float *logits = r.in(0);
    const int32_t *labels = r.in<int32_t>(1);
    bool fused = n == "cross_entropy_fused", lossOnly = n == "cross_entropy";
    float *loss = n == "cross_entropy_grad" ? nullptr : r.out(0);
    float *dx = lossOnly ? nullptr : r.out(fused ? 1 : 0);
    const float *dl = lossOnly ? nullptr : r.in(2);
    long long *bad = badPos;
    out = fromCuda(
        [=](cudaStream_t s) {
          cudaError_t err =
              loss ? crossEntropy(logits, labels, loss, sd, rows, classes, stride, bad, s, e, ig)
                   : cudaSuccess;
          return err != cudaSuccess || !dx ? err
                                           : crossEntropyGrad(logits, labels, dl, dx, rows, classes,
                                                              stride, bad, s, e, ig);
        },
        n);
  } else if (n == "count_labels") {
    const int32_t *labels = r.in<int32_t>(0);
    float *y = r.out(0);
    int64_t cnt = op.in(0).numel(), divisor = op.i("divisor", 1);
    int32_t ignore = (int32_t)op.i("ignore_index", 0);
    out = fromCuda([=](cudaStream_t s) { return countLabels(labels, cnt, ignore, divisor, y, s); },
                   n);
  } else if (n == "mse_loss" || n == "bce_with_logits") {
    const float *x = r.in(0), *t = r.in(1);
    float *y = r.out(0);
    int64_t cnt = op.in(0).numel();
    bool mse = n == "mse_loss";
    out = fromCuda(
        [=](cudaStream_t s) {
          return mse ? mseLoss(x, t, y, sd, cnt, s) : bceWithLogits(x, t, y, sd, cnt, s);
        },
        n);
  } else if (n == "mse_loss_grad" || n == "bce_with_logits_grad") {
    const float *x = r.in(0), *t = r.in(1), *dl = r.in(2);
    float *dx = r.out(0);
    int64_t numel = op.out(0).numel();
    bool mse = n == "mse_loss_grad";
    out = fromCuda(
        [=](cudaStream_t s) {
          return mse ? mseLossGrad(x, t, dl, dx, numel, s)
                     : bceWithLogitsGrad(x, t, dl, dx, numel, s);
        },
        n);
  } else {
    return FSDP_ERROR("op '", n, "' is not a loss"); // a bug in builders()
  }
  return Status::ok();
}

/// The optimizer updates over a flat shard (weight-decay-params=matrices:
/// the decayed prefix, then the rest), and the gradient-norm ops clipping
/// and loss scaling use.
/// What an update of narrow state (state-dtype=bf16 or 8bit) needs besides
/// its operands: the optional skip_nonfinite / grad_scale scalars, its cnt
/// elements' decayed prefix k (weight-decay-params=matrices), and (bf16)
/// its stochastic draws' {seed, step} (null: to nearest), key and the
/// operand's first position in its unit.
struct CudaDevice::StateUpdate {
  const float *skip = nullptr, *gs = nullptr;
  int64_t cnt = 0, k = 0;
  const uint64_t *ctx = nullptr;
  int64_t key = 0;
  uint64_t first = 0;
  /// part(at, count, decay) over the decayed prefix (weight decay wd),
  /// then the rest (none).
  template <typename Part> cudaError_t inParts(double wd, Part part) const {
    cudaError_t e = k ? part(0, k, wd) : cudaSuccess;
    return e != cudaSuccess || k == cnt ? e : part(k, cnt - k, 0.0);
  }
};

CudaDevice::StateUpdate CudaDevice::stateUpdate(const Op &op, const Ptrs &r, int64_t rank) const {
  StateUpdate u;
  rules::UpdateExtras x = rules::updateExtras(op);
  u.skip = x.skip >= 0 ? r.in(x.skip) : nullptr;
  u.gs = x.scale >= 0 ? r.in(x.scale) : nullptr;
  u.cnt = op.in(0).numel();
  u.k = rules::decayedCount(op, rank);
  u.ctx = op.b("stochastic") ? stepCtx : nullptr;
  u.key = op.i("key", 0);
  u.first = (uint64_t)(rank * op.i("shard_stride", 0));
  return u;
}

Status CudaDevice::buildUpdate(const Op &op, uint8_t *base, int64_t rank, Launch &out) {
  Ptrs r{op, base, rank};
  const std::string &n = op.inst.op;
  // The parameters (Params): f32, or bf16 (master-dtype=bf16,
  // updatesBf16Params) read widened and written rounded once in the same
  // kernel, to nearest or with the stochastic cast's draws
  // (stochastic_param: the device's {seed, step}, so a captured graph
  // replays each step's; the unit's key; element i at rank x shard_stride +
  // i): the CPU device's bits, with no f32 copy.
  const Params q =
      rules::updatesBf16Params(op.plan, op.inst)
          ? Params::bf16Storage(r.in<uint8_t>(0), r.out<uint8_t>(0),
                                op.b("stochastic_param") ? stepCtx : nullptr, op.i("key", 0),
                                (uint64_t)(rank * op.i("shard_stride", 0)))
          : Params(r.in(0), r.out(0));
  double *sd = scratch.d;
  if (n == "sgd_update") {
    const float *g = r.in(1), *lr = r.in(2);
    double wd = op.f("weight_decay", 0);
    int64_t cnt = op.in(0).numel(), k = rules::decayedCount(op, rank);
    rules::UpdateExtras x = rules::updateExtras(op);
    const float *skip = x.skip >= 0 ? r.in(x.skip) : nullptr;
    const float *gs = x.scale >= 0 ? r.in(x.scale) : nullptr;
    out = fromCuda(
        [=](cudaStream_t s) {
          cudaError_t e = k ? sgdUpdate(q, g, k, lr, wd, s, skip, gs) : cudaSuccess;
          return e != cudaSuccess || k == cnt
                     ? e
                     : sgdUpdate(q.from(k), g + k, cnt - k, lr, 0.0, s, skip, gs);
        },
        n);
  } else if (n == "sgd_momentum_update" && op.in(2).dtype == DType::I8) {
    // state-dtype=8bit: one call (a block may straddle the decayed prefix)
    const float *g = r.in(1), *lr = r.in(3), *step = r.in(4);
    const uint8_t *buf = r.in<uint8_t>(2);
    uint8_t *nb = r.out<uint8_t>(1);
    double m = op.f("momentum", 0), damp = op.f("dampening", 0), wd = op.f("weight_decay", 0);
    bool nesterov = op.b("nesterov");
    const int64_t block = op.i("state_block", 256);
    const StateUpdate u = stateUpdate(op, r, rank);
    out = fromCuda(
        [=](cudaStream_t s) {
          return native::sgdMomentum8bitState(q, g, buf, nb, u.cnt, block, lr, step, m, damp, wd,
                                              nesterov, u.k, u.gs, u.skip, s);
        },
        n);
  } else if (n == "sgd_momentum_update" && op.in(2).dtype == DType::BF16) {
    // state-dtype=bf16 (OpRules: f32 p, g; a bf16 buffer), as adamw's below.
    const float *g = r.in(1), *lr = r.in(3), *step = r.in(4);
    const uint8_t *buf = r.in<uint8_t>(2);
    uint8_t *nb = r.out<uint8_t>(1);
    double m = op.f("momentum", 0), damp = op.f("dampening", 0), wd = op.f("weight_decay", 0);
    bool nesterov = op.b("nesterov");
    const StateUpdate u = stateUpdate(op, r, rank);
    out = fromCuda(
        [=](cudaStream_t s) {
          return u.inParts(wd, [&](int64_t at, int64_t count, double decay) {
            return native::sgdMomentumBf16State(q.from(at), g + at, buf + 2 * at, nb + 2 * at,
                                                count, lr, step, m, damp, decay, nesterov, u.gs,
                                                u.skip, u.ctx, u.key, u.first + (uint64_t)at, s);
          });
        },
        n);
  } else if (n == "sgd_momentum_update") {
    const float *g = r.in(1), *buf = r.in(2), *lr = r.in(3), *step = r.in(4);
    float *nb = r.out(1);
    double m = op.f("momentum", 0), damp = op.f("dampening", 0), wd = op.f("weight_decay", 0);
    bool nesterov = op.b("nesterov");
    int64_t cnt = op.in(0).numel(), k = rules::decayedCount(op, rank);
    rules::UpdateExtras x = rules::updateExtras(op);
    const float *skip = x.skip >= 0 ? r.in(x.skip) : nullptr;
    const float *gs = x.scale >= 0 ? r.in(x.scale) : nullptr;
    out = fromCuda(
        [=](cudaStream_t s) {
          cudaError_t e =
              k ? sgdMomentumUpdate(q, g, buf, nb, k, lr, step, m, damp, wd, nesterov, s, skip, gs)
                : cudaSuccess;
          return e != cudaSuccess || k == cnt
                     ? e
                     : sgdMomentumUpdate(q.from(k), g + k, buf + k, nb + k, cnt - k, lr, step, m,
                                         damp, 0.0, nesterov, s, skip, gs);
        },
        n);
  } else if (n == "adamw_update" && op.in(2).dtype != DType::F32) {
    // state-dtype=bf16 or 8bit (OpRules: f32 p, g; bf16 moments, or i8
    // packed codes and scales).
    const float *g = r.in(1), *lr = r.in(4), *step = r.in(5);
    const uint8_t *m = r.in<uint8_t>(2), *v = r.in<uint8_t>(3);
    uint8_t *nm = r.out<uint8_t>(1), *nv = r.out<uint8_t>(2);
    double b1 = op.f("beta1", 0.9), b2 = op.f("beta2", 0.999), eps = op.f("eps", 1e-8),
           wd = op.f("weight_decay", 0.01);
    const StateUpdate u = stateUpdate(op, r, rank);
    if (op.in(2).dtype == DType::I8) {
      // 8-bit or 4-bit: one call (a block may straddle the decayed prefix)
      const int64_t block = op.i("state_block", 256);
      auto *const kernel =
          op.i("state_bits", 8) == 4 ? native::adamw4bitState : native::adamw8bitState;
      out = fromCuda(
          [=](cudaStream_t s) {
            return kernel(q, g, m, v, nm, nv, u.cnt, block, lr, step, b1, b2, eps, wd, u.k, u.gs,
                          u.skip, s);
          },
          n);
    } else {
      // bf16: the decayed prefix and the rest as below; the draws'
      // positions in the unit.
      out = fromCuda(
          [=](cudaStream_t s) {
            return u.inParts(wd, [&](int64_t at, int64_t count, double decay) {
              return native::adamwBf16State(q.from(at), g + at, m + 2 * at, v + 2 * at, nm + 2 * at,
                                            nv + 2 * at, count, lr, step, b1, b2, eps, decay, u.gs,
                                            u.skip, u.ctx, u.key, u.first + (uint64_t)at, s);
            });
          },
          n);
    }
  } else if (n == "adamw_update") {
    const float *m = r.in(2), *v = r.in(3), *lr = r.in(4), *step = r.in(5);
    float *nm = r.out(1), *nv = r.out(2);
    double b1 = op.f("beta1", 0.9), b2 = op.f("beta2", 0.999), eps = op.f("eps", 1e-8),
           wd = op.f("weight_decay", 0.01);
    int64_t cnt = op.in(0).numel(), k = rules::decayedCount(op, rank);
    // The fused kernel (CudaNative.h): the reference's math with the
    // scalars formed once per thread; optional operands after `step`:
    // skip_nonfinite (loss scaling: skip the update when it is inf/NaN),
    // grad_scale (the gradient times it: clipping / unscaling folded in).
    rules::UpdateExtras x = rules::updateExtras(op);
    const float *skip = x.skip >= 0 ? r.in(x.skip) : nullptr;
    const float *gs = x.scale >= 0 ? r.in(x.scale) : nullptr;
    FloatKind gk = floatKind(op.in(1).dtype);
    const void *gv = r.v(1);
    const void *gRest = r.in<uint8_t>(1) + k * dtypeSize(op.in(1).dtype);
    out = fromCuda(
        [=](cudaStream_t s) {
          cudaError_t e =
              k ? native::adamw(q, gv, gk, m, v, nm, nv, k, lr, step, b1, b2, eps, wd, gs, skip, s)
                : cudaSuccess;
          return e != cudaSuccess || k == cnt
                     ? e
                     : native::adamw(q.from(k), gRest, gk, m + k, v + k, nm + k, nv + k, cnt - k,
                                     lr, step, b1, b2, eps, 0.0, gs, skip, s);
        },
        n);
  } else if (n == "lamb_norms" || n == "lamb_update") {
    // The unit's parameter bounds and this shard's place among them
    // (rules::lambLayout; the shard index as decayedCount's). p and g f32;
    // the moments f32, bf16 (state-dtype=bf16) or i8 packed codes and
    // scales (state-dtype=8bit); the plan check holds them to one dtype.
    LambLayout l = rules::lambLayout(op, rank);
    const float *p = r.in(0), *g = r.in(1);
    const void *m = r.v(2), *v = r.v(3);
    const bool bf16 = op.in(2).dtype == DType::BF16, codes8 = op.in(2).dtype == DType::I8;
    const int64_t block = op.i("state_block", 256);
    double b1 = op.f("beta1", 0.9), b2 = op.f("beta2", 0.999), eps = op.f("eps", 1e-6),
           wd = op.f("weight_decay", 0.01);
    int64_t cnt = op.in(0).numel();
    rules::UpdateExtras x = rules::updateExtras(op);
    const float *skip = x.skip >= 0 ? r.in(x.skip) : nullptr;
    const float *gs = x.scale >= 0 ? r.in(x.scale) : nullptr;
    if (n == "lamb_norms") {
      const float *step = r.in(4);
      float *y = r.out(0);
      out = fromCuda(
          [=](cudaStream_t s) {
            if (codes8)
              return lambNorms8bitState(p, g, m, v, y, cnt, block, l.segments, l.base, l.decayNumel,
                                        step, b1, b2, eps, wd, gs, sd, s);
            return bf16 ? lambNormsBf16State(p, g, m, v, y, cnt, l.segments, l.base, l.decayNumel,
                                             step, b1, b2, eps, wd, gs, sd, s)
                        : lambNorms(p, g, static_cast<const float *>(m),
                                    static_cast<const float *>(v), y, cnt, l.segments, l.base,
                                    l.decayNumel, step, b1, b2, eps, wd, gs, sd, s);
          },
          n);
    } else {
      const float *norms = r.in(4), *lr = r.in(5), *step = r.in(6);
      float *np = r.out(0);
      void *nm = r.out<uint8_t>(1), *nv = r.out<uint8_t>(2);
      const uint64_t *ctx = op.b("stochastic") ? stepCtx : nullptr;
      const int64_t key = op.i("key", 0);
      const uint64_t first = (uint64_t)(rank * op.i("shard_stride", 0));
      out = fromCuda(
          [=](cudaStream_t s) {
            if (codes8)
              return lambUpdate8bitState(p, g, m, v, norms, np, nm, nv, cnt, block, l.segments,
                                         l.base, l.decayNumel, lr, step, b1, b2, eps, wd, gs, skip,
                                         s);
            return bf16 ? lambUpdateBf16State(p, g, m, v, norms, np, nm, nv, cnt, l.segments,
                                              l.base, l.decayNumel, lr, step, b1, b2, eps, wd, gs,
                                              skip, ctx, key, first, s)
                        : lambUpdate(p, g, static_cast<const float *>(m),
                                     static_cast<const float *>(v), norms, np,
                                     static_cast<float *>(nm), static_cast<float *>(nv), cnt,
                                     l.segments, l.base, l.decayNumel, lr, step, b1, b2, eps, wd,
                                     gs, skip, s);
          },
          n);
    }
  } else if (n == "squared_norm") {
    std::vector<const float *> xs;
    std::vector<int64_t> ns;
    for (size_t i = 0; i < op.inst.in.size(); ++i) {
      xs.push_back(r.in(i));
      ns.push_back(op.in(i).numel());
    }
    float *y = r.out(0);
    out = fromCuda([=](cudaStream_t s) { return squaredNorm(xs, ns, y, sd, s); }, n);
  } else if (n == "clip_coef") {
    const float *x = r.in(0);
    float *y = r.out(0);
    double maxNorm = op.f("max_norm", 1.0);
    out = fromCuda([=](cudaStream_t s) { return clipCoef(x, y, maxNorm, s); }, n);
  } else if (n == "grad_coef") {
    const float *x = r.in(0), *scale = r.in(1);
    float *y = r.out(0);
    double maxNorm = op.has("max_norm") ? op.f("max_norm", 1.0) : 0.0;
    out = fromCuda([=](cudaStream_t s) { return gradCoef(x, scale, y, maxNorm, s); }, n);
  } else {
    return FSDP_ERROR("op '", n, "' is not an update"); // a bug in builders()
  }
  return Status::ok();
}

/// The f32 builders' ops, and the host <-> device copies prepare() launches
/// itself.
bool CudaDevice::implementsOp(const std::string &op) const {
  return builders().count(op) > 0 || isArenaCopy(op);
}

Status CudaDevice::prepare(const Plan &plan, int64_t shard) {
  FSDP_CUDA_CHECK(cudaSetDevice(ordinal));
  // Scratch: the maxima over the program, allocated once.
  int64_t fN = 0, dN = 0, wide = 0;
  size_t stage = 0;
  const char *stagingEnv = std::getenv("FSDP_CUDA_GEMM_STAGING");
  const bool stagingOn = !(stagingEnv && std::string(stagingEnv) == "0");
  // fsdp-offload: an instruction writing the host arena runs there.
  for (const Instruction &inst : plan.program) {
    if (isCollectiveOp(inst.op) || isArenaCopy(inst.op) || isHostInstruction(plan, inst))
      continue;
    Op op{plan, inst};
    int64_t f, d;
    scratchNeeds(op, shard, attention, f, d);
    FloatKind t;
    const bool narrow = rules::needsWidening(plan, inst),
               native = narrow && nativeKind(plan, inst, t);
    fN = std::max(fN, f);
    dN = std::max(dN, d);
    if (narrow && !native)
      wide = std::max(wide, rules::widen(plan, inst).bytes);
    // A 16-bit GEMM with a row length not a multiple of 8 (GPT-2's vocabulary)
    // multiplies padded copies (CudaGemm.h); FSDP_CUDA_GEMM_STAGING=0 turns it
    // off (for comparison).
    rules::MM mm;
    if (inst.op == "matmul" && native && t != FloatKind::F32 && stagingOn &&
        rules::matmulDims(op, mm).isOk())
      stage =
          std::max(stage, Gemm::stagingNeed(gemmTypeOf(t, op.out(0)), mm.batch, mm.m, mm.n, mm.k,
                                            op.b("transpose_lhs"), op.b("transpose_rhs")));
  }
  if (stage)
    FSDP_RETURN_IF_ERROR(gemm->reserveStaging(stage));
  if (fN)
    FSDP_CUDA_CHECK(cudaMalloc(&scratch.f, sizeof(float) * fN));
  if (dN)
    FSDP_CUDA_CHECK(cudaMalloc(&scratch.d, sizeof(double) * dN));
  if (wide)
    FSDP_CUDA_CHECK(cudaMalloc(&scratch.wide, (size_t)wide));
  if (!stepCtx && std::any_of(plan.program.begin(), plan.program.end(), [](const Instruction &i) {
        return i.op == "dropout" ||
               ((i.op == "cast" || i.op == "adamw_update" || i.op == "sgd_momentum_update" ||
                 i.op == "lamb_update") &&
                i.attrs.value("stochastic", false)) ||
               i.attrs.value("stochastic_param", false);
      })) {
    FSDP_CUDA_CHECK(cudaMalloc(&stepCtx, 2 * sizeof(uint64_t)));
    FSDP_RETURN_IF_ERROR(setDropoutContext(dropoutContext()));
  }
  scratch.fN = fN;
  scratch.dN = dN;
  scratch.wideBytes = wide;

  launches.assign(plan.program.size(), Launch());
  hostRuns.assign(plan.program.size(), nullptr);
  for (size_t i = 0; i < plan.program.size(); ++i) {
    const Instruction &inst = plan.program[i];
    if (isCollectiveOp(inst.op))
      continue;
    if (isArenaCopy(inst.op)) {
      // Asynchronous DMA on the stream it is given: compute's, in program
      // order, or (marked async) the copy stream's (runOn).
      uint8_t *dst = address(bufferOffset(plan, inst.out[0], shard)),
              *src = address(bufferOffset(plan, inst.in[0], shard));
      size_t bytes = (size_t)plan.buffers[inst.out[0]].bytes;
      launches[i] = [dst, src, bytes](cudaStream_t s) -> Status {
        FSDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
        return Status::ok();
      };
      continue;
    }
    if (isHostInstruction(plan, inst)) {
      // The update of an offloaded unit: the CPU backend's kernel on the
      // pinned arena, once the compute stream has drained (its inputs were
      // copied there, and no queued copy still reads what it overwrites):
      // the host waits once per offloaded update (the executor refuses
      // --cuda-graphs for such a plan). Later copies of what it wrote are
      // enqueued after it returns, so they read the new values.
      const Instruction *ip = &inst;
      uint8_t *a = arena, *h = hostArena;
      launches[i] = [this, ip, a, h, shard, &plan](cudaStream_t s) -> Status {
        FSDP_CUDA_CHECK(cudaStreamSynchronize(s));
        return cpu::runInstruction(plan, *ip, a, shard, dropoutContext(), h);
      };
      // Marked async: the same body on the host stream, after the event
      // it waits for ([Note: the CUDA host stream]).
      hostRuns[i] = [ip, a, h, shard, &plan](const DropoutContext &ctx) -> Status {
        return cpu::runInstruction(plan, *ip, a, shard, ctx, h);
      };
      continue;
    }
    Status st;
    FloatKind t;
    if (!rules::needsWidening(plan, inst)) {
      Op op{plan, inst};
      st = build(op, arena, shard, launches[i]);
    } else if (nativeKind(plan, inst, t)) {
      Op op{plan, inst};
      st = buildNative(op, t, arena, shard, launches[i]);
    } else {
      // bf16 / f16 operands: widen into scratch, run the f32 kernel,
      // narrow the outputs back (the CPU device's scheme).
      auto w = std::make_shared<rules::Widened>(rules::widen(plan, inst));
      Op op{w->plan, w->inst};
      Launch body;
      st = build(op, scratch.wide, shard, body); // shard: decayedCount
      if (st) {
        std::vector<bool> isIn(w->ids.size());
        for (int64_t sl : w->inst.in)
          isIn[sl] = true;
        uint8_t *base = arena, *wideBase = scratch.wide;
        launches[i] = [w, isIn, body, base, wideBase, shard, &plan](cudaStream_t s) -> Status {
          for (size_t sl = 0; sl < w->ids.size(); ++sl)
            if (isIn[sl]) {
              const Buffer &b = plan.buffers[w->ids[sl]];
              if (b.dtype == w->plan.buffers[sl].dtype) { // f32 or integer: bytes
                FSDP_CUDA_CHECK(cudaMemcpyAsync(wideBase + w->plan.buffers[sl].offset,
                                                base + bufferOffset(plan, w->ids[sl], shard),
                                                (size_t)b.bytes, cudaMemcpyDeviceToDevice, s));
                continue;
              }
              FSDP_CUDA_CHECK(cast(base + bufferOffset(plan, w->ids[sl], shard), floatKind(b.dtype),
                                   wideBase + w->plan.buffers[sl].offset,
                                   floatKind(w->plan.buffers[sl].dtype), b.numel(), s));
            }
          FSDP_RETURN_IF_ERROR(body(s));
          for (int64_t sl : w->inst.out) {
            const Buffer &b = plan.buffers[w->ids[sl]];
            if (b.dtype == w->plan.buffers[sl].dtype) {
              FSDP_CUDA_CHECK(cudaMemcpyAsync(base + bufferOffset(plan, w->ids[sl], shard),
                                              wideBase + w->plan.buffers[sl].offset,
                                              (size_t)b.bytes, cudaMemcpyDeviceToDevice, s));
              continue;
            }
            FSDP_CUDA_CHECK(cast(
                wideBase + w->plan.buffers[sl].offset, floatKind(w->plan.buffers[sl].dtype),
                base + bufferOffset(plan, w->ids[sl], shard), floatKind(b.dtype), b.numel(), s));
          }
          return Status::ok();
        };
      }
    }
    if (!st)
      return Status::error("instruction #" + std::to_string(i) + " (" + inst.op +
                           "): " + st.message());
  }
  if (gemm->tuned() > 0)
    std::fprintf(stderr,
                 "fsdp-run: cuBLASLt tuning (FSDP_CUDA_GEMM_TUNE=1): %d GEMM shapes timed "
                 "(%d with an epilogue), another algorithm than the heuristic's first won "
                 "for %d\n",
                 gemm->tuned(), gemm->tunedEpilogue(), gemm->tunedChanged());
  return Status::ok();
}

Status createCudaDevice(const DeviceOptions &options, std::unique_ptr<Device> &out) {
  FSDP_RETURN_IF_ERROR(checkCudaDevice());
  int n = cudaDeviceCount();
  auto dev = std::make_unique<CudaDevice>((int)(options.localRank % n));
  FSDP_RETURN_IF_ERROR(dev->init(options.allowTf32));
  out = std::move(dev);
  return Status::ok();
}

} // namespace fsdp::cuda
