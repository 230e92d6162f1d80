//===- CudaDevice.h - the CUDA implementation of Device ---------*- C++ -*-===//
//
// One GPU per device: a cudaMalloc arena of the plan's size, a compute
// stream and a high-priority communication stream with cudaEvents between
// them ([Note: streams and events] in runtime/core/Device.h), every compute
// op launched from runtime/cuda/CudaKernels.h or cuBLASLt (CudaGemm.h).
// Host work crosses by explicit copies; the host waits once per step.
//
// Communicators for CUDA buffers (CudaComm.h): NCCL when every rank has a
// GPU of its own, else host-staged Gloo (device -> pinned host -> Gloo ->
// device on the comm stream), which lets N ranks share one GPU: NCCL
// refuses two ranks on one device.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDADEVICE_H
#define FSDP_RUNTIME_CUDA_CUDADEVICE_H

#include "runtime/core/Device.h"

#include <memory>

namespace fsdp::cuda {

/// Ok when a CUDA GPU is usable here; else why not (no driver, no device).
Status checkCudaDevice();

/// A device on GPU `options.localRank` modulo the number of GPUs.
Status createCudaDevice(const DeviceOptions &options, std::unique_ptr<Device> &out);

/// The number of visible GPUs (0 when none or no driver).
int cudaDeviceCount();

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDADEVICE_H
