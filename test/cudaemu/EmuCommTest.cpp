//===- EmuCommTest.cpp - the CUDA communicators' all-to-all, emulated -----===//
//
// NcclComm and StagedComm (runtime/cuda/CudaComm.cpp), the backend's own
// code, on the emulator: N ranks as threads of one process, each with its
// own host communicator (shared memory, met through a FileStore
// directory) and, for NCCL, its own emulated NCCL rank (EmuNccl.cpp:
// ncclSend / ncclRecv grouped, run at ncclGroupEnd). All-to-all on a
// stream, bit for bit, in f32 and i8, for chunks of 1, 37 and 300000
// bytes (several rounds of the emulator's 1 MiB slots), into device
// buffers reused across rounds; bytesSent() grows by (N - 1) x chunk
// bytes; host buffers (no stream) go to the host communicator. And the
// emulator's check that both sides of every send agree.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/ShmComm.h"
#include "runtime/core/Device.h"
#include "runtime/cuda/CudaComm.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

using namespace fsdp;

namespace {

std::string freshDir(const std::string &tag) {
  auto dir = std::filesystem::temp_directory_path() /
             ("fsdp-emucommtest-" + std::to_string(::getpid()) + "-" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

/// Runs `body(rank)` on n threads; returns the first failure.
std::string runThreads(int n, const std::function<std::string(int)> &body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { errors[r] = body(r); });
  for (auto &t : threads)
    t.join();
  for (auto &e : errors)
    if (!e.empty())
      return e;
  return "";
}

class EmuStream final : public Stream {
public:
  explicit EmuStream(cudaStream_t s) : s(s) {}
  void *nativeHandle() const override { return s; }
  cudaStream_t s;
};

/// (FSDP_CUDA_COMM: nccl or staged, world size)
class CudaCommEmuTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CudaCommEmuTest, AllToAllMovesEveryChunkExactly) {
  auto [mode, n] = GetParam();
  const std::string dir = freshDir(mode + std::to_string(n));
  ::setenv("FSDP_CUDA_COMM", mode.c_str(), 1);
  ::setenv("CUDAEMU_DEVICES", std::to_string(n).c_str(), 1); // a GPU per rank
  std::string err = runThreads(n, [&](int r) -> std::string {
    JobEnv job;
    job.rank = r;
    job.worldSize = n;
    job.localRank = r;
    job.localWorldSize = n;
    job.storeDir = dir;
    std::unique_ptr<Communicator> host, comm;
    if (Status st = makeHostCommunicator("shm", job, 30, host); !st)
      return "host communicator: " + st.message();
    if (Status st = cuda::makeCudaCommunicator(job, 30, std::move(host), comm); !st)
      return "CUDA communicator: " + st.message();
    if ((mode == "nccl") != (std::string(comm->backend()) == "nccl"))
      return "backend " + comm->describe() + " for FSDP_CUDA_COMM=" + mode;
    // Non-blocking, and copies on it: the emulator's legacy stream waits
    // for every blocking stream of the process, the other ranks' too.
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
      return "cudaStreamCreate failed";
    auto copy = [&](void *to, const void *from, size_t bytes, cudaMemcpyKind kind) {
      return cudaMemcpyAsync(to, from, bytes, kind, s) == cudaSuccess &&
             cudaStreamSynchronize(s) == cudaSuccess;
    };
    // Once, for the largest chunk (a free while a peer's stream waits for
    // this rank could wait for it too).
    const size_t most = (size_t)n * 300000;
    void *din = nullptr, *dout = nullptr;
    if (cudaMalloc(&din, most) != cudaSuccess || cudaMalloc(&dout, most) != cudaSuccess)
      return "cudaMalloc failed";
    EmuStream stream(s);
    auto byte = [](int from, int to, int64_t i, int round) {
      uint32_t h =
          (uint32_t)(from * 131 + to * 29 + round * 13) * 2654435761u ^ (uint32_t)i * 40503u;
      return (uint8_t)((h >> 11) ^ (h >> 3) ^ (uint32_t)i);
    };
    // The first wrong result; every rank still runs every collective, so
    // that a failed check leaves no peer waiting.
    std::string failure;
    for (DType dtype : {DType::F32, DType::I8}) {
      const int64_t es = dtypeSize(dtype);
      for (int64_t chunk : {int64_t(1), int64_t(37), 300000 / es}) {
        const int64_t bytes = chunk * es;
        std::vector<uint8_t> in(n * bytes), out(n * bytes), want(n * bytes);
        for (int round = 0; round < 3; ++round) {
          for (int j = 0; j < n; ++j)
            for (int64_t i = 0; i < bytes; ++i) {
              in[j * bytes + i] = byte(r, j, i, round);
              want[j * bytes + i] = byte(j, r, i, round);
            }
          std::fill(out.begin(), out.end(), 0xA5);
          std::string what = std::string(dtypeName(dtype)) + " chunk " + std::to_string(chunk) +
                             " round " + std::to_string(round);
          // The last round's buffers are host memory: the host communicator's.
          const bool onHost = round == 2;
          if (!onHost && (!copy(din, in.data(), in.size(), cudaMemcpyHostToDevice) ||
                          !copy(dout, out.data(), out.size(), cudaMemcpyHostToDevice)))
            return "cudaMemcpy failed";
          std::this_thread::sleep_for(std::chrono::milliseconds((r * 7 + round * 3) % 5));
          const int64_t before = comm->bytesSent();
          Status st = onHost ? comm->allToAll(in.data(), out.data(), chunk, dtype, nullptr)
                             : comm->allToAll(din, dout, chunk, dtype, &stream);
          if (st && !onHost && cudaStreamSynchronize(s) != cudaSuccess)
            st = FSDP_ERROR("cudaStreamSynchronize failed");
          if (st)
            st = cuda::takeAsyncCommError();
          if (!st)
            return "all_to_all " + what + " failed: " + st.message();
          if (failure.empty() && !onHost && comm->bytesSent() - before != (n - 1) * bytes)
            failure = "all_to_all " + what + ": bytesSent grew by " +
                      std::to_string(comm->bytesSent() - before);
          if (!onHost && !copy(out.data(), dout, out.size(), cudaMemcpyDeviceToHost))
            return "cudaMemcpy failed";
          auto bad = std::mismatch(out.begin(), out.end(), want.begin());
          if (failure.empty() && bad.first != out.end())
            failure = "all_to_all " + what + ": rank " + std::to_string(r) + " byte " +
                      std::to_string((bad.first - out.begin()) % bytes) + " of rank " +
                      std::to_string((bad.first - out.begin()) / bytes) + "'s chunk is " +
                      std::to_string(*bad.first) + ", expected " + std::to_string(*bad.second);
        }
      }
    }
    cudaFree(din);
    cudaFree(dout);
    cudaStreamDestroy(s);
    return failure;
  });
  ::unsetenv("FSDP_CUDA_COMM");
  ::unsetenv("CUDAEMU_DEVICES");
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaCommEmuTest,
                         ::testing::Combine(::testing::Values("nccl", "staged"),
                                            ::testing::Values(2, 3, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, int>> &i) {
                           return std::get<0>(i.param) + std::to_string(std::get<1>(i.param));
                         });

/// Sends and receives whose sizes disagree fail on every rank, naming the
/// pair, instead of leaving a peer waiting.
TEST(EmuNcclTest, MismatchedSendAndReceiveFailEverywhere) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclResult_t> results(2, ncclSuccess);
  std::string err = runThreads(2, [&](int r) -> std::string {
    ncclComm_t c = nullptr;
    if (ncclCommInitRank(&c, 2, id, r) != ncclSuccess)
      return "ncclCommInitRank failed";
    void *buf = nullptr;
    cudaMalloc(&buf, 64);
    ncclGroupStart();
    ncclSend(buf, r == 0 ? 16 : 8, ncclUint8, 1 - r, c, nullptr);
    ncclRecv(static_cast<char *>(buf) + 32, 8, ncclUint8, 1 - r, c, nullptr);
    results[r] = ncclGroupEnd();
    std::string last = ncclGetLastError(c);
    cudaFree(buf);
    ncclCommDestroy(c);
    if (last.find("rank 0 sends 16 bytes to rank 1, which receives 8 from it") == std::string::npos)
      return "rank " + std::to_string(r) + ": " + last;
    return "";
  });
  EXPECT_EQ(err, "");
  EXPECT_EQ(results[0], ncclInvalidUsage);
  EXPECT_EQ(results[1], ncclInvalidUsage);
}

} // namespace
