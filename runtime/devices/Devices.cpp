//===- Devices.cpp - the backends this binary was built with --------------===//

#include "runtime/devices/Devices.h"

#include "runtime/cpu/CpuDevice.h"

namespace fsdp {

std::vector<std::string> deviceNames() { return {"cpu", "cuda"}; }

Status checkDevice(const std::string &name) {
  if (name == "cpu")
    return Status::ok();
  if (name == "cuda")
    // runtime/cuda/ registers here once it exists (FSDP_HAVE_CUDA).
    return FSDP_ERROR("--device cuda: this fsdp-run was built without the CUDA "
                      "backend (runtime/cuda/ is not implemented yet); use --device cpu");
  return FSDP_ERROR("unknown --device '", name, "' (expected cpu or cuda)");
}

Status createDevice(const std::string &name, const DeviceOptions &options,
                    std::unique_ptr<Device> &out) {
  FSDP_RETURN_IF_ERROR(checkDevice(name));
  return cpu::createCpuDevice(options, out);
}

} // namespace fsdp
