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

/// A tensor as a header describes it (its bytes follow in header order).
struct TensorMeta {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  int64_t bytes;
};

/// The first bytes of a .safetensors file holding `tensors` in this order
/// (name order, as writeSafeTensors writes a TensorMap): the 8-byte length
/// and the JSON header, padded with spaces to a multiple of 8.
std::string safeTensorsHeader(const std::vector<TensorMeta> &tensors,
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

/// Where one tensor of a .safetensors file lies, without its bytes.
struct TensorEntry {
  /// The header's dtype name ("F32", "BF16", "F64", "I32", ...): any
  /// safetensors dtype, not only the ones plans use.
  std::string dtype;
  int64_t elementSize = 0; ///< bytes per element
  std::vector<int64_t> shape;
  /// Absolute byte offsets in the file: [begin, end) holds the data.
  uint64_t begin = 0, end = 0;
  int64_t numel() const { return (int64_t)((end - begin) / (uint64_t)elementSize); }
};

/// A .safetensors file's header, checked as readSafeTensors checks it.
struct SafeTensorsHeader {
  uint64_t fileSize = 0;
  std::map<std::string, TensorEntry> tensors;
};

/// Reads and checks only the header of a .safetensors file (every check
/// readSafeTensors makes, against the file's size), never its data, so
/// a checkpoint of any size costs its header's bytes. Unlike
/// readSafeTensors it accepts every safetensors dtype (F64, I8, BOOL,
/// ...): what to do with one is the caller's choice.
Status readSafeTensorsHeader(const std::string &path, SafeTensorsHeader &header);
/// The same on a file's first bytes: `prefix` holds at least the 8-byte
/// length and the JSON header (or the whole file), `fileSize` is the
/// whole file's size.
Status parseSafeTensorsHeader(const std::string &name, const std::string &prefix,
                              uint64_t fileSize, SafeTensorsHeader &header);

/// True for the floating-point dtypes toF32 converts (F32, BF16, F16, F64).
bool isFloatSafeTensorsDType(const std::string &dtype);
/// Converts `n` elements of a floating-point dtype (little-endian bytes
/// at `src`, any alignment) to f32 as torch's `copy_` into an f32 tensor
/// does: BF16 and F16 widen exactly, F64 rounds to the nearest f32, F32
/// is copied. An error for any other dtype.
Status toF32(const std::string &dtype, const void *src, int64_t n, float *dst);
/// Reads exactly `n` bytes at `offset` of the open file `fd` (pread: no
/// shared file position); `path` names it in errors, a short read too.
Status readSafeTensorsRange(int fd, const std::string &path, uint64_t offset,
                            void *dst, size_t n);

/// Writes `bytes` to `path` atomically (temp file + fsync + rename).
Status writeFileAtomic(const std::string &path, const std::string &bytes);

/// A span of bytes in memory, one piece of a file being written.
struct Bytes {
  const void *data;
  size_t size;
};

/// Writes the concatenation of `pieces` to `path` atomically, without
/// copying them into one buffer first.
Status writeFileAtomic(const std::string &path, const std::vector<Bytes> &pieces);

/// Writes `n` bytes at `data` to `path` atomically like writeFileAtomic,
/// past the page cache (O_DIRECT) where the file system takes it: `data`
/// must be aligned to kDirectWriteAlign and readable up to `n` rounded up
/// to it (the file is cut back to `n`). Elsewhere (no O_DIRECT, a larger
/// block) the same bytes go through the page cache. `direct` tells which.
constexpr size_t kDirectWriteAlign = 4096;
Status writeFileAtomicDirect(const std::string &path, const void *data, size_t n, bool &direct);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_SAFETENSORS_H
