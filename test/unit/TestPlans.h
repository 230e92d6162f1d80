//===- TestPlans.h - pieces of hand-written one-rank test plans -----------===//
//
// The unit tests that write small plans by hand (DeviceTest's offloaded and
// swapping plans, RuntimeTest's plan-reader cases) share the JSON of an f32
// buffer and of a one-rank plan around its buffers and program, so that
// each test spells out only what it is about: the buffers, the program and
// the memory figures its checks read (docs/PLAN_FORMAT.md).
//
//===----------------------------------------------------------------------===//
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>

namespace fsdp::testplans {

/// Buffer `buffers.size()` appended to `buffers`: `n` f32 elements, or one
/// when `scalar`, in `space` ("device", "host" or "nvme") at `offset`;
/// persistent, or live over [first, last].
inline void addF32Buffer(nlohmann::json &buffers, const char *name, const char *kind,
                         const char *space, int64_t offset, int64_t n, bool scalar, bool persistent,
                         int64_t first, int64_t last) {
  using nlohmann::json;
  buffers.push_back({{"id", buffers.size()},
                     {"name", name},
                     {"kind", kind},
                     {"space", space},
                     {"offset", offset},
                     {"bytes", scalar ? 4 : n * 4},
                     {"shape", scalar ? json::array() : json::array({n})},
                     {"dtype", "f32"},
                     {"persistent", persistent},
                     {"first", first},
                     {"last", last}});
}

/// What a one-rank stage-0 plan holds besides its buffers and program.
struct OneRankPlan {
  int64_t arenaBytes = 0;
  int64_t hostArenaBytes = 0;
  /// The swap file's size; 0: none.
  int64_t nvmeBytes = 0;
  /// memory.host (params, state, peak, peak_live); null: none.
  nlohmann::json hostMemory = nullptr;
  nlohmann::json units = nlohmann::json::array(), params = nlohmann::json::array(),
                 states = nlohmann::json::array(), inputs = nlohmann::json::array(),
                 outputs = nlohmann::json::array();
};

/// The plan's JSON text: format, version 2, world size 1, stage 0, the
/// arenas, a memory block whose device peak is the arena (every other
/// device figure 0), then `p`'s tables, `buffers` and `program`.
inline std::string oneRankPlan(const OneRankPlan &p, const nlohmann::json &buffers,
                               const nlohmann::json &program) {
  using nlohmann::json;
  json memory = {{"params", 0},      {"grads", 0},           {"state", 0},
                 {"activations", 0}, {"temps", 0},           {"inputs", 0},
                 {"comm", 0},        {"peak", p.arenaBytes}, {"peak_live", 0}};
  if (!p.hostMemory.is_null())
    memory["host"] = p.hostMemory;
  json plan = {{"format", "fsdp-plan"},
               {"version", 2},
               {"world_size", 1},
               {"stage", 0},
               {"arena_bytes", p.arenaBytes},
               {"host_arena_bytes", p.hostArenaBytes},
               {"memory", memory},
               {"units", p.units},
               {"params", p.params},
               {"states", p.states},
               {"inputs", p.inputs},
               {"outputs", p.outputs},
               {"buffers", buffers},
               {"program", program}};
  if (p.nvmeBytes > 0)
    plan["nvme_bytes"] = p.nvmeBytes;
  return plan.dump();
}

} // namespace fsdp::testplans
