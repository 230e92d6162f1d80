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
#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/ShapeRules.h"

#include "runtime/core/Bf16.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

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

/// A packed moment shard's layout by its code width (8: Moments8.h, 4:
/// Moments4.h): where its scales start, and its block from its size.
int64_t packedScalesOffset(int64_t n, int bits) {
  return bits == 4 ? moments4::scalesOffset(n) : moments8::scalesOffset(n);
}
int64_t packedBlockOf(int64_t n, int64_t bytes, int bits) {
  return bits == 4 ? moments4::blockOfPacked(n, bytes) : moments8::blockOfPacked(n, bytes);
}

/// The code width of a plan's i8 buffer (packed moments): 4 where the plan
/// requires optimizer-state-4bit, else 8.
int codeBits(const Plan &plan) { return plan.stateCodes4() ? 4 : 8; }

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
    // 4-bit moments are i8 bytes too: the width told apart by name
    if (b.dtype == DType::I8 && codeBits(plan) == 4)
      buffers.back()["state_bits"] = 4;
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
                {"data",
                 {{"spec", position.data},
                  {"next_step", position.step + 1},
                  {"items_per_step", position.itemsPerStep},
                  {"rows_consumed", position.rowsConsumed}}},
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
    return FSDP_ERROR("'", dir, "' is not a directory");
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
    return FSDP_ERROR("no complete checkpoint in '", dir,
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
  // An integer field must be a JSON integer: nlohmann's get<int64_t>()
  // converts a float as C++ does, undefined out of range (1e300).
  auto integer = [](const json &v, const char *key) {
    if (!v.is_number_integer())
      throw std::invalid_argument(std::string("'") + key + "' is not an integer");
  };
  try {
    for (const json &b : map["buffers"]) {
      integer(b.at("id"), "id");
      (void)b.at("name").get<std::string>();
      (void)b.at("tensor").get<std::string>();
      integer(b.at("bytes"), "bytes");
      (void)b.at("dtype").get<std::string>();
    }
    for (const json &u : map["units"]) {
      integer(u.at("buffer"), "buffer");
      (void)u.at("sharded").get<bool>();
      integer(u.at("padded_numel"), "padded_numel");
      integer(u.at("shard_numel"), "shard_numel");
    }
    for (const json &p : map["params"]) {
      (void)p.at("name").get<std::string>();
      if (!p.at("shape").is_array())
        throw std::invalid_argument("'shape' is not an array");
      for (const json &d : p.at("shape"))
        integer(d, "shape");
      integer(p.at("unit"), "unit");
      integer(p.at("flat_offset"), "flat_offset");
      integer(p.at("buffer"), "buffer");
    }
  } catch (const std::exception &e) {
    return FSDP_ERROR(file, ": bad shard_map entry: ", e.what());
  }
  return Status::ok();
}

// [Note: resharding on load]
// A checkpoint's shard map says, for every parameter, which unit holds it
// and where (flat_offset), and for every unit how it was padded and cut
// (padded_numel, shard_numel); optimizer state shares its unit's flat
// layout. So any element of a parameter or of its state is found without
// the plan that wrote it: in rank r's file at f % shard, with
// r = f / shard (a sharded unit), or in rank 0's (a whole one). A rank of
// the new plan walks its own saved buffers in its own layout, and for each
// piece asks the parameters that overlap it for exactly those elements:
// only its own slices' bytes are read (pread), never whole files, and
// padding stays zero. This is what PyTorch DCP's load does with a
// state_dict of DTensors; here the layouts are the shard map's. Offline
// resharding (fsdp-ckpt reshard) builds every target rank's file the same
// way. The result does not depend on the path taken: an element is copied,
// widened to f32 and narrowed to its new storage dtype (exact for the
// same dtype), so a resharded load equals the offline conversion byte for
// byte.

namespace {

/// A checkpoint's rank files, each opened and its header read (and checked
/// against the file's size) on first use; only the byte ranges asked for
/// are read, and counted.
class RankFiles {
public:
  RankFiles(std::string dir, const json &index) : dir(std::move(dir)) {
    for (const json &f : index["files"])
      names.push_back(f.get<std::string>());
    files.resize(names.size());
  }
  ~RankFiles() {
    for (File &f : files)
      if (f.fd >= 0)
        ::close(f.fd);
  }
  RankFiles(const RankFiles &) = delete;
  RankFiles &operator=(const RankFiles &) = delete;

  std::string path(int64_t r) const { return dir + "/" + names[r]; }
  int64_t world() const { return (int64_t)names.size(); }

  /// Where tensor `name` lies in rank r's file.
  Status find(int64_t r, const std::string &name, const TensorEntry *&e) {
    File *f;
    FSDP_RETURN_IF_ERROR(open(r, f));
    auto it = f->header.tensors.find(name);
    if (it == f->header.tensors.end())
      return FSDP_ERROR(path(r), ": no tensor '", name, "'");
    e = &it->second;
    return Status::ok();
  }
  /// `n` bytes at byte `offset` of rank r's file.
  Status read(int64_t r, uint64_t offset, void *dst, size_t n) {
    File *f;
    FSDP_RETURN_IF_ERROR(open(r, f));
    bytesRead += n;
    return readSafeTensorsRange(f->fd, path(r), offset, dst, n);
  }
  /// The rank files' sizes, all together.
  uint64_t totalBytes() const {
    uint64_t total = 0;
    std::error_code ec;
    for (size_t r = 0; r < names.size(); ++r) {
      uintmax_t n = fs::file_size(path((int64_t)r), ec);
      total += ec ? 0 : (uint64_t)n;
    }
    return total;
  }

  uint64_t bytesRead = 0;

private:
  struct File {
    int fd = -1;
    SafeTensorsHeader header;
  };
  Status open(int64_t r, File *&out) {
    if (r < 0 || r >= (int64_t)files.size())
      return FSDP_ERROR(dir, ": a shard on rank ", r, " of ", files.size());
    File &f = files[r];
    if (f.fd < 0) {
      FSDP_RETURN_IF_ERROR(readSafeTensorsHeader(path(r), f.header));
      f.fd = ::open(path(r).c_str(), O_RDONLY | O_CLOEXEC);
      if (f.fd < 0)
        return FSDP_ERROR("cannot open '", path(r), "': ", std::strerror(errno));
    }
    out = &f;
    return Status::ok();
  }

  std::string dir;
  std::vector<std::string> names;
  std::vector<File> files;
};

/// What an index records beside the buffers.
TrainingPosition positionOf(const json &index) {
  // Fields an older or hand-edited index may lack read as absent (null);
  // readCheckpointIndex checked `step`.
  TrainingPosition pos;
  pos.step = index["step"];
  const json seed = index.value("seed", json());
  pos.seed = seed.is_string() ? std::strtoull(seed.get<std::string>().c_str(), nullptr, 10) : 0;
  pos.schedule = index.value("schedule", json());
  const json data = index.value("data", json());
  if (data.is_object() && data.contains("spec") && data["spec"].is_string())
    pos.data = data["spec"];
  if (data.is_object() && data.contains("items_per_step") &&
      data["items_per_step"].is_number_integer())
    pos.itemsPerStep = data["items_per_step"];
  if (data.is_object() && data.contains("rows_consumed") &&
      data["rows_consumed"].is_number_integer() && data["rows_consumed"].get<int64_t>() >= 0)
    pos.rowsConsumed = data["rows_consumed"];
  pos.lossScale = index.value("loss_scale", json());
  return pos;
}

/// Reads a checkpoint in the model's terms ([Note: resharding on load]):
/// elements of a parameter, or of its optimizer state of one kind, from
/// the shard map alone (no plan, no ranks), a range at a time.
class ShardMapReader {
  /// Bounds a shard map's sizes and offsets, so that sums of them cannot
  /// overflow (2^46 f32 elements: 256 TiB).
  static constexpr int64_t kMaxElems = INT64_C(1) << 46;

public:
  Status open(const std::string &p) {
    path = p;
    FSDP_RETURN_IF_ERROR(readCheckpointIndex(path, index));
    files = std::make_unique<RankFiles>(path, index);
    const json &map = index["shard_map"];
    for (const json &p : map["params"]) {
      Source s;
      s.shape = p["shape"].get<std::vector<int64_t>>();
      for (int64_t d : s.shape)
        if (d < 0 || __builtin_mul_overflow(s.numel, d, &s.numel) || s.numel > kMaxElems)
          return FSDP_ERROR(path, ": parameter ", p["name"].get<std::string>(), " has a bad shape");
      s.unit = p["unit"];
      s.offset = p["flat_offset"];
      s.buffer = p["buffer"];
      if (s.offset < 0 || s.offset > kMaxElems)
        return FSDP_ERROR(path, ": parameter ", p["name"].get<std::string>(),
                          " has a bad flat_offset");
      params[p["name"]] = std::move(s);
    }
    return Status::ok();
  }

  struct Source {
    std::vector<int64_t> shape;
    int64_t numel = 1, unit = -1, offset = 0, buffer = -1;
  };
  /// The parameters by name, as the checkpoint's plan had them.
  const std::map<std::string, Source> &sourceParams() const { return params; }

  /// Whether the checkpoint holds parameter `name`'s optimizer state of
  /// `kind` (a frozen unit holds none).
  bool hasState(const std::string &kind, const std::string &name) {
    Where w;
    return locate(kind, name, w) && w.buffer >= 0;
  }

  /// Elements [first, first + count) of parameter `name` (`kind` empty) or
  /// of its optimizer state of `kind`, widened to f32. A null `dst` makes
  /// the checks a read makes first (bounding what a caller allocates for
  /// it by the files' sizes), reading nothing.
  Status read(const std::string &kind, const std::string &name, int64_t first, int64_t count,
              float *dst) {
    auto it = params.find(name);
    if (it == params.end())
      return FSDP_ERROR(path, " has no parameter '", name, "'");
    if (first < 0 || count < 0 || first > it->second.numel - count)
      return FSDP_ERROR(path, ": elements [", first, ", ", first + count, ") of ", name,
                        " lie outside it");
    Where w;
    if (!locate(kind, name, w))
      return FSDP_ERROR(path, ": parameter ", name, " names a bad unit");
    if (w.buffer < 0)
      return FSDP_ERROR(path, " has no ", kind, " state for parameter ", name);
    std::string tensor;
    if (!tensorOf(w.buffer, tensor))
      return FSDP_ERROR(path, ": no storage for parameter ", name);
    return flat(tensor, w.shard, w.padded, w.offset + first, count, dst, kind == "exp_avg_sq");
  }

  /// The flat size of the checkpoint's unit `u` (-1: none such).
  int64_t unitFlatNumel(int64_t u) const {
    if (!index.contains("shard_map") || !index["shard_map"].is_object() ||
        !index["shard_map"].contains("units"))
      return -1;
    const json &units = index["shard_map"]["units"];
    if (u < 0 || !units.is_array() || u >= (int64_t)units.size() || !units[u].is_object() ||
        !units[u].value("flat_numel", json()).is_number_integer())
      return -1;
    return units[u]["flat_numel"].get<int64_t>();
  }

  /// The 8-bit moments (state-dtype=8bit) of `kind` of the unit holding
  /// parameter `name`, as codes and block scales: the codes of unit
  /// positions [first, first + count) and the scales of their blocks, `first`
  /// and `count` whole blocks of `block` elements. Exact (no decoding) when
  /// the checkpoint's blocks are these: the same block size, and each of its
  /// shards whole blocks; positions past its unit are zero blocks (scale 0).
  /// False in `exact` (nothing read) where they are not.
  Status blocks8(const std::string &kind, const std::string &name, int64_t block, int64_t first,
                 int64_t count, uint8_t *codes, float *scales, bool &exact, int bits = 8) {
    exact = false;
    Where w;
    if (!params.count(name) || !locate(kind, name, w) || w.buffer < 0)
      return FSDP_ERROR(path, " has no ", kind, " state for parameter ", name);
    std::string tensor;
    if (!tensorOf(w.buffer, tensor))
      return FSDP_ERROR(path, ": no storage for parameter ", name);
    const TensorEntry *e0;
    FSDP_RETURN_IF_ERROR(files->find(0, tensor, e0));
    DType dt;
    if (!parseSafetensorsDType(e0->dtype, dt) || dt != DType::I8 || bitsOf(tensor) != bits)
      return Status::ok(); // not packed here, or in another code width
    const int64_t bytes0 = (int64_t)(e0->end - e0->begin);
    const bool whole = packedBlockOf(w.padded, bytes0, bits) == block;
    if (!whole && (packedBlockOf(w.shard, bytes0, bits) != block || w.shard % block))
      return Status::ok(); // other blocks: decode instead
    if (first % block || count % block)
      return Status::ok();
    // (whole blocks: even element counts, so 4-bit ranges are whole bytes)
    const int64_t local = whole ? w.padded : w.shard, sc = packedScalesOffset(local, bits);
    const int64_t per = 8 / bits; // codes a byte
    // positions past the unit: blocks of zeros, as the update codes them
    // (4-bit exp_avg's zero is code 7: bytes 0x77; every other zero code 0)
    const int fill = bits == 4 && kind != "exp_avg_sq" ? 0x77 : 0;
    std::memset(codes, fill, (size_t)(count / per));
    std::fill(scales, scales + count / block, 0.0f);
    for (int64_t i = 0; i < count && first + i < w.padded;) {
      const int64_t f = first + i, r = whole ? 0 : f / w.shard, at = whole ? f : f % w.shard;
      const int64_t len = std::min({count - i, local - at, w.padded - f});
      if (r >= files->world())
        return FSDP_ERROR(path, ": a range of ", tensor, " lies past the last rank's shard");
      const TensorEntry *e;
      FSDP_RETURN_IF_ERROR(files->find(r, tensor, e));
      if (e->dtype != e0->dtype || (int64_t)(e->end - e->begin) != bytes0)
        return FSDP_ERROR(path, ": rank ", r, "'s file lacks its shard of '", tensor, "'");
      FSDP_RETURN_IF_ERROR(
          files->read(r, e->begin + (uint64_t)(at / per), codes + i / per, (size_t)(len / per)));
      FSDP_RETURN_IF_ERROR(files->read(r, e->begin + (uint64_t)(sc + 4 * (at / block)),
                                       scales + i / block,
                                       (size_t)(4 * ((len + block - 1) / block))));
      i += len;
    }
    exact = true;
    return Status::ok();
  }

  /// Whole parameters (`kind` empty) or whole per-parameter optimizer state
  /// of one kind, under the parameters' names.
  Status tensors(const std::string &kind, TensorMap &out) {
    for (const auto &[name, s] : params) {
      if (!kind.empty() && !hasState(kind, name))
        continue; // a frozen unit: no state of this kind
      Tensor t;
      t.shape = s.shape;
      FSDP_RETURN_IF_ERROR(read(kind, name, 0, s.numel, nullptr)); // before allocating
      t.data.resize(s.numel * 4);
      FSDP_RETURN_IF_ERROR(read(kind, name, 0, s.numel, reinterpret_cast<float *>(t.data.data())));
      out[name] = std::move(t);
    }
    return Status::ok();
  }

  /// The optimizer-state kinds the checkpoint holds (exp_avg, ...).
  std::vector<std::string> stateKinds() const {
    std::vector<std::string> kinds;
    const json &map = index["shard_map"];
    if (map.contains("states") && map["states"].is_array())
      for (const json &st : map["states"])
        if (st.is_object() && st.contains("kind") && st["kind"].is_string() &&
            std::find(kinds.begin(), kinds.end(), st["kind"]) == kinds.end())
          kinds.push_back(st["kind"]);
    return kinds;
  }

  std::string path;
  json index;
  std::unique_ptr<RankFiles> files;

private:
  /// Where a parameter's elements lie: buffer `buffer` (-1: no such
  /// state), a flat layout of `padded` elements cut in shards of `shard`,
  /// the parameter at `offset`.
  struct Where {
    int64_t buffer = -1, shard = 0, padded = 0, offset = 0;
  };
  /// False: the shard map names a unit that is not there, or one whose
  /// sizes are out of range.
  bool locate(const std::string &kind, const std::string &name, Where &w) {
    const Source &s = params.at(name);
    json &map = index["shard_map"];
    json *states = map.contains("states") && map["states"].is_array() ? &map["states"] : nullptr;
    auto stateOf = [&](const char *field, const std::string &of) -> int64_t {
      if (states)
        for (const json &st : *states)
          if (st.is_object() && st.value("kind", json()) == kind && st.value(field, json()) == of &&
              st.value("buffer", json()).is_number_integer())
            return st["buffer"];
      return -1;
    };
    // A parameter's own buffer (unsharded plans), or state shadowing it.
    int64_t own = kind.empty() ? s.buffer : stateOf("param", name);
    if (own >= 0) {
      w = {own, s.numel, s.numel, 0};
      return true;
    }
    if (s.unit < 0 || s.unit >= (int64_t)map["units"].size())
      return false;
    const json &u = map["units"][s.unit];
    int64_t buffer = kind.empty() ? u["buffer"].get<int64_t>()
                                  : (u.contains("name") && u["name"].is_string()
                                         ? stateOf("unit", u["name"].get<std::string>())
                                         : -1);
    w = {buffer, u["shard_numel"], u["padded_numel"], s.offset};
    return w.shard >= 1 && w.shard <= kMaxElems && w.padded >= 0 && w.padded <= kMaxElems;
  }

  /// The code width of the checkpoint's packed tensor `name` (its buffer's
  /// state_bits: 4, else 8).
  int bitsOf(const std::string &name) const {
    for (const json &b : index["shard_map"]["buffers"])
      if (b.is_object() && b.value("tensor", json()) == name)
        return b.value("state_bits", json(8)) == 4 ? 4 : 8;
    return 8;
  }

  bool tensorOf(int64_t bufferId, std::string &name) const {
    for (const json &b : index["shard_map"]["buffers"])
      if (b["id"] == bufferId) {
        name = b["tensor"];
        return true;
      }
    return false;
  }

  /// Elements [offset, offset + numel) of a flat buffer of `padded`
  /// elements saved as tensor `name`: on every rank whole, or as rank r's
  /// shard [r * shard, (r + 1) * shard) (told apart by its size). A null
  /// `dst` checks the range against rank 0's header and the world size,
  /// reading nothing.
  Status flat(const std::string &name, int64_t shard, int64_t padded, int64_t offset, int64_t numel,
              float *dst, bool root = false) {
    if (offset < 0 || numel < 0 || offset > padded - numel || shard < 1)
      return FSDP_ERROR(path, ": a range of ", name, " lies outside its unit");
    const TensorEntry *e0;
    FSDP_RETURN_IF_ERROR(files->find(0, name, e0));
    // f32, or a frozen unit's 16-bit storage ([Note: parameter storage
    // dtypes] in Executor.cpp), widened.
    DType dt;
    if (parseSafetensorsDType(e0->dtype, dt) && dt == DType::I8)
      return flat8(name, *e0, shard, padded, offset, numel, dst, root);
    if (!parseSafetensorsDType(e0->dtype, dt) ||
        (dt != DType::F32 && dt != DType::BF16 && dt != DType::F16))
      return FSDP_ERROR(path, ": tensor '", name, "' is ", e0->dtype,
                        ", not parameter storage (F32, BF16 or F16)");
    int64_t esz = dtypeSize(dt), bytes0 = (int64_t)(e0->end - e0->begin);
    bool whole = bytes0 == padded * esz;
    if (!whole && bytes0 != shard * esz)
      return FSDP_ERROR(path, ": tensor '", name, "' holds ", bytes0, " bytes, neither its unit (",
                        padded, " elements) nor a shard (", shard, ")");
    if (!whole && numel > 0 && (offset + numel - 1) / shard >= files->world())
      return FSDP_ERROR(path, ": a range of ", name, " lies past the last rank's shard");
    if (!dst)
      return Status::ok(); // check only
    for (int64_t i = 0; i < numel;) {
      int64_t f = offset + i;
      int64_t r = whole ? 0 : f / shard, at = whole ? f : f % shard;
      int64_t len = std::min(numel - i, (whole ? padded : shard) - at);
      const TensorEntry *e;
      FSDP_RETURN_IF_ERROR(files->find(r, name, e));
      if (e->dtype != e0->dtype || (int64_t)(e->end - e->begin) < (at + len) * esz)
        return FSDP_ERROR(path, ": rank ", r, "'s file lacks its shard of '", name, "'");
      uint64_t from = e->begin + (uint64_t)(at * esz);
      if (dt == DType::F32) {
        FSDP_RETURN_IF_ERROR(files->read(r, from, dst + i, (size_t)(len * esz)));
      } else {
        scratch.resize((size_t)(len * esz));
        FSDP_RETURN_IF_ERROR(files->read(r, from, scratch.data(), scratch.size()));
        widenParams(dt, scratch.data(), len, dst + i);
      }
      i += len;
    }
    return Status::ok();
  }

  /// flat() of 8-bit moments (optimizer-state-dtype=8bit, Moments8.h):
  /// each rank's tensor the packed codes and block scales of its shard
  /// (or of the whole unit), decoded (exp_avg_sq, `root`: the root
  /// squared), so they load into f32 or bf16 moments of any layout.
  Status flat8(const std::string &name, const TensorEntry &e0, int64_t shard, int64_t padded,
               int64_t offset, int64_t numel, float *dst, bool root) {
    const int64_t bytes0 = (int64_t)(e0.end - e0.begin);
    const int bits = bitsOf(name);
    int64_t block = packedBlockOf(padded, bytes0, bits);
    const bool whole = block != 0;
    if (!whole)
      block = packedBlockOf(shard, bytes0, bits);
    if (!block)
      return FSDP_ERROR(path, ": tensor '", name, "' holds ", bytes0, " bytes, not the ", bits,
                        "-bit moments of its unit (", padded, " elements) or of a shard (", shard,
                        ")");
    if (!whole && numel > 0 && (offset + numel - 1) / shard >= files->world())
      return FSDP_ERROR(path, ": a range of ", name, " lies past the last rank's shard");
    if (!dst)
      return Status::ok(); // check only
    const int64_t local = whole ? padded : shard, scales = packedScalesOffset(local, bits);
    std::vector<uint8_t> codes;
    std::vector<float> scale;
    for (int64_t i = 0; i < numel;) {
      int64_t f = offset + i;
      int64_t r = whole ? 0 : f / shard, at = whole ? f : f % shard;
      int64_t len = std::min(numel - i, local - at);
      const TensorEntry *e;
      FSDP_RETURN_IF_ERROR(files->find(r, name, e));
      if (e->dtype != e0.dtype || (int64_t)(e->end - e->begin) != bytes0)
        return FSDP_ERROR(path, ": rank ", r, "'s file lacks its shard of '", name, "'");
      const int64_t b0 = at / block, b1 = (at + len - 1) / block;
      // (4-bit: the bytes holding codes [at, at + len), from at's byte)
      const int64_t c0 = bits == 4 ? at / 2 : at,
                    c1 = bits == 4 ? (at + len - 1) / 2 + 1 : at + len;
      codes.resize((size_t)(c1 - c0));
      scale.resize((size_t)(b1 - b0 + 1));
      FSDP_RETURN_IF_ERROR(files->read(r, e->begin + (uint64_t)c0, codes.data(), codes.size()));
      FSDP_RETURN_IF_ERROR(
          files->read(r, e->begin + (uint64_t)(scales + 4 * b0), scale.data(), scale.size() * 4));
      const auto *sp = reinterpret_cast<const uint8_t *>(scale.data());
      if (bits == 4)
        moments4::decodeRange(codes.data(), sp, at, len, block, root, dst + i);
      else
        moments8::decodeRange(codes.data(), sp, at, len, block, root, dst + i);
      i += len;
    }
    return Status::ok();
  }

  std::map<std::string, Source> params;
  std::vector<uint8_t> scratch;
};

/// Refuses a checkpoint of another model: every parameter of `target` by
/// name, with its shape, and no other.
Status checkSameModel(const ShardMapReader &src, const Plan &target) {
  const auto &params = src.sourceParams();
  for (const Param &p : target.params) {
    auto it = params.find(p.name);
    if (it == params.end())
      return FSDP_ERROR("checkpoint '", src.path, "' has no parameter '", p.name,
                        "' the plan needs: it was written for another model");
    if (it->second.shape != p.shape)
      return FSDP_ERROR("checkpoint '", src.path, "': parameter '", p.name,
                        "' has another shape there ", json(it->second.shape).dump(),
                        " than in the plan ", json(p.shape).dump(),
                        ": it was written for another model");
  }
  if (params.size() != target.params.size())
    return FSDP_ERROR("checkpoint '", src.path, "' holds ", params.size(), " parameters, the plan ",
                      target.params.size(), ": it was written for another model");
  return Status::ok();
}

/// Rank `rank`'s bytes of the target plan's saved buffer `id`, assembled
/// from `src` ([Note: resharding on load]) a piece at a time: `sink(at,
/// bytes, n)` receives bytes [at, at + n) of the buffer, every byte once.
using PieceSink = std::function<Status(int64_t at, const void *bytes, int64_t n)>;

/// A plan's 8-bit moments buffer (optimizer-state-dtype=8bit): the
/// elements it codes (its unit's shard, or the whole unit) in blocks of
/// `block`, `lo` the first of them in the unit's flat layout.
struct Packed8 {
  int64_t n = 0, block = 0, lo = 0;
  int bits = 8; ///< the code width (4: Moments4.h)
};
Status packed8Of(const Plan &target, const Buffer &b, int64_t unit, int64_t rank, Packed8 &out) {
  if (unit < 0)
    return FSDP_ERROR("cannot load ", b.name, ": 8-bit storage that is not a unit's moments");
  const Unit &u = target.units[unit];
  out.bits = codeBits(target);
  const bool shard =
      u.shardNumel != u.paddedNumel && packedBlockOf(u.shardNumel, b.bytes, out.bits) != 0;
  out.n = shard ? u.shardNumel : u.paddedNumel;
  out.block = packedBlockOf(out.n, b.bytes, out.bits);
  if (!out.block || out.n % out.block)
    return FSDP_ERROR("cannot load ", b.name, ": ", b.bytes, " bytes are not whole blocks of ",
                      out.bits, "-bit moments of its unit");
  out.lo = shard ? target.shardIndex(rank) * out.n : 0;
  return Status::ok();
}

/// assembleBuffer of this plan's 8-bit moments where the checkpoint holds
/// these very blocks: 8-bit moments of the same block size and unit (these
/// parameters at these places), every shard whole blocks (what fsdp-shard
/// pads to). Then the codes and scales are copied block for block, exact;
/// false in `exact` (nothing sent) where they are not.
Status copyBlocks8(ShardMapReader &src, const Plan &target, const Packed8 &q,
                   const std::string &kind, int64_t unit, const PieceSink &sink, bool &exact) {
  exact = false;
  const Unit &u = target.units[unit];
  const Param *first = nullptr;
  int64_t from = -1;
  for (const Param &p : target.params) {
    if (p.unit != unit)
      continue;
    auto it = src.sourceParams().find(p.name);
    if (it == src.sourceParams().end() || it->second.unit < 0 ||
        (first && it->second.unit != from) || it->second.offset != p.flatOffset)
      return Status::ok();
    if (!first)
      first = &p, from = it->second.unit;
  }
  if (!first || src.unitFlatNumel(from) != u.flatNumel || !src.hasState(kind, first->name))
    return Status::ok(); // (no such state: refused below, by name)
  const int64_t codeBytes = q.n * q.bits / 8, at = packedScalesOffset(q.n, q.bits);
  std::vector<uint8_t> codes((size_t)codeBytes);
  std::vector<float> scales((size_t)(q.n / q.block));
  FSDP_RETURN_IF_ERROR(src.blocks8(kind, first->name, q.block, q.lo, q.n, codes.data(),
                                   scales.data(), exact, q.bits));
  if (!exact)
    return Status::ok();
  FSDP_RETURN_IF_ERROR(sink(0, codes.data(), codeBytes));
  const std::vector<uint8_t> pad((size_t)(at - codeBytes), 0);
  if (!pad.empty())
    FSDP_RETURN_IF_ERROR(sink(codeBytes, pad.data(), (int64_t)pad.size()));
  return sink(at, scales.data(), (int64_t)scales.size() * 4);
}

/// `encoded` (when given) receives the state kinds of this plan's 8-bit
/// moments that were encoded from the checkpoint's values, not copied.
Status assembleBuffer(ShardMapReader &src, const Plan &target, int64_t id, int64_t rank,
                      const PieceSink &sink, std::set<std::string> *encoded = nullptr) {
  const Buffer &b = target.buffers[id];
  // What the buffer holds: a unit's parameters, one parameter, or the
  // optimizer state of either (`kind`).
  std::string kind;
  int64_t unit = -1;
  const Param *own = nullptr;
  auto paramNamed = [&](const std::string &name) -> const Param * {
    for (const Param &p : target.params)
      if (p.name == name)
        return &p;
    return nullptr;
  };
  for (size_t u = 0; u < target.units.size(); ++u)
    if (target.units[u].buffer == id)
      unit = (int64_t)u;
  for (const Param &p : target.params)
    if (p.buffer == id)
      own = &p;
  for (const State &st : target.states)
    if (st.buffer == id) {
      kind = st.kind;
      for (size_t u = 0; u < target.units.size(); ++u)
        if (!st.unit.empty() && target.units[u].name == st.unit)
          unit = (int64_t)u;
      if (!st.param.empty())
        own = paramNamed(st.param);
    }
  if (unit < 0 && !own)
    return FSDP_ERROR("cannot reshard: the plan's persistent buffer ", b.id, " (", b.name,
                      ") is neither parameter storage nor optimizer state");
  // 8-bit moments: copied block for block where the checkpoint has these
  // blocks, else the f32 values (widened, or decoded) encoded block by
  // block.
  Packed8 q;
  if (b.dtype == DType::I8) {
    FSDP_RETURN_IF_ERROR(packed8Of(target, b, unit, rank, q));
    if (kind != "exp_avg" && kind != "exp_avg_sq" && kind != "momentum_buffer")
      return FSDP_ERROR("cannot load ", b.name, ": 8-bit storage of ", kind, " state");
    bool exact = false;
    FSDP_RETURN_IF_ERROR(copyBlocks8(src, target, q, kind, unit, sink, exact));
    if (exact)
      return Status::ok();
  } else if (b.bytes != b.numel() * dtypeSize(b.dtype) ||
             (b.dtype != DType::F32 && b.dtype != DType::BF16 && b.dtype != DType::F16))
    return FSDP_ERROR("cannot reshard buffer ", b.name, ": ", dtypeName(b.dtype), " storage");
  // The parameters it holds, and the elements [lo, hi) of the flat layout
  // they share that this rank stores.
  std::vector<const Param *> members;
  int64_t lo = 0, hi = 0;
  if (own) {
    members.push_back(own);
    hi = own->numel();
  } else {
    const Unit &u = target.units[unit];
    for (const Param &p : target.params)
      if (p.unit == unit)
        members.push_back(&p);
    if (b.numel() == u.shardNumel && u.shardNumel != u.paddedNumel)
      lo = target.shardIndex(rank) * u.shardNumel, hi = lo + u.shardNumel;
    else
      hi = u.paddedNumel;
  }
  if (b.dtype == DType::I8)
    lo = q.lo, hi = q.lo + q.n;
  else if (hi - lo != b.numel())
    return FSDP_ERROR("cannot reshard buffer ", b.name, ": ", b.numel(),
                      " elements, neither whole nor a shard");
  for (const Param *p : members)
    if (!kind.empty() && !src.hasState(kind, p->name))
      return FSDP_ERROR("cannot reshard: the plan's state ", b.name, " (", kind,
                        ") has no counterpart for parameter ", p->name, " in ", src.path,
                        " (another optimizer, or a unit frozen there?)");
  const int64_t esz = dtypeSize(b.dtype);
  // (8-bit: whole blocks a piece, a power of two no larger than the piece)
  const int64_t piece = b.dtype == DType::I8
                            ? std::max(q.block, kLoadPieceBytes / 4 / q.block * q.block)
                            : kLoadPieceBytes / 4;
  std::vector<float> vals;
  std::vector<uint8_t> narrow;
  if (b.dtype == DType::I8 && encoded)
    encoded->insert(kind);
  for (int64_t at = lo; at < hi; at += piece) {
    int64_t n = std::min(piece, hi - at);
    vals.assign((size_t)n, 0.0f); // padding stays zero
    for (const Param *p : members) {
      int64_t from = own ? 0 : p->flatOffset;
      int64_t a = std::max(at, from), z = std::min(at + n, from + p->numel());
      if (a < z)
        FSDP_RETURN_IF_ERROR(src.read(kind, p->name, a - from, z - a, vals.data() + (a - at)));
    }
    if (b.dtype == DType::I8) {
      // the codes of [at, at + n), then their blocks' scales (n whole
      // blocks: even, so 4-bit codes fill whole bytes)
      narrow.resize((size_t)shapes::packedStateBytes(n, q.block, q.bits));
      const bool root = kind == "exp_avg_sq";
      if (q.bits == 4)
        moments4::encodeShard(vals.data(), n, q.block, root, narrow.data());
      else
        moments8::encodeShard(vals.data(), n, q.block, root, narrow.data());
      const int64_t per = 8 / q.bits;
      FSDP_RETURN_IF_ERROR(sink((at - lo) / per, narrow.data(), n / per));
      FSDP_RETURN_IF_ERROR(sink(packedScalesOffset(q.n, q.bits) + 4 * ((at - lo) / q.block),
                                narrow.data() + packedScalesOffset(n, q.bits), n / q.block * 4));
      continue;
    }
    const void *bytes = vals.data();
    if (b.dtype != DType::F32) {
      narrow.resize((size_t)(n * esz));
      narrowParams(b.dtype, vals.data(), n, narrow.data());
      bytes = narrow.data();
    }
    FSDP_RETURN_IF_ERROR(sink((at - lo) * esz, bytes, n * esz));
  }
  return Status::ok();
}

using StorageDtypes = std::map<std::string, std::set<std::string>>;

/// The storage dtypes a checkpoint's shard map records: kind ("" for the
/// parameters, else an optimizer-state kind) -> the dtypes its buffers
/// have. A malformed entry is skipped here (a load rejects it).
StorageDtypes savedStorage(const json &index) {
  StorageDtypes was;
  if (!index.is_object() || !index.contains("shard_map") || !index["shard_map"].is_object())
    return was;
  const json &map = index["shard_map"];
  auto savedDtype = [&](const json &id) -> std::string {
    if (id.is_number_integer() && map.contains("buffers") && map["buffers"].is_array())
      for (const json &b : map["buffers"])
        if (b.is_object() && b.value("id", json()) == id && b.value("dtype", json()).is_string())
          return b["dtype"] != "i8"                    ? b["dtype"].get<std::string>()
                 : b.value("state_bits", json(8)) == 4 ? std::string("4bit")
                                                       : std::string("8bit");
    return "";
  };
  for (const char *list : {"units", "params"})
    if (map.contains(list) && map[list].is_array())
      for (const json &e : map[list])
        if (e.is_object() && e.contains("buffer"))
          if (std::string d = savedDtype(e["buffer"]); !d.empty())
            was[""].insert(d);
  if (map.contains("states") && map["states"].is_array())
    for (const json &st : map["states"])
      if (st.is_object() && st.value("kind", json()).is_string() && st.contains("buffer"))
        if (std::string d = savedDtype(st["buffer"]); !d.empty())
          was[st["kind"].get<std::string>()].insert(d);
  return was;
}

std::string joinDtypes(const std::set<std::string> &s) {
  std::string out;
  for (const std::string &d : s)
    out += (out.empty() ? "" : "/") + d;
  return out;
}

/// What loading `index`'s checkpoint into `plan` converts: for the
/// parameters' storage and for each optimizer-state kind whose storage
/// dtype differs between them, "exp_avg f32 -> bf16" (a bf16-moment plan
/// resuming an f32-moment checkpoint, or the reverse).
std::vector<std::string> storageConversions(const json &index, const Plan &plan) {
  const StorageDtypes was = savedStorage(index);
  StorageDtypes now;
  auto dtypeOf = [&](int64_t id) {
    if (id < 0 || id >= (int64_t)plan.buffers.size())
      return std::string();
    DType d = plan.buffers[id].dtype;
    if (d == DType::I8) // packed moments
      return std::string(codeBits(plan) == 4 ? "4bit" : "8bit");
    return std::string(dtypeName(d));
  };
  for (const Unit &u : plan.units)
    if (u.buffer >= 0)
      now[""].insert(dtypeOf(u.buffer));
  for (const Param &p : plan.params)
    if (p.buffer >= 0)
      now[""].insert(dtypeOf(p.buffer));
  for (const State &st : plan.states)
    if (st.buffer >= 0)
      now[st.kind].insert(dtypeOf(st.buffer));
  std::vector<std::string> out;
  for (const auto &[kind, dtypes] : now) {
    auto it = was.find(kind);
    if (it != was.end() && it->second != dtypes)
      out.push_back((kind.empty() ? std::string("parameters") : kind) + " " +
                    joinDtypes(it->second) + " -> " + joinDtypes(dtypes));
  }
  return out;
}

/// The 8-bit moments a load encoded from the checkpoint's own 8-bit moments
/// (in other blocks, or units of other parameters: decoded, then encoded in
/// this plan's blocks), as storageConversions names conversions.
void noteReencoded(const json &index, const Plan &plan, const std::set<std::string> &encoded,
                   std::vector<std::string> &out) {
  const StorageDtypes was = savedStorage(index);
  const std::string w = codeBits(plan) == 4 ? "4bit" : "8bit";
  for (const std::string &kind : encoded)
    if (auto it = was.find(kind); it != was.end() && it->second.count(w))
      out.push_back(kind + " " + w + " -> " + w + " in other blocks or units (re-encoded)");
}

/// "2 rank(s) (mesh 1x2) at stage 3".
std::string layoutName(int64_t world, int64_t replicas, int64_t shards, int64_t stage) {
  return std::to_string(world) + " rank(s) (mesh " + std::to_string(replicas) + "x" +
         std::to_string(shards) + ") at stage " + std::to_string(stage);
}

} // namespace

std::string checkpointStorage(const json &index) {
  std::string out;
  for (const auto &[kind, dtypes] : savedStorage(index))
    out += (out.empty() ? "" : ", ") + (kind.empty() ? std::string("parameters") : kind) + " " +
           joinDtypes(dtypes);
  return out;
}

std::string conversionNote(const std::vector<std::string> &converted) {
  std::string out;
  bool narrowed = false, encoded = false, decoded = false, widened = false;
  for (size_t i = 0; i < converted.size(); ++i) {
    const std::string &c = converted[i];
    out += (i ? ", " : "") + c;
    const size_t arrow = c.find(" -> ");
    const std::string from = c.substr(0, arrow), to = arrow == c.npos ? "" : c.substr(arrow);
    auto coded = [](const std::string &t) {
      return t.find("8bit") != t.npos || t.find("4bit") != t.npos;
    };
    const bool dec = coded(from) && !coded(to);
    encoded |= coded(to);
    decoded |= dec;
    narrowed |= to.find("f16") != to.npos; // (bf16 or f16)
    widened |= !dec && to.find("f32") != to.npos;
  }
  std::string how;
  for (auto [on, what] :
       {std::pair{narrowed, "narrowed to nearest even"},
        std::pair{encoded, "encoded to each block's nearest code"},
        std::pair{decoded, "coded moments decoded exactly"}, std::pair{widened, "widened exactly"}})
    if (on)
      how += (how.empty() ? "" : "; ") + std::string(what);
  return how.empty() ? out : out + " (" + how + ")";
}

Status loadCheckpoint(const std::string &path, const Plan &plan, Executor &ex, int64_t rank,
                      TrainingPosition &position, LoadReport *report) {
  ShardMapReader src;
  FSDP_RETURN_IF_ERROR(src.open(path));
  const json &index = src.index;
  int64_t world = index["world_size"], stage = index["stage"];
  // Written before meshes existed: a 1-D mesh.
  std::vector<int64_t> mesh = {1, world};
  if (index.contains("mesh")) {
    const json &m = index["mesh"];
    // (each factor in [1, world] before the product: no overflow)
    auto factor = [&](const json &f) {
      return f.is_number_integer() && f.get<int64_t>() >= 1 && f.get<int64_t>() <= world;
    };
    if (!m.is_array() || m.size() != 2 || !factor(m[0]) || !factor(m[1]) ||
        m[0].get<int64_t>() * m[1].get<int64_t>() != world)
      return FSDP_ERROR(path, "/index.json: mesh must be [replicas, shards] holding "
                              "world_size ranks");
    mesh = {m[0].get<int64_t>(), m[1].get<int64_t>()};
  }
  // The same layout: the same buffers, by id, name, size and dtype, on
  // the same mesh at the same stage. Then this rank's file holds exactly
  // its buffers.
  std::vector<int64_t> ids = savedBuffers(plan);
  const json &saved = index["shard_map"]["buffers"];
  bool same = world == plan.worldSize && stage == plan.stage && mesh[0] == plan.meshReplicas &&
              saved.size() == ids.size();
  for (size_t i = 0; same && i < ids.size(); ++i) {
    const Buffer &b = plan.buffers[ids[i]];
    same = saved[i]["id"] == b.id && saved[i]["name"] == b.name && saved[i]["bytes"] == b.bytes &&
           saved[i]["dtype"] == dtypeName(b.dtype) &&
           saved[i].value("state_bits", json(8)) == (b.dtype == DType::I8 ? codeBits(plan) : 8);
  }
  FSDP_RETURN_IF_ERROR(ex.finishCarried());
  std::set<std::string> encoded;
  if (same) {
    std::vector<uint8_t> piece;
    for (int64_t id : ids) {
      const Buffer &b = plan.buffers[id];
      const TensorEntry *e;
      FSDP_RETURN_IF_ERROR(src.files->find(rank, tensorName(b), e));
      DType dt;
      if (!parseSafetensorsDType(e->dtype, dt) || dt != b.dtype ||
          (int64_t)(e->end - e->begin) != b.bytes)
        return FSDP_ERROR(src.files->path(rank), ": tensor '", tensorName(b), "' has ",
                          e->end - e->begin, " bytes of ", e->dtype, ", the plan's buffer ",
                          b.bytes, " bytes of ", dtypeName(b.dtype));
      for (int64_t at = 0; at < b.bytes; at += kLoadPieceBytes) {
        int64_t n = std::min(kLoadPieceBytes, b.bytes - at);
        piece.resize((size_t)n);
        FSDP_RETURN_IF_ERROR(src.files->read(rank, e->begin + at, piece.data(), (size_t)n));
        FSDP_RETURN_IF_ERROR(ex.writeBytes(id, at, piece.data(), n));
      }
    }
  } else {
    FSDP_RETURN_IF_ERROR(checkSameModel(src, plan));
    for (int64_t id : ids)
      FSDP_RETURN_IF_ERROR(assembleBuffer(
          src, plan, id, rank,
          [&](int64_t at, const void *bytes, int64_t n) { return ex.writeBytes(id, at, bytes, n); },
          &encoded));
  }
  position = positionOf(index);
  if (report) {
    report->resharded = !same;
    report->from = layoutName(world, mesh[0], mesh[1], stage);
    report->to = layoutName(plan.worldSize, plan.meshReplicas, plan.meshShards, plan.stage);
    report->readBytes = src.files->bytesRead;
    report->checkpointBytes = src.files->totalBytes();
    report->converted = storageConversions(index, plan);
    noteReencoded(index, plan, encoded, report->converted);
  }
  return Status::ok();
}

bool isTrainingCheckpoint(const std::string &path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    return false;
  if (fs::exists(fs::path(path) / kIndexFile, ec))
    return true;
  for (const auto &e : fs::directory_iterator(path, ec)) {
    long long s;
    char tail;
    if (e.is_directory(ec) &&
        std::sscanf(e.path().filename().string().c_str(), "step-%lld%c", &s, &tail) == 1)
      return true;
  }
  return false;
}

Status initParamsFromCheckpoint(const std::string &path, const Plan &plan, Executor &ex,
                                std::string &used) {
  FSDP_RETURN_IF_ERROR(latestCheckpoint(path, used));
  ShardMapReader src;
  FSDP_RETURN_IF_ERROR(src.open(used));
  FSDP_RETURN_IF_ERROR(checkSameModel(src, plan));
  return ex.loadParams([&](const Param &p, int64_t first, int64_t count, float *out) {
    return src.read("", p.name, first, count, out);
  });
}

Status exportCheckpoint(const std::string &path, TensorMap &params) {
  ShardMapReader reader;
  FSDP_RETURN_IF_ERROR(reader.open(path));
  return reader.tensors("", params);
}

Status reshardCheckpoint(const std::string &path, const Plan &target, const std::string &outDir,
                         std::vector<std::string> *converted) {
  ShardMapReader src;
  FSDP_RETURN_IF_ERROR(src.open(path));
  FSDP_RETURN_IF_ERROR(checkSameModel(src, target));
  if (converted)
    *converted = storageConversions(src.index, target);
  TrainingPosition pos = positionOf(src.index);
  std::string out = outDir + "/" + stepDirName(pos.step);
  std::error_code ec;
  if (fs::exists(out, ec))
    return FSDP_ERROR("'", out, "' exists: reshard into a new directory");
  FSDP_RETURN_IF_ERROR(makeDirs(out));
  // One target rank's file at a time: host memory holds one rank's state.
  std::set<std::string> encoded;
  for (int64_t r = 0; r < target.worldSize; ++r) {
    TensorMap file;
    for (int64_t id : savedBuffers(target)) {
      const Buffer &b = target.buffers[id];
      Tensor t;
      t.dtype = b.dtype;
      t.shape = b.shape;
      t.data.resize(b.bytes);
      FSDP_RETURN_IF_ERROR(assembleBuffer(
          src, target, id, r,
          [&](int64_t at, const void *bytes, int64_t n) {
            std::memcpy(t.data.data() + at, bytes, (size_t)n);
            return Status::ok();
          },
          &encoded));
      file[tensorName(b)] = std::move(t);
    }
    FSDP_RETURN_IF_ERROR(writeSafeTensors(
        out + "/" + rankFileName(r, target.worldSize), file,
        {{"format", "fsdp-checkpoint-shard"}, {"step", std::to_string(pos.step)}}));
  }
  if (converted)
    noteReencoded(src.index, target, encoded, *converted);
  return commit(out, makeIndex(target, pos), pos.step);
}

} // namespace fsdp
