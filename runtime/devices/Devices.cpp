//===- Devices.cpp - the backends this binary was built with --------------===//

#include "runtime/devices/Devices.h"

#include "runtime/cpu/CpuDevice.h"
#ifdef FSDP_HAVE_CUDA
#include "runtime/cuda/CudaComm.h"
#include "runtime/cuda/CudaDevice.h"
#endif

namespace fsdp {

std::vector<std::string> deviceNames() { return {"cpu", "cuda"}; }

Status checkDevice(const std::string &name) {
  if (name == "cpu")
    return Status::ok();
  if (name == "cuda") {
#ifdef FSDP_HAVE_CUDA
    return cuda::checkCudaDevice();
#else
    return FSDP_ERROR("--device cuda: this fsdp-run was built without the CUDA "
                      "backend (no CUDA toolkit at build time, or -DFSDP_CUDA=OFF); "
                      "use --device cpu");
#endif
  }
  return FSDP_ERROR("unknown --device '", name, "' (expected cpu or cuda)");
}

Status createDevice(const std::string &name, const DeviceOptions &options,
                    std::unique_ptr<Device> &out) {
  FSDP_RETURN_IF_ERROR(checkDevice(name));
#ifdef FSDP_HAVE_CUDA
  if (name == "cuda")
    return cuda::createCudaDevice(options, out);
#endif
  return cpu::createCpuDevice(options, out);
}

Status deviceCommunicator(const std::string &name, const JobEnv &job, double timeoutSeconds,
                          std::unique_ptr<Communicator> &comm) {
#ifdef FSDP_HAVE_CUDA
  if (name == "cuda") {
    std::unique_ptr<Communicator> wrapped;
    FSDP_RETURN_IF_ERROR(
        cuda::makeCudaCommunicator(job, timeoutSeconds, std::move(comm), wrapped));
    comm = std::move(wrapped);
  }
#endif
  (void)name;
  (void)job;
  (void)timeoutSeconds;
  return Status::ok();
}

} // namespace fsdp
