//===- InitFrom.cpp - parameters from a checkpoint on disk ----------------===//

#include "runtime/core/InitFrom.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdp {

namespace {

constexpr const char *kIndexName = "model.safetensors.index.json";
constexpr const char *kSingleName = "model.safetensors";

bool isRegular(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool endsWith(const std::string &s, const std::string &suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shapeStr(const std::vector<int64_t> &s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i)
    r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

/// The weight_map of a Hugging Face index: tensor name -> shard file name.
Status readIndex(const std::string &path, std::map<std::string, std::string> &weightMap) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    return FSDP_ERROR("cannot open the index '", path, "': ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return FSDP_ERROR("the index '", path, "' is not a regular file");
  // An index lists names, not data: a few MB even for the largest models.
  if ((uint64_t)st.st_size > kMaxSafeTensorsHeader)
    return FSDP_ERROR("the index '", path, "' is ", (uint64_t)st.st_size,
                      " bytes, more than the limit of ", kMaxSafeTensorsHeader,
                      " (is it a checkpoint index?)");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return FSDP_ERROR("cannot open the index '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return FSDP_ERROR("cannot read the index '", path, "'");
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(ss.str());
  } catch (const std::exception &e) {
    return FSDP_ERROR("the index '", path, "' is not valid JSON: ", e.what());
  }
  if (!index.is_object())
    return FSDP_ERROR("the index '", path, "': expected a JSON object, found ",
                      index.type_name());
  auto wm = index.find("weight_map");
  if (wm == index.end())
    return FSDP_ERROR("the index '", path, "' has no \"weight_map\" (a Hugging Face "
                      "index maps every tensor to its shard file: {\"weight_map\": "
                      "{\"name\": \"model-00001-of-00002.safetensors\", ...}})");
  if (!wm->is_object())
    return FSDP_ERROR("the index '", path, "': weight_map: expected an object of "
                      "tensor name -> shard file name, found ", wm->type_name());
  for (auto &item : wm->items()) {
    const nlohmann::json &v = item.value();
    if (!v.is_string() || v.get<std::string>().empty())
      return FSDP_ERROR("the index '", path, "': weight_map['", item.key(),
                        "']: expected a shard file name (a non-empty string), found ",
                        v.dump());
    weightMap[item.key()] = v.get<std::string>();
  }
  return Status::ok();
}

} // namespace

CheckpointReader::~CheckpointReader() {
  for (int fd : fds)
    if (fd >= 0)
      ::close(fd);
}

Status CheckpointReader::open(const std::string &path,
                              std::unique_ptr<CheckpointReader> &out) {
  std::unique_ptr<CheckpointReader> r(new CheckpointReader());
  r->where = path;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    return FSDP_ERROR("cannot open '", path, "': ", std::strerror(errno));
  std::string file = path;
  if (S_ISDIR(st.st_mode)) {
    std::string dir = endsWith(path, "/") ? path : path + "/";
    if (isRegular(dir + kIndexName))
      file = dir + kIndexName;
    else if (isRegular(dir + kSingleName))
      file = dir + kSingleName;
    else
      return FSDP_ERROR("the directory '", path, "' holds neither '", kIndexName,
                        "' nor '", kSingleName, "' (a Hugging Face checkpoint "
                        "directory has one of them; or name the .safetensors file "
                        "or the index)");
  }
  if (!endsWith(file, ".json")) {
    SafeTensorsHeader h;
    FSDP_RETURN_IF_ERROR(readSafeTensorsHeader(file, h));
    r->paths.push_back(file);
    for (auto &[name, e] : h.tensors)
      r->entries[name] = Entry{0, e};
    r->fds.assign(1, -1);
    out = std::move(r);
    return Status::ok();
  }

  // A sharded checkpoint: the index names each tensor's shard.
  std::map<std::string, std::string> weightMap;
  FSDP_RETURN_IF_ERROR(readIndex(file, weightMap));
  std::string dir = file.substr(0, file.find_last_of('/') + 1);
  // Shard names are relative to the index's directory (HF writes plain
  // file names); an absolute one is taken as it is.
  auto shardPathOf = [&](const std::string &shard) {
    return shard.front() == '/' ? shard : dir + shard;
  };
  std::map<std::string, std::vector<std::string>> byShard; // shard -> tensors
  for (auto &[name, shard] : weightMap)
    byShard[shard].push_back(name);
  for (auto &[shard, names] : byShard) {
    std::string shardPath = shardPathOf(shard);
    SafeTensorsHeader h;
    Status st = readSafeTensorsHeader(shardPath, h);
    if (!st)
      return FSDP_ERROR("the index '", file, "' maps tensor '", names.front(), "'",
                        names.size() > 1
                            ? " and " + std::to_string(names.size() - 1) + " more"
                            : std::string(),
                        " to the shard '", shard, "': ", st.message());
    size_t id = r->paths.size();
    r->paths.push_back(shardPath);
    for (const std::string &name : names)
      if (!h.tensors.count(name))
        return FSDP_ERROR("the index '", file, "' maps tensor '", name,
                          "' to the shard '", shardPath, "', which has no tensor '",
                          name, "'");
    for (auto &[name, e] : h.tensors) {
      auto it = weightMap.find(name);
      if (it == weightMap.end())
        return FSDP_ERROR("the shard '", shardPath, "' holds tensor '", name,
                          "', which the index '", file, "' does not list in its "
                          "weight_map");
      if (it->second != shard)
        return FSDP_ERROR("tensor '", name, "' is in two shards: '", shardPathOf(it->second),
                          "' (where the index '", file, "' maps it) and '",
                          shardPath, "'");
      r->entries[name] = Entry{id, e};
    }
  }
  r->fds.assign(r->paths.size(), -1);
  out = std::move(r);
  return Status::ok();
}

Status CheckpointReader::readF32(const std::string &name, int64_t first,
                                 int64_t count, float *out) {
  auto it = entries.find(name);
  if (it == entries.end())
    return FSDP_ERROR("'", where, "' has no tensor '", name, "'");
  const Entry &e = it->second;
  const std::string &path = paths[e.file];
  if (first < 0 || count < 0 || first > e.info.numel() - count)
    return FSDP_ERROR("'", path, "': tensor '", name, "': elements [", first, ", ",
                      first + count, ") outside its ", e.info.numel());
  if (count == 0)
    return Status::ok();
  int &fd = fds[e.file];
  if (fd < 0) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return FSDP_ERROR("cannot open '", path, "': ", std::strerror(errno));
  }
  uint64_t offset = e.info.begin + (uint64_t)first * (uint64_t)e.info.elementSize;
  size_t bytes = (size_t)count * (size_t)e.info.elementSize;
  if (e.info.dtype == "F32")
    return readSafeTensorsRange(fd, path, offset, out, bytes);
  scratch.resize(std::max(scratch.size(), bytes));
  FSDP_RETURN_IF_ERROR(readSafeTensorsRange(fd, path, offset, scratch.data(), bytes));
  Status st = toF32(e.info.dtype, scratch.data(), count, out);
  if (!st)
    return FSDP_ERROR("'", path, "': tensor '", name, "': ", st.message());
  return Status::ok();
}

Status loadParamsFrom(CheckpointReader &reader, const Plan &plan, Executor &ex) {
  const auto &tensors = reader.tensors();
  // Name each tensor's file where it is not the one the user named.
  bool sharded = reader.files().size() != 1 || reader.files()[0] != reader.source();
  auto fileOf = [&](const CheckpointReader::Entry &e) { return reader.files()[e.file]; };
  // Strict, like PyTorch's load_state_dict: a tensor the model does not
  // have is as much a sign of the wrong checkpoint as a missing one.
  std::set<std::string> params;
  for (const Param &p : plan.params)
    params.insert(p.name);
  std::string extra;
  int64_t extras = 0;
  for (const auto &[name, e] : tensors)
    if (!params.count(name) && extras++ < 5)
      extra += (extra.empty() ? "'" : ", '") + name + "'" +
               (sharded ? " (in '" + fileOf(e) + "')" : std::string());
  if (extras)
    return FSDP_ERROR("'", reader.source(), "' has ", extras,
                      " tensor(s) the model does not: ", extra, extras > 5 ? ", ..." : "");
  for (const Param &p : plan.params) {
    auto it = tensors.find(p.name);
    if (it == tensors.end())
      return FSDP_ERROR("'", reader.source(), "' has no tensor '", p.name,
                        "' (a parameter of the model)");
    const TensorEntry &t = it->second.info;
    if (!isFloatSafeTensorsDType(t.dtype))
      return FSDP_ERROR("tensor '", p.name, "' has dtype ", t.dtype, " in '",
                        fileOf(it->second), "'; a parameter loads from F32, BF16, F16 "
                        "or F64 only");
    if (t.shape != p.shape)
      return FSDP_ERROR("tensor '", p.name, "' has shape ", shapeStr(t.shape),
                        " and dtype ", t.dtype, " in '", fileOf(it->second),
                        "'; the model's parameter has shape ", shapeStr(p.shape),
                        " and dtype ", dtypeName(p.dtype));
  }
  return ex.loadParams([&](const Param &p, int64_t first, int64_t count, float *out) {
    return reader.readF32(p.name, first, count, out);
  });
}

Status initParamsFrom(const std::string &path, const Plan &plan, Executor &ex) {
  std::unique_ptr<CheckpointReader> reader;
  FSDP_RETURN_IF_ERROR(CheckpointReader::open(path, reader));
  return loadParamsFrom(*reader, plan, ex);
}

} // namespace fsdp
