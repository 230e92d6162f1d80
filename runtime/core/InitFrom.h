//===- InitFrom.h - parameters from a checkpoint on disk --------*- C++ -*-===//
//
// fsdp-run --init-from: a .safetensors file, or a Hugging Face sharded
// checkpoint (model.safetensors.index.json naming the shard file of every
// tensor), read lazily: only the files' headers are read whole, then each
// rank reads the byte range of its own slice of each parameter through a
// bounded buffer, so a rank's host memory does not grow with the model.
// F32, BF16, F16 and F64 tensors load into the f32 parameters as torch's
// load_state_dict (param.copy_) converts them.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_INITFROM_H
#define FSDP_RUNTIME_CORE_INITFROM_H

#include "runtime/core/Executor.h"
#include "runtime/core/SafeTensors.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// The tensors of a checkpoint on disk, by name, without their bytes.
class CheckpointReader {
public:
  /// Opens `path`: a .safetensors file, a Hugging Face index (a `.json`
  /// file {"weight_map": {tensor: shard file}}, shard files relative to
  /// its directory), or a directory holding `model.safetensors.index.json`
  /// or else `model.safetensors`. Reads and checks every header and the
  /// index against the shards (each tensor in the shard the index names,
  /// in no other shard, every shard tensor listed): a bad checkpoint is
  /// an error naming the file and the tensor.
  static Status open(const std::string &path, std::unique_ptr<CheckpointReader> &out);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader &) = delete;
  CheckpointReader &operator=(const CheckpointReader &) = delete;

  struct Entry {
    size_t file = 0; ///< index into files()
    TensorEntry info;
  };
  const std::map<std::string, Entry> &tensors() const { return entries; }
  const std::vector<std::string> &files() const { return paths; }
  /// What the user named (the file, index or directory), for messages.
  const std::string &source() const { return where; }

  /// Elements [first, first + count) of tensor `name` converted to f32
  /// (toF32) into `out`; reads only their bytes, through a buffer of at
  /// most `count` elements (none for F32).
  Status readF32(const std::string &name, int64_t first, int64_t count, float *out);

private:
  CheckpointReader() = default;
  std::string where;
  std::vector<std::string> paths;
  std::vector<int> fds; ///< opened on first read, -1 until then
  std::map<std::string, Entry> entries;
  std::vector<uint8_t> scratch;
};

/// Checks `reader`'s tensors against the plan's parameters as strictly as
/// load_state_dict (a tensor the model lacks, a parameter the checkpoint
/// lacks, another shape, a dtype that is not floating-point: an error
/// naming the tensor and its file), then loads this rank's part of every
/// parameter into `ex` (Executor::loadParams). Every rank reads the same
/// headers, so a bad checkpoint fails every rank alike.
Status loadParamsFrom(CheckpointReader &reader, const Plan &plan, Executor &ex);

/// CheckpointReader::open then loadParamsFrom.
Status initParamsFrom(const std::string &path, const Plan &plan, Executor &ex);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_INITFROM_H
