//===- Plan.cpp - reading and validating plan files -----------------------===//
//
// The runtime trusts nothing in a plan: every field is type-checked, every
// buffer id and offset bounds-checked, the memory plan is re-verified (no
// two buffers share bytes while both are live) and each instruction is
// checked against its op before anything runs.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Plan.h"

#include "runtime/core/OpRules.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>

namespace fsdp {

namespace {

using json = nlohmann::json;

/// Sane bounds of a plan's numbers: far above any real model (2^48 bytes
/// is 256 TiB per rank), far below where int64 arithmetic on them could
/// overflow (every product and sum below stays under 2^62).
constexpr int64_t kMaxBytes = int64_t(1) << 48;
/// The largest swap_alignment accepted (a huge page; drives need 512 or
/// 4096).
constexpr int64_t kMaxSwapAlignment = int64_t(2) << 20;
constexpr int64_t kMaxDim = int64_t(1) << 40;
constexpr int64_t kMaxRank = 8;
constexpr int64_t kMaxWorld = 1 << 16;
constexpr int64_t kMaxOperands = 1 << 16;
/// JSON nesting a plan needs is 4 deep; deeper is hostile (the JSON
/// library recurses when copying and destroying values).
constexpr int kMaxJsonDepth = 64;

/// Typed field access: the value must have the JSON type asked for (an
/// integer field rejects 3524.5 and "7"), integers must lie in [lo, hi],
/// and the first failure is kept with the field's path in the message.
struct Reader {
  Status status;

  const json *find(const json &obj, const char *key, const std::string &where,
                   bool required) {
    if (!status)
      return nullptr;
    if (!obj.is_object()) {
      status = FSDP_ERROR("plan: ", where, ": expected an object, found ",
                          obj.type_name());
      return nullptr;
    }
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (required)
        status = FSDP_ERROR("plan: ", where, " is missing \"", key, "\"");
      return nullptr;
    }
    return &*it;
  }
  bool fail(const std::string &where, const char *key, const char *expected,
            const json &v) {
    std::string shown = v.is_primitive() ? v.dump() : std::string(v.type_name());
    if (shown.size() > 40)
      shown = shown.substr(0, 40) + "...";
    status = FSDP_ERROR("plan: ", where, ".", key, ": expected ", expected,
                        ", found ", shown);
    return false;
  }
  static bool toInt(const json &v, int64_t &out) {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > (uint64_t)INT64_MAX)
        return false;
      out = (int64_t)u;
      return true;
    }
    if (v.is_number_integer()) {
      out = v.get<int64_t>();
      return true;
    }
    return false;
  }
  bool integer(const json &obj, const char *key, int64_t &out,
               const std::string &where, int64_t lo, int64_t hi,
               bool required = true) {
    const json *v = find(obj, key, where, required);
    if (!v)
      return false;
    int64_t x;
    if (!toInt(*v, x) || x < lo || x > hi)
      return fail(where, key,
                  ("an integer in [" + std::to_string(lo) + ", " +
                   std::to_string(hi) + "]").c_str(),
                  *v);
    out = x;
    return true;
  }
  bool number(const json &obj, const char *key, double &out,
              const std::string &where, bool required = true) {
    const json *v = find(obj, key, where, required);
    if (!v)
      return false;
    if (!v->is_number() || !std::isfinite(v->get<double>()))
      return fail(where, key, "a finite number", *v);
    out = v->get<double>();
    return true;
  }
  bool boolean(const json &obj, const char *key, bool &out,
               const std::string &where, bool required = true) {
    const json *v = find(obj, key, where, required);
    if (!v)
      return false;
    if (!v->is_boolean())
      return fail(where, key, "true or false", *v);
    out = v->get<bool>();
    return true;
  }
  bool string(const json &obj, const char *key, std::string &out,
              const std::string &where, bool required = true) {
    const json *v = find(obj, key, where, required);
    if (!v)
      return false;
    if (!v->is_string())
      return fail(where, key, "a string", *v);
    out = v->get<std::string>();
    return true;
  }
  bool ints(const json &obj, const char *key, std::vector<int64_t> &out,
            const std::string &where, int64_t lo, int64_t hi, size_t maxLen) {
    const json *v = find(obj, key, where, true);
    if (!v)
      return false;
    if (!v->is_array() || v->size() > maxLen)
      return fail(where, key,
                  ("an array of at most " + std::to_string(maxLen) + " integers")
                      .c_str(),
                  *v);
    out.clear();
    for (const json &e : *v) {
      int64_t x;
      if (!toInt(e, x) || x < lo || x > hi)
        return fail(where, key,
                    ("integers in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]").c_str(),
                    e);
      out.push_back(x);
    }
    return true;
  }
  /// An array of objects (each element checked when read).
  const json *objects(const json &obj, const char *key, const std::string &where) {
    const json *v = find(obj, key, where, true);
    if (!v)
      return nullptr;
    if (!v->is_array()) {
      fail(where, key, "an array", *v);
      return nullptr;
    }
    for (size_t i = 0; i < v->size(); ++i)
      if (!(*v)[i].is_object()) {
        fail(where, (std::string(key) + "[" + std::to_string(i) + "]").c_str(),
             "an object", (*v)[i]);
        return nullptr;
      }
    return v;
  }
};

/// Deepest nesting of arrays/objects in JSON text (strings skipped), to
/// reject hostile nesting before the JSON library recurses on it.
int jsonDepth(const std::string &text) {
  int depth = 0, worst = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      worst = std::max(worst, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return worst;
}

/// A shape: at most kMaxRank dimensions in [0, kMaxDim] whose element
/// count times `elemBytes` stays within kMaxBytes.
bool readShape(Reader &r, const json &obj, std::vector<int64_t> &shape,
               const std::string &where, int64_t elemBytes) {
  if (!r.ints(obj, "shape", shape, where, 0, kMaxDim, kMaxRank))
    return false;
  int64_t n = elemBytes;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n) || n > kMaxBytes) {
      r.status = FSDP_ERROR("plan: ", where, ".shape: more than ", kMaxBytes,
                            " bytes");
      return false;
    }
  return true;
}

/// Whether `id` names a buffer of the plan.
bool validId(const Plan &plan, int64_t id) { return id >= 0 && id < (int64_t)plan.buffers.size(); }

/// The mesh (replicas x shards = world size, the reshard group, the node
/// size), the arena size and the swap file's alignment.
Status validateMesh(const Plan &plan) {
  if (plan.worldSize < 1)
    return FSDP_ERROR("plan: world_size must be >= 1, found ", plan.worldSize);
  if (plan.meshReplicas * plan.meshShards != plan.worldSize)
    return FSDP_ERROR("plan: mesh ", plan.meshReplicas, "x", plan.meshShards,
                      " (replicas x shards) does not hold world_size ", plan.worldSize,
                      " ranks");
  if (plan.meshReshard != 0 &&
      (plan.meshReshard < 2 || plan.meshReshard >= plan.meshShards ||
       plan.meshShards % plan.meshReshard != 0))
    return FSDP_ERROR("plan: mesh reshard group of ", plan.meshReshard,
                      " ranks: expected 1 < reshard < shards (", plan.meshShards,
                      ") and a divisor of it");
  if (plan.meshNode != 0 && (plan.meshNode < 2 || plan.meshNode >= plan.meshShards ||
                             plan.meshShards % plan.meshNode != 0))
    return FSDP_ERROR("plan: mesh node of ", plan.meshNode, " ranks: expected 1 < node < shards (",
                      plan.meshShards, ") dividing it");
  if (plan.arenaBytes < 0)
    return FSDP_ERROR("plan: negative arena_bytes");
  // [Note: swap file]: whole blocks of a power of two, the file too.
  const int64_t a = plan.swapAlignment;
  if (a != 0 && (a < 64 || (a & (a - 1)) != 0))
    return FSDP_ERROR("plan: swap_alignment ", a, " is not a power of two from 64 to ",
                      kMaxSwapAlignment);
  if (a != 0 && plan.nvmeBytes % a != 0)
    return FSDP_ERROR("plan: nvme_bytes ", plan.nvmeBytes,
                      " is not a multiple of the plan's swap_alignment ", a);
  return Status::ok();
}

/// Each buffer: its id, bytes, alignment, rank stride and period, its
/// place inside its arena (or the buffer it views), its live range.
Status validateBuffers(const Plan &plan) {
  const int64_t nb = (int64_t)plan.buffers.size();
  const int64_t end = (int64_t)plan.program.size();
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
    if (b.rankStride < 0 || b.rankStride % dtypeSize(b.dtype) != 0)
      return FSDP_ERROR("plan: ", where, " has a misaligned or negative rank_stride ",
                        b.rankStride);
    if (b.rankPeriod != 0 && (!b.rankStride || b.rankPeriod != plan.meshReshard))
      return FSDP_ERROR("plan: ", where, " has rank_period ", b.rankPeriod,
                        ": expected it only on a shard view over the mesh's reshard "
                        "group (",
                        plan.meshReshard ? std::to_string(plan.meshReshard) + " ranks"
                                         : std::string("none"),
                        ")");
    // The last shard's view ends at offset + bytes + (S-1) * stride (S
    // the period, if any): computed without overflow, every field being
    // bounded by the reader.
    int64_t hi;
    if (__builtin_mul_overflow((b.rankPeriod ? b.rankPeriod : plan.meshShards) - 1, b.rankStride,
                               &hi) ||
        __builtin_add_overflow(hi, b.offset + reservedBytes(plan, b), &hi) ||
        hi > (b.nvme   ? plan.nvmeBytes
              : b.host ? plan.hostArenaBytes
                       : plan.arenaBytes))
      return FSDP_ERROR("plan: ", where, " (offset ", b.offset, ", ", b.bytes,
                        " bytes, rank stride ", b.rankStride, ") reaches outside the ",
                        b.nvme   ? "swap file"
                        : b.host ? "host arena"
                                 : "arena",
                        " of ",
                        b.nvme   ? plan.nvmeBytes
                        : b.host ? plan.hostArenaBytes
                                 : plan.arenaBytes,
                        " bytes");
    if ((b.nvme || b.swapStaging) && b.aliasOf < 0 && plan.swapAlignment > 0 &&
        b.offset % plan.swapAlignment != 0)
      return FSDP_ERROR("plan: ", where, " (", b.nvme ? "in the swap file" : "a swap's staging",
                        ") has offset ", b.offset, ", not a multiple of the plan's swap_alignment ",
                        plan.swapAlignment);
    // Optimizer state, or a unit's storage (offload-nvme-params) and the
    // views of it its copies to the device stood for.
    if (b.nvme && (!b.persistent || (b.kind != BufferKind::State && b.kind != BufferKind::Param) ||
                   b.rankStride))
      return FSDP_ERROR("plan: ", where,
                        " is in the swap file (space \"nvme\"): only persistent optimizer "
                        "state and parameters may be");
    if (b.aliasOf >= 0) {
      if (!validId(plan, b.aliasOf) || plan.buffers[b.aliasOf].aliasOf >= 0)
        return FSDP_ERROR("plan: ", where, " is a view of an invalid buffer ", b.aliasOf);
      const Buffer &base = plan.buffers[b.aliasOf];
      if (base.nvme != b.nvme)
        return FSDP_ERROR("plan: ", where, " is a view ", b.nvme ? "in" : "outside",
                          " the swap file of buffer ", base.id, ", which is ",
                          base.nvme ? "in" : "not in", " it");
      if (base.host != b.host)
        return FSDP_ERROR("plan: ", where, " is a view in ", b.host ? "host" : "device",
                          " memory of buffer ", base.id, " in the other arena");
      if (b.offset < base.offset || hi > base.offset + base.bytes)
        return FSDP_ERROR("plan: ", where, " is a view outside its buffer ", base.id);
    } else if (b.rankStride) {
      return FSDP_ERROR("plan: ", where, " has a rank stride but is not a view");
    }
    if (!b.persistent && (b.first < 0 || b.last < b.first || b.last > end))
      return FSDP_ERROR("plan: ", where, " has an invalid live range [", b.first,
                        ", ", b.last, "]");
  }
  return Status::ok();
}

/// The memory plan, verified: owners whose bytes intersect must not be
/// live at the same time.
Status validateMemoryPlan(const Plan &plan) {
  const int64_t nb = (int64_t)plan.buffers.size();
  const int64_t end = (int64_t)plan.program.size();
  std::vector<int64_t> owners, swapped;
  for (int64_t i = 0; i < nb; ++i)
    if (plan.buffers[i].aliasOf >= 0)
      continue;
    else if (plan.buffers[i].nvme)
      swapped.push_back(i);
    else
      owners.push_back(i);
  // The swap file's buffers are all persistent: none may meet another.
  std::sort(swapped.begin(), swapped.end(),
            [&](int64_t a, int64_t b) { return plan.buffers[a].offset < plan.buffers[b].offset; });
  for (size_t x = 1; x < swapped.size(); ++x) {
    const Buffer &a = plan.buffers[swapped[x - 1]], &b = plan.buffers[swapped[x]];
    if (a.bytes && b.bytes && b.offset < a.offset + reservedBytes(plan, a))
      return FSDP_ERROR("plan: buffers ", a.id, " (", a.name, ") and ", b.id, " (", b.name,
                        ") overlap in the swap file: the memory plan is corrupt");
  }
  // Both arenas in one offset range ([Note: two arenas]): the host
  // arena's buffers sort after the device arena's and never meet them.
  auto at = [&](int64_t id) { return bufferOffset(plan, id, 0); };
  std::sort(owners.begin(), owners.end(),
            [&](int64_t a, int64_t b) { return at(a) < at(b); });
  for (size_t x = 0; x < owners.size(); ++x) {
    const Buffer &a = plan.buffers[owners[x]];
    for (size_t y = x + 1; y < owners.size(); ++y) {
      const Buffer &b = plan.buffers[owners[y]];
      if (at(b.id) >= at(a.id) + reservedBytes(plan, a))
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
  return Status::ok();
}

/// Each unit's sizes for the shard count, and its f32 storage in the
/// arena its offloading names.
Status validateUnits(const Plan &plan) {
  for (const Unit &u : plan.units) {
    int64_t padded;
    if (u.paddedNumel < u.flatNumel ||
        __builtin_mul_overflow(u.shardNumel, plan.meshShards, &padded) ||
        padded != u.paddedNumel)
      return FSDP_ERROR("plan: unit ", u.name, " has inconsistent sizes (",
                        u.flatNumel, " / ", u.paddedNumel, " / ", u.shardNumel,
                        ") for ", plan.meshShards, " shards");
    if (u.buffer >= 0) {
      if (!validId(plan, u.buffer))
        return FSDP_ERROR("plan: unit ", u.name, " has an invalid buffer");
      int64_t want = u.sharded ? u.shardNumel : u.paddedNumel;
      // Trainable storage is the f32 master the update writes, or bf16
      // (master-dtype=bf16: no f32 master); a frozen unit may store a
      // 16-bit float ([Note: parameter storage dtypes]).
      DType t = plan.buffers[u.buffer].dtype;
      if (t != DType::F32 && t != DType::BF16 && !(u.frozen && t == DType::F16))
        return FSDP_ERROR("plan: unit ", u.name, " storage is ", dtypeName(t),
                          u.frozen ? "; a frozen unit stores f32, bf16 or f16"
                                   : "; a trainable unit stores f32 (its master copy) or bf16 "
                                     "(master-dtype=bf16)");
      if (plan.buffers[u.buffer].numel() != want)
        return FSDP_ERROR("plan: unit ", u.name, " storage holds ",
                          plan.buffers[u.buffer].numel(), " elements, expected ", want);
      // (Offloaded: in the host arena, or with offload-nvme-params in the
      // swap file.)
      const Buffer &s = plan.buffers[u.buffer];
      if (u.offloaded != (s.host || s.nvme))
        return FSDP_ERROR("plan: unit ", u.name, " is ",
                          u.offloaded ? "offloaded" : "not offloaded", " but its storage is in ",
                          s.nvme   ? "the swap file"
                          : s.host ? "host memory"
                                   : "device memory");
    } else if (u.offloaded) {
      return FSDP_ERROR("plan: unit ", u.name, " is offloaded but has no storage");
    }
  }
  return Status::ok();
}

/// Each parameter: its unit, its place in it, dtype, storage and init.
Status validateParams(const Plan &plan) {
  for (const Param &p : plan.params) {
    if (p.unit < 0 || p.unit >= (int64_t)plan.units.size())
      return FSDP_ERROR("plan: parameter ", p.name, " has an invalid unit");
    const Unit &u = plan.units[p.unit];
    if (p.flatOffset < 0 || p.flatOffset + p.numel() > u.flatNumel)
      return FSDP_ERROR("plan: parameter ", p.name, " does not fit its unit ", u.name);
    if (p.numel() < 1)
      return FSDP_ERROR("plan: parameter ", p.name, " has no elements");
    if (p.dtype != DType::F32)
      return FSDP_ERROR("plan: parameter ", p.name, " is ", dtypeName(p.dtype),
                        "; this runtime keeps parameters in f32");
    if (p.buffer >= 0) {
      if (!validId(plan, p.buffer) || plan.buffers[p.buffer].shape != p.shape ||
          plan.buffers[p.buffer].dtype != p.dtype)
        return FSDP_ERROR("plan: parameter ", p.name,
                          " has a buffer of another shape or dtype");
    } else if (u.buffer < 0) {
      return FSDP_ERROR("plan: parameter ", p.name, " has no storage");
    }
    if (p.init != "normal" && p.init != "uniform" && p.init != "zeros" && p.init != "ones")
      return FSDP_ERROR("plan: parameter ", p.name, " has unknown init '", p.init, "'");
  }
  return Status::ok();
}

/// Each optimizer state's buffer, f32, or bf16 (state-dtype=bf16: AdamW's
/// moments, SGD's momentum buffer; the update's check holds its operands
/// to one dtype), or i8 8-bit codes (state-dtype=8bit: the same states).
Status validateStates(const Plan &plan) {
  for (const State &s : plan.states) {
    if (!validId(plan, s.buffer))
      return FSDP_ERROR("plan: state ", s.name, " has an invalid buffer");
    DType d = plan.buffers[s.buffer].dtype;
    const bool narrowable =
        s.kind == "exp_avg" || s.kind == "exp_avg_sq" || s.kind == "momentum_buffer";
    if (d != DType::F32 && !((d == DType::BF16 || d == DType::I8) && narrowable))
      return FSDP_ERROR("plan: state ", s.name, " (", s.kind, ") is ", dtypeName(d),
                        "; this runtime keeps optimizer state in f32 (AdamW's moments and SGD's "
                        "momentum buffer in f32, bf16 or 8-bit codes)");
  }
  return Status::ok();
}

/// The inputs' or outputs' bindings (`what`): each one's buffer, a known
/// role, and the dtype and shape the role needs.
Status validateBindings(const Plan &plan, const std::vector<Binding> &bs, const char *what) {
  for (const Binding &b : bs) {
    if (!validId(plan, b.buffer))
      return FSDP_ERROR("plan: ", what, " ", b.name, " has an invalid buffer");
    static const char *roles[] = {"input", "target",     "lr",   "step",
                                  "loss",  "loss_scale", "grad", "grad_sumsq"};
    if (std::find(std::begin(roles), std::end(roles), b.role) == std::end(roles))
      return FSDP_ERROR("plan: ", what, " ", b.name, " has unknown role '", b.role, "'");
    const Buffer &buf = plan.buffers[b.buffer];
    bool isInt = buf.dtype == DType::I32 || buf.dtype == DType::I64;
    if ((b.role == "lr" || b.role == "step" || b.role == "loss" || b.role == "loss_scale" ||
         b.role == "grad_sumsq") &&
        (buf.numel() != 1 || buf.dtype != DType::F32))
      return FSDP_ERROR("plan: ", what, " ", b.name, " must be an f32 scalar");
    if (b.role == "input" || b.role == "target") {
      if (buf.shape.empty() || buf.numel() < 1)
        return FSDP_ERROR("plan: ", what, " ", b.name,
                          " needs at least one element (a batch of >= 1)");
      if (isInt && b.range < 1)
        return FSDP_ERROR("plan: ", what, " ", b.name,
                          " holds integers but has no range >= 1 (the "
                          "vocabulary or class count)");
      if (!isInt && buf.dtype != DType::F32)
        return FSDP_ERROR("plan: ", what, " ", b.name, " is ", dtypeName(buf.dtype),
                          "; expected f32 or an integer type");
    }
    if (b.role == "grad" && buf.dtype != DType::F32)
      return FSDP_ERROR("plan: ", what, " ", b.name, " must be f32");
  }
  return Status::ok();
}

/// The bindings, a loss output, and loss scaling all or nothing.
Status validateIo(const Plan &plan) {
  FSDP_RETURN_IF_ERROR(validateBindings(plan, plan.inputs, "input"));
  FSDP_RETURN_IF_ERROR(validateBindings(plan, plan.outputs, "output"));
  bool hasLoss = false;
  for (const Binding &b : plan.outputs)
    hasLoss |= b.role == "loss";
  if (!hasLoss)
    return FSDP_ERROR("plan: no output with role \"loss\"");
  // Loss scaling is all or nothing: the policy, the scale the step reads
  // and the overflow signal it returns.
  auto count = [](const std::vector<Binding> &bs, const char *role) {
    return std::count_if(bs.begin(), bs.end(),
                         [&](const Binding &b) { return b.role == role; });
  };
  int64_t scaleIn = count(plan.inputs, "loss_scale"),
          sumsqOut = count(plan.outputs, "grad_sumsq");
  // A plan that clips returns the squared norm without loss scaling.
  bool on = plan.lossScaling.enabled;
  if (scaleIn != (on ? 1 : 0) || sumsqOut > 1 || (on && sumsqOut != 1))
    return FSDP_ERROR("plan: loss scaling needs \"loss_scale\" and one input "
                      "with role \"loss_scale\" and one output with role "
                      "\"grad_sumsq\"; found ",
                      on ? "the policy" : "no policy", ", ", scaleIn, " and ", sumsqOut);
  return Status::ok();
}

/// Instruction #i's swaps ([Note: swap file]): only a host instruction or
/// a copy to the device has them; each pairs a buffer in the swap file
/// with a staging buffer of its bytes and dtype in the host arena that the
/// instruction reads (and writes, when written back), each file and
/// staging buffer once. A copy may read part of it: whole blocks from an
/// offset on, into a staging buffer of those bytes it reads a view of.
Status validateSwaps(const Plan &plan, int64_t i) {
  const Instruction &inst = plan.program[i];
  if (inst.swaps.empty()) {
    if (inst.swapReadAt >= 0)
      return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                        ") has \"swap_read_at\" but no \"swap\"");
    return Status::ok();
  }
  // Read ahead (offload-nvme's read-ahead): after an earlier instruction,
  // each staging buffer live from there, so no other buffer has its
  // bytes while the read fills it.
  if (inst.swapReadAt >= i)
    return FSDP_ERROR("plan: instruction #", i, " (", inst.op, ") swap_read_at ", inst.swapReadAt,
                      ": a read ahead is issued after an earlier instruction (0 to ", i - 1, ")");
  const bool copy = inst.op == "to_device";
  if (!isHostInstruction(plan, inst) && !copy)
    return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                      ") has \"swap\" but is no host instruction nor a copy to the device: "
                      "only the offloaded update and the copies of parameters on disk read the "
                      "swap file");
  std::set<int64_t> files, stagings;
  for (const Swap &s : inst.swaps) {
    std::string what = "plan: instruction #" + std::to_string(i) + " (" + inst.op + ") swap [" +
                       std::to_string(s.file) + ", " + std::to_string(s.staging) + "]";
    if (!validId(plan, s.file) || !plan.buffers[s.file].nvme || plan.buffers[s.file].aliasOf >= 0)
      return FSDP_ERROR(what, ": ", s.file, " is no buffer in the swap file");
    if (!validId(plan, s.staging))
      return FSDP_ERROR(what, ": unknown staging buffer ", s.staging);
    const Buffer &f = plan.buffers[s.file], &t = plan.buffers[s.staging];
    const bool whole = s.offset == 0 && t.bytes == f.bytes;
    if (s.write && copy)
      return FSDP_ERROR(what, ": a copy to the device writes nothing back");
    if (!t.host || t.persistent || t.aliasOf >= 0 || t.dtype != f.dtype ||
        (!whole && (!copy || s.write)))
      return FSDP_ERROR(what, ": the staging buffer (", t.name,
                        ") must be a transient host buffer of the file buffer's ", f.bytes,
                        " bytes (", dtypeName(f.dtype), ")",
                        copy && !s.write ? ", or of whole blocks of them" : "");
    if (!whole) {
      // Part of it (a copy of a view): whole blocks inside its own.
      const int64_t a = plan.swapAlignment;
      if (a <= 0 || s.offset < 0 || s.offset % a != 0 || t.bytes % a != 0 ||
          s.offset > reservedBytes(plan, f) - t.bytes)
        return FSDP_ERROR(what, ": reads ", t.bytes, " bytes from byte ", s.offset, " of ", f.name,
                          " (", reservedBytes(plan, f),
                          " bytes reserved): not whole blocks of the swap_alignment ", a,
                          " inside it");
    }
    if (!files.insert(s.file).second || !stagings.insert(s.staging).second)
      return FSDP_ERROR(what, ": a state or staging buffer swapped twice");
    auto has = [&](const std::vector<int64_t> &ids) {
      return std::any_of(ids.begin(), ids.end(),
                         [&](int64_t id) { return storageRoot(plan, id) == s.staging; });
    };
    if (!has(inst.in) || (s.write && !has(inst.out)))
      return FSDP_ERROR(what, ": the instruction does not ", has(inst.in) ? "write" : "read",
                        " its staging buffer");
    if (inst.swapReadAt >= 0 && t.first > inst.swapReadAt)
      return FSDP_ERROR("plan: instruction #", i, " (", inst.op, ") reads its state after #",
                        inst.swapReadAt, " (swap_read_at) into staging buffer ", s.staging, " (",
                        t.name, "), whose live range [", t.first, ", ", t.last,
                        "] starts later: another buffer could take its bytes while it is read");
  }
  // Nothing else touches a staging buffer from the read point on: the
  // read fills it on the swap-in thread beside those instructions.
  if (inst.swapReadAt >= 0)
    for (int64_t k = inst.swapReadAt; k < i; ++k)
      for (const auto *ids : {&plan.program[k].in, &plan.program[k].out})
        for (int64_t id : *ids)
          for (const Swap &s : inst.swaps)
            if (storageRoot(plan, id) == s.staging)
              return FSDP_ERROR("plan: instruction #", k, " (", plan.program[k].op,
                                ") uses staging buffer ", s.staging, " (",
                                plan.buffers[s.staging].name, "), which instruction #", i, " (",
                                inst.op, ") reads its state into from after #", inst.swapReadAt,
                                " (swap_read_at): the two are not ordered");
  return Status::ok();
}

/// Each instruction: its buffers known and live, its arena (host or
/// device, the copies crossing), and its op's rule (checkInstruction).
Status validateProgram(const Plan &plan) {
  const int64_t end = (int64_t)plan.program.size();
  for (int64_t i = 0; i < end; ++i) {
    const Instruction &inst = plan.program[i];
    for (const auto *ids : {&inst.in, &inst.out})
      for (int64_t id : *ids) {
        if (!validId(plan, id))
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                            ") refers to unknown buffer ", id);
        const Buffer &b = plan.buffers[id];
        if (b.nvme)
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op, ") names buffer ", id, " (",
                            b.name,
                            "), which is in the swap file: an instruction "
                            "reads such state through a staging buffer (attrs \"swap\")");
        if (!b.persistent && (i < b.first || i > b.last))
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op, ") uses buffer ",
                            id, " (", b.name, ") outside its live range [", b.first,
                            ", ", b.last, "]");
      }
    // Each instruction works in one arena; the copies cross between them.
    // A wait touches no memory: it joins an async collective (device) or
    // an async copy (either arena); checkInstruction checks in == out.
    if (inst.op == "wait") {
      Status st = checkInstruction(plan, inst);
      if (!st)
        return Status::error("plan: instruction #" + std::to_string(i) + ": " +
                             st.message());
      continue;
    }
    // (A collective with a host output counts as on the host here, to be
    // refused below.)
    bool inHost = inst.op == "to_device" || (inst.op != "to_host" && !inst.out.empty() &&
                                             plan.buffers[inst.out[0]].host);
    bool outHost = inst.op == "to_host" || (inst.op != "to_device" && inHost);
    if (isCollectiveOp(inst.op) && (inHost || outHost))
      return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                        ") works on host memory: collectives run on the device");
    for (const auto *ids : {&inst.in, &inst.out})
      for (int64_t id : *ids) {
        bool want = ids == &inst.in ? inHost : outHost;
        if (plan.buffers[id].host != want)
          return FSDP_ERROR("plan: instruction #", i, " (", inst.op, "): its ",
                            ids == &inst.in ? "inputs" : "outputs", " must be in ",
                            want ? "host" : "device", " memory, but buffer ", id, " (",
                            plan.buffers[id].name, ") is in ", want ? "device" : "host",
                            " memory");
      }
    // Only work off the compute stream may be async: a collective (comm
    // stream), a copy between the arenas (copy stream) or a host
    // instruction (the offloaded update: the host stream). A non-boolean
    // value is checkInstruction's to report.
    auto async = inst.attrs.find("async");
    if (async != inst.attrs.end() && async->is_boolean() && async->get<bool>() &&
        !isCollectiveOp(inst.op) && !isArenaCopy(inst.op) && !isHostInstruction(plan, inst))
      return FSDP_ERROR("plan: instruction #", i, " (", inst.op,
                        ") is marked \"async\": true, but async is for collectives, copies "
                        "between the arenas (to_host / to_device) and host instructions (the "
                        "offloaded update, in host memory); this one is device compute");
    Status st = checkInstruction(plan, inst);
    if (!st)
      return Status::error("plan: instruction #" + std::to_string(i) + ": " +
                           st.message());
    FSDP_RETURN_IF_ERROR(validateSwaps(plan, i));
  }
  return Status::ok();
}

/// The first operand (input, then output) of `inst` whose storage root is
/// in `roots`, or -1.
static int64_t firstUsedOperand(const Plan &plan, const Instruction &inst,
                                const std::set<int64_t> &roots) {
  for (const auto *ids : {&inst.in, &inst.out})
    for (int64_t id : *ids)
      if (roots.count(storageRoot(plan, id)))
        return id;
  return -1;
}

/// A carried wait at `i` joining host update #q on the copy stream: the next
/// instruction is an async copy to the device of the update's storage
/// (the copy stream runs it after the join; with offload-nvme-params it
/// reads a staging of the same file buffer, read after the update's
/// write-back of it) and, until that copy's wait,
/// compute touches none of the update's buffers (`used`, their roots):
/// only copies on the copy stream, host instructions (the host stream runs
/// after the update) and waits may.
static Status validateCopyStreamJoin(const Plan &plan, int64_t i, int64_t q,
                                     const std::set<int64_t> &used) {
  const int64_t end = (int64_t)plan.program.size();
  auto root = [&](int64_t id) { return storageRoot(plan, id); };
  const int64_t b = plan.program[i].in[0];
  const Instruction *copy = i + 1 < end ? &plan.program[i + 1] : nullptr;
  // (The update's storage on disk: the file buffer b stages.)
  auto fileOf = [&](const Instruction &inst, int64_t staging) {
    for (const Swap &s : inst.swaps)
      if (s.staging == staging)
        return s.file;
    return int64_t(-1);
  };
  const int64_t file = fileOf(plan.program[q], root(b));
  if (!copy || copy->op != "to_device" || !isAsync(*copy) ||
      (root(copy->in[0]) != root(b) && (file < 0 || file != fileOf(*copy, root(copy->in[0])))))
    return FSDP_ERROR("plan: instruction #", i, " (carried wait on buffer ", b,
                      ") joins on the copy stream, but the next instruction is not an async "
                      "to_device of that buffer");
  int64_t joinAt = i + 2;
  while (joinAt < end &&
         !(plan.program[joinAt].op == "wait" && plan.program[joinAt].in[0] == copy->out[0]))
    ++joinAt;
  if (joinAt == end)
    return FSDP_ERROR("plan: instruction #", i + 1,
                      " (the async to_device after copy-stream join #", i, ") is never waited for");
  for (int64_t k = i + 2; k < joinAt; ++k) {
    const Instruction &o = plan.program[k];
    if (o.op == "wait" || isHostInstruction(plan, o) || (isArenaCopy(o.op) && isAsync(o)))
      continue;
    if (int64_t id = firstUsedOperand(plan, o, used); id >= 0)
      return FSDP_ERROR("plan: instruction #", k, " (", o.op, ") uses buffer ", id, " (",
                        plan.buffers[id].name, ") on compute after instruction #", i,
                        " joins host update #", q, " on the copy stream and before the copy's wait #",
                        joinAt);
  }
  return Status::ok();
}

/// fsdp-offload's next-step joins: each carried wait names the first
/// output of one async host update later in the program that no wait of
/// its own step joins; nothing before the join touches that update's
/// buffers (the previous step's update may still run), and its transient
/// operands are live through the whole step (no other buffer shares their
/// memory at any instruction).
Status validateCarried(const Plan &plan) {
  const int64_t end = (int64_t)plan.program.size();
  auto root = [&](int64_t id) { return storageRoot(plan, id); };
  std::set<int64_t> joined;
  for (int64_t i = 0; i < end; ++i) {
    const Instruction &w = plan.program[i];
    auto c = w.attrs.find("carried");
    if (c != w.attrs.end() && (w.op != "wait" || !c->is_boolean()))
      return FSDP_ERROR("plan: instruction #", i, " (", w.op,
                        "): \"carried\" is a boolean of a wait (fsdp-offload's next-step)");
    auto cs = w.attrs.find("copy_stream");
    if (cs != w.attrs.end() && (!cs->is_boolean() || !isCarried(w)))
      return FSDP_ERROR("plan: instruction #", i, " (", w.op,
                        "): \"copy_stream\" is a boolean of a carried wait");
    if (c == w.attrs.end() || !c->get<bool>())
      continue;
    int64_t b = w.in[0], q = i + 1;
    while (q < end && !(isHostInstruction(plan, plan.program[q]) && isAsync(plan.program[q]) &&
                        plan.program[q].out[0] == b))
      ++q;
    if (q == end)
      return FSDP_ERROR("plan: instruction #", i, " (carried wait on buffer ", b,
                        ") joins no async host update issued later in the program");
    if (!joined.insert(b).second)
      return FSDP_ERROR("plan: instruction #", i, ": a second carried wait on buffer ", b);
    const Instruction &u = plan.program[q];
    std::set<int64_t> used;
    for (const auto *ids : {&u.in, &u.out})
      for (int64_t id : *ids)
        used.insert(root(id));
    for (int64_t k = 0; k < end; ++k) {
      const Instruction &o = plan.program[k];
      if (k > q && o.op == "wait" && o.in[0] == b)
        return FSDP_ERROR("plan: instruction #", k, " waits in its own step for host update #", q,
                          ", which instruction #", i, " joins in the next step");
      if (k >= i || o.op == "wait")
        continue;
      if (int64_t id = firstUsedOperand(plan, o, used); id >= 0)
        return FSDP_ERROR("plan: instruction #", k, " (", o.op, ") uses buffer ", id, " (",
                          plan.buffers[id].name, ") before instruction #", i,
                          " joins the previous step's host update #", q, " that uses it");
    }
    if (isCopyStreamJoin(w))
      FSDP_RETURN_IF_ERROR(validateCopyStreamJoin(plan, i, q, used));
    for (int64_t id : u.in) {
      const Buffer &in = plan.buffers[root(id)];
      if (!in.persistent && (in.first > 0 || in.last < end - 1))
        return FSDP_ERROR("plan: buffer ", root(id), " (", in.name, "), read by host update #", q,
                          " that the next step joins, must be live through the whole step "
                          "[0, ",
                          end - 1, "]; its live range is [", in.first, ", ", in.last, "]");
    }
  }
  return Status::ok();
}

/// [Note: async windows] An async instruction runs on a stream of its own
/// from its issue to its wait: a collective (and every blocking one, queued
/// behind it) on the comm stream, or on the node comm stream where it is
/// marked so ([Note: node comm stream] in Device.h), a copy between the
/// arenas on the copy stream, a host update on the host stream. Work on any other stream in
/// that window is not ordered with it, so none may write what it reads,
/// nor read or write what it writes (by storage root: a view is its
/// buffer; each of its buffers is live through its wait, so no other
/// buffer shares their bytes in the window). Work on its own stream runs
/// in issue order after it. A host
/// update the next step joins (carried) has no wait of its own in the step
/// and is validateCarried's. Without this check a plan whose copy or
/// collective overlaps a write of its source would train on whichever
/// bytes the race left.
enum class Lane { Compute, Comm, NodeComm, Copy, Host };
static Lane laneOf(const Plan &plan, const Instruction &x) {
  if (isCollectiveOp(x.op))
    return onNodeCommStream(x) ? Lane::NodeComm : Lane::Comm;
  if (isArenaCopy(x.op))
    return isAsync(x) ? Lane::Copy : Lane::Compute;
  return isHostInstruction(plan, x) && isAsync(x) ? Lane::Host : Lane::Compute;
}
static const char *laneName(Lane l) {
  return l == Lane::Comm       ? "comm"
         : l == Lane::NodeComm ? "node comm"
         : l == Lane::Copy     ? "copy"
         : l == Lane::Host     ? "host"
                               : "compute";
}

Status validateAsyncWindows(const Plan &plan) {
  const int64_t end = (int64_t)plan.program.size();
  auto root = [&](int64_t id) { return storageRoot(plan, id); };
  for (int64_t i = 0; i < end; ++i) {
    const Instruction &a = plan.program[i];
    const Lane lane = laneOf(plan, a);
    if (a.op == "wait" || !isAsync(a) || a.out.empty() || lane == Lane::Compute)
      continue;
    int64_t j = i + 1;
    while (j < end && !(plan.program[j].op == "wait" && plan.program[j].in[0] == a.out[0]))
      ++j;
    if (j == end)
      continue;
    // Its buffers live through the wait: another buffer's bytes may be
    // the same as theirs only where the two are never live at once
    // (validateMemoryPlan), so with this the check by root below sees
    // every race in the window.
    for (const auto *ids : {&a.in, &a.out})
      for (int64_t id : *ids) {
        const Buffer &b = plan.buffers[root(id)];
        if (!b.persistent && b.last < j)
          return FSDP_ERROR("plan: buffer ", b.id, " (", b.name, "), ",
                            ids == &a.in ? "read" : "written", " by async instruction #", i, " (",
                            a.op, ", on the ", laneName(lane), " stream) until its wait #", j,
                            ", must be live through #", j, "; its live range is [", b.first, ", ",
                            b.last, "] (another buffer could take its bytes while it is in use)");
      }
    std::set<int64_t> reads, writes;
    for (int64_t id : a.in)
      reads.insert(root(id));
    for (int64_t id : a.out)
      writes.insert(root(id));
    for (int64_t k = i + 1; k < j; ++k) {
      const Instruction &o = plan.program[k];
      if (o.op == "wait" || laneOf(plan, o) == lane)
        continue;
      auto race = [&](int64_t id, const char *what, const char *itDoes) {
        return FSDP_ERROR("plan: instruction #", k, " (", o.op, ") ", what, " buffer ", id, " (",
                          plan.buffers[id].name, "), which async instruction #", i, " (", a.op,
                          ", on the ", laneName(lane), " stream) ", itDoes, " until its wait #", j,
                          ": the two are not ordered (join it before, or issue it after)");
      };
      for (int64_t id : o.out) {
        if (writes.count(root(id)))
          return race(id, "writes", "writes");
        if (reads.count(root(id)))
          return race(id, "writes", "reads");
      }
      for (int64_t id : o.in)
        if (writes.count(root(id)))
          return race(id, "reads", "writes");
    }
  }
  return Status::ok();
}

/// [Note: node comm stream] in Device.h: a group's collectives all on one
/// stream. Two collectives over the same group on the two comm streams
/// could run at once on one communicator (a Gloo context, an NCCL
/// communicator), which neither allows.
Status validateCommStreams(const Plan &plan) {
  int64_t first = -1;
  std::string firstStream;
  for (int64_t i = 0; i < (int64_t)plan.program.size(); ++i) {
    const Instruction &x = plan.program[i];
    if (!isCollectiveOp(x.op) || x.attrs.value("group", std::string("world")) != "node")
      continue;
    const std::string stream = onNodeCommStream(x) ? "node" : "comm";
    if (first < 0) {
      first = i;
      firstStream = stream;
    } else if (stream != firstStream) {
      return FSDP_ERROR("plan: instruction #", i, " (", x.op, " over group node) runs on the ",
                        stream, " stream but instruction #", first, " (", plan.program[first].op,
                        " over the same group) on the ", firstStream,
                        " stream: a group's collectives must all be on one stream (they share "
                        "its communicator)");
    }
  }
  return Status::ok();
}

/// The plan as the runtime needs it, in order: mesh, buffers, the memory
/// plan, units, parameters, states, bindings, program; the first error
/// stops it.
Status validate(const Plan &plan) {
  FSDP_RETURN_IF_ERROR(validateMesh(plan));
  FSDP_RETURN_IF_ERROR(validateBuffers(plan));
  FSDP_RETURN_IF_ERROR(validateMemoryPlan(plan));
  FSDP_RETURN_IF_ERROR(validateUnits(plan));
  FSDP_RETURN_IF_ERROR(validateParams(plan));
  FSDP_RETURN_IF_ERROR(validateStates(plan));
  FSDP_RETURN_IF_ERROR(validateIo(plan));
  FSDP_RETURN_IF_ERROR(validateProgram(plan));
  FSDP_RETURN_IF_ERROR(validateCommStreams(plan));
  FSDP_RETURN_IF_ERROR(validateAsyncWindows(plan));
  return validateCarried(plan);
}

/// f16's dynamic loss scaling: the initial scale and its growth and
/// backoff, each a power of two.
Status readLossScaling(Reader &r, const json &obj, LossScaling &l) {
  l.enabled = true;
  r.number(obj, "init", l.init, "loss_scale");
  r.number(obj, "growth_factor", l.growthFactor, "loss_scale");
  r.number(obj, "backoff_factor", l.backoffFactor, "loss_scale");
  r.integer(obj, "growth_interval", l.growthInterval, "loss_scale", 1, INT64_C(1) << 40);
  if (!r.status)
    return r.status;
  int e = 0;
  // Powers of two in f32's normal range: scaling and unscaling are exact.
  auto pow2 = [&](double v) { return std::frexp(v, &e) == 0.5; };
  if (!(l.init >= 1 && l.init <= 0x1p127 && pow2(l.init)))
    return FSDP_ERROR("plan: loss_scale.init = ", l.init,
                      ": expected a power of two in [1, 2^127]");
  if (!(l.growthFactor > 1 && pow2(l.growthFactor)) ||
      !(l.backoffFactor > 0 && l.backoffFactor < 1 && pow2(l.backoffFactor)))
    return FSDP_ERROR("plan: loss_scale: growth_factor (", l.growthFactor,
                      ") must be a power of two > 1 and backoff_factor (", l.backoffFactor,
                      ") one in (0, 1)");
  return Status::ok();
}

/// The header: format and version first (a plan for another runtime is
/// refused before anything else is read), then the model, the mesh, the
/// arena sizes, loss scaling and the compile options.
Status readHeader(Reader &r, const json &j, Plan &plan) {
  std::string format;
  r.string(j, "format", format, "plan");
  if (!r.status)
    return r.status;
  if (format != kPlanFormat)
    return FSDP_ERROR("plan: format is '", format, "', expected 'fsdp-plan'");
  int64_t version = 0;
  r.integer(j, "version", version, "plan", 0, INT64_MAX);
  if (!r.status)
    return r.status;
  if (version > kPlanVersion)
    return FSDP_ERROR("plan version ", version, " is newer than this runtime (",
                      kPlanVersion, "): rebuild fsdp-run");
  if (version < kOldestPlanVersion)
    return FSDP_ERROR("plan version ", version, " is older than this runtime reads (",
                      kOldestPlanVersion, " to ", kPlanVersion,
                      "): recompile the model with fsdp-opt");
  plan.version = (int)version;
  // The features it needs beyond its version: one this runtime lacks
  // refuses the plan before anything else is read (PlanSchema.h).
  if (const json *req = r.find(j, "requires", "plan", false)) {
    if (!req->is_array())
      return FSDP_ERROR("plan: requires: expected an array of feature names, found ",
                        req->type_name());
    for (const json &f : *req) {
      if (!f.is_string())
        return FSDP_ERROR("plan: requires: expected feature names, found ", f.type_name());
      const std::string name = f.get<std::string>();
      if (std::find(std::begin(kPlanFeatures), std::end(kPlanFeatures), name) ==
          std::end(kPlanFeatures)) {
        std::string known;
        for (std::string_view k : kPlanFeatures)
          known += (known.empty() ? "" : ", ") + std::string(k);
        return FSDP_ERROR("plan requires the feature '", name,
                          "', which this runtime does not have (it has: ", known,
                          "): rebuild fsdp-run");
      }
      plan.features.push_back(name);
    }
  }
  r.string(j, "model", plan.model, "plan", false);
  r.integer(j, "world_size", plan.worldSize, "plan", 1, kMaxWorld);
  r.integer(j, "stage", plan.stage, "plan", 0, 3, false);
  plan.meshShards = plan.worldSize;
  if (const json *m = r.find(j, "mesh", "plan", false)) {
    r.integer(*m, "replicas", plan.meshReplicas, "mesh", 1, kMaxWorld);
    r.integer(*m, "shards", plan.meshShards, "mesh", 1, kMaxWorld);
    r.integer(*m, "reshard", plan.meshReshard, "mesh", 0, kMaxWorld, false);
    r.integer(*m, "node", plan.meshNode, "mesh", 0, kMaxWorld, false);
  }
  r.integer(j, "arena_bytes", plan.arenaBytes, "plan", 0, kMaxBytes);
  r.integer(j, "host_arena_bytes", plan.hostArenaBytes, "plan", 0, kMaxBytes, false);
  r.integer(j, "nvme_bytes", plan.nvmeBytes, "plan", 0, kMaxBytes, false);
  r.integer(j, "swap_alignment", plan.swapAlignment, "plan", 0, kMaxSwapAlignment, false);
  if (const json *ls = r.find(j, "loss_scale", "plan", false))
    FSDP_RETURN_IF_ERROR(readLossScaling(r, *ls, plan.lossScaling));
  if (const json *o = r.find(j, "options", "plan", false)) {
    if (!o->is_object())
      return FSDP_ERROR("plan: options: expected an object, found ", o->type_name());
    plan.options = *o;
  }
  return Status::ok();
}

/// The compiler's memory report (device and, with offload, host bytes).
Status readMemory(Reader &r, const json &j, MemoryReport &memory) {
  if (const json *mem = r.find(j, "memory", "plan", true)) {
    auto field = [&](const char *k, int64_t &v) {
      r.integer(*mem, k, v, "memory", 0, kMaxBytes);
    };
    field("params", memory.params);
    field("grads", memory.grads);
    field("state", memory.state);
    field("activations", memory.activations);
    field("temps", memory.temps);
    field("inputs", memory.inputs);
    field("comm", memory.comm);
    field("peak", memory.peak);
    field("peak_live", memory.peakLive);
    if (const json *h = r.find(*mem, "host", "memory", false)) {
      r.integer(*h, "params", memory.hostParams, "memory.host", 0, kMaxBytes);
      r.integer(*h, "state", memory.hostState, "memory.host", 0, kMaxBytes);
      r.integer(*h, "peak", memory.hostPeak, "memory.host", 0, kMaxBytes);
      r.integer(*h, "peak_live", memory.hostPeakLive, "memory.host", 0, kMaxBytes);
    }
  }
  return r.status;
}

/// The buffers: dtype, kind, place in the arena, lifetime, sharding.
Status readBuffers(Reader &r, const json &j, Plan &plan) {
  // Program indices run from -1 (before the step) to the program's size.
  const int64_t kMaxIndex = INT64_C(1) << 40;
  if (const json *arr = r.objects(j, "buffers", "plan"))
    for (size_t i = 0; i < arr->size() && r.status; ++i) {
      const json &o = (*arr)[i];
      std::string where = "buffers[" + std::to_string(i) + "]";
      Buffer b;
      std::string dt, kind;
      r.string(o, "dtype", dt, where);
      r.string(o, "kind", kind, where);
      if (!r.status)
        break;
      if (!parseDType(dt, b.dtype))
        return FSDP_ERROR("plan: ", where, ".dtype: unknown dtype '", dt, "'");
      if (!parseBufferKind(kind, b.kind))
        return FSDP_ERROR("plan: ", where, ".kind: unknown kind '", kind, "'");
      r.integer(o, "id", b.id, where, 0, INT64_MAX);
      r.integer(o, "offset", b.offset, where, 0, kMaxBytes);
      r.integer(o, "bytes", b.bytes, where, 0, kMaxBytes);
      readShape(r, o, b.shape, where, dtypeSize(b.dtype));
      r.integer(o, "first", b.first, where, -1, kMaxIndex);
      r.integer(o, "last", b.last, where, -1, kMaxIndex);
      r.boolean(o, "persistent", b.persistent, where);
      r.string(o, "name", b.name, where, false);
      r.integer(o, "alias_of", b.aliasOf, where, -1, INT64_MAX, false);
      r.integer(o, "rank_stride", b.rankStride, where, 0, kMaxBytes, false);
      r.integer(o, "rank_period", b.rankPeriod, where, 0, kMaxWorld, false);
      std::string space = "device";
      r.string(o, "space", space, where, false);
      if (r.status && space != "device" && space != "host" && space != "nvme")
        return FSDP_ERROR("plan: ", where, ".space: '", space,
                          "' (expected \"device\", \"host\" or \"nvme\")");
      b.host = space == "host";
      b.nvme = space == "nvme";
      plan.buffers.push_back(b);
    }
  return Status::ok();
}

/// The flat parameter units (FSDP's FlatParameter).
Status readUnits(Reader &r, const json &j, Plan &plan) {
  if (const json *arr = r.objects(j, "units", "plan"))
    for (size_t i = 0; i < arr->size() && r.status; ++i) {
      const json &o = (*arr)[i];
      std::string where = "units[" + std::to_string(i) + "]";
      Unit u;
      r.string(o, "name", u.name, where);
      r.integer(o, "flat_numel", u.flatNumel, where, 0, kMaxBytes);
      r.integer(o, "padded_numel", u.paddedNumel, where, 0, kMaxBytes);
      r.integer(o, "shard_numel", u.shardNumel, where, 0, kMaxBytes);
      r.boolean(o, "sharded", u.sharded, where, false);
      r.boolean(o, "frozen", u.frozen, where, false);
      r.boolean(o, "offloaded", u.offloaded, where, false);
      r.integer(o, "buffer", u.buffer, where, -1, INT64_MAX, false);
      plan.units.push_back(u);
    }
  return Status::ok();
}

/// The parameters: shape, initializer and place in their unit.
Status readParams(Reader &r, const json &j, Plan &plan) {
  if (const json *arr = r.objects(j, "params", "plan"))
    for (size_t i = 0; i < arr->size() && r.status; ++i) {
      const json &o = (*arr)[i];
      std::string where = "params[" + std::to_string(i) + "]";
      Param p;
      std::string dt;
      r.string(o, "name", p.name, where);
      r.string(o, "dtype", dt, where);
      if (r.status && !parseDType(dt, p.dtype))
        return FSDP_ERROR("plan: ", where, ".dtype: unknown dtype '", dt, "'");
      readShape(r, o, p.shape, where, r.status ? dtypeSize(p.dtype) : 1);
      r.string(o, "init", p.init, where);
      r.number(o, "scale", p.scale, where);
      r.boolean(o, "trainable", p.trainable, where);
      r.integer(o, "unit", p.unit, where, 0, INT64_MAX);
      r.integer(o, "flat_offset", p.flatOffset, where, 0, kMaxBytes);
      r.integer(o, "buffer", p.buffer, where, -1, INT64_MAX);
      plan.params.push_back(p);
    }
  return Status::ok();
}

/// The optimizer states.
Status readStates(Reader &r, const json &j, Plan &plan) {
  if (const json *arr = r.objects(j, "states", "plan"))
    for (size_t i = 0; i < arr->size() && r.status; ++i) {
      const json &o = (*arr)[i];
      std::string where = "states[" + std::to_string(i) + "]";
      State st;
      r.string(o, "name", st.name, where);
      r.string(o, "kind", st.kind, where);
      r.integer(o, "buffer", st.buffer, where, -1, INT64_MAX);
      r.string(o, "param", st.param, where, false);
      r.string(o, "unit", st.unit, where, false);
      plan.states.push_back(st);
    }
  return Status::ok();
}

/// The step's inputs and outputs.
Status readIo(Reader &r, const json &j, Plan &plan) {
  for (auto [key, list] : {std::make_pair("inputs", &plan.inputs),
                           std::make_pair("outputs", &plan.outputs)})
    if (const json *arr = r.objects(j, key, "plan"))
      for (size_t i = 0; i < arr->size() && r.status; ++i) {
        const json &o = (*arr)[i];
        std::string where = std::string(key) + "[" + std::to_string(i) + "]";
        Binding b;
        r.string(o, "name", b.name, where);
        r.string(o, "role", b.role, where);
        r.integer(o, "buffer", b.buffer, where, -1, INT64_MAX);
        r.string(o, "param", b.param, where, false);
        r.integer(o, "range", b.range, where, 0, INT64_C(1) << 40, false);
        list->push_back(b);
      }
  return Status::ok();
}

/// The program: one instruction per op, with its operands and attributes.
Status readProgram(Reader &r, const json &j, Plan &plan) {
  if (const json *arr = r.objects(j, "program", "plan"))
    for (size_t i = 0; i < arr->size() && r.status; ++i) {
      const json &o = (*arr)[i];
      std::string where = "program[" + std::to_string(i) + "]";
      Instruction inst;
      r.string(o, "op", inst.op, where);
      r.ints(o, "in", inst.in, where, 0, INT64_MAX, kMaxOperands);
      r.ints(o, "out", inst.out, where, 0, INT64_MAX, kMaxOperands);
      if (const json *a = r.find(o, "attrs", where, false)) {
        if (!a->is_object())
          return FSDP_ERROR("plan: ", where, ".attrs: expected an object, found ",
                            a->type_name());
        inst.attrs = *a;
        // [Note: swap file]: [[file, staging, write], ...]
        if (auto sw = a->find("swap"); sw != a->end()) {
          if (!sw->is_array() || sw->size() > (size_t)kMaxOperands)
            return FSDP_ERROR("plan: ", where,
                              ".attrs.swap: expected an array of "
                              "[file, staging, write] entries");
          for (const json &e : *sw) {
            if (!e.is_array() || (e.size() != 3 && e.size() != 4) || !e[0].is_number_integer() ||
                !e[1].is_number_integer() || !e[2].is_boolean() ||
                (e.size() == 4 && !e[3].is_number_integer()))
              return FSDP_ERROR("plan: ", where,
                                ".attrs.swap: expected [file, staging, "
                                "write] or [file, staging, write, offset] (two buffer ids, a "
                                "boolean and a byte offset), found ",
                                e.dump());
            inst.swaps.push_back({e[0].get<int64_t>(), e[1].get<int64_t>(), e[2].get<bool>(),
                                  e.size() == 4 ? e[3].get<int64_t>() : 0});
          }
        }
        if (a->contains("swap_read_at"))
          r.integer(*a, "swap_read_at", inst.swapReadAt, where + ".attrs", 0, INT64_MAX);
      }
      plan.program.push_back(std::move(inst));
    }
  return Status::ok();
}

} // namespace

Status parsePlan(const std::string &text, Plan &plan) {
  int depth = jsonDepth(text);
  if (depth > kMaxJsonDepth)
    return FSDP_ERROR("plan: JSON nested ", depth, " levels deep (at most ", kMaxJsonDepth,
                      " accepted)");
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception &e) {
    return FSDP_ERROR("plan: not valid JSON (truncated or corrupt?): ", e.what());
  }
  if (!j.is_object())
    return FSDP_ERROR("plan: expected a JSON object");
  Reader r;
  FSDP_RETURN_IF_ERROR(readHeader(r, j, plan));
  FSDP_RETURN_IF_ERROR(readMemory(r, j, plan.memory));
  FSDP_RETURN_IF_ERROR(readBuffers(r, j, plan));
  FSDP_RETURN_IF_ERROR(readUnits(r, j, plan));
  FSDP_RETURN_IF_ERROR(readParams(r, j, plan));
  FSDP_RETURN_IF_ERROR(readStates(r, j, plan));
  FSDP_RETURN_IF_ERROR(readIo(r, j, plan));
  FSDP_RETURN_IF_ERROR(readProgram(r, j, plan));
  if (!r.status)
    return r.status;
  // The staging buffers, where they are of the kind one must be (what
  // validateSwaps refuses otherwise, by name).
  for (const Instruction &inst : plan.program)
    for (const Swap &s : inst.swaps)
      if (validId(plan, s.staging) && validId(plan, s.file)) {
        Buffer &t = plan.buffers[s.staging];
        const Buffer &f = plan.buffers[s.file];
        // (of the file buffer's bytes, or of whole blocks of them)
        const int64_t a = plan.swapAlignment;
        const bool size = (s.offset == 0 && t.bytes == f.bytes) ||
                          (a > 0 && s.offset % a == 0 && t.bytes % a == 0);
        t.swapStaging = t.swapStaging || (f.nvme && f.aliasOf < 0 && t.host && !t.persistent &&
                                          t.aliasOf < 0 && t.dtype == f.dtype && size);
      }
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
