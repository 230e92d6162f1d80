//===- SafeTensors.h - reading and writing .safetensors files ---*- C++ -*-===//
//
// The format PyTorch users load with safetensors.torch.load_file: an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets}}, then raw little-endian data. Writes are atomic: a
// temporary file in the same directory, fsync, rename.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_SAFETENSORS_H
#define FSDP_RUNTIME_CORE_SAFETENSORS_H

#include "runtime/core/Plan.h"

#include <map>
#include <string>
#include <vector>

namespace fsdp {

struct Tensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

using TensorMap = std::map<std::string, Tensor>;

Status writeSafeTensors(const std::string &path, const TensorMap &tensors,
                        const std::map<std::string, std::string> &metadata = {});
/// Reads a .safetensors file. Every header field is checked (header length
/// within the file and at most kMaxSafeTensorsHeader, a JSON object,
/// dtype / shape / data_offsets of the right types, shape x dtype size
/// equal to the byte range, ranges inside the data section and not
/// overlapping, all without integer overflow): a bad file is an error
/// naming the file, the tensor and the field, never a crash.
Status readSafeTensors(const std::string &path, TensorMap &tensors);
/// The same on the file's bytes; `name` is used in messages (the fuzzer's
/// entry point).
Status parseSafeTensors(const std::string &name, const std::string &bytes,
                        TensorMap &tensors);

/// Upper bound of the JSON header, as in the reference implementation (100 MB).
constexpr uint64_t kMaxSafeTensorsHeader = 100'000'000;

/// Writes `bytes` to `path` atomically (temp file + fsync + rename).
Status writeFileAtomic(const std::string &path, const std::string &bytes);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_SAFETENSORS_H
