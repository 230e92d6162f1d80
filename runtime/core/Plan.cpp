//===- Plan.cpp - reading and validating plan files -----------------------===//
//
// The runtime trusts nothing in a plan: every field is type-checked, every
// buffer id and offset bounds-checked, the memory plan is re-verified (no
// two buffers share bytes while both are live) and each instruction is
// checked against its op before anything runs.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Plan.h"

#include "runtime/cpu/Dispatch.h"

#include <algorithm>
#include <fstream>
#include <sstream>

namespace fsdp {

namespace {

using json = nlohmann::json;

/// Typed field access with messages naming the field's path.
struct Reader {
  Status status;
  template <typename T>
  bool get(const json &obj, const char *key, T &out, const std::string &where,
           bool required = true) {
    if (!status)
      return false;
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (required)
        status = FSDP_ERROR("plan: ", where, " is missing \"", key, "\"");
      return false;
    }
    try {
      out = it->get<T>();
    } catch (const std::exception &e) {
      status = FSDP_ERROR("plan: ", where, ".", key, " has the wrong type (",
                          e.what(), ")");
      return false;
    }
    return true;
  }
};

Status checkShape(const std::vector<int64_t> &s, const std::string &where) {
  for (int64_t d : s)
    if (d < 0)
      return FSDP_ERROR("plan: ", where, " has a negative dimension");
  return Status::ok();
}

Status validate(Plan &plan) {
  int64_t nb = (int64_t)plan.buffers.size();
  if (plan.worldSize < 1)
    return FSDP_ERROR("plan: world_size must be >= 1, found ", plan.worldSize);
  if (plan.arenaBytes < 0)
    return FSDP_ERROR("plan: negative arena_bytes");
  auto validId = [&](int64_t id) { return id >= 0 && id < nb; };
  int64_t end = (int64_t)plan.program.size();
  for (int64_t i = 0; i < nb; ++i) {
    const Buffer &b = plan.buffers[i];
    std::string where = "buffer " + std::to_string(i) + " (" + b.name + ")";
    if (b.id != i)
      return FSDP_ERROR("plan: ", where, " has id ", b.id, "; ids must equal positions");
    if (b.bytes != b.numel() * dtypeSize(b.dtype))
      return FSDP_ERROR("plan: ", where, " has ", b.bytes, " bytes but shape x dtype needs ",
                        b.numel() * dtypeSize(b.dtype));
    if (b.offset < 0 || b.offset % dtypeSize(b.dtype) != 0)
      return FSDP_ERROR("plan: ", where, " has a misaligned or negative offset ", b.offset);
    int64_t hi = b.offset + b.bytes + (plan.worldSize - 1) * b.rankStride;
    if (hi > plan.arenaBytes)
      return FSDP_ERROR("plan: ", where, " ends at byte ", hi,
                        ", outside the arena of ", plan.arenaBytes, " bytes");
    if (b.aliasOf >= 0) {
      if (!validId(b.aliasOf) || plan.buffers[b.aliasOf].aliasOf >= 0)
        return FSDP_ERROR("plan: ", where, " is a view of an invalid buffer ", b.aliasOf);
      const Buffer &base = plan.buffers[b.aliasOf];
      if (b.offset < base.offset || hi > base.offset + base.bytes)
        return FSDP_ERROR("plan: ", where, " is a view outside its buffer ", base.id);
    } else if (b.rankStride) {
      return FSDP_ERROR("plan: ", where, " has a rank stride but is not a view");
    }
    if (!b.persistent && (b.first < 0 || b.last < b.first || b.last > end))
      return FSDP_ERROR("plan: ", where, " has an invalid live range [", b.first,
                        ", ", b.last, "]");
  }
  // The memory plan, verified: owners whose bytes intersect must not be
  // live at the same time.
  std::vector<int64_t> owners;
  for (int64_t i = 0; i < nb; ++i)
    if (plan.buffers[i].aliasOf < 0)
      owners.push_back(i);
  std::sort(owners.begin(), owners.end(), [&](int64_t a, int64_t b) {
    return plan.buffers[a].offset < plan.buffers[b].offset;
  });
  for (size_t x = 0; x < owners.size(); ++x) {
    const Buffer &a = plan.buffers[owners[x]];
    for (size_t y = x + 1; y < owners.size(); ++y) {
      const Buffer &b = plan.buffers[owners[y]];
      if (b.offset >= a.offset + a.bytes)
        break;
      if (a.bytes == 0 || b.bytes == 0)
        continue;
      int64_t af = a.persistent ? -1 : a.first, al = a.persistent ? end : a.last;
      int64_t bf = b.persistent ? -1 : b.first, bl = b.persistent ? end : b.last;
      if (af <= bl && bf <= al)
        return FSDP_ERROR("plan: buffers ", a.id, " (", a.name, ") and ", b.id, " (",
                          b.name, ") overlap in memory while both are live: the "
                          "memory plan is corrupt");
    }
  }
  for (const Unit &u : plan.units) {
    if (u.paddedNumel < u.flatNumel || u.shardNumel * plan.worldSize != u.paddedNumel)
      return FSDP_ERROR("plan: unit ", u.name, " has inconsistent sizes (",
                        u.flatNumel, " / ", u.paddedNumel, " / ", u.shardNumel,
                        ") for world size ", plan.worldSize);
    if (u.buffer >= 0) {
      if (!validId(u.buffer))
        return FSDP_ERROR("plan: unit ", u.name, " has an invalid buffer");
      int64_t want = u.sharded ? u.shardNumel : u.paddedNumel;
      if (plan.buffers[u.buffer].numel() != want)
        return FSDP_ERROR("plan: unit ", u.name, " storage holds ",
                          plan.buffers[u.buffer].numel(), " elements, expected ", want);
    }
  }
  for (const Param &p : plan.params) {
    if (p.unit < 0 || p.unit >= (int64_t)plan.units.size())
      return FSDP_ERROR("plan: parameter ", p.name, " has an invalid unit");
    const Unit &u = plan.units[p.unit];
    if (p.flatOffset < 0 || p.flatOffset + p.numel() > u.flatNumel)
      return FSDP_ERROR("plan: parameter ", p.name, " does not fit its unit ", u.name);
    if (p.buffer >= 0) {
      if (!validId(p.buffer) || plan.buffers[p.buffer].shape != p.shape)
        return FSDP_ERROR("plan: parameter ", p.name, " has a buffer of another shape");
    } else if (u.buffer < 0) {
      return FSDP_ERROR("plan: parameter ", p.name, " has no storage");
    }
    if (p.init != "normal" && p.init != "uniform" && p.init != "zeros" && p.init != "ones")
      return FSDP_ERROR("plan: parameter ", p.name, " has unknown init '", p.init, "'");
  }
  for (const State &s : plan.states)
    if (!validId(s.buffer))
      return FSDP_ERROR("plan: state ", s.name, " has an invalid buffer");
  auto checkBindings = [&](const std::vector<Binding> &bs, const char *what) {
    for (const Binding &b : bs) {
      if (!validId(b.buffer))
        return FSDP_ERROR("plan: ", what, " ", b.name, " has an invalid buffer");
      static const char *roles[] = {"input", "target", "lr", "step", "loss", "grad"};
      if (std::find(std::begin(roles), std::end(roles), b.role) == std::end(roles))
        return FSDP_ERROR("plan: ", what, " ", b.name, " has unknown role '", b.role, "'");
      if ((b.role == "lr" || b.role == "step" || b.role == "loss") &&
          plan.buffers[b.buffer].numel() != 1)
        return FSDP_ERROR("plan: ", what, " ", b.name, " must be a scalar");
    }
    return Status::ok();
  };
  FSDP_RETURN_IF_ERROR(checkBindings(plan.inputs, "input"));
  FSDP_RETURN_IF_ERROR(checkBindings(plan.outputs, "output"));
  bool hasLoss = false;
  for (const Binding &b : plan.outputs)
    hasLoss |= b.role == "loss";
  if (!hasLoss)
    return FSDP_ERROR("plan: no output with role \"loss\"");
  for (int64_t i = 0; i < end; ++i) {
    const Instruction &inst = plan.program[i];
    for (const auto *ids : {&inst.in, &inst.out})
      for (int64_t id : *ids) {
        if (!validId(id))
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                            ") refers to unknown buffer ", id);
        const Buffer &b = plan.buffers[id];
        if (!b.persistent && (i < b.first || i > b.last))
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op, ") uses buffer ",
                            id, " (", b.name, ") outside its live range [", b.first,
                            ", ", b.last, "]");
      }
    Status st = cpu::checkInstruction(plan, inst);
    if (!st)
      return Status::error("plan: instruction #" + std::to_string(i) + ": " +
                           st.message());
  }
  return Status::ok();
}

} // namespace

Status parsePlan(const std::string &text, Plan &plan) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception &e) {
    return FSDP_ERROR("plan: not valid JSON (truncated or corrupt?): ", e.what());
  }
  if (!j.is_object())
    return FSDP_ERROR("plan: expected a JSON object");
  Reader r;
  std::string format;
  r.get(j, "format", format, "plan");
  if (!r.status)
    return r.status;
  if (format != "fsdp-plan")
    return FSDP_ERROR("plan: format is '", format, "', expected 'fsdp-plan'");
  r.get(j, "version", plan.version, "plan");
  if (!r.status)
    return r.status;
  if (plan.version > kPlanVersion)
    return FSDP_ERROR("plan version ", plan.version, " is newer than this runtime (",
                      kPlanVersion, "): rebuild fsdp-run");
  if (plan.version < kPlanVersion)
    return FSDP_ERROR("plan version ", plan.version, " is older than this runtime (",
                      kPlanVersion, "): recompile the model with fsdp-opt");
  r.get(j, "model", plan.model, "plan", false);
  r.get(j, "world_size", plan.worldSize, "plan");
  r.get(j, "stage", plan.stage, "plan", false);
  r.get(j, "arena_bytes", plan.arenaBytes, "plan");
  if (j.contains("options"))
    plan.options = j["options"];
  json mem;
  if (r.get(j, "memory", mem, "plan")) {
    r.get(mem, "params", plan.memory.params, "memory");
    r.get(mem, "grads", plan.memory.grads, "memory");
    r.get(mem, "state", plan.memory.state, "memory");
    r.get(mem, "activations", plan.memory.activations, "memory");
    r.get(mem, "temps", plan.memory.temps, "memory");
    r.get(mem, "inputs", plan.memory.inputs, "memory");
    r.get(mem, "comm", plan.memory.comm, "memory");
    r.get(mem, "peak", plan.memory.peak, "memory");
    r.get(mem, "peak_live", plan.memory.peakLive, "memory");
  }
  json arr;
  if (r.get(j, "buffers", arr, "plan"))
    for (size_t i = 0; i < arr.size() && r.status; ++i) {
      const json &o = arr[i];
      std::string where = "buffers[" + std::to_string(i) + "]";
      Buffer b;
      std::string dt, kind;
      r.get(o, "id", b.id, where);
      r.get(o, "offset", b.offset, where);
      r.get(o, "bytes", b.bytes, where);
      r.get(o, "shape", b.shape, where);
      r.get(o, "dtype", dt, where);
      r.get(o, "kind", kind, where);
      r.get(o, "first", b.first, where);
      r.get(o, "last", b.last, where);
      r.get(o, "persistent", b.persistent, where);
      r.get(o, "name", b.name, where, false);
      r.get(o, "alias_of", b.aliasOf, where, false);
      r.get(o, "rank_stride", b.rankStride, where, false);
      if (!r.status)
        break;
      if (!parseDType(dt, b.dtype))
        return FSDP_ERROR("plan: ", where, " has unknown dtype '", dt, "'");
      if (!parseBufferKind(kind, b.kind))
        return FSDP_ERROR("plan: ", where, " has unknown kind '", kind, "'");
      FSDP_RETURN_IF_ERROR(checkShape(b.shape, where));
      plan.buffers.push_back(b);
    }
  if (r.get(j, "units", arr, "plan"))
    for (size_t i = 0; i < arr.size() && r.status; ++i) {
      std::string where = "units[" + std::to_string(i) + "]";
      Unit u;
      r.get(arr[i], "name", u.name, where);
      r.get(arr[i], "flat_numel", u.flatNumel, where);
      r.get(arr[i], "padded_numel", u.paddedNumel, where);
      r.get(arr[i], "shard_numel", u.shardNumel, where);
      r.get(arr[i], "sharded", u.sharded, where, false);
      r.get(arr[i], "frozen", u.frozen, where, false);
      r.get(arr[i], "buffer", u.buffer, where, false);
      plan.units.push_back(u);
    }
  if (r.get(j, "params", arr, "plan"))
    for (size_t i = 0; i < arr.size() && r.status; ++i) {
      std::string where = "params[" + std::to_string(i) + "]";
      Param p;
      std::string dt;
      r.get(arr[i], "name", p.name, where);
      r.get(arr[i], "shape", p.shape, where);
      r.get(arr[i], "dtype", dt, where);
      r.get(arr[i], "init", p.init, where);
      r.get(arr[i], "scale", p.scale, where);
      r.get(arr[i], "trainable", p.trainable, where);
      r.get(arr[i], "unit", p.unit, where);
      r.get(arr[i], "flat_offset", p.flatOffset, where);
      r.get(arr[i], "buffer", p.buffer, where);
      if (r.status && !parseDType(dt, p.dtype))
        return FSDP_ERROR("plan: ", where, " has unknown dtype '", dt, "'");
      if (r.status)
        FSDP_RETURN_IF_ERROR(checkShape(p.shape, where));
      plan.params.push_back(p);
    }
  if (r.get(j, "states", arr, "plan"))
    for (size_t i = 0; i < arr.size() && r.status; ++i) {
      std::string where = "states[" + std::to_string(i) + "]";
      State s;
      r.get(arr[i], "name", s.name, where);
      r.get(arr[i], "kind", s.kind, where);
      r.get(arr[i], "buffer", s.buffer, where);
      r.get(arr[i], "param", s.param, where, false);
      r.get(arr[i], "unit", s.unit, where, false);
      plan.states.push_back(s);
    }
  for (auto [key, list] : {std::make_pair("inputs", &plan.inputs),
                           std::make_pair("outputs", &plan.outputs)})
    if (r.get(j, key, arr, "plan"))
      for (size_t i = 0; i < arr.size() && r.status; ++i) {
        std::string where = std::string(key) + "[" + std::to_string(i) + "]";
        Binding b;
        r.get(arr[i], "name", b.name, where);
        r.get(arr[i], "role", b.role, where);
        r.get(arr[i], "buffer", b.buffer, where);
        r.get(arr[i], "param", b.param, where, false);
        r.get(arr[i], "range", b.range, where, false);
        list->push_back(b);
      }
  if (r.get(j, "program", arr, "plan"))
    for (size_t i = 0; i < arr.size() && r.status; ++i) {
      std::string where = "program[" + std::to_string(i) + "]";
      Instruction inst;
      r.get(arr[i], "op", inst.op, where);
      r.get(arr[i], "in", inst.in, where);
      r.get(arr[i], "out", inst.out, where);
      if (arr[i].contains("attrs")) {
        inst.attrs = arr[i]["attrs"];
        if (!inst.attrs.is_object())
          return FSDP_ERROR("plan: ", where, ".attrs must be an object");
      }
      plan.program.push_back(std::move(inst));
    }
  if (!r.status)
    return r.status;
  return validate(plan);
}

Status loadPlan(const std::string &path, Plan &plan) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return FSDP_ERROR("cannot open plan file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  Status st = parsePlan(ss.str(), plan);
  if (!st)
    return Status::error(path + ": " + st.message());
  return Status::ok();
}

} // namespace fsdp
