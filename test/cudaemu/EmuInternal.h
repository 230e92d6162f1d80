//===- EmuInternal.h - the CUDA emulator's own seams ----------------------===//
//
// What EmuRuntime.cpp offers the emulator's other libraries (NCCL,
// cuBLASLt): stream-ordered execution (run now or captured into a graph),
// the allocation registry's pointer check and the sticky error a failed
// kernel leaves.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_TEST_CUDAEMU_EMUINTERNAL_H
#define FSDP_TEST_CUDAEMU_EMUINTERNAL_H

#include <cuda_runtime_api.h>

#include <functional>

namespace cudaemu {
/// Runs op on stream s: now, or appended to the graph s is capturing.
cudaError_t enqueue(cudaStream_t s, std::function<void()> op);
/// Whether an operation enqueued on s now runs before enqueue returns
/// (neither captured nor queued on a stream thread).
bool runsAtIssue(cudaStream_t s);
/// cudaErrorInvalidValue (and a message) unless [p, p + n) lies inside one
/// cudaMalloc / cudaMallocHost allocation.
cudaError_t checkDevicePointer(const void *p, size_t n, const char *what);
void stickyError(cudaError_t e);
cudaError_t takeSticky();
void clearSticky();
} // namespace cudaemu

#endif // FSDP_TEST_CUDAEMU_EMUINTERNAL_H
