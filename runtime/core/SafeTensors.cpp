//===- SafeTensors.cpp - reading and writing .safetensors files -----------===//

#include "runtime/core/SafeTensors.h"

#include "runtime/core/Bf16.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

namespace fsdp {

namespace {
// safetensors' dtype names: PlanSchema.h (kDTypes).
const char *stName(DType t) { return dtypeInfo(t).safetensors.data(); }
bool stParse(const std::string &s, DType &t) { return parseSafetensorsDType(s, t); }
} // namespace

Status writeFileAtomic(const std::string &path, const std::string &bytes) {
  return writeFileAtomic(path, {{bytes.data(), bytes.size()}});
}

namespace {

/// writeFileAtomic and writeFileAtomicDirect: `pieces` into a temporary
/// file, fsync, rename over `path`, fsync of the directory. `direct`: try
/// O_DIRECT (the pieces are aligned), then cut the file to `size`; set to
/// whether the bytes went past the page cache.
Status writeAtomic(const std::string &path, const std::vector<Bytes> &pieces, bool &direct,
                   int64_t size) {
  // Only regular files are written: renaming over a FIFO, a device node or
  // a directory would replace it (or fail late, after all the writing).
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return FSDP_ERROR("'", path, "' exists and is not a regular file; "
                      "refusing to replace it");
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  // O_EXCL | O_NOFOLLOW: never write through a link planted at the name.
  ::unlink(tmp.c_str());
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW;
  int fd = direct ? ::open(tmp.c_str(), flags | O_DIRECT, 0644) : -1;
  if (fd < 0) { // no O_DIRECT here (EINVAL: tmpfs, some FUSE file systems)
    direct = false;
    fd = ::open(tmp.c_str(), flags, 0644);
  }
  if (fd < 0)
    return FSDP_ERROR("cannot create '", tmp, "': ", std::strerror(errno));
  auto fail = [&](const char *what) {
    int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return FSDP_ERROR("cannot ", what, " '", tmp, "': ", std::strerror(e));
  };
  for (const Bytes &piece : pieces) {
    size_t done = 0;
    while (done < piece.size) {
      // Buffered, at most 4 MiB a call: the page cache takes one large
      // write at a third of the rate it takes the same bytes in pieces
      // (measured on the CI machine's ext4: 368 MB/s in 64 MiB writes, 1.2
      // GB/s in 1 MiB). Direct, 16 MiB (aligned; 558 MB/s against 366 in
      // 4 MiB there).
      size_t most = size_t(direct ? 16 : 4) << 20;
      ssize_t w = ::write(fd, static_cast<const char *>(piece.data) + done,
                          std::min(piece.size - done, most));
      if (w < 0 && errno == EINTR)
        continue;
      if (w < 0 && errno == EINVAL && direct) {
        // A device block larger than the alignment: the rest buffered.
        direct = false;
        int fl = ::fcntl(fd, F_GETFL);
        if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
          return fail("write");
        continue;
      }
      if (w < 0)
        return fail("write");
      done += (size_t)w;
    }
  }
  if (size >= 0 && ::ftruncate(fd, size) != 0)
    return fail("truncate");
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return FSDP_ERROR("cannot flush '", tmp, "'");
  }
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    ::unlink(tmp.c_str());
    return FSDP_ERROR("'", path, "' exists and is not a regular file; "
                      "refusing to replace it");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return FSDP_ERROR("cannot rename '", tmp, "' to '", path, "': ", std::strerror(e));
  }
  // The rename is durable once the directory entry is.
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

} // namespace

Status writeFileAtomic(const std::string &path, const std::vector<Bytes> &pieces) {
  bool direct = false;
  return writeAtomic(path, pieces, direct, -1);
}

Status writeFileAtomicDirect(const std::string &path, const void *data, size_t n, bool &direct) {
  if (reinterpret_cast<uintptr_t>(data) % kDirectWriteAlign != 0)
    return FSDP_ERROR("writeFileAtomicDirect: the buffer is not aligned to ", kDirectWriteAlign,
                      " bytes");
  size_t padded = (n + kDirectWriteAlign - 1) / kDirectWriteAlign * kDirectWriteAlign;
  direct = true;
  return writeAtomic(path, {{data, padded}}, direct, (int64_t)n);
}

std::string safeTensorsHeader(const std::vector<TensorMeta> &tensors,
                              const std::map<std::string, std::string> &metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty())
    header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const TensorMeta &t : tensors) {
    header[t.name] = {{"dtype", stName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string h = header.dump();
  while (h.size() % 8)
    h += ' ';
  uint64_t len = h.size();
  return std::string(reinterpret_cast<const char *>(&len), 8) + h;
}

Status writeSafeTensors(const std::string &path, const TensorMap &tensors,
                        const std::map<std::string, std::string> &metadata) {
  std::vector<TensorMeta> metas;
  for (auto &[name, t] : tensors)
    metas.push_back({name, t.dtype, t.shape, (int64_t)t.data.size()});
  std::string h = safeTensorsHeader(metas, metadata);
  // Written piece by piece from the tensors themselves: no second copy of
  // the file in memory (a checkpoint shard can be most of a host's RAM).
  std::vector<Bytes> pieces = {{h.data(), h.size()}};
  for (auto &[name, t] : tensors)
    pieces.push_back({t.data.data(), t.data.size()});
  return writeFileAtomic(path, pieces);
}

namespace {

/// Every dtype a safetensors header may name, with its element size (the
/// reference implementation's list).
struct AnyDType {
  const char *name;
  int64_t bytes;
};
constexpr AnyDType kAnyDTypes[] = {
    {"F64", 8}, {"F32", 4},  {"BF16", 2}, {"F16", 2},     {"F8_E4M3", 1},
    {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
    {"U64", 8}, {"U32", 4},  {"U16", 2},  {"U8", 1},      {"BOOL", 1}};

/// The header length in the first 8 bytes of `bytes` (the file's first
/// bytes), checked against the file's size and the limit.
Status headerLength(const std::string &path, const std::string &bytes,
                    uint64_t fileSize, uint64_t &len) {
  if (fileSize < 8 || bytes.size() < 8)
    return FSDP_ERROR(path, ": truncated safetensors file (", fileSize,
                      " bytes: no 8-byte header length)");
  len = 0;
  for (int i = 7; i >= 0; --i) // little-endian whatever the host
    len = (len << 8) | (uint8_t)bytes[i];
  if (len > fileSize - 8)
    return FSDP_ERROR(path, ": truncated safetensors file (header length ", len,
                      " bytes, file of ", fileSize, ")");
  if (len > kMaxSafeTensorsHeader)
    return FSDP_ERROR(path, ": safetensors header length ", len,
                      " exceeds the limit of ", kMaxSafeTensorsHeader, " bytes");
  if (len < 2)
    return FSDP_ERROR(path, ": safetensors header length ", len,
                      " is too short for a JSON object");
  return Status::ok();
}

/// Checks the JSON header at bytes[8, 8 + len) of a file of `fileSize`
/// bytes. `planDTypes`: only the dtypes a plan has (readSafeTensors'
/// contract: every tensor becomes a Tensor); otherwise any safetensors
/// dtype.
Status parseHeader(const std::string &path, const std::string &bytes,
                   uint64_t fileSize, bool planDTypes, SafeTensorsHeader &out) {
  uint64_t len = 0;
  FSDP_RETURN_IF_ERROR(headerLength(path, bytes, fileSize, len));
  if (bytes.size() < 8 + len)
    return FSDP_ERROR(path, ": internal: the header's ", len, " bytes were not read");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8,
                                   bytes.begin() + 8 + (std::ptrdiff_t)len);
  } catch (const std::exception &e) {
    return FSDP_ERROR(path, ": corrupt safetensors header (not valid JSON): ",
                      e.what());
  }
  if (!header.is_object())
    return FSDP_ERROR(path, ": safetensors header: expected a JSON object, found ",
                      header.type_name());
  const uint64_t dataStart = 8 + len, dataSize = fileSize - dataStart;
  // [begin, end, name] of every tensor, to reject overlapping ranges.
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  SafeTensorsHeader result;
  result.fileSize = fileSize;
  for (auto &item : header.items()) {
    const std::string &name = item.key();
    const nlohmann::json &v = item.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        return FSDP_ERROR(path, ": __metadata__: expected an object, found ",
                          v.type_name());
      continue;
    }
    std::string where = path + ": tensor '" + name + "'";
    if (!v.is_object())
      return FSDP_ERROR(where, ": expected an object, found ", v.type_name());
    auto field = [&](const char *key, const nlohmann::json *&f) -> Status {
      auto it = v.find(key);
      if (it == v.end())
        return FSDP_ERROR(where, ": missing field '", key, "'");
      f = &*it;
      return Status::ok();
    };
    const nlohmann::json *dt = nullptr, *shape = nullptr, *offs = nullptr;
    FSDP_RETURN_IF_ERROR(field("dtype", dt));
    FSDP_RETURN_IF_ERROR(field("shape", shape));
    FSDP_RETURN_IF_ERROR(field("data_offsets", offs));
    TensorEntry t;
    if (dt->is_string()) {
      std::string s = dt->get<std::string>();
      DType planType;
      for (const AnyDType &a : kAnyDTypes)
        if (s == a.name && (!planDTypes || stParse(s, planType))) {
          t.dtype = s;
          t.elementSize = a.bytes;
        }
    }
    if (t.elementSize == 0)
      return FSDP_ERROR(where, ": dtype: unsupported ", dt->dump(),
                        planDTypes ? " (expected F32, BF16, F16, I32 or I64)"
                                   : " (not a safetensors dtype)");
    if (!shape->is_array())
      return FSDP_ERROR(where, ": shape: expected an array, found ",
                        shape->type_name());
    // Bytes the shape needs, without overflow: every dimension a
    // non-negative integer, the product bounded by the data section.
    uint64_t need = (uint64_t)t.elementSize;
    bool tooBig = false;
    for (size_t d = 0; d < shape->size(); ++d) {
      const nlohmann::json &x = (*shape)[d];
      if (!x.is_number_unsigned()) // integers >= 0 parse as unsigned
        return FSDP_ERROR(where, ": shape[", d, "]: expected a non-negative "
                          "integer, found ", x.dump());
      uint64_t dim = x.get<uint64_t>();
      if (dim > (uint64_t)INT64_MAX)
        return FSDP_ERROR(where, ": shape[", d, "]: ", dim, " is too large");
      t.shape.push_back((int64_t)dim);
      if (dim == 0)
        need = 0;
      else if (need != 0 && need > dataSize / dim)
        tooBig = true; // keep checking the other dimensions' types
      else
        need *= dim;
    }
    if (tooBig && need != 0)
      return FSDP_ERROR(where, ": shape ", shape->dump(), " of ", dt->dump(),
                        " needs more than the ", dataSize, " bytes of the "
                        "file's data section (truncated file?)");
    if (!offs->is_array() || offs->size() != 2)
      return FSDP_ERROR(where, ": data_offsets: expected [begin, end], found ",
                        offs->dump());
    uint64_t be[2];
    for (int k = 0; k < 2; ++k) {
      const nlohmann::json &x = (*offs)[k];
      if (!x.is_number_unsigned())
        return FSDP_ERROR(where, ": data_offsets[", k, "]: expected a "
                          "non-negative integer, found ", x.dump());
      be[k] = x.get<uint64_t>();
    }
    if (be[0] > be[1])
      return FSDP_ERROR(where, ": data_offsets: begin ", be[0], " exceeds end ",
                        be[1]);
    if (be[1] > dataSize)
      return FSDP_ERROR(where, ": data_offsets: end ", be[1], " is past the data "
                        "section of ", dataSize, " bytes (truncated file?)");
    if (be[1] - be[0] != need)
      return FSDP_ERROR(where, ": data_offsets: ", be[1] - be[0], " bytes, but "
                        "shape ", shape->dump(), " of ", dt->dump(), " needs ", need);
    // Both ends are within the file: dataStart + be[1] <= fileSize.
    t.begin = dataStart + be[0];
    t.end = dataStart + be[1];
    ranges.emplace_back(be[0], be[1], name);
    result.tensors[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (std::get<0>(ranges[i]) < std::get<1>(ranges[i - 1]))
      return FSDP_ERROR(path, ": tensors '", std::get<2>(ranges[i - 1]), "' and '",
                        std::get<2>(ranges[i]), "': data_offsets overlap");
  out = std::move(result);
  return Status::ok();
}

/// Reads exactly `n` bytes at `offset` (pread: no shared file position).
Status preadAll(int fd, const std::string &path, uint64_t offset, void *dst,
                size_t n) {
  auto *p = static_cast<uint8_t *>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, (off_t)offset);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return FSDP_ERROR("cannot read '", path, "': ", std::strerror(errno));
    if (r == 0)
      return FSDP_ERROR("cannot read '", path, "': the file ended at byte ", offset,
                        " (was it truncated while being read?)");
    p += r;
    offset += (uint64_t)r;
    n -= (size_t)r;
  }
  return Status::ok();
}

} // namespace

Status readSafeTensors(const std::string &path, TensorMap &tensors) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return FSDP_ERROR("cannot open '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return FSDP_ERROR("cannot read '", path, "'");
  return parseSafeTensors(path, ss.str(), tensors);
}

Status parseSafeTensors(const std::string &path, const std::string &bytes,
                        TensorMap &tensors) {
  SafeTensorsHeader header;
  FSDP_RETURN_IF_ERROR(parseHeader(path, bytes, bytes.size(), /*planDTypes=*/true,
                                   header));
  TensorMap out;
  for (auto &[name, e] : header.tensors) {
    Tensor t;
    stParse(e.dtype, t.dtype); // one of the plan's: parseHeader checked
    t.shape = e.shape;
    t.data.assign(bytes.begin() + (std::ptrdiff_t)e.begin,
                  bytes.begin() + (std::ptrdiff_t)e.end);
    out[name] = std::move(t);
  }
  for (auto &[name, t] : out)
    tensors[name] = std::move(t);
  return Status::ok();
}

Status parseSafeTensorsHeader(const std::string &name, const std::string &prefix,
                              uint64_t fileSize, SafeTensorsHeader &header) {
  if (prefix.size() > fileSize)
    return FSDP_ERROR(name, ": internal: ", prefix.size(), " bytes read from a file of ",
                      fileSize);
  return parseHeader(name, prefix, fileSize, /*planDTypes=*/false, header);
}

Status readSafeTensorsHeader(const std::string &path, SafeTensorsHeader &header) {
  // O_NONBLOCK: a FIFO named by mistake is refused below, not waited on
  // (it changes nothing for a regular file).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return FSDP_ERROR("cannot open '", path, "': ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0)
    return FSDP_ERROR("cannot stat '", path, "': ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return FSDP_ERROR("'", path, "' is not a regular file (a .safetensors file "
                      "was expected)");
  uint64_t fileSize = (uint64_t)st.st_size;
  // The length first: a hostile one must not size an allocation before
  // it is checked against the file and the limit.
  std::string prefix(std::min<uint64_t>(fileSize, 8), '\0');
  FSDP_RETURN_IF_ERROR(preadAll(fd, path, 0, prefix.data(), prefix.size()));
  uint64_t len = 0;
  FSDP_RETURN_IF_ERROR(headerLength(path, prefix, fileSize, len));
  prefix.resize(8 + len);
  FSDP_RETURN_IF_ERROR(preadAll(fd, path, 8, prefix.data() + 8, len));
  return parseHeader(path, prefix, fileSize, /*planDTypes=*/false, header);
}

bool isFloatSafeTensorsDType(const std::string &dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64";
}

Status toF32(const std::string &dtype, const void *src, int64_t n, float *dst) {
  const auto *b = static_cast<const uint8_t *>(src);
  if (dtype == "F32") {
    std::memcpy(dst, b, (size_t)n * 4);
  } else if (dtype == "BF16" || dtype == "F16") {
    bool bf = dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      dst[i] = bf ? widenBf16(h) : widenHalf(h);
    }
  } else if (dtype == "F64") {
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, b + 8 * i, 8);
      // Nearest, as torch's copy_; beyond float's range the IEEE result
      // (FLT_MAX below the halfway point to 2^128, else inf) explicitly,
      // since a C++ conversion of an unrepresentable value is undefined.
      if (std::fabs(d) > (double)FLT_MAX && !std::isinf(d))
        dst[i] = std::copysign(std::fabs(d) >= 0x1.ffffffp127 ? INFINITY : FLT_MAX, d);
      else
        dst[i] = static_cast<float>(d);
    }
  } else {
    return FSDP_ERROR("cannot convert dtype ", dtype, " to f32 (a floating-point "
                      "dtype was expected: F32, BF16, F16 or F64)");
  }
  return Status::ok();
}

Status readSafeTensorsRange(int fd, const std::string &path, uint64_t offset,
                            void *dst, size_t n) {
  return preadAll(fd, path, offset, dst, n);
}

} // namespace fsdp
