//===- SafeTensors.cpp - reading and writing .safetensors files -----------===//

#include "runtime/core/SafeTensors.h"

#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace fsdp {

namespace {
const char *stName(DType t) {
  switch (t) {
  case DType::F32:
    return "F32";
  case DType::BF16:
    return "BF16";
  case DType::F16:
    return "F16";
  case DType::I32:
    return "I32";
  case DType::I64:
    return "I64";
  }
  return "F32";
}
bool stParse(const std::string &s, DType &t) {
  static const std::pair<const char *, DType> names[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16},
      {"I32", DType::I32}, {"I64", DType::I64}};
  for (auto &[n, d] : names)
    if (s == n) {
      t = d;
      return true;
    }
  return false;
}
} // namespace

Status writeFileAtomic(const std::string &path, const std::string &bytes) {
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
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
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return FSDP_ERROR("cannot rename '", tmp, "' to '", path, "': ", std::strerror(e));
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
  std::string bytes = ss.str();
  if (bytes.size() < 8)
    return FSDP_ERROR(path, ": truncated safetensors file (no header)");
  uint64_t len;
  std::memcpy(&len, bytes.data(), 8);
  if (len > bytes.size() - 8)
    return FSDP_ERROR(path, ": truncated safetensors file (header of ", len,
                      " bytes, file of ", bytes.size(), ")");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, len));
  } catch (const std::exception &e) {
    return FSDP_ERROR(path, ": corrupt safetensors header: ", e.what());
  }
  size_t dataStart = 8 + len, dataSize = bytes.size() - dataStart;
  try {
    for (auto &[name, v] : header.items()) {
      if (name == "__metadata__")
        continue;
      Tensor t;
      if (!stParse(v.at("dtype").get<std::string>(), t.dtype))
        return FSDP_ERROR(path, ": tensor ", name, " has unsupported dtype ",
                          v.at("dtype").dump());
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      auto offs = v.at("data_offsets").get<std::vector<int64_t>>();
      int64_t n = dtypeSize(t.dtype);
      for (int64_t d : t.shape)
        n *= d;
      if (offs.size() != 2 || offs[0] < 0 || offs[1] < offs[0] ||
          (size_t)offs[1] > dataSize || offs[1] - offs[0] != n)
        return FSDP_ERROR(path, ": tensor ", name,
                          " has data offsets outside the file or of the wrong "
                          "size (truncated file?)");
      t.data.assign(bytes.begin() + dataStart + offs[0],
                    bytes.begin() + dataStart + offs[1]);
      tensors[name] = std::move(t);
    }
  } catch (const std::exception &e) {
    return FSDP_ERROR(path, ": corrupt safetensors header: ", e.what());
  }
  return Status::ok();
}

} // namespace fsdp
