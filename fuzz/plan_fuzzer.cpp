//===- plan_fuzzer.cpp - libFuzzer harness: plan loader, validation, a step ===//
//
// Input: the bytes of a plan file. The harness parses and validates it with
// the runtime's own entry point (parsePlan, what loadPlan runs on a file's
// contents); a plan that validates and is small (arena <= 1 MiB, world size
// <= 8, program <= 4096 instructions) is then run the way fsdp-run runs it:
// Executor::init (arena + parameter / state init), a synthetic batch when
// the plan's bindings allow one, one step, and the consolidation /
// re-load round trip of --save / --init-from (gatherParams, loadParams) and
// gradOutputs. Collectives go to an in-process communicator that plays
// rank r of N with the exact memory footprint of the real ones (all-gather
// writes N shards, reduce-scatter reads N shards), so ASan sees every byte
// a real rank would touch. Any crash, sanitizer report or uncaught
// exception is a finding: validation must reject what the executor cannot
// run.
//
// Byte-level mutation of a 10-25 KB JSON plan almost never yields another
// valid plan with one hostile value, so the harness has a structure-aware
// custom mutator (LLVMFuzzerCustomMutator): it parses the input, changes one
// JSON value (an integer to an edge value or to another integer of the plan,
// a string to another string of the plan, an element dropped / duplicated /
// swapped, a key removed, a value's type changed, a value wrapped in deep
// nesting) and writes it back; one time in eight, or when the input is not
// JSON, it falls back to libFuzzer's byte mutations.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Comm.h"
#include "runtime/core/Data.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Plan.h"
#include "runtime/devices/Devices.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

using namespace fsdp;

namespace {

constexpr int64_t kMaxArena = 1 << 20;
constexpr int64_t kMaxWorld = 8;
constexpr size_t kMaxProgram = 4096;

/// Rank `r` of `n` in one process: every collective reads and writes the
/// bytes the real one would (the values are this rank's, replicated).
class FakeComm final : public Communicator {
public:
  FakeComm(int64_t rank, int64_t size) : r(rank), n(size) {}
  int64_t rank() const override { return r; }
  int64_t size() const override { return n; }
  // Narrow-float reductions read and write the bytes only (their values
  // do not matter to the fuzzer): sums are done for f32.
  Status allReduce(const void *in, void *data, int64_t count, DType dtype, ReduceOp op,
                   Stream *) override {
    const bool mean = op == ReduceOp::Mean;
    if (in != data)
      std::memmove(data, in, count * dtypeSize(dtype));
    if (dtype != DType::F32)
      return Status::ok();
    auto *d = static_cast<float *>(data);
    for (int64_t i = 0; i < count; ++i)
      d[i] = mean ? d[i] : d[i] * (float)n;
    return Status::ok();
  }
  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype,
                       ReduceOp op, Stream *) override {
    const bool mean = op == ReduceOp::Mean;
    if (dtype != DType::F32) {
      std::memmove(out, in, shard * dtypeSize(dtype));
      return Status::ok();
    }
    const auto *f = static_cast<const float *>(in);
    tmp.assign(f, f + n * shard);
    for (int64_t i = 0; i < shard; ++i) {
      float s = 0;
      for (int64_t k = 0; k < n; ++k)
        s += tmp[k * shard + i];
      static_cast<float *>(out)[i] = mean ? s / (float)n : s;
    }
    return Status::ok();
  }
  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *) override {
    const int64_t bytes = shard * dtypeSize(dtype);
    std::vector<uint8_t> copy(static_cast<const uint8_t *>(in),
                              static_cast<const uint8_t *>(in) + bytes);
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(static_cast<uint8_t *>(out) + k * bytes, copy.data(), bytes);
    return Status::ok();
  }
  /// Every rank holds what this one does: chunk k of `out` is this rank's
  /// chunk of `in`. The whole input is read, as a real exchange sends it.
  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *) override {
    const int64_t bytes = chunk * dtypeSize(dtype);
    std::vector<uint8_t> copy(static_cast<const uint8_t *>(in),
                              static_cast<const uint8_t *>(in) + n * bytes);
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(static_cast<uint8_t *>(out) + k * bytes, copy.data() + r * bytes, bytes);
    return Status::ok();
  }
  Status broadcast(void *data, int64_t bytes, int64_t) override {
    volatile uint8_t *p = static_cast<uint8_t *>(data);
    for (int64_t i = 0; i < bytes; ++i)
      p[i] = p[i];
    return Status::ok();
  }
  Status barrier() override { return Status::ok(); }
  /// The mesh's groups (HSDP, the reshard group): a fake of the group's
  /// size, so those plans reach a step too.
  Status subgroup(const std::vector<int64_t> &ranks, const std::string &,
                  std::unique_ptr<Communicator> &out) override {
    auto me = std::find(ranks.begin(), ranks.end(), r);
    if (me == ranks.end())
      return FSDP_ERROR("rank ", r, " is not in its group");
    out = std::make_unique<FakeComm>((int64_t)(me - ranks.begin()), (int64_t)ranks.size());
    return Status::ok();
  }

private:
  int64_t r, n;
  std::vector<float> tmp;
};

/// FSDP_FUZZ_STATS=1: how far inputs get, printed at exit (to judge the
/// corpus: a harness whose inputs never reach a step tests only the parser).
struct Stats {
  long inputs = 0, valid = 0, small = 0, inited = 0, data = 0, stepped = 0;
  ~Stats() {
    if (std::getenv("FSDP_FUZZ_STATS"))
      std::fprintf(stderr, "plan_fuzzer: %ld inputs, %ld valid plans, %ld small "
                   "enough, %ld initialized, %ld with a synthetic batch, %ld ran "
                   "a step\n", inputs, valid, small, inited, data, stepped);
  }
} stats;


using nlohmann::json;

const char *const kDeepMarker = "\x01fuzz-deep\x01";

/// Bracket nesting of JSON text, ignoring strings: deeper inputs are not
/// parsed by the mutator (nlohmann's dump and copy recurse).
int nesting(const uint8_t *p, size_t n) {
  int depth = 0, worst = 0;
  bool str = false;
  for (size_t i = 0; i < n; ++i) {
    if (str) {
      if (p[i] == '\\')
        ++i;
      else if (p[i] == '"')
        str = false;
    } else if (p[i] == '"') {
      str = true;
    } else if (p[i] == '[' || p[i] == '{') {
      worst = std::max(worst, ++depth);
    } else if (p[i] == ']' || p[i] == '}') {
      --depth;
    }
  }
  return worst;
}

/// Every value of the document, depth first, with its parent (null for the
/// root) so that elements and keys can be removed.
/// `soft` collects the values under op attributes, parameters, units and
/// bindings: a change there more often leaves a plan that still validates,
/// so the executor and kernels see it (a change to a buffer's offset or
/// shape is almost always, and rightly, rejected by validation).
void collect(json &v, json *parent, std::vector<std::pair<json *, json *>> &out,
             std::vector<std::pair<json *, json *>> &soft, bool inSoft = false,
             int depth = 0) {
  out.emplace_back(&v, parent);
  if (inSoft)
    soft.emplace_back(&v, parent);
  if (depth > 64)
    return;
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string &k = it.key();
      bool s = inSoft || k == "attrs" || k == "params" || k == "units" ||
               k == "inputs" || k == "outputs" || k == "states";
      collect(*it, &v, out, soft, s, depth + 1);
    }
  } else if (v.is_array()) {
    for (auto &c : v)
      collect(c, &v, out, soft, inSoft, depth + 1);
  }
}

int64_t edgeInt(std::mt19937_64 &rng, int64_t old,
                const std::vector<int64_t> &pool) {
  static const int64_t edges[] = {0,          1,         -1,        2,
                                  3,          4,         7,         8,
                                  63,         64,        65,        INT32_MAX,
                                  (int64_t)INT32_MAX + 1, (int64_t)1 << 32,
                                  ((int64_t)1 << 32) + 1, (int64_t)1 << 62,
                                  INT64_MAX,  INT64_MIN, INT64_MAX - 1,
                                  INT64_MAX / 4, INT32_MIN};
  switch (rng() % 6) {
  case 0:
    return edges[rng() % (sizeof(edges) / sizeof(edges[0]))];
  case 1:
    return pool.empty() ? old : pool[rng() % pool.size()];
  case 2:
    return (int64_t)((uint64_t)old + rng() % 9 - 4); // wraps, no UB
  case 3:
    return old < INT64_MAX / 2 && old > INT64_MIN / 2 ? old * 2 : old / 2;
  case 4:
    return (int64_t)(0 - (uint64_t)old);
  default:
    return (int64_t)(rng() % 4096);
  }
}

json anyValue(std::mt19937_64 &rng, const std::vector<std::string> &strs) {
  switch (rng() % 9) {
  case 0: return json::object();
  case 1: return json::array();
  case 2: return nullptr;
  case 3: return rng() % 2 == 0;
  case 4: return 3524.5;
  case 5: return strs.empty() ? std::string("yes") : strs[rng() % strs.size()];
  case 6: return json::array({INT64_MAX, 4});
  case 7: return -1;
  default: return (uint64_t)-1;
  }
}

bool mutateJson(json &doc, std::mt19937_64 &rng) {
  std::vector<std::pair<json *, json *>> nodes, soft;
  collect(doc, nullptr, nodes, soft);
  std::vector<int64_t> ints;
  std::vector<std::string> strs;
  for (auto &[v, parent] : nodes) {
    if (v->is_number_integer())
      ints.push_back(v->get<int64_t>());
    else if (v->is_string() && strs.size() < 4096)
      strs.push_back(v->get<std::string>());
  }
  auto &[v, parent] = !soft.empty() && rng() % 2 ? soft[rng() % soft.size()]
                                                  : nodes[rng() % nodes.size()];
  switch (rng() % 10) {
  case 0: // change the type
    *v = anyValue(rng, strs);
    return true;
  case 1: // drop this element / key
    if (parent && parent->is_array()) {
      for (size_t i = 0; i < parent->size(); ++i)
        if (&(*parent)[i] == v) {
          parent->erase(i);
          return true;
        }
    } else if (parent && parent->is_object()) {
      for (auto it = parent->begin(); it != parent->end(); ++it)
        if (&*it == v) {
          parent->erase(it);
          return true;
        }
    }
    return false;
  case 2: // duplicate or swap elements of an array
    if (parent && parent->is_array() && !parent->empty()) {
      size_t a = rng() % parent->size(), b = rng() % parent->size();
      if (rng() % 2)
        parent->push_back((*parent)[a]);
      else
        std::swap((*parent)[a], (*parent)[b]);
      return true;
    }
    return false;
  case 3: // deep nesting (stack depth of the JSON reader and its users):
           // a marker, expanded in the text by the caller (building the
           // nested value here would recurse in nlohmann's copy and dump)
    if (rng() % 16 == 0) {
      *v = kDeepMarker;
      return true;
    }
    return false;
  default: // change the value keeping its type
    if (v->is_number_integer()) {
      *v = edgeInt(rng, v->get<int64_t>(), ints);
    } else if (v->is_number_float()) {
      static const double fs[] = {0.0, -1.0, 0.5, 1e308, -1e308, 1e-45, 2.5};
      *v = fs[rng() % 7];
    } else if (v->is_boolean()) {
      *v = !v->get<bool>();
    } else if (v->is_string()) {
      *v = strs.empty() ? std::string() : strs[rng() % strs.size()];
    } else if (v->is_array()) {
      v->push_back(ints.empty() ? 0 : ints[rng() % ints.size()]);
    } else if (v->is_object() && !v->empty()) {
      auto it = v->begin();
      std::advance(it, rng() % v->size());
      *it = anyValue(rng, strs);
    } else {
      return false;
    }
    return true;
  }
}

} // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t maxSize);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size,
                                          size_t maxSize, unsigned int seed) {
  std::mt19937_64 rng(seed);
  if (rng() % 8 != 0 && nesting(data, size) <= 64) {
    json doc = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
    if (!doc.is_discarded()) {
      int n = 1 + (int)(rng() % 3);
      bool changed = false;
      for (int i = 0; i < n; ++i)
        changed |= mutateJson(doc, rng);
      if (changed) {
        std::string out = doc.dump();
        std::string marker = json(kDeepMarker).dump();
        size_t at = out.find(marker);
        if (at != std::string::npos) {
          size_t depth = 1 + rng() % 30000;
          out = out.substr(0, at) + std::string(depth, '[') + "1" +
                std::string(depth, ']') + out.substr(at + marker.size());
        }
        if (out.size() <= maxSize) {
          std::memcpy(data, out.data(), out.size());
          return out.size();
        }
      }
    }
  }
  return LLVMFuzzerMutate(data, size, maxSize);
}

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  // One compute thread: deterministic, and no OpenMP pool per input (the
  // CPU device sets it; later devices of one process keep it).
  std::unique_ptr<Device> device;
  DeviceOptions options;
  options.threads = 1;
  (void)createDevice("cpu", options, device);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::string text(reinterpret_cast<const char *>(data), size);
  Plan plan;
  ++stats.inputs;
  Status parsed = parsePlan(text, plan);
  if (!parsed.isOk()) {
    static const bool why = std::getenv("FSDP_FUZZ_WHY") != nullptr;
    if (why) // what rejects the inputs (to tune the mutator)
      std::fprintf(stderr, "why: %.100s\n", parsed.message().c_str());
    return 0;
  }
  ++stats.valid;
  if (plan.arenaBytes > kMaxArena || plan.nvmeBytes > kMaxArena || plan.worldSize < 1 ||
      plan.worldSize > kMaxWorld || plan.program.size() > kMaxProgram)
    return 0;
  ++stats.small;
  // The rank follows from the input so that every rank's addresses get
  // exercised (rank_stride views, shard offsets).
  int64_t rank = (int64_t)(size % (size_t)plan.worldSize);
  FakeComm comm(rank, plan.worldSize);
  std::unique_ptr<Device> device;
  if (!createDevice("cpu", DeviceOptions{}, device).isOk())
    return 0;
  Executor ex(plan, comm, *device);
  // offload-nvme's swap file (unlinked as soon as it is open).
  static const std::string tmp = std::filesystem::temp_directory_path().string();
  ex.setNvmeDir(tmp);
  if (!ex.init(1234).isOk())
    return 0;
  ++stats.inited;
  std::unique_ptr<DataSource> src;
  if (makeDataSource("synthetic", plan, rank, plan.worldSize, 1, src).isOk() &&
      ex.fillInputs(*src, 1).isOk())
    ++stats.data;
  float loss = 0;
  if (!ex.step(1, 1e-3, loss).isOk())
    return 0;
  ++stats.stepped;
  TensorMap params;
  if (ex.gatherParams(params).isOk())
    (void)ex.loadParams(params);
  TensorMap grads;
  (void)ex.gradOutputs(grads);
  // Validation (--eval-every): the program's prefix up to the loss.
  (void)ex.evaluate(loss);
  (void)ex.measureMemory();
  return 0;
}
