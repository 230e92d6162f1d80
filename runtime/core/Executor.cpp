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
// [Note: the communication stream]
// Every collective runs on the device's one comm stream, in program order,
// so the order across ranks is the plan's order whatever the compute does
// ([Note: streams and events] in Device.h). A collective marked `async` is
// enqueued there after the compute that precedes it, and compute goes on
// with the next instructions (the overlap fsdp-schedule planned); its
// `wait` instruction makes compute wait for it. A synchronous collective
// is enqueued and waited for at once (behind any async ones still queued,
// which keeps the order). The memory plan keeps an async collective's
// input and output alive until its wait, so the two streams never touch
// the same bytes. The host waits for the device once, at the end of the
// step. An async host instruction (the offloaded optimizer's update) goes
// the same way on the device's host stream: issued behind the compute
// before it (its gradient's to_host copy), joined by its wait; the memory
// plan keeps all its operands alive until that wait. An async copy between
// the arenas (activation offload) goes the same way on the copy stream.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Executor.h"
#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"

#include "runtime/core/Bf16.h"
#include "runtime/core/Init.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>

namespace fsdp {

namespace {
constexpr uint32_t kSentinel = 0x7fc0dead; // a NaN payload

double nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// [Note: parameter storage dtypes]
// Trainable units store f32 (the master copy the update writes), or bf16
// with fsdp-mixed-precision's master-dtype=bf16 (no f32 master: the update
// widens them, steps in f32 and rounds them back itself, stochastically
// with stochastic-rounding=true). A frozen
// unit may store its compute dtype (fsdp-shard frozen-storage=compute):
// bf16 or f16, each element the f32 value rounded to nearest even, as the
// cast before each use would have rounded it. Initialization, --init-from
// and setParamElement narrow f32 values into it; gatherParams (--save,
// --dump-dir) and getParamElement widen them back, exactly.

} // namespace

namespace {
const char *const kLrScheduleKinds[] = {"constant", "cosine", "linear", "wsd"};
const char *const kLrDecayShapes[] = {"linear", "cosine", "1-sqrt"};

template <size_t N> std::string listOf(const char *const (&names)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i)
    out += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + names[i];
  return out;
}

template <size_t N> bool isOneOf(const char *const (&names)[N], const std::string &name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}
} // namespace

std::string lrScheduleKinds() { return listOf(kLrScheduleKinds); }
bool isLrScheduleKind(const std::string &kind) { return isOneOf(kLrScheduleKinds, kind); }
std::string lrDecayShapes() { return listOf(kLrDecayShapes); }
bool isLrDecayShape(const std::string &shape) { return isOneOf(kLrDecayShapes, shape); }

double scheduledLr(const LrSchedule &s, int64_t step) {
  if (s.warmup > 0 && step <= s.warmup)
    return s.lr * (double)step / (double)s.warmup;
  if (s.kind == "cosine" && s.steps > s.warmup) {
    double progress = (double)(step - s.warmup) / (double)(s.steps - s.warmup);
    return s.minLr + 0.5 * (s.lr - s.minLr) * (1 + std::cos(M_PI * progress));
  }
  // linear, and wsd's decay: the fraction of the decay's span left at
  // `step`, from 1 just before it starts to 0 at the last step.
  int64_t span = s.kind == "linear" ? s.steps - s.warmup : s.kind == "wsd" ? s.decaySteps : 0;
  if (span <= 0)
    return s.lr;
  double left = std::min((double)(s.steps - step) / (double)span, 1.0);
  if (left >= 1)
    return s.lr; // before the decay: the peak itself, not min + (lr - min) rounded
  left = std::max(left, 0.0);
  if (s.kind == "wsd" && s.decayShape == "cosine")
    return s.minLr + 0.5 * (s.lr - s.minLr) * (1 + std::cos(M_PI * (1 - left)));
  if (s.kind == "wsd" && s.decayShape == "1-sqrt")
    return s.minLr + (s.lr - s.minLr) * (1 - std::sqrt(1 - left));
  return s.minLr + (s.lr - s.minLr) * left;
}

Executor::Executor(const Plan &plan, Communicator &comm, Device &device)
    : plan(plan), comm(comm), dev(device) {}

Executor::~Executor() {
  // Queued collectives refer to this executor (tracing) and the arena.
  (void)dev.synchronize();
}

uint8_t *Executor::address(int64_t id) const {
  return dev.address(bufferOffset(plan, id, shardIndex()));
}

Status Executor::settle(int64_t id) const {
  if (!carriedPending || !(plan.buffers[id].host || plan.buffers[id].nvme))
    return Status::ok();
  // The host stream drains; the events stay for the next step's joins
  // (complete by then).
  carriedPending = false;
  return dev.synchronize();
}

Status Executor::finishCarried() {
  if (!carriedPending)
    return Status::ok();
  carriedPending = false;
  Status st = dev.synchronize();
  inFlight.clear();
  if (!st)
    return Status::error("the host updates of the last step (joined in the next one): " +
                         st.message());
  return st;
}

Status Executor::readBuffer(int64_t id, void *host) const {
  FSDP_RETURN_IF_ERROR(settle(id));
  return readBytes(id, 0, host, plan.buffers[id].bytes);
}

Status Executor::writeBuffer(int64_t id, const void *host) {
  FSDP_RETURN_IF_ERROR(settle(id));
  return writeBytes(id, 0, host, plan.buffers[id].bytes);
}

Status Executor::readBytes(int64_t id, int64_t at, void *host, int64_t n) const {
  const Buffer &b = plan.buffers[id];
  if (b.nvme) // [Note: swap file]
    return swap ? swap->read(b.offset + at, host, n)
                : FSDP_ERROR("buffer ", b.name, " is in the swap file, which is not open");
  return dev.copyToHost(host, address(id) + at, n);
}

Status Executor::writeBytes(int64_t id, int64_t at, const void *host, int64_t n) {
  const Buffer &b = plan.buffers[id];
  if (b.nvme)
    return swap ? swap->write(b.offset + at, host, n)
                : FSDP_ERROR("buffer ", b.name, " is in the swap file, which is not open");
  return dev.copyToDevice(address(id) + at, host, n);
}

// [Note: swap pipeline]
// An instruction that swaps (Plan.h's [Note: swap file]) runs in three
// stages on three host threads, each ordered after the one before by an
// event:
//   swap-in:  its staging buffers read from the file   (after `ready`)
//   host:     the update itself                        (after the reads)
//   swap-out: the updated staging written back         (after the update)
// and its `done` (what the plan's wait joins) is the write's. So while the
// host stream runs unit k's update, the swap-in stream is already reading
// unit k+1's state (issued as soon as compute reached it) and the swap-out
// stream writing unit k-1's: DeepSpeed's pipelined optimizer swapper, here
// ordered by events rather than by the update loop. It is sound because a
// read starts after `ready` (compute's event at the instruction: every
// earlier user of its staging memory has been joined by then, the memory
// plan keeping a staging buffer live to its instruction's wait) and after
// the last write of the same state, if that write is still in flight.
// A failed read fails the update and the write behind it (a wait between
// host threads carries the failure): state the read did not bring is never
// updated nor written back.
//
// With a read ahead (the plan's swap_read_at, offload-nvme's read-ahead)
// the reads are issued after an earlier instruction instead, with compute's
// event there as `ready` (the memory plan keeps the staging live from
// there), and the update's host-stream work waits for that read: the drive
// reads the next units' state while compute is still on the gradients (and
// the first ones' during the forward pass) instead of idling until
// compute reaches each update. Reads are issued in program order either
// way, so the swap-in stream's queue is the updates' order.
void Executor::prepareSwaps() {
  swapIo.assign(plan.program.size(), nullptr);
  readsAfter.assign(plan.program.size(), {});
  readAhead.clear();
  for (size_t i = 0; i < plan.program.size(); ++i) {
    const Instruction &inst = plan.program[i];
    if (inst.swaps.empty())
      continue;
    if (inst.swapReadAt >= 0)
      readsAfter[inst.swapReadAt].push_back((int64_t)i);
    auto io = std::make_shared<SwapIo>();
    for (const Swap &s : inst.swaps) {
      // (A copy of part of a unit's storage: the staging's blocks from
      // s.offset on; otherwise all of it, s.offset 0.)
      const Buffer &f = plan.buffers[s.file];
      io->parts.push_back({s.file, f.offset + s.offset, plan.buffers[s.staging].bytes,
                           address(s.staging), s.write});
      io->writes = io->writes || s.write;
    }
    swapIo[i] = std::move(io);
  }
}

std::function<Status()> Executor::swapTransfer(int64_t index, bool write, bool traced) {
  // One direction's transfers of an instruction, as stream work; with
  // --trace a span on that direction's track.
  return [this, file = swap.get(), io = swapIo[index], index, step = currentStep, traced,
          write]() -> Status {
    const double start = traced ? nowUs() : 0;
    for (const SwapIo::Part &p : io->parts)
      if (!write)
        FSDP_RETURN_IF_ERROR(file->swapIn(p.offset, p.staging, p.bytes));
      else if (p.write)
        FSDP_RETURN_IF_ERROR(file->swapOut(p.offset, p.staging, p.bytes));
    if (traced) {
      std::lock_guard<std::mutex> l(traceMu);
      commEvents.push_back({write ? "swap_out" : "swap_in", write ? kSwapOutTrack : kSwapInTrack,
                            step, index, start, nowUs() - start});
    }
    return Status::ok();
  };
}

Status Executor::issueSwapReads(int64_t index, Event &ready, std::unique_ptr<Event> &read) {
  if (!swap)
    return FSDP_ERROR(plan.program[index].op,
                      " reads from the swap file (offload-nvme), which is not open");
  Stream &in = dev.swapInStream();
  FSDP_RETURN_IF_ERROR(dev.wait(in, ready));
  // After the last write of the state it reads, if still in flight (one
  // write's event guards every part it wrote: waited for once).
  const Event *waited = nullptr;
  for (const SwapIo::Part &p : swapIo[index]->parts)
    if (auto w = lastSwapWrite.find(p.file); w != lastSwapWrite.end()) {
      if (w->second.get() != waited)
        FSDP_RETURN_IF_ERROR(dev.wait(in, *w->second));
      waited = w->second.get();
      lastSwapWrite.erase(w);
    }
  dev.enqueue(in, swapTransfer(index, false, tracing));
  read = dev.record(in);
  return Status::ok();
}

Status Executor::readAheadAfter(int64_t i) {
  if (readsAfter[i].empty())
    return Status::ok();
  // Compute's event after instruction i: every earlier user of the
  // staging's bytes is joined by then (the plan keeps it live from i).
  std::unique_ptr<Event> ready = dev.record(dev.computeStream());
  for (int64_t k : readsAfter[i]) {
    std::unique_ptr<Event> read;
    FSDP_RETURN_IF_ERROR(issueSwapReads(k, *ready, read));
    readAhead[k] = std::move(read);
  }
  return Status::ok();
}

Status Executor::swapReads(int64_t index, Event &ready, std::unique_ptr<Event> &read) {
  // Read ahead after an earlier instruction, or now.
  if (auto it = readAhead.find(index); it != readAhead.end()) {
    read = std::move(it->second);
    readAhead.erase(it);
    return Status::ok();
  }
  return issueSwapReads(index, ready, read);
}

Status Executor::runCopyWithSwaps(const Instruction &inst) {
  // [Note: parameters on disk]
  // With offload-nvme-params a copy of a unit's storage (or of a view of
  // it) to the device copies from a staging buffer that the swap-in
  // stream fills from the file first: after compute's event here, or read
  // ahead after an earlier instruction (the plan's swap_read_at, so that
  // the drive reads the next copies' bytes while this one runs). The copy
  // waits for that read on its own stream: on the CPU device (whose copy
  // stream is the compute stream) the issuing thread blocks until the
  // bytes are there; on CUDA a host function holds the copy stream only.
  // The read also waits for the last write-back of the same file buffer
  // still in flight (issueSwapReads), so a copy never reads a master shard
  // its update is still writing (next-step's updates write in the next
  // step, beside the forward pass's copies).
  const int64_t index = &inst - plan.program.data();
  Stream &compute = dev.computeStream();
  std::unique_ptr<Event> ready = dev.record(compute), read;
  FSDP_RETURN_IF_ERROR(swapReads(index, *ready, read));
  if (!isAsyncCopy(inst)) {
    FSDP_RETURN_IF_ERROR(dev.wait(compute, *read));
    return dev.run(index);
  }
  if (inFlight.count(inst.out[0]))
    return FSDP_ERROR(inst.op, ": a copy writing buffer ", inst.out[0], " is already in flight");
  Stream &copyStream = dev.copyStream();
  std::unique_ptr<Event> done;
  FSDP_RETURN_IF_ERROR(dev.wait(copyStream, *ready));
  FSDP_RETURN_IF_ERROR(dev.wait(copyStream, *read));
  FSDP_RETURN_IF_ERROR(dev.runOn(copyStream, index, done));
  inFlight[inst.out[0]] = std::move(done);
  return Status::ok();
}

Status Executor::runHostWithSwaps(const Instruction &inst, Event &ready,
                                  std::unique_ptr<Event> &done,
                                  const std::shared_ptr<TraceEvent> &span) {
  Stream &hostStream = dev.hostStream();
  const int64_t index = &inst - plan.program.data();
  std::shared_ptr<const SwapIo> io = swapIo[index];
  Stream &out = dev.swapOutStream();
  if (io) {
    std::unique_ptr<Event> read;
    FSDP_RETURN_IF_ERROR(swapReads(index, ready, read));
    FSDP_RETURN_IF_ERROR(dev.wait(hostStream, *read));
  }
  if (span)
    dev.enqueue(hostStream, [span] {
      span->startUs = nowUs();
      return Status::ok();
    });
  FSDP_RETURN_IF_ERROR(dev.runOn(hostStream, index, done));
  if (span) {
    dev.enqueue(hostStream, [this, span] {
      span->durUs = nowUs() - span->startUs;
      std::lock_guard<std::mutex> l(traceMu);
      commEvents.push_back(*span);
      return Status::ok();
    });
    // The join waits for the stamp too: a span ends before its join does.
    done = dev.record(hostStream);
  }
  if (!io || !io->writes)
    return Status::ok();
  FSDP_RETURN_IF_ERROR(dev.wait(out, *done));
  dev.enqueue(out, swapTransfer(index, true, span != nullptr));
  done = dev.record(out);
  std::shared_ptr<Event> written = dev.record(out);
  for (const SwapIo::Part &p : io->parts)
    if (p.write)
      lastSwapWrite[p.file] = written;
  return Status::ok();
}

Communicator &Executor::group(const std::string &name) {
  if (name == "shard" && shardComm)
    return *shardComm;
  if (name == "replica" && replicaComm)
    return *replicaComm;
  if (name == "reshard" && reshardComm)
    return *reshardComm;
  if (name == "node" && nodeComm)
    return *nodeComm;
  if (name == "cross" && crossComm)
    return *crossComm;
  return comm;
}

int64_t Executor::commBytes() const {
  int64_t n = comm.bytesSent();
  for (const auto *g : {&shardComm, &replicaComm, &reshardComm, &nodeComm, &crossComm})
    if (*g)
      n += (*g)->bytesSent();
  return n;
}

Status Executor::init(uint64_t seed) {
  if (comm.size() != plan.worldSize)
    return FSDP_ERROR("the plan was compiled for ", plan.worldSize, " rank(s) but this job has ",
                      comm.size(), ": recompile with world-size=", comm.size(),
                      " or run with --nproc ", plan.worldSize);
  scaler = LossScaler{};
  runSeed = seed;
  scaler.scale = plan.lossScaling.init;
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
  // [Note: reshard group] With reshard-after-forward=G (hpZ) a rank also
  // joins the G consecutive ranks of its shard group that gather the
  // parts each kept after the forward pass (its index there is shard mod
  // G, the rank_period of those shard views). Created after the mesh's
  // groups, in the same order on every rank.
  if (plan.meshReshard > 1) {
    int64_t r = comm.rank(), g = plan.meshReshard;
    int64_t first = r - shardIndex() % g;
    std::vector<int64_t> ranks;
    for (int64_t j = 0; j < g; ++j)
      ranks.push_back(first + j);
    FSDP_RETURN_IF_ERROR(comm.subgroup(ranks, "reshard-" + std::to_string(first / g), reshardComm));
  }
  // [Note: node groups] With a node size L (mesh "node", hierarchical
  // qgZ) a shard group of S ranks is S / L nodes of L consecutive ranks,
  // and a rank also joins its node ("node": the L ranks of its node) and
  // the S / L ranks of its shard group at its place on their nodes
  // ("cross", ascending). Created after the reshard group, node then
  // cross, on every rank.
  if (plan.meshNode > 1) {
    int64_t r = comm.rank(), l = plan.meshNode, s = shardIndex();
    int64_t base = r - s, first = base + s / l * l, place = s % l;
    std::vector<int64_t> nodeRanks, crossRanks;
    for (int64_t i = 0; i < l; ++i)
      nodeRanks.push_back(first + i);
    for (int64_t n = 0; n < plan.meshShards / l; ++n)
      crossRanks.push_back(base + place + n * l);
    FSDP_RETURN_IF_ERROR(comm.subgroup(nodeRanks, "node-" + std::to_string(first), nodeComm));
    FSDP_RETURN_IF_ERROR(comm.subgroup(
        crossRanks, "cross-" + std::to_string(base) + "-" + std::to_string(place), crossComm));
  }
  FSDP_RETURN_IF_ERROR(dev.allocateArena(plan.arenaBytes, plan.hostArenaBytes));
  // [Note: swap file]: created (zeros: the state's initial value) before
  // anything is written to it; a plan without one has none.
  swap.reset();
  if (plan.nvmeBytes > 0) {
    if (nvmeDir.empty())
      return FSDP_ERROR(
          "the plan keeps its optimizer state",
          std::any_of(plan.buffers.begin(), plan.buffers.end(),
                      [](const Buffer &b) { return b.nvme && b.kind == BufferKind::Param; })
              ? " and parameters"
              : "",
          " in a swap file (fsdp-offload's nvme, ", plan.nvmeBytes,
          " bytes a rank): give fsdp-run --nvme-dir DIR, "
          "a directory on a fast local disk");
    // [Note: swap file I/O]: direct where every staging buffer is on a
    // block (the host arena starts on a page: hostArenaStart).
    bool stagingAligned = plan.swapAlignment > 0;
    for (const Instruction &inst : plan.program)
      for (const Swap &s : inst.swaps)
        stagingAligned =
            stagingAligned && (uintptr_t)address(s.staging) % (uintptr_t)plan.swapAlignment == 0;
    swap = std::make_unique<SwapFile>();
    FSDP_RETURN_IF_ERROR(swap->open(nvmeDir, comm.rank(), plan.nvmeBytes, nvmeIo,
                                    plan.swapAlignment, stagingAligned));
  }
  FSDP_RETURN_IF_ERROR(dev.prepare(plan, shardIndex()));
  offCompute.clear();
  carriedBufs.clear();
  for (const Instruction &inst : plan.program) {
    offCompute.push_back(isCollectiveOp(inst.op) || isAsyncCopy(inst) || isAsyncHost(plan, inst) ||
                         !inst.swaps.empty());
    if (isCarried(inst))
      carriedBufs.insert(inst.in[0]);
  }
  prepareSwaps();
  lastSwapWrite.clear();
  {
    // See [Note: memory measurement]: every word starts as the sentinel,
    // in both arenas ([Note: two arenas]).
    // The device arena ends before hostStart (on a page) where the device
    // allocates it apart (CUDA: its size; the CPU's block holds both).
    int64_t hostStart = hostArenaStart(plan.arenaBytes);
    std::pair<int64_t, int64_t> ranges[] = {
        {0, plan.hostArenaBytes > 0 ? std::min(hostStart, dev.arenaBytes()) : dev.arenaBytes()},
        {hostStart, hostStart + plan.hostArenaBytes}};
    for (auto [from, to] : ranges)
      if (to - from >= 4)
        FSDP_RETURN_IF_ERROR(dev.fillWords(dev.address(from), kSentinel, (to - from) / 4 * 4));
  }

  // Parameters: per-parameter buffers, or unit storage (whole or shard),
  // initialized on the host and copied over.
  std::vector<float> host;
  for (const Param &p : plan.params)
    if (p.buffer >= 0) {
      host.assign(p.numel(), 0.0f);
      initParam(p, seed, 0, p.numel(), host.data());
      FSDP_RETURN_IF_ERROR(writeBuffer(p.buffer, host.data()));
    }
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const Unit &unit = plan.units[u];
    if (unit.buffer < 0)
      continue;
    int64_t first = unit.sharded ? shardIndex() * unit.shardNumel : 0;
    int64_t count = unit.sharded ? unit.shardNumel : unit.paddedNumel;
    host.assign(count, 0.0f); // padding stays zero
    for (const Param &p : plan.params) {
      if (p.unit != (int64_t)u)
        continue;
      int64_t lo = std::max(first, p.flatOffset);
      int64_t hi = std::min(first + count, p.flatOffset + p.numel());
      if (lo < hi)
        initParam(p, seed, lo - p.flatOffset, hi - lo, host.data() + (lo - first));
    }
    // [Note: parameter storage dtypes]: f32 as it is, else rounded.
    DType t = plan.buffers[unit.buffer].dtype;
    if (t == DType::F32) {
      FSDP_RETURN_IF_ERROR(writeBuffer(unit.buffer, host.data()));
      continue;
    }
    std::vector<uint8_t> stored((size_t)(count * dtypeSize(t)));
    narrowParams(t, host.data(), count, stored.data());
    FSDP_RETURN_IF_ERROR(writeBuffer(unit.buffer, stored.data()));
  }
  // Optimizer state starts at zero: filled where it lives (a host vector
  // of zeros copied over cost seconds for a billion-parameter model).
  for (const State &s : plan.states) {
    if (plan.buffers[s.buffer].nvme)
      continue; // the swap file starts as zeros
    int64_t bytes = plan.buffers[s.buffer].bytes;
    if (bytes % 4 == 0) {
      FSDP_RETURN_IF_ERROR(dev.fillWords(address(s.buffer), 0, bytes));
      continue;
    }
    std::vector<uint8_t> zeros(bytes, 0);
    FSDP_RETURN_IF_ERROR(writeBuffer(s.buffer, zeros.data()));
  }

  // The runtime's own liveness (see the note above).
  std::vector<int64_t> first(plan.buffers.size(), INT64_MAX), last(plan.buffers.size(), -1);
  auto owner = [&](int64_t id) { return storageRoot(plan, id); };
  int64_t n = (int64_t)plan.program.size();
  // async output buffer -> the inputs it reads until its wait
  std::map<int64_t, std::vector<int64_t>> asyncInputs;
  for (int64_t i = 0; i < n; ++i) {
    const Instruction &inst = plan.program[i];
    std::vector<int64_t> touched(inst.in);
    touched.insert(touched.end(), inst.out.begin(), inst.out.end());
    // An async collective or copy reads its input until its wait; an
    // async host update every operand.
    if ((isCollectiveOp(inst.op) && inst.op != "wait" && isAsync(inst)) || isAsyncCopy(inst))
      asyncInputs[inst.out[0]] = {inst.in[0]};
    else if (isAsyncHost(plan, inst))
      asyncInputs[inst.out[0]] = inst.in;
    // One the next step joins reads its operands through the whole step.
    if (isAsyncHost(plan, inst) && carriedBufs.count(inst.out[0]))
      for (int64_t id : inst.in) {
        first[owner(id)] = 0;
        last[owner(id)] = n - 1;
      }
    if (inst.op == "wait") {
      auto it = asyncInputs.find(inst.in[0]);
      if (it != asyncInputs.end())
        touched.insert(touched.end(), it->second.begin(), it->second.end());
    }
    // A read ahead fills its staging from the earlier instruction on.
    if (inst.swapReadAt >= 0)
      for (const Swap &s : inst.swaps)
        first[owner(s.staging)] = std::min(first[owner(s.staging)], inst.swapReadAt);
    for (int64_t id : touched) {
      int64_t o = owner(id);
      first[o] = std::min(first[o], i);
      last[o] = std::max(last[o], i);
    }
  }
  for (const Binding &b : plan.outputs)
    last[owner(b.buffer)] = n;
  std::vector<int64_t> live(std::max<int64_t>(n, 1), 0), hostLive(live.size(), 0);
  for (size_t id = 0; id < plan.buffers.size(); ++id) {
    const Buffer &b = plan.buffers[id];
    if (b.aliasOf >= 0 || b.nvme) // the swap file is in no arena
      continue;
    int64_t lo = b.persistent ? 0 : first[id], hi = b.persistent ? n - 1 : last[id];
    if (!b.persistent && last[id] < 0)
      continue; // never touched
    std::vector<int64_t> &l = b.host ? hostLive : live;
    for (int64_t i = std::max<int64_t>(lo, 0); i <= std::min(hi, n - 1); ++i)
      l[i] += b.bytes;
  }
  peakLive = *std::max_element(live.begin(), live.end());
  hostPeakLive = *std::max_element(hostLive.begin(), hostLive.end());
  return Status::ok();
}

Status Executor::runOffCompute(const Instruction &inst) {
  Stream &compute = dev.computeStream();
  if (inst.op == "wait") {
    auto it = inFlight.find(inst.in[0]);
    // A carried wait joins the previous step's update: none in the first
    // step, nor after finishCarried.
    if (it == inFlight.end() && isCarried(inst))
      return Status::ok();
    if (it == inFlight.end())
      return FSDP_ERROR("wait on buffer ", inst.in[0],
                        " but no collective, copy or host update writing it is in flight");
    // A copy-stream join (fsdp-offload): the copy that follows waits for
    // the previous step's update, compute only for that copy.
    Status st = dev.wait(isCopyStreamJoin(inst) ? dev.copyStream() : compute, *it->second);
    inFlight.erase(it);
    return st;
  }
  if (isArenaCopy(inst.op) && !inst.swaps.empty())
    return runCopyWithSwaps(inst);
  if (isAsyncCopy(inst)) {
    // Activation offload's copy between the arenas, on the copy stream
    // behind the compute that wrote its input (beside the collectives);
    // its wait joins it back.
    if (inFlight.count(inst.out[0]))
      return FSDP_ERROR(inst.op, ": a copy writing buffer ", inst.out[0], " is already in flight");
    Stream &copyStream = dev.copyStream();
    std::unique_ptr<Event> ready = dev.record(compute), done;
    FSDP_RETURN_IF_ERROR(dev.wait(copyStream, *ready));
    FSDP_RETURN_IF_ERROR(dev.runOn(copyStream, &inst - plan.program.data(), done));
    inFlight[inst.out[0]] = std::move(done);
    return Status::ok();
  }
  if (isAsyncHost(plan, inst) || !inst.swaps.empty()) {
    // The offloaded update on the host stream, behind the compute that
    // copied its gradient to the host; its wait joins it back. One that
    // swaps but is not async is joined at once.
    if (isAsync(inst) && inFlight.count(inst.out[0]))
      return FSDP_ERROR(inst.op, ": a host update writing buffer ", inst.out[0],
                        " is already in flight");
    Stream &hostStream = dev.hostStream();
    std::unique_ptr<Event> ready = dev.record(compute), done;
    FSDP_RETURN_IF_ERROR(dev.wait(hostStream, *ready));
    // --trace: the update's span on the host track, stamped by the host
    // stream's own thread (on both devices a host thread running its work
    // in order): from when it starts the update (its gradient is on the
    // host, its state read) to its end, kept under the step that issued it
    // (with next-step the next step joins it). Its swaps have spans of
    // their own on the swap-in and swap-out tracks.
    // The span is stamped by jobs on the host stream around the update, so
    // the join (`done`, recorded after them: the host stream's, or the
    // write's behind it) waits for the stamps too.
    const bool traced = tracing;
    std::shared_ptr<TraceEvent> span;
    if (traced)
      span = std::make_shared<TraceEvent>(
          TraceEvent{inst.op, kHostTrack, currentStep, traceIndex, 0, 0});
    FSDP_RETURN_IF_ERROR(runHostWithSwaps(inst, *ready, done, span));
    if (!isAsync(inst))
      return dev.wait(compute, *done);
    inFlight[inst.out[0]] = std::move(done);
    return Status::ok();
  }
  const Buffer &in = plan.buffers[inst.in[0]], &out = plan.buffers[inst.out[0]];
  const void *src = address(inst.in[0]);
  void *dst = address(inst.out[0]);
  const DType dtype = in.dtype; // checkInstruction: in and out agree
  ReduceOp reduce = ReduceOp::Sum;
  parseReduceOp(inst.attrs.value("reduce", std::string("sum")), reduce);
  std::string op = inst.op;
  int64_t outN = out.numel(), inN = in.numel();
  Communicator *c = &group(inst.attrs.value("group", std::string("world")));
  // [Note: node comm stream] in Device.h: the plan's node-stream
  // collectives on the second comm stream, except a host-staged one on a
  // GPU (a host function, which CUDA may serialize across streams).
  const bool onNode = onNodeCommStream(inst) && !(dev.enqueuesAsync() && !c->capturable());
  Stream &commStream = onNode ? dev.nodeCommStream() : dev.commStream();
  Stream *stream = &commStream;
  auto job = [c, op, src, dst, dtype, reduce, outN, inN, stream]() -> Status {
    if (op == "all_reduce")
      return c->allReduce(src, dst, outN, dtype, reduce, stream);
    if (op == "reduce_scatter")
      return c->reduceScatter(src, dst, outN, dtype, reduce, stream);
    if (op == "all_to_all")
      return c->allToAll(src, dst, inN / c->size(), dtype, stream);
    return c->allGather(src, dst, inN, dtype, stream);
  };
  // The collective reads what compute wrote before it.
  std::unique_ptr<Event> ready = dev.record(compute);
  FSDP_RETURN_IF_ERROR(dev.wait(commStream, *ready));
  if (tracing) {
    // The span on the comm stream: from when it starts running the
    // collective (not when it was queued) to its end.
    TraceEvent ev{op, onNode ? kNodeCommTrack : kCommTrack, currentStep, traceIndex, 0, 0};
    dev.enqueue(commStream, [this, job, ev]() mutable {
      ev.startUs = nowUs();
      Status st = job();
      ev.durUs = nowUs() - ev.startUs;
      std::lock_guard<std::mutex> l(traceMu);
      commEvents.push_back(std::move(ev));
      return st;
    });
  } else {
    dev.enqueue(commStream, std::move(job));
  }
  std::unique_ptr<Event> done = dev.record(commStream);
  if (!inst.attrs.value("async", false))
    return dev.wait(compute, *done);
  if (inFlight.count(inst.out[0]))
    return FSDP_ERROR(inst.op, ": a collective writing buffer ", inst.out[0],
                      " is already in flight");
  inFlight[inst.out[0]] = std::move(done);
  return Status::ok();
}

Status Executor::fillInputs(DataSource &data, int64_t step) {
  // The batch is made in host memory, then copied to the device.
  std::map<int64_t, std::vector<uint8_t>> staged;
  for (const Binding &b : plan.inputs)
    if (b.role == "input" || b.role == "target") {
      // Starts from the buffer's bytes: a source that writes part of it
      // leaves the rest as it was, as when it wrote into the arena.
      std::vector<uint8_t> &bytes = staged[b.buffer];
      bytes.resize(plan.buffers[b.buffer].bytes);
      FSDP_RETURN_IF_ERROR(readBuffer(b.buffer, bytes.data()));
    }
  auto addr = [](void *ctx, int64_t id) -> uint8_t * {
    auto &m = *static_cast<std::map<int64_t, std::vector<uint8_t>> *>(ctx);
    auto it = m.find(id);
    return it == m.end() ? nullptr : it->second.data();
  };
  FSDP_RETURN_IF_ERROR(data.fill(step, addr, &staged));
  for (auto &[id, bytes] : staged)
    FSDP_RETURN_IF_ERROR(writeBuffer(id, bytes.data()));
  return Status::ok();
}

// [Note: step capture]
// A plan's step is the same work every step: the same kernels on the same
// arena addresses, the collectives in the same order; only the contents of
// the input buffers (batch, lr, step, loss scale) change, and those are
// written before the step. So the device can record the step once (CUDA:
// stream capture into a graph; the comm stream joins the recording through
// the events of runOffCompute, and every async collective's wait joins it
// back) and replay the recording, one launch per step instead of one per
// kernel. The first step runs as usual (lazy initialisation: cuBLASLt,
// NCCL's first collectives), the second is recorded and then replayed, and
// every later step is a replay. The loss and the found-inf flag are read
// after the step's synchronisation, as without capture. What a replay
// cannot do: per-instruction tracing (refused with capture), counting
// communicated bytes on the host (counted once, at the recording), and
// host-staged collectives (host code, not device work: refused).
Status Executor::setStepCapture(bool on) {
  if (on) {
    if (!dev.canCapture())
      return FSDP_ERROR("device ", dev.name(),
                        " cannot capture a step (CUDA graphs need "
                        "--device cuda)");
    for (Communicator *c : {&comm, shardComm.get(), replicaComm.get(), reshardComm.get(),
                            nodeComm.get(), crossComm.get()})
      if (c && c->size() > 1 && !c->capturable())
        return FSDP_ERROR("the step's collectives run host code (the host-staged "
                          "communicator of ranks sharing a GPU): it cannot be captured");
    if (tracing)
      return FSDP_ERROR("a captured step is replayed whole: no per-instruction trace");
    // Copies to and from the (pinned) host arena are DMA a graph replays
    // (activation offload); an instruction writing host memory otherwise
    // is host code (the offloaded optimizer's update).
    for (const Instruction &inst : plan.program)
      if (inst.op != "to_host" && inst.op != "wait" && !inst.out.empty() &&
          plan.buffers[inst.out[0]].host)
        return FSDP_ERROR("the plan offloads its optimizer: the update runs on the host "
                          "between the step's device work, which a CUDA graph cannot "
                          "replay (run without --cuda-graphs)");
  }
  captureSteps = on;
  return Status::ok();
}

Status Executor::step(int64_t step, double lr, float &loss) {
  const LossScaling &ls = plan.lossScaling;
  for (const Binding &b : plan.inputs) {
    float v;
    if (b.role == "lr")
      v = (float)lr;
    else if (b.role == "step") // the optimizer's count: applied updates
      v = (float)(step - scaler.skippedSteps);
    else if (b.role == "loss_scale")
      v = (float)scaler.scale;
    else
      continue;
    FSDP_RETURN_IF_ERROR(writeBuffer(b.buffer, &v));
  }
  currentStep = step;
  FSDP_RETURN_IF_ERROR(dev.setDropoutContext({runSeed, step, comm.rank(), true}));
  const bool capturing = captureSteps && !captured && stepsRun >= 1;
  ++stepsRun;
  if (capturing)
    FSDP_RETURN_IF_ERROR(dev.beginCapture());
  // [Note: stamped trace]
  // On a device that only enqueues (CUDA), the host's clock around run()
  // times a launch. So --trace stamps the compute stream before the first
  // instruction and after each one (CUDA events, no host wait): after the
  // step's synchronize, instruction i's span is the device time between
  // stamps i and i + 1, the step running as it does untraced (overlap
  // included; a wait's span is the time compute stood still). The spans
  // are placed on the host's clock by the last stamp, taken as the time
  // the step's synchronize returned (the comm track's spans are host
  // times). --trace-sync instead synchronizes after every instruction:
  // each instruction's cost alone, without overlap.
  const bool stamped = tracing && dev.enqueuesAsync() && !traceSync && dev.stampsCompute();
  const size_t traceFrom = computeEvents.size();
  if (stamped && !captured)
    FSDP_RETURN_IF_ERROR(dev.stampCompute(0));
  for (size_t i = 0; i < plan.program.size() && !captured; ++i) {
    const Instruction &inst = plan.program[i];
    double t0 = tracing ? nowUs() : 0;
    traceIndex = (int64_t)i;
    Status st = offCompute[i] ? runOffCompute(inst) : dev.run((int64_t)i);
    if (st)
      st = readAheadAfter((int64_t)i);
    if (stamped && st)
      st = dev.stampCompute((int64_t)i + 1);
    // Without stamps, an asynchronous device's span is its work's only
    // after a synchronize (the step runs slower and without overlap).
    else if (tracing && st && dev.enqueuesAsync())
      st = dev.synchronize();
    if (tracing) {
      // A collective's span here is its issue (async) or the whole blocking
      // call (sync); a wait's is the time compute stood still.
      bool issue = offCompute[i] && inst.op != "wait" && isAsync(inst);
      computeEvents.push_back(
          {issue ? "issue " + inst.op : inst.op, 0, step, (int64_t)i, t0, nowUs() - t0});
    }
    if (!st) {
      if (capturing)
        (void)dev.endCapture(false);
      (void)dev.synchronize(); // nothing may run past the step
      inFlight.clear();
      readAhead.clear();
      carriedPending = false;
      return Status::error("step " + std::to_string(step) + ", instruction #" + std::to_string(i) +
                           " (" + inst.op + "): " + st.message());
    }
  }
  if (capturing) {
    if (!inFlight.empty()) {
      (void)dev.endCapture(false);
      inFlight.clear();
      return FSDP_ERROR("step ", step,
                        ": the plan left an async collective, copy or host update "
                        "without a wait");
    }
    FSDP_RETURN_IF_ERROR(dev.endCapture(true));
    captured = true;
  }
  if (captured) {
    Status st = dev.replay();
    if (!st) {
      (void)dev.synchronize();
      return Status::error("step " + std::to_string(step) +
                           " (the captured step): " + st.message());
    }
  }
  // The step's one host synchronization; host updates the next step
  // joins (carried) run on.
  Status synced = carriedBufs.empty() ? dev.synchronize() : dev.synchronizeDevice();
  const bool onlyCarried = std::all_of(inFlight.begin(), inFlight.end(), [&](const auto &kv) {
    return carriedBufs.count(kv.first) > 0;
  });
  carriedPending = !inFlight.empty() && onlyCarried;
  if (!onlyCarried) {
    (void)dev.synchronize();
    carriedPending = false;
    inFlight.clear();
    return FSDP_ERROR("step ", step,
                      ": the plan left an async collective, "
                      "copy or host update without a wait");
  }
  if (!synced)
    return Status::error("step " + std::to_string(step) + ": " + synced.message());
  if (stamped) {
    const double end = nowUs();
    const int64_t last = (int64_t)plan.program.size();
    for (size_t k = traceFrom; k < computeEvents.size(); ++k) {
      TraceEvent &ev = computeEvents[k];
      double durMs = 0, toEndMs = 0;
      FSDP_RETURN_IF_ERROR(dev.stampGapMs(ev.index, ev.index + 1, durMs));
      FSDP_RETURN_IF_ERROR(dev.stampGapMs(ev.index, last, toEndMs));
      ev.startUs = end - 1e3 * toEndMs;
      ev.durUs = 1e3 * durMs;
    }
  }
  float sumsq = 0;
  for (const Binding &b : plan.outputs) {
    if (b.role == "loss")
      FSDP_RETURN_IF_ERROR(readBuffer(b.buffer, &loss));
    else if (b.role == "grad_sumsq")
      FSDP_RETURN_IF_ERROR(readBuffer(b.buffer, &sumsq));
  }
  // The norm of the gradients before clipping; under loss scaling they
  // carry this step's scale, which the norm reported leaves out.
  gradNorm = std::sqrt((double)sumsq) / (ls.enabled ? scaler.scale : 1.0);
  if (ls.enabled) {
    // GradScaler.update: back off after an overflow (the updates skipped
    // themselves), grow after growthInterval clean steps.
    scaler.lastSkipped = !std::isfinite(sumsq);
    if (scaler.lastSkipped) {
      ++scaler.skippedSteps;
      scaler.growthTracker = 0;
      scaler.scale *= ls.backoffFactor;
      if (scaler.scale < 0x1p-126)
        return FSDP_ERROR("step ", step,
                          ": the gradients overflow at every loss scale "
                          "(the scale fell below 2^-126): they are inf/NaN whatever the "
                          "scale; lower the learning rate or check the data");
    } else if (++scaler.growthTracker >= ls.growthInterval) {
      scaler.growthTracker = 0;
      scaler.scale = std::min(scaler.scale * ls.growthFactor, 0x1p127);
    }
  }
  return Status::ok();
}

bool Executor::hasGradNorm() const {
  return std::any_of(plan.outputs.begin(), plan.outputs.end(),
                     [](const Binding &b) { return b.role == "grad_sumsq"; });
}

// [Note: evaluation]
// A plan holds one program, the training step; there is no separate
// forward-only program to keep in step with it. Evaluation runs the
// instructions of that program's prefix (up to the last instruction, not
// a collective, that writes the loss output) that the loss depends on:
// the forward pass, its parameter gathers and their waits, in program
// order. Then the collectives that reduce the loss across ranks and their
// waits (the compiler issues them last).
// Every rank runs the same instructions in the same order, so the
// collective order stays identical across ranks. Nothing persistent is
// written before the optimizer runs: every gradient buffer is first
// written, not accumulated into, within the step (checked end to end:
// training with evaluations is bitwise training without; test/lit/e2e/
// eval.test). Liveness and the arena are the step's: the prefix touches a
// subset of its buffers, so the measured high-water cannot grow.
Status Executor::evaluate(float &loss) {
  FSDP_RETURN_IF_ERROR(finishCarried());
  int64_t lossBuf = -1;
  for (const Binding &b : plan.outputs)
    if (b.role == "loss")
      lossBuf = b.buffer;
  if (lossBuf < 0)
    return FSDP_ERROR("evaluate: the plan has no loss output");
  // Evaluation runs the model as nn.Module.eval() would: no dropout.
  FSDP_RETURN_IF_ERROR(dev.setDropoutContext({runSeed, currentStep, comm.rank(), false}));
  int64_t end = -1;
  for (size_t i = 0; i < plan.program.size(); ++i)
    if (!offCompute[i] && std::find(plan.program[i].out.begin(), plan.program[i].out.end(),
                                    lossBuf) != plan.program[i].out.end())
      end = (int64_t)i;
  if (end < 0)
    return FSDP_ERROR("evaluate: no instruction of the plan computes the loss");
  // The loss's dependency slice of the prefix, walked backwards: an
  // instruction runs when it writes a buffer that a running instruction
  // (or the loss) reads. Buffers are tracked by the buffer owning their
  // memory (a view's alias_of), so a write through one view counts for
  // every view of that memory: conservative, never missing a writer. The
  // forward pass stays; with gradient accumulation the earlier
  // micro-batches' backward passes and the prefetched backward gathers
  // drop out. Parameters, optimizer state and inputs have no writer in the
  // prefix: they hold what init, the last step and fillInputs left.
  auto owner = [&](int64_t id) {
    for (int guard = 0; plan.buffers[id].aliasOf >= 0 && guard < 64; ++guard)
      id = plan.buffers[id].aliasOf;
    return id;
  };
  std::vector<char> needed(plan.buffers.size(), 0);
  needed[owner(lossBuf)] = 1;
  std::vector<size_t> order;
  for (int64_t i = end; i >= 0; --i) {
    const Instruction &inst = plan.program[i];
    bool writes = false;
    for (int64_t o : inst.out)
      writes = writes || needed[owner(o)];
    if (!writes)
      continue;
    order.push_back((size_t)i);
    for (int64_t in : inst.in)
      needed[owner(in)] = 1;
  }
  std::reverse(order.begin(), order.end());
  for (size_t i = end + 1; i < plan.program.size(); ++i) {
    const Instruction &inst = plan.program[i];
    if (offCompute[i] && (inst.op == "wait" ? inst.in[0] : inst.out[0]) == lossBuf)
      order.push_back(i);
  }
  const bool wasTracing = tracing;
  tracing = false;
  Status st = Status::ok();
  for (size_t k = 0; k < order.size() && st; ++k) {
    size_t i = order[k];
    if (k > 0 && order[k - 1] == (size_t)end) {
      // Anything else still in flight (none: every gather in the slice
      // has its wait there too) completes before the loss's collectives.
      for (auto &f : inFlight)
        if (f.first != lossBuf && st)
          st = dev.wait(dev.computeStream(), *f.second);
      for (auto it = inFlight.begin(); it != inFlight.end();)
        it = it->first == lossBuf ? std::next(it) : inFlight.erase(it);
      if (!st)
        break;
    }
    st = offCompute[i] ? runOffCompute(plan.program[i]) : dev.run((int64_t)i);
    if (!st)
      st = Status::error("evaluation, instruction #" + std::to_string(i) + " (" +
                         plan.program[i].op + "): " + st.message());
  }
  for (auto &f : inFlight)
    if (st)
      st = dev.wait(dev.computeStream(), *f.second);
  tracing = wasTracing;
  Status synced = dev.synchronize();
  inFlight.clear();
  FSDP_RETURN_IF_ERROR(st);
  FSDP_RETURN_IF_ERROR(synced);
  return readBuffer(lossBuf, &loss);
}

nlohmann::json Executor::lossScalerState() const {
  if (!plan.lossScaling.enabled)
    return nullptr;
  return {{"scale", scaler.scale},
          {"growth_tracker", scaler.growthTracker},
          {"skipped_steps", scaler.skippedSteps}};
}

Status Executor::restoreLossScaler(const nlohmann::json &state) {
  if (!plan.lossScaling.enabled || state.is_null())
    return Status::ok();
  auto bad = [&](const char *why) {
    return FSDP_ERROR("checkpoint: loss_scale ", state.dump(), ": ", why);
  };
  if (!state.is_object() || !state.contains("scale") || !state["scale"].is_number() ||
      !state.contains("growth_tracker") || !state["growth_tracker"].is_number_integer() ||
      !state.contains("skipped_steps") || !state["skipped_steps"].is_number_integer())
    return bad("expected {scale, growth_tracker, skipped_steps}");
  double scale = state["scale"].get<double>();
  int e = 0;
  if (!(scale >= 0x1p-126 && scale <= 0x1p127) || std::frexp(scale, &e) != 0.5)
    return bad("the scale is not a power of two in [2^-126, 2^127]");
  int64_t tracker = state["growth_tracker"].get<int64_t>(),
          skipped = state["skipped_steps"].get<int64_t>();
  if (tracker < 0 || skipped < 0)
    return bad("negative counters");
  scaler.scale = scale;
  scaler.growthTracker = tracker;
  scaler.skippedSteps = skipped;
  return Status::ok();
}

std::vector<TraceEvent> Executor::traceEvents() {
  std::vector<TraceEvent> all(computeEvents);
  std::lock_guard<std::mutex> l(traceMu);
  all.insert(all.end(), commEvents.begin(), commEvents.end());
  return all;
}

MemoryMeasurement Executor::measureMemory() const {
  // The highest word that no longer holds the sentinel, scanning down from
  // the arena's end a chunk at a time (host copies of device memory); the
  // same for the host arena from its start ([Note: two arenas]).
  auto highWater = [&](int64_t start, int64_t bytes) {
    int64_t n = bytes / 4;
    std::vector<uint32_t> chunk(std::min<int64_t>(n, 1 << 18));
    while (n > 0) {
      int64_t lo = std::max<int64_t>(0, n - (int64_t)chunk.size());
      if (!dev.copyToHost(chunk.data(), dev.address(start + lo * 4), (n - lo) * 4))
        break;
      int64_t k = n - lo;
      while (k > 0 && chunk[k - 1] == kSentinel)
        --k;
      if (k > 0) {
        n = lo + k;
        break;
      }
      n = lo;
    }
    return n * 4;
  };
  MemoryMeasurement m;
  m.highWater = highWater(0, plan.arenaBytes);
  m.peakLive = peakLive;
  m.hostHighWater = highWater(hostArenaStart(plan.arenaBytes), plan.hostArenaBytes);
  m.hostPeakLive = hostPeakLive;
  return m;
}

bool Executor::paramLocation(const Param &p, int64_t i, int64_t &buffer, int64_t &elem) const {
  if (p.buffer >= 0) {
    buffer = p.buffer;
    elem = i;
    return true;
  }
  const Unit &u = plan.units[p.unit];
  int64_t f = p.flatOffset + i;
  int64_t first = u.sharded ? shardIndex() * u.shardNumel : 0;
  int64_t count = u.sharded ? u.shardNumel : u.paddedNumel;
  if (f < first || f >= first + count)
    return false;
  buffer = u.buffer;
  elem = f - first;
  return true;
}

bool Executor::holdsParamElement(const Param &p, int64_t i) const {
  int64_t b, e;
  return paramLocation(p, i, b, e);
}

Status Executor::getParamElement(const Param &p, int64_t i, float &value) const {
  int64_t b, e;
  if (!paramLocation(p, i, b, e))
    return FSDP_ERROR("parameter ", p.name, " element ", i, " is not on this rank");
  FSDP_RETURN_IF_ERROR(settle(b));
  DType t = plan.buffers[b].dtype;
  uint8_t raw[4];
  FSDP_RETURN_IF_ERROR(readBytes(b, dtypeSize(t) * e, raw, dtypeSize(t)));
  widenParams(t, raw, 1, &value);
  return Status::ok();
}

Status Executor::setParamElement(const Param &p, int64_t i, float value) {
  int64_t b, e;
  if (!paramLocation(p, i, b, e))
    return FSDP_ERROR("parameter ", p.name, " element ", i, " is not on this rank");
  FSDP_RETURN_IF_ERROR(settle(b));
  DType t = plan.buffers[b].dtype;
  uint8_t raw[4];
  narrowParams(t, &value, 1, raw);
  return writeBytes(b, dtypeSize(t) * e, raw, dtypeSize(t));
}

Status Executor::gatherParams(TensorMap &out) {
  FSDP_RETURN_IF_ERROR(finishCarried());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const Unit &unit = plan.units[u];
    std::vector<float> flat;
    if (unit.buffer >= 0) {
      flat.resize(unit.paddedNumel);
      // Read as stored, widened ([Note: parameter storage dtypes]).
      DType t = plan.buffers[unit.buffer].dtype;
      std::vector<float> mine(unit.sharded ? unit.shardNumel : unit.paddedNumel);
      std::vector<uint8_t> raw(plan.buffers[unit.buffer].bytes);
      FSDP_RETURN_IF_ERROR(readBuffer(unit.buffer, raw.data()));
      widenParams(t, raw.data(), (int64_t)mine.size(), mine.data());
      if (unit.sharded) // a host all-gather of host copies (no stream: host buffers)
        FSDP_RETURN_IF_ERROR(
            group("shard").allGather(mine.data(), flat.data(), unit.shardNumel, DType::F32));
      else
        flat = std::move(mine);
    }
    for (const Param &p : plan.params) {
      if (p.unit != (int64_t)u)
        continue;
      Tensor t;
      t.dtype = DType::F32;
      t.shape = p.shape;
      t.data.resize(p.numel() * 4);
      if (p.buffer >= 0)
        FSDP_RETURN_IF_ERROR(readBuffer(p.buffer, t.data.data()));
      else
        std::memcpy(t.data.data(), flat.data() + p.flatOffset, t.data.size());
      out[p.name] = std::move(t);
    }
  }
  return Status::ok();
}

Status Executor::gatherMoments(TensorMap &out) {
  FSDP_RETURN_IF_ERROR(finishCarried());
  for (const State &st : plan.states) {
    if (st.kind != "exp_avg" && st.kind != "exp_avg_sq" && st.kind != "momentum_buffer")
      continue;
    const Buffer &b = plan.buffers[st.buffer];
    std::vector<uint8_t> raw(b.bytes);
    FSDP_RETURN_IF_ERROR(readBuffer(st.buffer, raw.data()));
    std::vector<float> mine;
    if (b.dtype == DType::I8) {
      // 8-bit or 4-bit moments (state-dtype=8bit|4bit): decoded, as the
      // update reads them, of what it shadows: a parameter, or its unit
      // whole or a shard
      std::vector<int64_t> sizes;
      for (const Param &p : plan.params)
        if (p.name == st.param)
          sizes.push_back(p.numel());
      for (const Unit &u : plan.units)
        if (st.param.empty() && u.name == st.unit)
          sizes = {u.shardNumel, u.paddedNumel};
      const bool four = plan.stateCodes4();
      int64_t n = 0, block = 0;
      for (int64_t k : sizes)
        if (!block && (block = four ? moments4::blockOfPacked(k, b.bytes)
                                    : moments8::blockOfPacked(k, b.bytes)))
          n = k;
      if (!block)
        return FSDP_ERROR("state ", st.name, ": ", b.bytes, " bytes are not ", four ? 4 : 8,
                          "-bit moments of what it shadows");
      mine.resize(n);
      if (four)
        moments4::decodeShard(raw.data(), n, block, st.kind == "exp_avg_sq", mine.data());
      else
        moments8::decodeShard(raw.data(), n, block, st.kind == "exp_avg_sq", mine.data());
    } else {
      mine.resize(b.numel());
      widenParams(b.dtype, raw.data(), b.numel(), mine.data());
    }
    if (!st.param.empty()) { // a parameter's own (unsharded plans)
      Tensor t{DType::F32, b.shape, std::vector<uint8_t>(b.numel() * 4)};
      std::memcpy(t.data.data(), mine.data(), t.data.size());
      out[st.param + "." + st.kind] = std::move(t);
      continue;
    }
    int64_t u = -1;
    for (size_t i = 0; i < plan.units.size(); ++i)
      if (plan.units[i].name == st.unit)
        u = (int64_t)i;
    if (u < 0)
      return FSDP_ERROR("state ", st.name, " shadows no unit of the plan");
    const Unit &unit = plan.units[u];
    // Sharded with its unit's update (any stage above 0): this rank's
    // shard of the padded flat moments.
    std::vector<float> flat(unit.paddedNumel);
    const int64_t have = (int64_t)mine.size();
    if (have == unit.shardNumel && unit.shardNumel != unit.paddedNumel)
      FSDP_RETURN_IF_ERROR(
          group("shard").allGather(mine.data(), flat.data(), unit.shardNumel, DType::F32));
    else if (have == unit.paddedNumel)
      flat = std::move(mine);
    else
      return FSDP_ERROR("state ", st.name, " has ", have, " elements, neither its unit's ",
                        unit.paddedNumel, " nor a shard's ", unit.shardNumel);
    for (const Param &p : plan.params) {
      if (p.unit != u)
        continue;
      Tensor t{DType::F32, p.shape, std::vector<uint8_t>(p.numel() * 4)};
      std::memcpy(t.data.data(), flat.data() + p.flatOffset, t.data.size());
      out[p.name + "." + st.kind] = std::move(t);
    }
  }
  return Status::ok();
}

Status Executor::loadParams(const TensorMap &in) {
  FSDP_RETURN_IF_ERROR(finishCarried());
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
      return FSDP_ERROR("tensor '", p.name, "' has shape ", shapeStr(t.shape), " and dtype ",
                        dtypeName(t.dtype),
                        " in the file; the model's "
                        "parameter has shape ",
                        shapeStr(p.shape), " and dtype ", dtypeName(p.dtype));
  }
  // Checked above: every parameter has an f32 tensor of its shape.
  return loadParams([&](const Param &p, int64_t first, int64_t count, float *out) {
    std::memcpy(out, in.at(p.name).data.data() + 4 * first, (size_t)count * 4);
    return Status::ok();
  });
}

Status Executor::loadParams(const ParamReader &read, int64_t chunk) {
  FSDP_RETURN_IF_ERROR(finishCarried());
  if (chunk < 1)
    return FSDP_ERROR("loadParams: chunk of ", chunk, " elements");
  std::vector<float> host;
  std::vector<uint8_t> stored; // a 16-bit chunk
  // Elements [lo, hi) of `p` to byte `to` of buffer `id` (in the swap
  // file with offload-nvme-params), stored as `t` ([Note: parameter
  // storage dtypes]), a chunk at a time.
  auto load = [&](const Param &p, int64_t lo, int64_t hi, int64_t id, int64_t to,
                  DType t = DType::F32) -> Status {
    for (int64_t at = lo; at < hi; at += chunk) {
      int64_t n = std::min(chunk, hi - at);
      host.resize((size_t)std::max<int64_t>((int64_t)host.size(), n));
      FSDP_RETURN_IF_ERROR(read(p, at, n, host.data()));
      const void *src = host.data();
      if (t != DType::F32) {
        stored.resize((size_t)(n * dtypeSize(t)));
        narrowParams(t, host.data(), n, stored.data());
        src = stored.data();
      }
      FSDP_RETURN_IF_ERROR(writeBytes(id, to + dtypeSize(t) * (at - lo), src, dtypeSize(t) * n));
    }
    return Status::ok();
  };
  for (const Param &p : plan.params) {
    if (p.buffer >= 0) {
      if (plan.buffers[p.buffer].bytes != 4 * p.numel())
        return FSDP_ERROR("parameter '", p.name, "': its buffer holds ",
                          plan.buffers[p.buffer].bytes, " bytes, not ", p.numel(), " f32 values");
      FSDP_RETURN_IF_ERROR(load(p, 0, p.numel(), p.buffer, 0));
      continue;
    }
    // The part of the parameter in this rank's slice of its unit.
    const Unit &u = plan.units[p.unit];
    int64_t first = u.sharded ? shardIndex() * u.shardNumel : 0;
    int64_t count = u.sharded ? u.shardNumel : u.paddedNumel;
    int64_t lo = std::max(first, p.flatOffset);
    int64_t hi = std::min(first + count, p.flatOffset + p.numel());
    DType t = plan.buffers[u.buffer].dtype;
    if (lo < hi)
      FSDP_RETURN_IF_ERROR(
          load(p, lo - p.flatOffset, hi - p.flatOffset, u.buffer, dtypeSize(t) * (lo - first), t));
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
    t.data.resize(buf.bytes);
    FSDP_RETURN_IF_ERROR(readBuffer(b.buffer, t.data.data()));
    out[b.param] = std::move(t);
  }
  return Status::ok();
}

} // namespace fsdp
