//===- Device.cpp - defaults of the device interface ----------------------===//

#include "runtime/core/Device.h"

namespace fsdp {

Status Device::calibrate(Communicator &, nlohmann::json &) {
  return FSDP_ERROR("--calibrate is not implemented for the ", name(), " device");
}

} // namespace fsdp
