//===- Checkpoint.cpp - sharded training-state checkpoints ----------------===//
//
// [Note: what a checkpoint holds] A step reads the persistent buffers the
// previous step wrote and nothing else: parameter storage (a unit's shard,
// its whole flat buffer, or a parameter's own buffer) and optimizer state.
// Inputs are refilled every step from the step number (synthetic data and
// token files both index by step), and transient buffers are written before
// they are read within a step. So saving every persistent buffer that is
// not an input, byte for byte, and the step number makes a resumed run
// bitwise identical to an uninterrupted one on the same plan and machine.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Checkpoint.h"

#include "runtime/core/Bf16.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>

namespace fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char *kCommitFile = "COMMIT";
constexpr const char *kIndexFile = "index.json";

std::string stepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", (long long)step);
  return buf;
}

std::string rankFileName(int64_t rank, int64_t world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05lld-of-%05lld.safetensors", (long long)rank,
                (long long)world);
  return buf;
}

/// The buffers a checkpoint holds: see [Note: what a checkpoint holds].
std::vector<int64_t> savedBuffers(const Plan &plan) {
  std::vector<int64_t> ids;
  for (const Buffer &b : plan.buffers)
    if (b.persistent && b.aliasOf < 0 && b.kind != BufferKind::Input && b.bytes > 0)
      ids.push_back(b.id);
  return ids;
}

std::string tensorName(const Buffer &b) {
  return "b" + std::to_string(b.id) + "." + b.name;
}

Status makeDirs(const std::string &dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return FSDP_ERROR("cannot create checkpoint directory '", dir, "': ", ec.message());
  return Status::ok();
}

/// Fault injection for the killed-during-save test: FSDP_FAULT_KILL_RANK=r
/// and FSDP_FAULT_KILL_SAVE_STEP=s make rank r die after writing its file of
/// the step-s checkpoint, before the commit.
void maybeDieDuringSave(int64_t rank, int64_t step) {
  const char *r = std::getenv("FSDP_FAULT_KILL_RANK");
  const char *s = std::getenv("FSDP_FAULT_KILL_SAVE_STEP");
  if (r && s && std::atoll(r) == rank && std::atoll(s) == step)
    std::raise(SIGKILL);
}

json shardMap(const Plan &plan) {
  json buffers = json::array(), units = json::array(), params = json::array();
  for (int64_t id : savedBuffers(plan)) {
    const Buffer &b = plan.buffers[id];
    buffers.push_back({{"id", b.id},
                       {"name", b.name},
                       {"tensor", tensorName(b)},
                       {"kind", bufferKindName(b.kind)},
                       {"dtype", dtypeName(b.dtype)},
                       {"shape", b.shape},
                       {"bytes", b.bytes}});
  }
  for (const Unit &u : plan.units)
    units.push_back({{"name", u.name},
                     {"buffer", u.buffer},
                     {"sharded", u.sharded},
                     {"flat_numel", u.flatNumel},
                     {"padded_numel", u.paddedNumel},
                     {"shard_numel", u.shardNumel}});
  for (const Param &p : plan.params)
    params.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"dtype", dtypeName(p.dtype)},
                      {"unit", p.unit},
                      {"flat_offset", p.flatOffset},
                      {"buffer", p.buffer}});
  json states = json::array();
  for (const State &st : plan.states)
    states.push_back({{"name", st.name},
                      {"kind", st.kind},
                      {"unit", st.unit},
                      {"param", st.param},
                      {"buffer", st.buffer}});
  return {{"buffers", buffers}, {"units", units}, {"params", params}, {"states", states}};
}

json makeIndex(const Plan &plan, const TrainingPosition &position) {
  json files = json::array();
  for (int64_t r = 0; r < plan.worldSize; ++r)
    files.push_back(rankFileName(r, plan.worldSize));
  json index = {{"format", "fsdp-checkpoint"},
          {"version", kCheckpointVersion},
          {"model", plan.model},
          {"world_size", plan.worldSize},
          {"mesh", {plan.meshReplicas, plan.meshShards}},
          {"stage", plan.stage},
          {"step", position.step},
          {"seed", std::to_string(position.seed)},
          {"schedule", position.schedule},
          {"data", {{"spec", position.data}, {"next_step", position.step + 1}}},
          {"files", files},
          {"shard_map", shardMap(plan)}};
  if (!position.lossScale.is_null())
    index["loss_scale"] = position.lossScale;
  return index;
}

/// Index and COMMIT, in that order: the checkpoint is complete after this.
Status commit(const std::string &path, const json &index, int64_t step) {
  FSDP_RETURN_IF_ERROR(writeFileAtomic(path + "/" + kIndexFile, index.dump(1)));
  return writeFileAtomic(path + "/" + kCommitFile, std::to_string(step) + "\n");
}

} // namespace

namespace {

/// Save, step 1 (every rank): rank 0 replaces a leftover of a save that died
/// (no COMMIT) with an empty directory; the barrier after it lets every
/// rank write into it.
Status prepareStepDir(const std::string &path, Communicator &comm) {
  if (comm.rank() == 0) {
    std::error_code ec;
    if (fs::exists(path, ec) && !fs::exists(path + "/" + kCommitFile, ec))
      fs::remove_all(path, ec);
    FSDP_RETURN_IF_ERROR(makeDirs(path));
  }
  return comm.barrier();
}

/// Save, step 2 (synchronous saves): this rank's saved buffers, copied to
/// host memory. --async-save stages into its file image instead
/// (AsyncCheckpointer::stage).
Status snapshot(const Plan &plan, Executor &ex, TensorMap &mine) {
  for (int64_t id : savedBuffers(plan)) {
    const Buffer &b = plan.buffers[id];
    Tensor &t = mine[tensorName(b)];
    t.dtype = b.dtype;
    t.shape = b.shape;
    t.data.resize(b.bytes);
    FSDP_RETURN_IF_ERROR(ex.readBuffer(id, t.data.data()));
  }
  return Status::ok();
}

/// Fault injection for the asynchronous-save test: FSDP_FAULT_SLOW_SAVE_MS=t
/// delays every rank's file by t ms, so that the steps after the save run
/// while it is written (the snapshot must not change under them).
void maybeSlowSave() {
  if (const char *t = std::getenv("FSDP_FAULT_SLOW_SAVE_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(t)));
}

/// Fault injection for the failed-background-write test:
/// FSDP_FAULT_SAVE_ERROR_RANK=r makes rank r's asynchronous writes fail.
bool injectedSaveFailure(int64_t rank) {
  const char *r = std::getenv("FSDP_FAULT_SAVE_ERROR_RANK");
  return r && std::atoll(r) == rank;
}

/// The metadata of a rank's file.
std::map<std::string, std::string> shardMetadata(int64_t step) {
  return {{"format", "fsdp-checkpoint-shard"}, {"step", std::to_string(step)}};
}

/// Save, step 3: this rank's file, durable when this returns (fsync, rename,
/// fsync of the directory).
Status writeRankFile(const std::string &path, int64_t rank, int64_t world, int64_t step,
                     const TensorMap &mine) {
  maybeSlowSave();
  return writeSafeTensors(path + "/" + rankFileName(rank, world), mine, shardMetadata(step));
}

/// Save, step 4 (rank 0, once every rank's file is durable): the index and
/// COMMIT, then retention: the newest `keep` committed checkpoints stay;
/// older ones and uncommitted leftovers older than this one go.
Status commitAndRetain(const std::string &dir, const std::string &path, int64_t keep,
                       const json &index, int64_t step) {
  FSDP_RETURN_IF_ERROR(commit(path, index, step));
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto &e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    long long s;
    char tail;
    if (!e.is_directory() || std::sscanf(name.c_str(), "step-%lld%c", &s, &tail) != 1)
      continue;
    bool committed = fs::exists(e.path() / kCommitFile);
    if (!committed && s < step)
      fs::remove_all(e.path(), ec);
    else if (committed)
      found.push_back({s, e.path().string()});
  }
  std::sort(found.rbegin(), found.rend());
  if (keep > 0)
    for (size_t i = (size_t)keep; i < found.size(); ++i)
      fs::remove_all(found[i].second, ec);
  return Status::ok();
}

/// The marker a rank whose background write failed leaves beside its file,
/// holding the error: rank 0 stops waiting for that file and reports it.
std::string failedMarker(const std::string &rankFile) { return rankFile + ".failed"; }

} // namespace

Status saveCheckpoint(const std::string &dir, int64_t keep, const Plan &plan, Executor &ex,
                      Communicator &comm, const TrainingPosition &position) {
  std::string path = dir + "/" + stepDirName(position.step);
  FSDP_RETURN_IF_ERROR(prepareStepDir(path, comm));
  TensorMap mine;
  FSDP_RETURN_IF_ERROR(snapshot(plan, ex, mine));
  FSDP_RETURN_IF_ERROR(writeRankFile(path, comm.rank(), comm.size(), position.step, mine));
  maybeDieDuringSave(comm.rank(), position.step);
  // [Note: commit] Every rank's file is renamed into place (and fsynced)
  // before the barrier; only then does rank 0 write the index and COMMIT.
  FSDP_RETURN_IF_ERROR(comm.barrier());
  if (comm.rank() != 0)
    return Status::ok();
  return commitAndRetain(dir, path, keep, makeIndex(plan, position), position.step);
}

// [Note: async save] AsyncCheckpointer::save blocks the training thread
// only for what must see the state of this step: the directory and its
// barrier, and the snapshot of this rank's buffers into host memory. A
// thread then writes the rank's file (as saveCheckpoint does), and on rank
// 0 waits for every rank's file to be durable before the index and COMMIT.
// That wait cannot be a barrier: the training thread owns the communicator
// and every collective must be issued in the same order on every rank
// (Comm.h), so a second thread's barrier would interleave with the step's
// collectives differently on each rank. The ranks meet in the checkpoint's
// directory instead, which they already share (rank 0 writes the index of
// every rank's file there): a rank's file appears under its name only by a
// rename after fsync, so its presence means it is durable, and a rank whose
// write failed leaves `<file>.failed` with the error, which rank 0 reports.
// One save is in flight at a time: the next save (and finish, at the end
// of training) first waits for the one before. A rank that dies mid-save
// leaves no COMMIT (rank 0 waits; the launcher stops the job, or the
// training thread's next collective fails and the wait is cancelled), so
// the previous checkpoint stays the newest complete one, as with a
// synchronous save.

AsyncCheckpointer::~AsyncCheckpointer() {
  {
    std::lock_guard<std::mutex> lock(mu);
    cancelled = true;
  }
  wake.notify_all();
  if (worker.joinable())
    worker.join();
  releaseImage();
}

void AsyncCheckpointer::releaseImage() {
  if (pinnedOn && image)
    (void)pinnedOn->unpinHost(image.get());
  pinnedOn = nullptr;
  image.reset();
  imageCapacity = 0;
}

Status AsyncCheckpointer::join() {
  if (worker.joinable())
    worker.join();
  Status st = std::move(result);
  result = Status::ok();
  return st;
}

Status AsyncCheckpointer::save(const std::string &dir, int64_t keep, const Plan &plan, Executor &ex,
                               Communicator &comm, const TrainingPosition &position) {
  auto t = std::chrono::steady_clock::now();
  FSDP_RETURN_IF_ERROR(join());
  waitMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  std::string path = dir + "/" + stepDirName(position.step);
  FSDP_RETURN_IF_ERROR(prepareStepDir(path, comm));
  // The staging copy stays allocated for the run (as DCP's cached staging
  // does): the thread below is done with it (joined above).
  FSDP_RETURN_IF_ERROR(stage(plan, ex, position.step));
  int64_t rank = comm.rank(), world = comm.size(), step = position.step;
  json index = rank == 0 ? makeIndex(plan, position) : json();
  worker = std::thread([this, dir, path, keep, rank, world, step, index = std::move(index)] {
    result = writeInBackground(dir, path, keep, rank, world, step, index);
  });
  return Status::ok();
}

Status AsyncCheckpointer::stage(const Plan &plan, Executor &ex, int64_t step) {
  // The file a synchronous save writes (writeSafeTensors of a TensorMap:
  // tensors in name order), laid out in one buffer as it will be on disk,
  // aligned for O_DIRECT.
  std::map<std::string, int64_t> byName;
  for (int64_t id : savedBuffers(plan))
    byName[tensorName(plan.buffers[id])] = id;
  std::vector<TensorMeta> metas;
  size_t bytes = 0;
  for (auto &[name, id] : byName) {
    const Buffer &b = plan.buffers[id];
    metas.push_back({name, b.dtype, b.shape, b.bytes});
    bytes += (size_t)b.bytes;
  }
  std::string header = safeTensorsHeader(metas, shardMetadata(step));
  imageBytes = header.size() + bytes;
  size_t padded = (imageBytes + kDirectWriteAlign - 1) / kDirectWriteAlign * kDirectWriteAlign;
  if (padded > imageCapacity) {
    releaseImage();
    // In 2 MiB pages where the kernel has them (transparent huge pages on
    // madvise): the first snapshot faults each page in, 512 times fewer.
    constexpr size_t kHuge = size_t(2) << 20;
    size_t alloc = (padded + kHuge - 1) / kHuge * kHuge;
    image.reset(static_cast<uint8_t *>(std::aligned_alloc(kHuge, alloc)));
    if (!image)
      return FSDP_ERROR("--async-save: cannot allocate ", alloc,
                        " bytes of host memory for the checkpoint's staging copy");
    imageCapacity = alloc;
    (void)::madvise(image.get(), alloc, MADV_HUGEPAGE);
    // Page-locked for the device's copies into it (a GPU's DMA at the
    // link's rate; nothing on CPU ranks). Not fatal: pageable works, slower.
    if (ex.device().pinHost(image.get(), (int64_t)alloc))
      pinnedOn = &ex.device();
  }
  std::memcpy(image.get(), header.data(), header.size());
  std::memset(image.get() + imageBytes, 0, padded - imageBytes); // the block's tail
  size_t at = header.size();
  for (auto &[name, id] : byName) {
    FSDP_RETURN_IF_ERROR(ex.readBuffer(id, image.get() + at));
    at += (size_t)plan.buffers[id].bytes;
  }
  return Status::ok();
}

Status AsyncCheckpointer::writeInBackground(const std::string &dir, const std::string &path,
                                            int64_t keep, int64_t rank, int64_t world, int64_t step,
                                            const json &index) {
  std::string file = path + "/" + rankFileName(rank, world);
  maybeSlowSave();
  Status st =
      injectedSaveFailure(rank)
          ? FSDP_ERROR("cannot write '", file, "': injected failure (FSDP_FAULT_SAVE_ERROR_RANK)")
          : writeFileAtomicDirect(file, image.get(), imageBytes, direct);
  if (!st) {
    (void)writeFileAtomic(failedMarker(file), st.message() + "\n");
    return st;
  }
  maybeDieDuringSave(rank, step);
  if (rank != 0)
    return Status::ok();
  for (int64_t r = 0; r < world; ++r) {
    std::string other = path + "/" + rankFileName(r, world);
    for (;;) {
      std::error_code ec;
      if (fs::exists(other, ec))
        break;
      if (fs::exists(failedMarker(other), ec)) {
        std::ifstream in(failedMarker(other));
        std::string why((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        while (!why.empty() && why.back() == '\n')
          why.pop_back();
        return FSDP_ERROR("checkpoint ", path, " not committed: rank ", r,
                          " could not write its file: ", why);
      }
      std::unique_lock<std::mutex> lock(mu);
      if (wake.wait_for(lock, std::chrono::milliseconds(10), [&] { return cancelled; }))
        return FSDP_ERROR("checkpoint ", path, " not committed: the run stopped before rank ", r,
                          "'s file was written");
    }
  }
  return commitAndRetain(dir, path, keep, index, step);
}

Status AsyncCheckpointer::finish(Communicator &comm) {
  if (!worker.joinable())
    return join();
  // Every rank reaches this point alive (the barrier fails on a dead or
  // stalled peer, FSDP_COMM_TIMEOUT_S) before rank 0 waits for the files.
  Status alive = comm.barrier();
  if (!alive) {
    std::lock_guard<std::mutex> lock(mu);
    cancelled = true;
    wake.notify_all();
  }
  Status st = join();
  FSDP_RETURN_IF_ERROR(alive);
  return st;
}

Status latestCheckpoint(const std::string &dir, std::string &path) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return FSDP_ERROR("--resume: '", dir, "' is not a directory");
  if (fs::exists(fs::path(dir) / kCommitFile, ec)) {
    path = dir;
    return Status::ok();
  }
  int64_t best = -1;
  for (const auto &e : fs::directory_iterator(dir, ec)) {
    long long s;
    char tail;
    std::string name = e.path().filename().string();
    if (e.is_directory() && std::sscanf(name.c_str(), "step-%lld%c", &s, &tail) == 1 &&
        fs::exists(e.path() / kCommitFile) && s > best) {
      best = s;
      path = e.path().string();
    }
  }
  if (best < 0)
    return FSDP_ERROR("--resume: no complete checkpoint in '", dir,
                      "' (a checkpoint is complete once its COMMIT file exists)");
  return Status::ok();
}

Status readCheckpointIndex(const std::string &path, json &index) {
  std::string file = path + "/" + kIndexFile;
  std::ifstream in(file, std::ios::binary);
  if (!in)
    return FSDP_ERROR("checkpoint '", path, "' has no ", kIndexFile);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    index = json::parse(ss.str());
  } catch (const std::exception &e) {
    return FSDP_ERROR(file, ": not valid JSON: ", e.what());
  }
  // Shape of the index, checked once so readers below can trust it.
  auto bad = [&](const char *what) {
    return FSDP_ERROR(file, ": ", what, " (not an index written by fsdp-run?)");
  };
  if (!index.is_object() || index.value("format", json()) != "fsdp-checkpoint")
    return bad("format is not \"fsdp-checkpoint\"");
  if (!index["version"].is_number_integer() || index["version"] != kCheckpointVersion)
    return bad("unsupported version");
  for (const char *k : {"world_size", "stage", "step"})
    if (!index[k].is_number_integer() || index[k].get<int64_t>() < 0)
      return bad((std::string("bad ") + k).c_str());
  if (index["world_size"].get<int64_t>() < 1 || index["world_size"].get<int64_t>() > (1 << 16))
    return bad("bad world_size");
  json &files = index["files"];
  if (!files.is_array() || (int64_t)files.size() != index["world_size"].get<int64_t>())
    return bad("files must list one file per rank");
  for (const json &f : files)
    if (!f.is_string() || f.get<std::string>().find('/') != std::string::npos)
      return bad("bad file name");
  json &map = index["shard_map"];
  if (!map.is_object() || !map["buffers"].is_array() || !map["units"].is_array() ||
      !map["params"].is_array())
    return bad("bad shard_map");
  try {
    for (const json &b : map["buffers"]) {
      (void)b.at("id").get<int64_t>();
      (void)b.at("name").get<std::string>();
      (void)b.at("tensor").get<std::string>();
      (void)b.at("bytes").get<int64_t>();
      (void)b.at("dtype").get<std::string>();
    }
    for (const json &u : map["units"]) {
      (void)u.at("buffer").get<int64_t>();
      (void)u.at("sharded").get<bool>();
      (void)u.at("padded_numel").get<int64_t>();
      (void)u.at("shard_numel").get<int64_t>();
    }
    for (const json &p : map["params"]) {
      (void)p.at("name").get<std::string>();
      (void)p.at("shape").get<std::vector<int64_t>>();
      (void)p.at("unit").get<int64_t>();
      (void)p.at("flat_offset").get<int64_t>();
      (void)p.at("buffer").get<int64_t>();
    }
  } catch (const std::exception &e) {
    return FSDP_ERROR(file, ": bad shard_map entry: ", e.what());
  }
  return Status::ok();
}

Status loadCheckpoint(const std::string &path, const Plan &plan, Executor &ex,
                      int64_t rank, TrainingPosition &position) {
  json index;
  FSDP_RETURN_IF_ERROR(readCheckpointIndex(path, index));
  int64_t world = index["world_size"], stage = index["stage"];
  // Written before meshes existed: a 1-D mesh.
  std::vector<int64_t> mesh = {1, world};
  if (index.contains("mesh")) {
    const json &m = index["mesh"];
    if (!m.is_array() || m.size() != 2 || !m[0].is_number_integer() ||
        !m[1].is_number_integer() || m[0].get<int64_t>() * m[1].get<int64_t>() != world)
      return FSDP_ERROR(path, "/index.json: mesh must be [replicas, shards] holding "
                        "world_size ranks");
    mesh = {m[0].get<int64_t>(), m[1].get<int64_t>()};
  }
  if (world != plan.worldSize || stage != plan.stage || mesh[0] != plan.meshReplicas)
    return FSDP_ERROR("checkpoint '", path, "' was written for ", world,
                      " rank(s) (mesh ", mesh[0], "x", mesh[1], ") at stage ", stage,
                      "; this plan is for ", plan.worldSize, " rank(s) (mesh ",
                      plan.meshReplicas, "x", plan.meshShards, ") at stage ", plan.stage,
                      " (reshard it offline, or resume with the plan it was written for)");
  // The same buffers, by id, name, size and dtype: another model or another
  // compilation of it is refused before any byte is loaded.
  std::vector<int64_t> ids = savedBuffers(plan);
  const json &saved = index["shard_map"]["buffers"];
  if (saved.size() != ids.size())
    return FSDP_ERROR("checkpoint '", path, "' holds ", saved.size(),
                      " buffers per rank; this plan has ", ids.size(),
                      ": it was written for another model or plan");
  for (size_t i = 0; i < ids.size(); ++i) {
    const Buffer &b = plan.buffers[ids[i]];
    if (saved[i]["id"] != b.id || saved[i]["name"] != b.name ||
        saved[i]["bytes"] != b.bytes || saved[i]["dtype"] != dtypeName(b.dtype))
      return FSDP_ERROR("checkpoint '", path, "': buffer ", b.id, " (", b.name,
                        ") differs from the plan's (", saved[i].dump(), " vs ", b.bytes,
                        " bytes of ", dtypeName(b.dtype),
                        "): it was written for another model or plan (fsdp-ckpt "
                        "reshard converts between plans of one model)");
  }
  std::string file = path + "/" + index["files"][rank].get<std::string>();
  TensorMap tensors;
  FSDP_RETURN_IF_ERROR(readSafeTensors(file, tensors));
  for (int64_t id : ids) {
    const Buffer &b = plan.buffers[id];
    auto it = tensors.find(tensorName(b));
    if (it == tensors.end())
      return FSDP_ERROR(file, ": no tensor '", tensorName(b), "'");
    if (it->second.dtype != b.dtype || (int64_t)it->second.data.size() != b.bytes)
      return FSDP_ERROR(file, ": tensor '", tensorName(b), "' has ",
                        it->second.data.size(), " bytes of ", dtypeName(it->second.dtype),
                        ", the plan's buffer ", b.bytes, " bytes of ", dtypeName(b.dtype));
    FSDP_RETURN_IF_ERROR(ex.writeBuffer(id, it->second.data.data()));
  }
  position.step = index["step"];
  position.schedule = index["schedule"];
  const json &seed = index["seed"];
  position.seed =
      seed.is_string() ? std::strtoull(seed.get<std::string>().c_str(), nullptr, 10) : 0;
  json &data = index["data"];
  position.data = data.is_object() && data.contains("spec") && data["spec"].is_string()
                      ? data["spec"].get<std::string>()
                      : "";
  if (index.contains("loss_scale"))
    position.lossScale = index["loss_scale"];
  return Status::ok();
}

namespace {

/// Reads a checkpoint's tensors back in the model's terms: whole parameters
/// and, per optimizer-state kind, whole per-parameter state, from the shard
/// map alone (no plan, no ranks).
class CheckpointReader {
public:
  Status open(const std::string &p) {
    path = p;
    FSDP_RETURN_IF_ERROR(readCheckpointIndex(path, index));
    world = index["world_size"];
    ranks.assign(world, TensorMap());
    loaded.assign(world, false);
    return Status::ok();
  }

  /// Elements [offset, offset + numel) of a unit-level flat buffer of
  /// `padded` elements saved as tensor `name`: on every rank whole, or as
  /// rank r's shard [r * shard, (r + 1) * shard) (told apart by its size).
  Status flat(const std::string &name, int64_t shard, int64_t padded, int64_t offset,
              int64_t numel, float *dst) {
    if (offset < 0 || numel < 0 || offset > padded - numel || shard < 1)
      return FSDP_ERROR(path, ": a range of ", name, " lies outside its unit");
    TensorMap *t0;
    FSDP_RETURN_IF_ERROR(rank(0, t0));
    auto it0 = t0->find(name);
    if (it0 == t0->end())
      return FSDP_ERROR(path, ": rank 0's file has no tensor '", name, "'");
    int64_t bytes0 = (int64_t)it0->second.data.size();
    // f32, or a frozen unit's 16-bit storage ([Note: parameter storage
    // dtypes] in Executor.cpp), widened.
    DType dt = it0->second.dtype;
    if (dt != DType::F32 && dt != DType::BF16 && dt != DType::F16)
      return FSDP_ERROR(path, ": tensor '", name, "' is ", dtypeName(dt),
                        ", not parameter storage (f32, bf16 or f16)");
    int64_t esz = dtypeSize(dt);
    bool whole = bytes0 == padded * esz;
    if (!whole && bytes0 != shard * esz)
      return FSDP_ERROR(path, ": tensor '", name, "' holds ", bytes0,
                        " bytes, neither its unit (", padded, " elements) nor a shard (",
                        shard, ")");
    for (int64_t i = 0; i < numel;) {
      int64_t f = offset + i;
      int64_t r = whole ? 0 : f / shard, at = whole ? f : f % shard;
      int64_t len = std::min(numel - i, (whole ? padded : shard) - at);
      TensorMap *tr;
      FSDP_RETURN_IF_ERROR(rank(r, tr));
      auto it = tr->find(name);
      if (it == tr->end() || it->second.dtype != dt ||
          (int64_t)it->second.data.size() < (at + len) * esz)
        return FSDP_ERROR(path, ": rank ", r, "'s file lacks its shard of '", name, "'");
      widenParams(dt, it->second.data.data() + at * esz, len, dst + i);
      i += len;
    }
    return Status::ok();
  }

  /// Whole parameters (`stateKind` empty) or whole per-parameter optimizer
  /// state of one kind, under the parameters' names.
  Status tensors(const std::string &stateKind, TensorMap &out) {
    json &map = index["shard_map"];
    for (const json &p : map["params"]) {
      std::string name = p["name"];
      std::vector<int64_t> shape = p["shape"];
      int64_t numel = 1;
      for (int64_t d : shape)
        if (d < 0 || __builtin_mul_overflow(numel, d, &numel) || numel > (INT64_C(1) << 46))
          return FSDP_ERROR(path, ": parameter ", name, " has a bad shape");
      int64_t unit = p["unit"], offset = p["flat_offset"], buffer = p["buffer"];
      Tensor t;
      t.shape = shape;
      t.data.resize(numel * 4);
      float *dst = reinterpret_cast<float *>(t.data.data());
      std::string tname;
      if (stateKind.empty() && buffer >= 0) {
        if (!tensorOf(buffer, tname))
          return FSDP_ERROR(path, ": no storage for parameter ", name);
        FSDP_RETURN_IF_ERROR(flat(tname, numel, numel, 0, numel, dst));
      } else {
        if (unit < 0 || unit >= (int64_t)map["units"].size())
          return FSDP_ERROR(path, ": parameter ", name, " names a bad unit");
        json &u = map["units"][unit];
        int64_t storage = u["buffer"];
        if (!stateKind.empty()) {
          storage = -1;
          if (map.contains("states") && map["states"].is_array())
            for (json &st : map["states"])
              if (st.is_object() && st["kind"] == stateKind && st["unit"] == u["name"] &&
                  st["buffer"].is_number_integer())
                storage = st["buffer"];
          // A unit without optimizer state (a frozen one): its
          // parameters have none of this kind.
          if (storage < 0)
            continue;
        }
        if (!tensorOf(storage, tname))
          return FSDP_ERROR(path, ": no storage for parameter ", name);
        FSDP_RETURN_IF_ERROR(flat(tname, u["shard_numel"], u["padded_numel"], offset, numel, dst));
      }
      out[name] = std::move(t);
    }
    return Status::ok();
  }

  /// The optimizer-state kinds the checkpoint holds (exp_avg, ...).
  std::vector<std::string> stateKinds() {
    std::vector<std::string> kinds;
    json &map = index["shard_map"];
    if (map.contains("states") && map["states"].is_array())
      for (json &st : map["states"])
        if (st.is_object() && st["kind"].is_string() &&
            std::find(kinds.begin(), kinds.end(), st["kind"]) == kinds.end())
          kinds.push_back(st["kind"]);
    return kinds;
  }

  json index;

private:
  Status rank(int64_t r, TensorMap *&out) {
    if (r < 0 || r >= world)
      return FSDP_ERROR(path, ": a shard on rank ", r, " of ", world);
    if (!loaded[r]) {
      FSDP_RETURN_IF_ERROR(
          readSafeTensors(path + "/" + index["files"][r].get<std::string>(), ranks[r]));
      loaded[r] = true;
    }
    out = &ranks[r];
    return Status::ok();
  }
  bool tensorOf(int64_t bufferId, std::string &name) {
    for (const json &b : index["shard_map"]["buffers"])
      if (b["id"] == bufferId) {
        name = b["tensor"];
        return true;
      }
    return false;
  }

  std::string path;
  int64_t world = 0;
  std::vector<TensorMap> ranks;
  std::vector<bool> loaded;
};

} // namespace

Status exportCheckpoint(const std::string &path, TensorMap &params) {
  CheckpointReader reader;
  FSDP_RETURN_IF_ERROR(reader.open(path));
  return reader.tensors("", params);
}

Status reshardCheckpoint(const std::string &path, const Plan &target,
                         const std::string &outDir) {
  CheckpointReader reader;
  FSDP_RETURN_IF_ERROR(reader.open(path));
  TensorMap params;
  FSDP_RETURN_IF_ERROR(reader.tensors("", params));
  std::map<std::string, TensorMap> states;
  for (const std::string &kind : reader.stateKinds())
    FSDP_RETURN_IF_ERROR(reader.tensors(kind, states[kind]));
  // The target's parameters by name, with the same shapes.
  for (const Param &p : target.params) {
    auto it = params.find(p.name);
    if (it == params.end())
      return FSDP_ERROR(path, " has no parameter '", p.name, "' the target plan needs");
    if (it->second.shape != p.shape)
      return FSDP_ERROR(path, ": parameter '", p.name, "' has another shape than in "
                        "the target plan");
  }
  if (params.size() != target.params.size())
    return FSDP_ERROR(path, " holds ", params.size(), " parameters, the target plan ",
                      target.params.size(), ": another model");
  // One whole flat buffer per target unit and per state kind it holds, in
  // the target's layout (padding zero), then cut into each rank's bytes.
  auto flatOf = [&](const TensorMap &source, int64_t unit) {
    const Unit &u = target.units[unit];
    std::vector<float> flatBuf(u.paddedNumel, 0.0f);
    for (const Param &p : target.params)
      if (p.unit == unit)
        std::memcpy(flatBuf.data() + p.flatOffset, source.at(p.name).data.data(),
                    p.numel() * 4);
    return flatBuf;
  };
  auto unitIndex = [&](const std::string &name) -> int64_t {
    for (size_t u = 0; u < target.units.size(); ++u)
      if (target.units[u].name == name)
        return (int64_t)u;
    return -1;
  };
  json index;
  FSDP_RETURN_IF_ERROR(readCheckpointIndex(path, index));
  TrainingPosition pos;
  pos.step = index["step"];
  pos.seed = index["seed"].is_string()
                 ? std::strtoull(index["seed"].get<std::string>().c_str(), nullptr, 10)
                 : 0;
  pos.schedule = index["schedule"];
  pos.data = index["data"].is_object() && index["data"].contains("spec") &&
                     index["data"]["spec"].is_string()
                 ? index["data"]["spec"].get<std::string>()
                 : "";
  if (index.contains("loss_scale"))
    pos.lossScale = index["loss_scale"];
  std::string out = outDir + "/" + stepDirName(pos.step);
  std::error_code ec;
  if (fs::exists(out, ec))
    return FSDP_ERROR("'", out, "' exists: reshard into a new directory");
  FSDP_RETURN_IF_ERROR(makeDirs(out));
  std::vector<TensorMap> files(target.worldSize);
  for (int64_t id : savedBuffers(target)) {
    const Buffer &b = target.buffers[id];
    std::vector<float> whole;
    int64_t unit = -1, shard = 0;
    for (size_t u = 0; u < target.units.size(); ++u)
      if (target.units[u].buffer == id)
        unit = (int64_t)u, whole = flatOf(params, unit);
    for (const Param &p : target.params)
      if (p.buffer == id) {
        const Tensor &t = params.at(p.name);
        whole.assign(reinterpret_cast<const float *>(t.data.data()),
                     reinterpret_cast<const float *>(t.data.data()) + p.numel());
      }
    for (const State &st : target.states)
      if (st.buffer == id) {
        unit = unitIndex(st.unit);
        bool complete = unit >= 0 && states.count(st.kind);
        for (const Param &p : target.params)
          if (complete && p.unit == unit)
            complete = states[st.kind].count(p.name) > 0;
        if (!complete)
          return FSDP_ERROR("cannot reshard: the target plan's state ", st.name, " (", st.kind,
                            ") has no counterpart in ", path,
                            " (another optimizer, or a unit frozen there?)");
        whole = flatOf(states[st.kind], unit);
      }
    if (whole.empty())
      return FSDP_ERROR("cannot reshard: the target plan's persistent buffer ", b.id,
                        " (", b.name, ") is neither parameter storage nor optimizer state");
    if (unit >= 0)
      shard = target.units[unit].shardNumel;
    for (int64_t r = 0; r < target.worldSize; ++r) {
      Tensor t;
      t.dtype = b.dtype;
      t.shape = b.shape;
      const float *src = whole.data();
      if (b.numel() == shard && shard != (int64_t)whole.size())
        src += target.shardIndex(r) * shard;
      else if (b.numel() != (int64_t)whole.size())
        return FSDP_ERROR("cannot reshard buffer ", b.name, ": ", b.numel(),
                          " elements, neither whole nor a shard");
      // Narrowed to the buffer's dtype (a frozen unit's 16-bit storage).
      if (b.bytes != b.numel() * dtypeSize(b.dtype) ||
          (b.dtype != DType::F32 && b.dtype != DType::BF16 && b.dtype != DType::F16))
        return FSDP_ERROR("cannot reshard buffer ", b.name, ": ", dtypeName(b.dtype), " storage");
      t.data.resize(b.bytes);
      narrowParams(b.dtype, src, b.numel(), t.data.data());
      files[r][tensorName(b)] = std::move(t);
    }
  }
  for (int64_t r = 0; r < target.worldSize; ++r)
    FSDP_RETURN_IF_ERROR(writeSafeTensors(
        out + "/" + rankFileName(r, target.worldSize), files[r],
        {{"format", "fsdp-checkpoint-shard"}, {"step", std::to_string(pos.step)}}));
  return commit(out, makeIndex(target, pos), pos.step);
}

} // namespace fsdp
