//===- SafeTensors.cpp - reading and writing .safetensors files -----------===//

#include "runtime/core/SafeTensors.h"

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace fsdp {

namespace {
// safetensors' dtype names: PlanSchema.h (kDTypes).
const char *stName(DType t) { return dtypeInfo(t).safetensors.data(); }
bool stParse(const std::string &s, DType &t) { return parseSafetensorsDType(s, t); }
} // namespace

Status writeFileAtomic(const std::string &path, const std::string &bytes) {
  // Only regular files are written: renaming over a FIFO, a device node or
  // a directory would replace it (or fail late, after all the writing).
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return FSDP_ERROR("'", path, "' exists and is not a regular file; "
                      "refusing to replace it");
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  // O_EXCL | O_NOFOLLOW: never write through a link planted at the name.
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
  if (fd < 0)
    return FSDP_ERROR("cannot create '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return FSDP_ERROR("cannot write '", tmp, "': ", std::strerror(e));
    }
    done += (size_t)w;
  }
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

Status writeSafeTensors(const std::string &path, const TensorMap &tensors,
                        const std::map<std::string, std::string> &metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty())
    header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (auto &[name, t] : tensors) {
    header[name] = {{"dtype", stName(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + (int64_t)t.data.size()}}};
    offset += (int64_t)t.data.size();
  }
  std::string h = header.dump();
  while (h.size() % 8)
    h += ' ';
  std::string out;
  uint64_t len = h.size();
  out.append(reinterpret_cast<const char *>(&len), 8);
  out += h;
  for (auto &[name, t] : tensors)
    out.append(reinterpret_cast<const char *>(t.data.data()), t.data.size());
  return writeFileAtomic(path, out);
}

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
  if (bytes.size() < 8)
    return FSDP_ERROR(path, ": truncated safetensors file (", bytes.size(),
                      " bytes: no 8-byte header length)");
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) // little-endian whatever the host
    len = (len << 8) | (uint8_t)bytes[i];
  if (len > bytes.size() - 8)
    return FSDP_ERROR(path, ": truncated safetensors file (header length ", len,
                      " bytes, file of ", bytes.size(), ")");
  if (len > kMaxSafeTensorsHeader)
    return FSDP_ERROR(path, ": safetensors header length ", len,
                      " exceeds the limit of ", kMaxSafeTensorsHeader, " bytes");
  if (len < 2)
    return FSDP_ERROR(path, ": safetensors header length ", len,
                      " is too short for a JSON object");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + len);
  } catch (const std::exception &e) {
    return FSDP_ERROR(path, ": corrupt safetensors header (not valid JSON): ",
                      e.what());
  }
  if (!header.is_object())
    return FSDP_ERROR(path, ": safetensors header: expected a JSON object, found ",
                      header.type_name());
  const uint64_t dataStart = 8 + len, dataSize = bytes.size() - dataStart;
  // [begin, end, name] of every tensor, to reject overlapping ranges.
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  TensorMap out;
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
    Tensor t;
    if (!dt->is_string() || !stParse(dt->get<std::string>(), t.dtype))
      return FSDP_ERROR(where, ": dtype: unsupported ", dt->dump(),
                        " (expected F32, BF16, F16, I32 or I64)");
    if (!shape->is_array())
      return FSDP_ERROR(where, ": shape: expected an array, found ",
                        shape->type_name());
    // Bytes the shape needs, without overflow: every dimension a
    // non-negative integer, the product bounded by the data section.
    uint64_t need = (uint64_t)dtypeSize(t.dtype);
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
    t.data.assign(bytes.begin() + (std::ptrdiff_t)(dataStart + be[0]),
                  bytes.begin() + (std::ptrdiff_t)(dataStart + be[1]));
    ranges.emplace_back(be[0], be[1], name);
    out[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (std::get<0>(ranges[i]) < std::get<1>(ranges[i - 1]))
      return FSDP_ERROR(path, ": tensors '", std::get<2>(ranges[i - 1]), "' and '",
                        std::get<2>(ranges[i]), "': data_offsets overlap");
  for (auto &[name, t] : out)
    tensors[name] = std::move(t);
  return Status::ok();
}

} // namespace fsdp
