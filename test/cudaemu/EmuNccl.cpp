//===- EmuNccl.cpp - NCCL for the CUDA emulator, across processes ---------===//
//
// The NCCL calls the CUDA backend makes (runtime/cuda/CudaComm.cpp), for
// ranks that are processes of one machine, each with its own emulated GPU
// (CUDAEMU_DEVICES >= ranks per node makes the backend choose NCCL, as a
// node with a GPU per rank does). A one-GPU machine can never run the
// backend's NCCL path with more than one rank (NCCL refuses two ranks on
// one GPU); this runs it: unique ids, ncclCommInitRank, ncclCommSplit
// (HSDP's subgroups), all-reduce / reduce-scatter / all-gather with NCCL's
// documented buffer semantics (reduce-scatter's recvcount per rank, rank
// r's block; all-gather's sendcount, rank r's data at r * sendcount;
// in-place), ncclSum and ncclAvg on f32 / f16 / bf16 / f64 / integers,
// and ncclSend / ncclRecv grouped by ncclGroupStart / ncclGroupEnd (an
// all-to-all; [Note: emulated send and receive]).
//
// Transport: one POSIX shared-memory segment per communicator, named from
// the unique id (random, made by rank 0, which the backend broadcasts).
// A collective runs where the emulator runs every stream operation, at
// its issue (or at its graph's replay): each rank copies a chunk of its
// input into its slot, all ranks meet at a process-shared barrier, each
// computes its output from the slots (f32 accumulation in rank order, one
// rounding; ncclAvg multiplies each term by 1/n first, NCCL's PreMulSum),
// and they meet again before the slots are reused. Every rank also
// publishes what it issued (kind, count, type, op): ranks that disagree
// fail the collective with both calls named (on a GPU: a hang or garbage).
// A peer that never arrives fails it after CUDAEMU_NCCL_TIMEOUT_S (120).
// The segment is unlinked once every rank has mapped it.
//
//===----------------------------------------------------------------------===//

#include "test/cudaemu/EmuInternal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <random>
#include <sched.h>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

constexpr int kMaxRanks = 64;
constexpr size_t kSlotBytes = 1 << 20; // per rank; collectives are chunked

/// What a rank issued, for the agreement check.
struct Call {
  int32_t kind, type, op;
  int64_t count;
};

struct Header {
  std::atomic<int32_t> joined;
  std::atomic<uint32_t> arrived, generation;
  Call calls[kMaxRanks];
  int32_t color[kMaxRanks], key[kMaxRanks]; // ncclCommSplit
  // A group of sends and receives: bytes rank r sends to / receives from
  // rank p (row r written by rank r).
  int64_t sendBytes[kMaxRanks][kMaxRanks], recvBytes[kMaxRanks][kMaxRanks];
};

size_t segmentBytes(int nranks) {
  return (sizeof(Header) + 4095) / 4096 * 4096 + (size_t)nranks * kSlotBytes;
}

double timeoutSeconds() {
  const char *e = std::getenv("CUDAEMU_NCCL_TIMEOUT_S");
  return e ? std::atof(e) : 120.0;
}

} // namespace

struct ncclComm {
  int nranks = 1, rank = 0;
  std::string name; // the segment's
  Header *hdr = nullptr;
  unsigned char *slots = nullptr;
  size_t bytes = 0;
  int splits = 0; // ncclCommSplit calls so far (names the children)
  ncclResult_t asyncError = ncclSuccess;
  std::string lastError;
  ~ncclComm() {
    if (hdr)
      munmap(hdr, bytes);
  }
  unsigned char *slot(int r) { return slots + (size_t)r * kSlotBytes; }

  /// The process-shared barrier: false after the timeout.
  bool barrier() {
    uint32_t gen = hdr->generation.load(std::memory_order_acquire);
    if ((int)hdr->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == nranks) {
      hdr->arrived.store(0, std::memory_order_relaxed);
      hdr->generation.fetch_add(1, std::memory_order_acq_rel);
      return true;
    }
    auto start = std::chrono::steady_clock::now();
    for (int spin = 0; hdr->generation.load(std::memory_order_acquire) == gen; ++spin) {
      if (spin < 100) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if ((spin & 1023) == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
              timeoutSeconds())
        return false;
    }
    return true;
  }
};

namespace {
thread_local std::string lastError;

ncclResult_t failed(ncclComm_t c, ncclResult_t r, const std::string &why) {
  lastError = why;
  if (c) {
    c->lastError = why;
    if (c->asyncError == ncclSuccess)
      c->asyncError = r;
  }
  std::fprintf(stderr, "cudaemu nccl: %s\n", why.c_str());
  return r;
}

size_t typeBytes(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

double loadAs(ncclDataType_t t, const unsigned char *p, size_t i) {
  switch (t) {
  case ncclFloat32:
    return reinterpret_cast<const float *>(p)[i];
  case ncclFloat64:
    return reinterpret_cast<const double *>(p)[i];
  case ncclFloat16:
    return __half2float(reinterpret_cast<const __half *>(p)[i]);
  case ncclBfloat16:
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i]);
  case ncclInt8:
    return reinterpret_cast<const int8_t *>(p)[i];
  case ncclUint8:
    return p[i];
  case ncclInt32:
    return reinterpret_cast<const int32_t *>(p)[i];
  case ncclUint32:
    return reinterpret_cast<const uint32_t *>(p)[i];
  case ncclInt64:
    return (double)reinterpret_cast<const int64_t *>(p)[i];
  case ncclUint64:
    return (double)reinterpret_cast<const uint64_t *>(p)[i];
  default:
    return 0;
  }
}
void storeAs(ncclDataType_t t, unsigned char *p, size_t i, double v) {
  switch (t) {
  case ncclFloat32:
    reinterpret_cast<float *>(p)[i] = (float)v;
    break;
  case ncclFloat64:
    reinterpret_cast<double *>(p)[i] = v;
    break;
  case ncclFloat16:
    reinterpret_cast<__half *>(p)[i] = __float2half_rn((float)v);
    break;
  case ncclBfloat16:
    reinterpret_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn((float)v);
    break;
  case ncclInt8:
    reinterpret_cast<int8_t *>(p)[i] = (int8_t)v;
    break;
  case ncclUint8:
    p[i] = (unsigned char)v;
    break;
  case ncclInt32:
    reinterpret_cast<int32_t *>(p)[i] = (int32_t)v;
    break;
  case ncclUint32:
    reinterpret_cast<uint32_t *>(p)[i] = (uint32_t)v;
    break;
  case ncclInt64:
    reinterpret_cast<int64_t *>(p)[i] = (int64_t)v;
    break;
  case ncclUint64:
    reinterpret_cast<uint64_t *>(p)[i] = (uint64_t)v;
    break;
  default:
    break;
  }
}
bool isFloat(ncclDataType_t t) {
  return t == ncclFloat32 || t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat64;
}

/// out[i] = reduction over ranks of the slots' element i (slot offset
/// `at` elements), for n elements.
void reduceSlots(ncclComm_t c, ncclDataType_t t, ncclRedOp_t op, size_t at, size_t n,
                 unsigned char *out) {
  for (size_t i = 0; i < n; ++i) {
    if (isFloat(t) && t != ncclFloat64) {
      // f32 accumulation in rank order, one rounding to the type.
      float s = 0.f, w = op == ncclAvg ? 1.f / (float)c->nranks : 1.f;
      for (int r = 0; r < c->nranks; ++r)
        s += (op == ncclAvg ? (float)loadAs(t, c->slot(r), at + i) * w
                            : (float)loadAs(t, c->slot(r), at + i));
      storeAs(t, out, i, s);
    } else {
      double s = 0;
      for (int r = 0; r < c->nranks; ++r)
        s += loadAs(t, c->slot(r), at + i);
      if (op == ncclAvg)
        s = isFloat(t) ? s / c->nranks : std::trunc(s / c->nranks);
      storeAs(t, out, i, s);
    }
  }
}

enum Kind { kAllReduce = 1, kReduceScatter, kAllGather, kSplit, kSendRecv };
const char *kindName(int k) {
  return k == kAllReduce       ? "ncclAllReduce"
         : k == kReduceScatter ? "ncclReduceScatter"
         : k == kAllGather     ? "ncclAllGather"
         : k == kSendRecv      ? "ncclSend/ncclRecv group"
                               : "ncclCommSplit";
}

/// Publishes this rank's call and checks every rank issued the same one.
ncclResult_t agree(ncclComm_t c, const Call &mine) {
  c->hdr->calls[c->rank] = mine;
  if (!c->barrier())
    return failed(c, ncclRemoteError,
                  std::string(kindName(mine.kind)) + ": a peer did not arrive within " +
                      std::to_string((int)timeoutSeconds()) + " s (CUDAEMU_NCCL_TIMEOUT_S)");
  for (int r = 0; r < c->nranks; ++r) {
    const Call &o = c->hdr->calls[r];
    if (o.kind != mine.kind || o.count != mine.count || o.type != mine.type || o.op != mine.op) {
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "ranks disagree on a collective: rank %d issued %s(count %lld, type %d, op "
                    "%d), rank %d %s(count %lld, type %d, op %d)",
                    c->rank, kindName(mine.kind), (long long)mine.count, mine.type, mine.op, r,
                    kindName(o.kind), (long long)o.count, o.type, o.op);
      c->barrier();
      return failed(c, ncclInvalidUsage, buf);
    }
  }
  // Every rank has read the calls before the next collective rewrites them.
  if (!c->barrier())
    return failed(c, ncclRemoteError, "a peer did not arrive");
  return ncclSuccess;
}

ncclResult_t runCollective(int kind, const void *in, void *out, size_t count,
                           ncclDataType_t t, ncclRedOp_t op, ncclComm_t c) {
  if (ncclResult_t r = agree(c, Call{kind, (int32_t)t, (int32_t)op, (int64_t)count}))
    return r;
  size_t es = typeBytes(t), n = (size_t)c->nranks;
  auto *src = static_cast<const unsigned char *>(in);
  auto *dst = static_cast<unsigned char *>(out);
  // Elements per chunk: what one slot holds (reduce-scatter: a block of
  // every destination per slot).
  size_t per = kind == kReduceScatter ? kSlotBytes / es / n : kSlotBytes / es;
  for (size_t j0 = 0; j0 < count; j0 += per) {
    size_t len = std::min(per, count - j0);
    unsigned char *mine = c->slot(c->rank);
    if (kind == kReduceScatter)
      for (size_t d = 0; d < n; ++d)
        std::memcpy(mine + d * len * es, src + (d * count + j0) * es, len * es);
    else
      std::memcpy(mine, src + j0 * es, len * es);
    if (!c->barrier())
      return failed(c, ncclRemoteError, std::string(kindName(kind)) + ": a peer did not arrive");
    if (kind == kAllReduce)
      reduceSlots(c, t, op, 0, len, dst + j0 * es);
    else if (kind == kReduceScatter)
      reduceSlots(c, t, op, (size_t)c->rank * len, len, dst + j0 * es);
    else
      for (size_t r = 0; r < n; ++r)
        std::memcpy(dst + (r * count + j0) * es, c->slot((int)r), len * es);
    if (!c->barrier())
      return failed(c, ncclRemoteError, std::string(kindName(kind)) + ": a peer did not arrive");
  }
  return ncclSuccess;
}

/// Checks, then runs the collective now, or queues it on its stream (a
/// captured or stream-threaded one: a failure there becomes the
/// communicator's asynchronous error, as NCCL reports errors of enqueued
/// work).
ncclResult_t collective(int kind, const void *in, void *out, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
  const char *what = kindName(kind);
  if (!c || !c->hdr)
    return failed(c, ncclInvalidArgument, std::string(what) + ": invalid or aborted communicator");
  size_t es = typeBytes(t);
  if (es == 0)
    return failed(c, ncclInvalidArgument, std::string(what) + ": unsupported datatype");
  if (op != ncclSum && op != ncclAvg)
    return failed(c, ncclInvalidArgument,
                  std::string(what) + ": only ncclSum and ncclAvg are emulated");
  size_t n = (size_t)c->nranks;
  size_t inBytes = (kind == kReduceScatter ? n * count : count) * es;
  size_t outBytes = (kind == kAllGather ? n * count : count) * es;
  if (cudaemu::checkDevicePointer(in, inBytes, what) != cudaSuccess ||
      cudaemu::checkDevicePointer(out, outBytes, what) != cudaSuccess)
    return failed(c, ncclInvalidArgument,
                  std::string(what) +
                      ": a buffer is not device memory of the size the call implies");
  // In place is only NCCL's: recvbuff + rank * count for all-gather,
  // sendbuff + rank * recvcount for reduce-scatter; any other overlap is
  // undefined.
  auto *ib = static_cast<const unsigned char *>(in);
  auto *ob = static_cast<const unsigned char *>(out);
  bool overlap = ib < ob + outBytes && ob < ib + inBytes;
  bool inPlace = kind == kAllReduce ? ib == ob
                 : kind == kAllGather ? ib == ob + (size_t)c->rank * count * es
                                      : ob == ib + (size_t)c->rank * count * es;
  if (overlap && !inPlace)
    return failed(c, ncclInvalidArgument,
                  std::string(what) + ": send and receive buffers overlap but are not in place");
  if (cudaemu::runsAtIssue(s)) // the buffers' producers have all run
    return runCollective(kind, in, out, count, t, op, c);
  cudaemu::enqueue(s, [=] { runCollective(kind, in, out, count, t, op, c); });
  return ncclSuccess;
}

// [Note: emulated send and receive]
// ncclSend / ncclRecv are kept in the calling thread's group (NCCL's
// group state is per thread; a call outside a group is a group of its
// own) and run at ncclGroupEnd, one exchange per communicator: every rank
// publishes how many bytes it sends to and receives from each peer, all
// check that every pair agrees (several calls to one peer are one stream
// of bytes, matched in issue order, as NCCL matches them), and the bytes
// move through the slots in rounds of kSlotBytes / n per peer. Unlike
// NCCL, every rank of the communicator must end a group at the same
// point (all-to-all's pattern; a pair exchanging alone times out here).

struct P2p {
  bool send;
  unsigned char *buf; // a receive's destination, or a send's source
  size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};

struct Group {
  int depth = 0;
  std::vector<P2p> ops;
  ncclResult_t error = ncclSuccess; // a call of the open group failed
};
thread_local Group group;

/// Copies bytes [at, at + len) of the stream the ops (to or from one peer,
/// in issue order) form, to or from `slot`.
void copyStream(const std::vector<P2p> &ops, size_t at, size_t len, unsigned char *slot) {
  size_t base = 0;
  for (const P2p &op : ops) {
    size_t lo = std::max(at, base), hi = std::min(at + len, base + op.bytes);
    if (lo < hi) {
      if (op.send)
        std::memcpy(slot + (lo - at), op.buf + (lo - base), hi - lo);
      else
        std::memcpy(op.buf + (lo - base), slot + (lo - at), hi - lo);
    }
    base += op.bytes;
  }
}

/// One communicator's sends and receives of a group.
ncclResult_t runSendRecv(ncclComm_t c, const std::vector<P2p> &ops) {
  const int n = c->nranks, me = c->rank;
  std::vector<std::vector<P2p>> to(n), from(n);
  for (int p = 0; p < n; ++p)
    c->hdr->sendBytes[me][p] = c->hdr->recvBytes[me][p] = 0;
  for (const P2p &op : ops) {
    (op.send ? to : from)[op.peer].push_back(op);
    (op.send ? c->hdr->sendBytes : c->hdr->recvBytes)[me][op.peer] += (int64_t)op.bytes;
  }
  // The rows are published before agree's first barrier and not written
  // again before this exchange's last one.
  if (ncclResult_t r = agree(c, Call{kSendRecv, 0, 0, 0}))
    return r;
  int64_t most = 0;
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) {
      const int64_t sent = c->hdr->sendBytes[r][p], got = c->hdr->recvBytes[p][r];
      if (sent != got) {
        // Every rank reads the same table: all fail alike, none waits.
        char buf[200];
        std::snprintf(buf, sizeof buf,
                      "ncclSend/ncclRecv: rank %d sends %lld bytes to rank %d, which receives "
                      "%lld from it",
                      r, (long long)sent, p, (long long)got);
        c->barrier();
        return failed(c, ncclInvalidUsage, buf);
      }
      most = std::max(most, sent);
    }
  const size_t per = kSlotBytes / (size_t)n;
  for (size_t at = 0; at < (size_t)most; at += per) {
    unsigned char *mine = c->slot(me);
    for (int p = 0; p < n; ++p) {
      const size_t sent = (size_t)c->hdr->sendBytes[me][p];
      if (at < sent)
        copyStream(to[p], at, std::min(per, sent - at), mine + (size_t)p * per);
    }
    if (!c->barrier())
      return failed(c, ncclRemoteError, "ncclSend/ncclRecv: a peer did not arrive");
    for (int p = 0; p < n; ++p) {
      const size_t got = (size_t)c->hdr->recvBytes[me][p];
      if (at < got)
        copyStream(from[p], at, std::min(per, got - at), c->slot(p) + (size_t)me * per);
    }
    if (!c->barrier())
      return failed(c, ncclRemoteError, "ncclSend/ncclRecv: a peer did not arrive");
  }
  // The table is read before a later group rewrites it.
  if (!c->barrier())
    return failed(c, ncclRemoteError, "ncclSend/ncclRecv: a peer did not arrive");
  return ncclSuccess;
}

/// Ends the outermost group: its calls run communicator by communicator
/// (in the order each first appears), each on its first call's stream.
ncclResult_t runGroup() {
  std::vector<P2p> ops;
  ops.swap(group.ops);
  ncclResult_t error = group.error;
  group.error = ncclSuccess;
  if (error != ncclSuccess) // a call of the group failed: NCCL fails the group
    return error;
  std::vector<ncclComm_t> comms;
  for (const P2p &op : ops)
    if (std::find(comms.begin(), comms.end(), op.comm) == comms.end())
      comms.push_back(op.comm);
  for (ncclComm_t c : comms) {
    std::vector<P2p> mine;
    for (const P2p &op : ops)
      if (op.comm == c)
        mine.push_back(op);
    cudaStream_t s = mine[0].stream;
    if (cudaemu::runsAtIssue(s)) {
      if (ncclResult_t r = runSendRecv(c, mine))
        return r;
    } else {
      cudaemu::enqueue(s, [c, mine] { runSendRecv(c, mine); });
    }
  }
  return ncclSuccess;
}

/// A send or receive: checked now, run at the group's end.
ncclResult_t pointToPoint(bool send, const void *buf, size_t count, ncclDataType_t t, int peer,
                          ncclComm_t c, cudaStream_t s) {
  const char *what = send ? "ncclSend" : "ncclRecv";
  ncclResult_t r = ncclSuccess;
  size_t es = typeBytes(t);
  if (!c || !c->hdr)
    r = failed(c, ncclInvalidArgument, std::string(what) + ": invalid or aborted communicator");
  else if (es == 0)
    r = failed(c, ncclInvalidArgument, std::string(what) + ": unsupported datatype");
  else if (peer < 0 || peer >= c->nranks)
    r = failed(c, ncclInvalidArgument,
               std::string(what) + ": peer " + std::to_string(peer) + " is not a rank of " +
                   std::to_string(c->nranks));
  else if (count > 0 && cudaemu::checkDevicePointer(buf, count * es, what) != cudaSuccess)
    r = failed(c, ncclInvalidArgument,
               std::string(what) +
                   ": the buffer is not device memory of the size the call implies");
  if (r != ncclSuccess) {
    if (group.depth > 0 && group.error == ncclSuccess)
      group.error = r;
    return r;
  }
  group.ops.push_back(
      P2p{send, static_cast<unsigned char *>(const_cast<void *>(buf)), count * es, peer, c, s});
  return group.depth == 0 ? runGroup() : ncclSuccess;
}

/// Maps (creating if needed) the segment of a communicator.
ncclResult_t attach(ncclComm_t c) {
  c->bytes = segmentBytes(c->nranks);
  int fd = shm_open(c->name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0)
    return failed(nullptr, ncclSystemError, "shm_open " + c->name + ": " + std::strerror(errno));
  if (ftruncate(fd, (off_t)c->bytes) != 0) {
    close(fd);
    return failed(nullptr, ncclSystemError, "ftruncate " + c->name + ": " + std::strerror(errno));
  }
  void *m = mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED)
    return failed(nullptr, ncclSystemError, "mmap " + c->name + ": " + std::strerror(errno));
  c->hdr = static_cast<Header *>(m);
  c->slots = static_cast<unsigned char *>(m) + (sizeof(Header) + 4095) / 4096 * 4096;
  // The last rank to map it unlinks the name: nothing stays in /dev/shm.
  if (c->hdr->joined.fetch_add(1) + 1 == c->nranks)
    shm_unlink(c->name.c_str());
  return ncclSuccess;
}

} // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  std::memset(id, 0, sizeof *id);
  std::random_device rd;
  std::snprintf(id->internal, sizeof id->internal, "/cudaemu-nccl-%d-%08x%08x", (int)getpid(),
                rd(), rd());
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  *comm = nullptr;
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
    return failed(nullptr, ncclInvalidArgument,
                  "ncclCommInitRank: rank " + std::to_string(rank) + " of " +
                      std::to_string(nranks) + " (the emulator takes up to 64 ranks)");
  if (std::strncmp(id.internal, "/cudaemu-nccl-", 14) != 0)
    return failed(nullptr, ncclInvalidArgument,
                  "ncclCommInitRank: not a unique id from ncclGetUniqueId");
  auto *c = new ncclComm;
  c->nranks = nranks;
  c->rank = rank;
  c->name = std::string(id.internal, strnlen(id.internal, sizeof id.internal));
  if (ncclResult_t r = attach(c)) {
    delete c;
    return r;
  }
  // Every rank has mapped the segment before any collective.
  if (!c->barrier()) {
    delete c;
    return failed(nullptr, ncclRemoteError, "ncclCommInitRank: a peer did not join");
  }
  *comm = c;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *out, ncclConfig_t *) {
  *out = nullptr;
  if (!comm || !comm->hdr)
    return failed(comm, ncclInvalidArgument, "ncclCommSplit of an invalid communicator");
  // Collective over the parent: every rank's (color, key), then each
  // group ordered by key (ties by parent rank), as NCCL documents.
  comm->hdr->color[comm->rank] = color;
  comm->hdr->key[comm->rank] = key;
  if (ncclResult_t r = agree(comm, Call{kSplit, 0, 0, 0}))
    return r;
  std::vector<std::pair<int, int>> group; // (key, parent rank)
  for (int r = 0; r < comm->nranks; ++r)
    if (comm->hdr->color[r] == color)
      group.push_back({comm->hdr->key[r], r});
  std::sort(group.begin(), group.end());
  int splitIndex = comm->splits++;
  if (!comm->barrier()) // every rank read the colors before they are reused
    return failed(comm, ncclRemoteError, "ncclCommSplit: a peer did not arrive");
  if (color == NCCL_SPLIT_NOCOLOR)
    return ncclSuccess;
  auto *c = new ncclComm;
  c->nranks = (int)group.size();
  c->rank = (int)(std::find(group.begin(), group.end(), std::make_pair(key, comm->rank)) -
                  group.begin());
  c->name = comm->name + "-s" + std::to_string(splitIndex) + "c" + std::to_string(color);
  if (ncclResult_t r = attach(c)) {
    delete c;
    return r;
  }
  if (!c->barrier()) {
    delete c;
    return failed(nullptr, ncclRemoteError, "ncclCommSplit: a peer did not join");
  }
  *out = c;
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async) {
  if (!comm)
    return ncclInvalidArgument;
  *async = comm->asyncError;
  return ncclSuccess;
}
const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error";
  case ncclSystemError: return "unhandled system error";
  case ncclInternalError: return "internal error";
  case ncclInvalidArgument: return "invalid argument";
  case ncclInvalidUsage: return "invalid usage";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}
const char *ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->lastError.c_str() : lastError.c_str();
}
ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  return collective(kAllReduce, in, out, count, t, op, comm, s);
}
ncclResult_t ncclReduceScatter(const void *in, void *out, size_t recvcount, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  return collective(kReduceScatter, in, out, recvcount, t, op, comm, s);
}
ncclResult_t ncclAllGather(const void *in, void *out, size_t sendcount, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s) {
  return collective(kAllGather, in, out, sendcount, t, ncclSum, comm, s);
}
ncclResult_t ncclSend(const void *in, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return pointToPoint(true, in, count, t, peer, comm, s);
}
ncclResult_t ncclRecv(void *out, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return pointToPoint(false, out, count, t, peer, comm, s);
}
// Collectives inside a group still run at their call (the backend groups
// only sends and receives); see [Note: emulated send and receive].
ncclResult_t ncclGroupStart() {
  ++group.depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group.depth == 0)
    return failed(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  return --group.depth == 0 ? runGroup() : ncclSuccess;
}

} // extern "C"
