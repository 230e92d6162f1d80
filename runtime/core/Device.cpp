//===- Device.cpp - defaults of the device interface ----------------------===//

#include "runtime/core/Device.h"

namespace fsdp {

Status Device::arenaSize(int64_t bytes, bool allocated, size_t &out) {
  if (allocated)
    return FSDP_ERROR("the arena is already allocated");
  if (bytes < 0)
    return FSDP_ERROR("cannot allocate an arena of ", bytes, " bytes");
  int64_t n = bytes > kArenaAlignment ? bytes : kArenaAlignment;
  out = (size_t)((n + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment);
  return Status::ok();
}

Status Device::calibrate(Communicator &, nlohmann::json &) {
  return FSDP_ERROR("--calibrate is not implemented for the ", name(), " device");
}

Status Device::beginCapture() {
  return FSDP_ERROR("device ", name(), " cannot capture a step (CUDA graphs need --device cuda)");
}
Status Device::endCapture(bool) { return FSDP_ERROR("device ", name(), " captures no step"); }
Status Device::stampCompute(int64_t) {
  return FSDP_ERROR("device ", name(), " cannot time its compute stream");
}
Status Device::stampGapMs(int64_t, int64_t, double &) {
  return FSDP_ERROR("device ", name(), " has no timing stamps");
}
Status Device::replay() { return FSDP_ERROR("device ", name(), " has no captured step"); }

} // namespace fsdp

