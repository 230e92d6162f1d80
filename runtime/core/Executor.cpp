//===- Executor.cpp - one rank running a plan -----------------------------===//
//
// [Note: memory measurement]
// Two figures are measured, each compared with the compiler's:
// 1. The arena high-water mark: before initialization the arena is filled
//    with a sentinel word (a NaN payload no kernel produces); after a step,
//    the highest word that no longer holds the sentinel marks how much of
//    the arena the step really used. It equals arena_bytes when the
//    compiler's placement is tight.
// 2. Peak live bytes by the runtime's own liveness: from the instruction
//    operand lists alone (not the plan's first/last fields) each owning
//    buffer is live from its first to its last use (outputs to the end of
//    the step); the largest sum over instructions must equal the
//    compiler's peak_live.
//
//
// [Note: the communication thread]
// Every collective runs on one communication thread, in program order, so
// the order across ranks is the plan's order whatever the compute does. A
// collective marked `async` is queued and the main thread goes on with
// the next instructions (the overlap fsdp-schedule planned); its `wait`
// instruction blocks on it. A synchronous collective is queued and waited
// for at once (behind any async ones still queued, which keeps the order).
// The memory plan keeps an async collective's input and output alive until
// its wait, so the two threads never touch the same bytes.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Executor.h"

#include "runtime/core/Init.h"
#include "runtime/cpu/Dispatch.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace fsdp {

namespace {
constexpr uint32_t kSentinel = 0x7fc0dead; // a NaN payload

double nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
} // namespace

double scheduledLr(const std::string &schedule, double lr, double minLr,
                   int64_t warmup, int64_t steps, int64_t step) {
  if (warmup > 0 && step <= warmup)
    return lr * (double)step / (double)warmup;
  if (schedule == "cosine" && steps > warmup) {
    double progress = (double)(step - warmup) / (double)(steps - warmup);
    return minLr + 0.5 * (lr - minLr) * (1 + std::cos(M_PI * progress));
  }
  return lr;
}

Executor::Executor(const Plan &plan, Communicator &comm)
    : plan(plan), comm(comm) {
  commThread = std::thread([this] { commLoop(); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> l(mu);
    stopping = true;
  }
  cv.notify_all();
  commThread.join();
  std::free(arena);
}

void Executor::commLoop() {
  for (;;) {
    std::packaged_task<Status()> job;
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return stopping || !jobs.empty(); });
      if (jobs.empty())
        return;
      job = std::move(jobs.front());
      jobs.pop_front();
    }
    job();
  }
}

std::future<Status> Executor::submit(std::function<Status()> fn) {
  std::packaged_task<Status()> task(std::move(fn));
  std::future<Status> f = task.get_future();
  {
    std::lock_guard<std::mutex> l(mu);
    jobs.push_back(std::move(task));
  }
  cv.notify_one();
  return f;
}

uint8_t *Executor::address(int64_t id) const {
  return cpu::bufferAddress(plan, id, arena, shardIndex());
}

Communicator &Executor::group(const std::string &name) {
  if (name == "shard" && shardComm)
    return *shardComm;
  if (name == "replica" && replicaComm)
    return *replicaComm;
  return comm;
}

int64_t Executor::commBytes() const {
  int64_t n = comm.bytesSent();
  for (const auto *g : {&shardComm, &replicaComm})
    if (*g)
      n += (*g)->bytesSent();
  return n;
}

Status Executor::init(uint64_t seed) {
  if (comm.size() != plan.worldSize)
    return FSDP_ERROR("the plan was compiled for ", plan.worldSize,
                      " rank(s) but this job has ", comm.size(),
                      ": recompile with world-size=", comm.size(),
                      " or run with --nproc ", plan.worldSize);
  // [Note: hybrid sharding] On a replicas x shards mesh every rank joins
  // two groups: the `shards` consecutive ranks of its replica (all-gather
  // and reduce-scatter of parameters and gradients) and the `replicas`
  // ranks holding the same shard (the all-reduce of each gradient shard).
  // Every rank creates both, in this order, before the first collective.
  if (plan.meshReplicas > 1 && plan.meshShards > 1) {
    int64_t r = comm.rank(), s = plan.meshShards;
    int64_t replica = r / s, shard = r % s;
    std::vector<int64_t> shardRanks, replicaRanks;
    for (int64_t j = 0; j < s; ++j)
      shardRanks.push_back(replica * s + j);
    for (int64_t i = 0; i < plan.meshReplicas; ++i)
      replicaRanks.push_back(i * s + shard);
    FSDP_RETURN_IF_ERROR(
        comm.subgroup(shardRanks, "replica-" + std::to_string(replica) + ".shards", shardComm));
    FSDP_RETURN_IF_ERROR(
        comm.subgroup(replicaRanks, "shard-" + std::to_string(shard) + ".replicas", replicaComm));
  } else if (plan.meshReplicas > 1) {
    // replicas x 1: nothing is sharded; the shard group is this rank alone.
    FSDP_RETURN_IF_ERROR(comm.subgroup({comm.rank()}, "self", shardComm));
  } else if (plan.meshShards > 1 && plan.worldSize > 1) {
    FSDP_RETURN_IF_ERROR(comm.subgroup({comm.rank()}, "self", replicaComm));
  }
  size_t bytes = (size_t)std::max<int64_t>(plan.arenaBytes, 64);
  bytes = (bytes + 63) / 64 * 64;
  arena = static_cast<uint8_t *>(std::aligned_alloc(64, bytes));
  if (!arena)
    return FSDP_ERROR("cannot allocate the arena of ", bytes, " bytes");
  uint32_t *words = reinterpret_cast<uint32_t *>(arena);
  std::fill(words, words + bytes / 4, kSentinel);

  // Parameters: per-parameter buffers, or unit storage (whole or shard).
  for (const Param &p : plan.params)
    if (p.buffer >= 0)
      initParam(p, seed, 0, p.numel(), reinterpret_cast<float *>(address(p.buffer)));
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const Unit &unit = plan.units[u];
    if (unit.buffer < 0)
      continue;
    float *dst = reinterpret_cast<float *>(address(unit.buffer));
    int64_t first = unit.sharded ? shardIndex() * unit.shardNumel : 0;
    int64_t count = unit.sharded ? unit.shardNumel : unit.paddedNumel;
    std::fill(dst, dst + count, 0.0f); // padding stays zero
    for (const Param &p : plan.params) {
      if (p.unit != (int64_t)u)
        continue;
      int64_t lo = std::max(first, p.flatOffset);
      int64_t hi = std::min(first + count, p.flatOffset + p.numel());
      if (lo < hi)
        initParam(p, seed, lo - p.flatOffset, hi - lo, dst + (lo - first));
    }
  }
  for (const State &s : plan.states)
    std::memset(address(s.buffer), 0, plan.buffers[s.buffer].bytes);

  // The runtime's own liveness (see the note above).
  std::vector<int64_t> first(plan.buffers.size(), INT64_MAX), last(plan.buffers.size(), -1);
  auto owner = [&](int64_t id) {
    return plan.buffers[id].aliasOf >= 0 ? plan.buffers[id].aliasOf : id;
  };
  int64_t n = (int64_t)plan.program.size();
  std::map<int64_t, int64_t> asyncInput; // async output buffer -> its input
  for (int64_t i = 0; i < n; ++i) {
    const Instruction &inst = plan.program[i];
    std::vector<int64_t> touched(inst.in);
    touched.insert(touched.end(), inst.out.begin(), inst.out.end());
    // An async collective reads its input until its wait.
    if (cpu::isCollectiveOp(inst.op) && inst.op != "wait" &&
        inst.attrs.value("async", false))
      asyncInput[inst.out[0]] = inst.in[0];
    if (inst.op == "wait" && asyncInput.count(inst.in[0]))
      touched.push_back(asyncInput[inst.in[0]]);
    for (int64_t id : touched) {
      int64_t o = owner(id);
      first[o] = std::min(first[o], i);
      last[o] = std::max(last[o], i);
    }
  }
  for (const Binding &b : plan.outputs)
    last[owner(b.buffer)] = n;
  std::vector<int64_t> live(std::max<int64_t>(n, 1), 0);
  for (size_t id = 0; id < plan.buffers.size(); ++id) {
    const Buffer &b = plan.buffers[id];
    if (b.aliasOf >= 0)
      continue;
    int64_t lo = b.persistent ? 0 : first[id], hi = b.persistent ? n - 1 : last[id];
    if (!b.persistent && last[id] < 0)
      continue; // never touched
    for (int64_t i = std::max<int64_t>(lo, 0); i <= std::min(hi, n - 1); ++i)
      live[i] += b.bytes;
  }
  peakLive = *std::max_element(live.begin(), live.end());
  return Status::ok();
}

Status Executor::runCollective(const Instruction &inst) {
  if (inst.op == "wait") {
    auto it = inFlight.find(inst.in[0]);
    if (it == inFlight.end())
      return FSDP_ERROR("wait on buffer ", inst.in[0],
                        " but no collective writing it is in flight");
    Status st = it->second.get();
    inFlight.erase(it);
    return st;
  }
  const Buffer &in = plan.buffers[inst.in[0]], &out = plan.buffers[inst.out[0]];
  void *src = address(inst.in[0]);
  void *dst = address(inst.out[0]);
  const DType dtype = in.dtype; // checkInstruction: in and out agree
  bool mean = inst.attrs.value("reduce", std::string("sum")) == "mean";
  std::string op = inst.op;
  int64_t inBytes = in.bytes, outN = out.numel(), inN = in.numel();
  Communicator *c = &group(inst.attrs.value("group", std::string("world")));
  auto job = [c, op, src, dst, dtype, mean, inBytes, outN, inN]() -> Status {
    if (op == "all_reduce") {
      if (src != dst)
        std::memmove(dst, src, inBytes);
      return c->allReduce(dst, outN, dtype, mean);
    }
    if (op == "reduce_scatter")
      return c->reduceScatter(src, dst, outN, dtype, mean);
    return c->allGather(src, dst, inN, dtype);
  };
  std::future<Status> done;
  if (tracing) {
    // The span on the communication thread: from when it starts running
    // the collective (not when it was queued) to its end.
    TraceEvent ev{op, 1, currentStep, traceIndex, 0, 0};
    done = submit([this, job, ev]() mutable {
      ev.startUs = nowUs();
      Status st = job();
      ev.durUs = nowUs() - ev.startUs;
      std::lock_guard<std::mutex> l(traceMu);
      commEvents.push_back(std::move(ev));
      return st;
    });
  } else {
    done = submit(job);
  }
  if (!inst.attrs.value("async", false))
    return done.get();
  if (inFlight.count(inst.out[0]))
    return FSDP_ERROR(inst.op, ": a collective writing buffer ", inst.out[0],
                      " is already in flight");
  inFlight[inst.out[0]] = std::move(done);
  return Status::ok();
}

Status Executor::step(int64_t step, double lr, float &loss) {
  for (const Binding &b : plan.inputs) {
    if (b.role == "lr")
      *reinterpret_cast<float *>(address(b.buffer)) = (float)lr;
    else if (b.role == "step")
      *reinterpret_cast<float *>(address(b.buffer)) = (float)step;
  }
  currentStep = step;
  for (size_t i = 0; i < plan.program.size(); ++i) {
    const Instruction &inst = plan.program[i];
    double t0 = tracing ? nowUs() : 0;
    traceIndex = (int64_t)i;
    Status st = cpu::isCollectiveOp(inst.op)
                    ? runCollective(inst)
                    : cpu::runInstruction(plan, inst, arena, shardIndex());
    if (tracing) {
      // A collective's span here is its issue (async) or the whole blocking
      // call (sync); a wait's is the time compute stood still.
      bool issue = cpu::isCollectiveOp(inst.op) && inst.op != "wait" &&
                   inst.attrs.value("async", false);
      computeEvents.push_back({issue ? "issue " + inst.op : inst.op, 0, step,
                               (int64_t)i, t0, nowUs() - t0});
    }
    if (!st)
      return Status::error("step " + std::to_string(step) + ", instruction #" +
                           std::to_string(i) + " (" + inst.op + "): " +
                           st.message());
  }
  if (!inFlight.empty()) {
    // Drain before reporting: nothing may be in flight past the step.
    for (auto &[id, f] : inFlight)
      f.get();
    inFlight.clear();
    return FSDP_ERROR("step ", step, ": the plan left an async collective "
                      "without a wait");
  }
  for (const Binding &b : plan.outputs)
    if (b.role == "loss")
      loss = *reinterpret_cast<float *>(address(b.buffer));
  return Status::ok();
}

std::vector<TraceEvent> Executor::traceEvents() {
  std::vector<TraceEvent> all(computeEvents);
  std::lock_guard<std::mutex> l(traceMu);
  all.insert(all.end(), commEvents.begin(), commEvents.end());
  return all;
}

MemoryMeasurement Executor::measureMemory() const {
  MemoryMeasurement m;
  const uint32_t *words = reinterpret_cast<const uint32_t *>(arena);
  int64_t n = plan.arenaBytes / 4;
  while (n > 0 && words[n - 1] == kSentinel)
    --n;
  m.highWater = n * 4;
  m.peakLive = peakLive;
  return m;
}

bool Executor::paramElement(const Param &p, int64_t i, float *&ptr) const {
  if (p.buffer >= 0) {
    ptr = reinterpret_cast<float *>(address(p.buffer)) + i;
    return true;
  }
  const Unit &u = plan.units[p.unit];
  int64_t f = p.flatOffset + i;
  int64_t first = u.sharded ? shardIndex() * u.shardNumel : 0;
  int64_t count = u.sharded ? u.shardNumel : u.paddedNumel;
  if (f < first || f >= first + count)
    return false;
  ptr = reinterpret_cast<float *>(address(u.buffer)) + (f - first);
  return true;
}

Status Executor::gatherParams(TensorMap &out) {
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const Unit &unit = plan.units[u];
    std::vector<float> flat;
    if (unit.buffer >= 0) {
      flat.resize(unit.paddedNumel);
      const float *src = reinterpret_cast<const float *>(address(unit.buffer));
      if (unit.sharded)
        FSDP_RETURN_IF_ERROR(group("shard").allGather(src, flat.data(), unit.shardNumel,
                                                         DType::F32));
      else
        std::memcpy(flat.data(), src, sizeof(float) * unit.paddedNumel);
    }
    for (const Param &p : plan.params) {
      if (p.unit != (int64_t)u)
        continue;
      Tensor t;
      t.dtype = DType::F32;
      t.shape = p.shape;
      t.data.resize(p.numel() * 4);
      const float *src = p.buffer >= 0
                             ? reinterpret_cast<const float *>(address(p.buffer))
                             : flat.data() + p.flatOffset;
      std::memcpy(t.data.data(), src, t.data.size());
      out[p.name] = std::move(t);
    }
  }
  return Status::ok();
}

Status Executor::loadParams(const TensorMap &in) {
  // Strict, like PyTorch's load_state_dict: a tensor the model does not
  // have is as much a sign of the wrong file as a missing one.
  std::string extra;
  int64_t extras = 0;
  for (const auto &kv : in) {
    bool known = false;
    for (const Param &p : plan.params)
      known |= p.name == kv.first;
    if (!known && extras++ < 5)
      extra += (extra.empty() ? "'" : ", '") + kv.first + "'";
  }
  if (extras)
    return FSDP_ERROR("the file has ", extras, " tensor(s) the model does not: ", extra,
                      extras > 5 ? ", ..." : "");
  for (const Param &p : plan.params) {
    auto it = in.find(p.name);
    if (it == in.end())
      return FSDP_ERROR("the file has no tensor '", p.name, "' (a parameter of the model)");
    const Tensor &t = it->second;
    auto shapeStr = [](const std::vector<int64_t> &s) {
      std::string r = "[";
      for (size_t i = 0; i < s.size(); ++i)
        r += (i ? ", " : "") + std::to_string(s[i]);
      return r + "]";
    };
    if (t.dtype != DType::F32 || t.shape != p.shape)
      return FSDP_ERROR("tensor '", p.name, "' has shape ", shapeStr(t.shape),
                        " and dtype ", dtypeName(t.dtype), " in the file; the model's "
                        "parameter has shape ", shapeStr(p.shape), " and dtype ",
                        dtypeName(p.dtype));
    const float *src = reinterpret_cast<const float *>(t.data.data());
    for (int64_t i = 0; i < p.numel(); ++i) {
      float *dst;
      if (paramElement(p, i, dst))
        *dst = src[i];
    }
  }
  return Status::ok();
}

Status Executor::gradOutputs(TensorMap &out) const {
  for (const Binding &b : plan.outputs) {
    if (b.role != "grad")
      continue;
    const Buffer &buf = plan.buffers[b.buffer];
    Tensor t;
    t.shape = buf.shape;
    t.data.assign(address(b.buffer), address(b.buffer) + buf.bytes);
    out[b.param] = std::move(t);
  }
  return Status::ok();
}

} // namespace fsdp
