//===- Device.cpp - defaults of the device interface ----------------------===//

#include "runtime/core/Device.h"

#include <algorithm>
#include <vector>

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

Status Device::fillWords(void *dst, uint32_t word, int64_t bytes) {
  std::vector<uint32_t> chunk((size_t)std::min<int64_t>(bytes / 4, 1 << 18), word);
  uint8_t *at = static_cast<uint8_t *>(dst);
  for (int64_t left = bytes / 4 * 4; left > 0;) {
    int64_t n = std::min<int64_t>((int64_t)chunk.size() * 4, left);
    FSDP_RETURN_IF_ERROR(copyToDevice(at, chunk.data(), n));
    at += n;
    left -= n;
  }
  return Status::ok();
}

Status Device::calibrate(Communicator &, nlohmann::json &) {
  return FSDP_ERROR("--calibrate is not implemented for the ", name(), " device");
}

Status Device::beginCapture() {
  return FSDP_ERROR("device ", name(), " cannot capture a step (CUDA graphs need --device cuda)");
}
Status Device::endCapture(bool) { return FSDP_ERROR("device ", name(), " captures no step"); }
Status Device::replay() { return FSDP_ERROR("device ", name(), " has no captured step"); }

} // namespace fsdp

