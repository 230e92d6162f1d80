//===- CpuDevice.h - the CPU implementation of Device -----------*- C++ -*-===//
//
// The arena is host memory (aligned_alloc); instructions run at once on the
// calling thread through Dispatch.h (OpenBLAS, OpenMP); the comm stream is
// one thread working through a queue ([Note: the CPU comm stream] in
// CpuDevice.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CPU_CPUDEVICE_H
#define FSDP_RUNTIME_CPU_CPUDEVICE_H

#include "runtime/core/Device.h"

#include <memory>

namespace fsdp::cpu {

/// A CPU device; `options.threads` > 0 sets the OpenMP and OpenBLAS
/// thread counts of this process.
Status createCpuDevice(const DeviceOptions &options, std::unique_ptr<Device> &out);

} // namespace fsdp::cpu

#endif // FSDP_RUNTIME_CPU_CPUDEVICE_H
