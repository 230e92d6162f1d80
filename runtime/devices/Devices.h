//===- Devices.h - the backends this binary was built with ------*- C++ -*-===//
//
// The one place that knows every backend (IREE's driver registry): tools
// ask it for a device by name; core never includes a backend header.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_DEVICES_DEVICES_H
#define FSDP_RUNTIME_DEVICES_DEVICES_H

#include "runtime/comm/JobEnv.h"
#include "runtime/core/Comm.h"
#include "runtime/core/Device.h"

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// Device names fsdp-run accepts (--device), built in or not.
std::vector<std::string> deviceNames();

/// Whether createDevice(name) can succeed here, without creating it (a
/// launcher checks before starting ranks).
Status checkDevice(const std::string &name);

/// The device named `name` ("cpu", "cuda"). An unknown name, a backend this
/// binary was built without, or one with no usable hardware is an error
/// saying which.
Status createDevice(const std::string &name, const DeviceOptions &options,
                    std::unique_ptr<Device> &out);

/// The communicator for device `name`'s buffers, made from the job's host
/// (Gloo) communicator: unchanged for cpu; NCCL or host-staged Gloo for
/// cuda (runtime/cuda/CudaComm.h). Call after createDevice (NCCL binds
/// the current GPU).
Status deviceCommunicator(const std::string &name, const JobEnv &job, double timeoutSeconds,
                          std::unique_ptr<Communicator> &comm);

} // namespace fsdp

#endif // FSDP_RUNTIME_DEVICES_DEVICES_H
