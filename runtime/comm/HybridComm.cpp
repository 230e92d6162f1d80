//===- HybridComm.cpp - shared memory within nodes, Gloo between ----------===//
//
// [Note: hybrid collectives]
// A job of M nodes holding L ranks each. Every rank joins two groups: its
// node's L ranks (shared memory: a memcpy and a futex barrier per chunk)
// and the M ranks holding its place l on every node (Gloo over TCP: the
// only traffic that leaves a node). A node's ranks are numbered 0..L-1 in
// rank order, and C_l lists the ranks of place l, ascending; ranks need
// not be consecutive on a node. Each collective runs in two levels, so
// that every byte crosses the network once and every rank of a node
// carries 1/L of it:
// - reduce-scatter (N x S in, S out): the node reduce-scatters with place
//   l' contributing the blocks of C_l' (M runs of S, read where they lie:
//   RunCollectives in ShmComm.h), so place l holds the node's sum of the
//   blocks of C_l; C_l reduce-scatters that among the nodes, so each
//   rank gets its own block summed over every rank. A rank sends
//   (M - 1) x S bytes between nodes where a ring over all N ranks sends
//   (N - 1) x S, all of it over the network;
// - all-gather: C_l gathers its members' shards (M x S), the node gathers
//   those runs, each block written at its rank's place in the output;
// - all-to-all (N x S in and out): the node exchanges, place l' getting
//   the blocks bound for C_l' (M x S from each of the node's ranks), then
//   C_l exchanges among the nodes what its member on each node is bound to
//   get (L x S each). The blocks are reordered through the scratch
//   before, between and after the levels; every block bound for another
//   node crosses the network once;
// - all-reduce of C elements: split into L pieces of ceil(C / L) (the last
//   zero-padded), the node reduce-scatters, C_l all-reduces its piece, the
//   node all-gathers: every rank ends with the same bits (Gloo gives the
//   members of C_l the same piece, the gather only copies). No copy of the
//   buffer beside the levels' own unless C does not divide by L.
// Buffers larger than a chunk (8 MiB) go in column ranges (an all-reduce
// in spans), so the scratch a rank holds (its piece between the levels)
// stays bounded whatever the largest gradient.
// A mean divides in both levels (by L, then by M), as each backend divides
// its own sums ([Note: f16 means] in GlooComm.cpp); sums are in another
// order than one ring's, so results equal Gloo's up to the summation order
// and, in bf16 / f16, up to one more rounding (the node's partial sum is
// rounded to the dtype before it travels, as NCCL's are).
//
// Nodes of unequal sizes, or a node without shared memory (every rank
// votes through Gloo, so all agree), make the collectives Gloo over all
// ranks ("flat"). broadcast and barrier (host-only helpers) are Gloo's.
// A subgroup (a 2-D mesh's axis, a reshard group) whose ranks share a node
// is shared memory alone, one whose ranks are each on another node is Gloo
// alone, and otherwise two-level in turn (the levels' own groups have tags
// starting with ':', which callers' tags may not). The job's flight recorder
// records the collectives at this level: a rank that does not come is
// named whichever level timed out.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/HybridComm.h"

#include "runtime/comm/FlightRecorder.h"
#include "runtime/comm/GlooComm.h"
#include "runtime/comm/ShmComm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

namespace fsdp {

namespace {

/// Who is on which node: nodes in the order of their lowest rank, each
/// node's ranks ascending.
struct Layout {
  std::vector<std::vector<int64_t>> nodes;
  std::vector<int64_t> nodeOf, placeOf; ///< by rank
  bool uniform = true;                  ///< every node holds as many ranks

  explicit Layout(const std::vector<std::string> &keys) {
    std::map<std::string, int64_t> index;
    for (int64_t r = 0; r < (int64_t)keys.size(); ++r) {
      auto [it, fresh] = index.emplace(keys[r], (int64_t)nodes.size());
      if (fresh)
        nodes.emplace_back();
      nodeOf.push_back(it->second);
      placeOf.push_back((int64_t)nodes[it->second].size());
      nodes[it->second].push_back(r);
    }
    for (const auto &n : nodes)
      uniform &= n.size() == nodes[0].size();
  }
  int64_t perNode() const { return (int64_t)nodes[0].size(); }
  /// C_l: the ranks at place l of every node, ascending.
  std::vector<int64_t> place(int64_t l) const {
    std::vector<int64_t> out;
    for (const auto &n : nodes)
      out.push_back(n[l]);
    std::sort(out.begin(), out.end());
    return out;
  }
};

/// 8 MiB, or FSDP_HYBRID_CHUNK_BYTES (at least 64).
int64_t chunkBytesFromEnv() {
  const char *v = std::getenv("FSDP_HYBRID_CHUNK_BYTES");
  long long b = v ? std::atoll(v) : 0;
  return b >= 64 ? (int64_t)b : (int64_t)8 << 20;
}

class HybridComm final : public Communicator {
public:
  HybridComm(std::unique_ptr<Communicator> world, std::vector<std::string> keys,
             std::shared_ptr<gloo::rendezvous::Store> store, std::string prefix,
             double timeoutSeconds, std::unique_ptr<FlightRecorder> recorder)
      : world(std::move(world)), keys(std::move(keys)), layout(this->keys), store(std::move(store)),
        prefix(std::move(prefix)), timeoutSeconds(timeoutSeconds), recorder(std::move(recorder)) {}

  /// Connects the two levels ([Note: hybrid collectives]); every member
  /// calls it, and all end in the same mode.
  Status connect(bool shmRefused) {
    const int64_t me = rank(), m = layout.nodeOf[me], l = layout.placeOf[me];
    const int64_t L = layout.perNode(), M = (int64_t)layout.nodes.size();
    if (!layout.uniform || shmRefused) {
      flat = !layout.uniform ? Flat::UnequalNodes : Flat::NoShm;
      return Status::ok();
    }
    bool unavailable = false;
    Status st = makeShmGroup(store, prefix + "/:node-" + std::to_string(m), l,
                             (int64_t)layout.nodes[m].size(), timeoutSeconds, node, &unavailable);
    // Every rank learns whether every node has shared memory.
    float failed = st ? 0.0f : 1.0f;
    Status voted = world->allReduce(&failed, &failed, 1, DType::F32, ReduceOp::Sum);
    if (!voted)
      return FSDP_ERROR("rank ", me,
                        ": agreeing on shared memory within the nodes failed: ", voted.message());
    if (!st && !unavailable)
      return FSDP_ERROR("rank ", me, ": connecting node ", m,
                        "'s shared memory failed: ", st.message());
    if (failed > 0) {
      if (me == 0)
        std::fprintf(stderr,
                     "fsdp-run: shared memory is unavailable to %g rank(s)%s%s; "
                     "using Gloo between all ranks\n",
                     (double)failed, st ? "" : ": ", st ? "" : st.message().c_str());
      node.reset();
      flat = Flat::NoShm;
      return Status::ok();
    }
    // Nodes of one rank never get here (they are Gloo alone), so every
    // node group is shared memory, whose collectives take the blocks
    // where they lie.
    runs = dynamic_cast<RunCollectives *>(node.get());
    if (!runs)
      return FSDP_ERROR("rank ", me, ": node ", m, "'s group of ", L,
                        " rank(s) is not a shared-memory group");
    if (M > 1) {
      std::vector<int64_t> mine = layout.place(l);
      FSDP_RETURN_IF_ERROR(world->subgroup(mine, ":place-" + std::to_string(l), cross));
      for (int64_t q = 0; q < L; ++q)
        places.push_back(layout.place(q));
    } else {
      FSDP_RETURN_IF_ERROR(Communicator::subgroup({me}, "self", cross));
      for (int64_t q = 0; q < L; ++q)
        places.push_back({layout.nodes[0][q]});
    }
    return Status::ok();
  }

  int64_t rank() const override { return world->rank(); }
  int64_t size() const override { return world->size(); }
  const char *backend() const override { return node ? "shm+gloo" : "gloo"; }
  std::string describe() const override {
    std::ostringstream os;
    os << backend() << " (" << layout.nodes.size()
       << (layout.nodes.size() == 1 ? " node" : " nodes");
    if (layout.uniform)
      os << " of " << layout.perNode() << " ranks";
    if (flat != Flat::No)
      os << ": "
         << (flat == Flat::UnequalNodes ? "nodes hold unequal numbers of ranks"
                                        : "no shared memory")
         << ", Gloo between all ranks";
    os << ")";
    return os.str();
  }

  bool levels(Communicator *&n, Communicator *&c, int64_t &perNode) override {
    if (flat != Flat::No || layout.nodes.size() < 2 || !node || !cross)
      return false;
    n = node.get(), c = cross.get(), perNode = layout.perNode();
    return true;
  }

  Status allReduce(const void *in, void *out, int64_t count, DType dtype, ReduceOp op,
                   Stream *) override {
    const int64_t es = dtypeSize(dtype), n = size();
    bytesSent_ += 2 * (n - 1) * count * es / n;
    if (!node)
      return guard("all_reduce", [&] { return world->allReduce(in, out, count, dtype, op); });
    const int64_t L = (int64_t)places.size();
    // Spans of at most chunkBytes, a multiple of L elements (the last may
    // be shorter): each in L pieces. A span of whole pieces goes from the
    // caller's buffers to the node level and back (the shared-memory
    // collectives copy through their own slots, so `in` may be `out`);
    // only a last span that does not divide by L passes through the
    // scratch, its tail zero-padded.
    const int64_t span = std::max<int64_t>(L, chunkBytes / es / L * L);
    return guard("all_reduce", [&]() -> Status {
      for (int64_t o = 0; o < count; o += span) {
        const int64_t c = std::min(span, count - o), piece = (c + L - 1) / L;
        const uint8_t *src = static_cast<const uint8_t *>(in) + o * es;
        uint8_t *dst = static_cast<uint8_t *>(out) + o * es;
        const bool padded = piece * L != c;
        if (padded) {
          a.resize((size_t)(L * piece * es));
          std::memcpy(a.data(), src, (size_t)(c * es));
          std::memset(a.data() + c * es, 0, (size_t)((L * piece - c) * es));
          src = a.data();
        }
        b.resize((size_t)(piece * es));
        FSDP_RETURN_IF_ERROR(node->reduceScatter(src, b.data(), piece, dtype, op));
        FSDP_RETURN_IF_ERROR(cross->allReduce(b.data(), b.data(), piece, dtype, op));
        FSDP_RETURN_IF_ERROR(node->allGather(b.data(), padded ? a.data() : dst, piece, dtype));
        if (padded)
          std::memcpy(dst, a.data(), (size_t)(c * es));
      }
      return Status::ok();
    });
  }

  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype, ReduceOp op,
                       Stream *) override {
    const int64_t es = dtypeSize(dtype), n = size();
    bytesSent_ += (n - 1) * shard * es;
    if (!node)
      return guard("reduce_scatter",
                   [&] { return world->reduceScatter(in, out, shard, dtype, op); });
    const int64_t M = (int64_t)places[0].size();
    // Columns [o, o + c) of every rank's block at a time (M x c elements of
    // scratch): the node's shared memory reads each place's blocks where
    // they lie in `in`.
    const int64_t cols = std::max<int64_t>(1, chunkBytes / (n * es));
    return guard("reduce_scatter", [&]() -> Status {
      for (int64_t o = 0; o < shard; o += cols) {
        const int64_t c = std::min(cols, shard - o);
        b.resize((size_t)(M * c * es));
        FSDP_RETURN_IF_ERROR(
            runs->reduceScatterRuns(in, placeRuns(shard, o, c, es), b.data(), dtype, op));
        FSDP_RETURN_IF_ERROR(
            cross->reduceScatter(b.data(), static_cast<uint8_t *>(out) + o * es, c, dtype, op));
      }
      return Status::ok();
    });
  }

  /// `in` may lie inside `out` (a rank's own block): each column range is
  /// read before any block of it is written, and writing the own block
  /// writes what it holds.
  Status allGather(const void *in, void *out, int64_t shard, DType dtype, Stream *) override {
    const int64_t es = dtypeSize(dtype), n = size();
    bytesSent_ += (n - 1) * shard * es;
    if (!node)
      return guard("all_gather", [&] { return world->allGather(in, out, shard, dtype); });
    const int64_t M = (int64_t)places[0].size();
    const int64_t cols = std::max<int64_t>(1, chunkBytes / (n * es));
    return guard("all_gather", [&]() -> Status {
      for (int64_t o = 0; o < shard; o += cols) {
        const int64_t c = std::min(cols, shard - o);
        b.resize((size_t)(M * c * es));
        FSDP_RETURN_IF_ERROR(
            cross->allGather(static_cast<const uint8_t *>(in) + o * es, b.data(), c, dtype));
        FSDP_RETURN_IF_ERROR(runs->allGatherRuns(b.data(), out, placeRuns(shard, o, c, es), dtype));
      }
      return Status::ok();
    });
  }

  /// Columns [o, o + c) of every chunk at a time, through the scratch
  /// (n x c elements each of a and b).
  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *) override {
    const int64_t es = dtypeSize(dtype), n = size();
    bytesSent_ += (n - 1) * chunk * es;
    if (!node)
      return guard("all_to_all", [&] { return world->allToAll(in, out, chunk, dtype); });
    const int64_t L = (int64_t)places.size(), M = (int64_t)places[0].size();
    const int64_t l = layout.placeOf[rank()];
    const int64_t cols = std::max<int64_t>(1, chunkBytes / (n * es));
    const auto *src = static_cast<const uint8_t *>(in);
    auto *dst = static_cast<uint8_t *>(out);
    return guard("all_to_all", [&]() -> Status {
      for (int64_t o = 0; o < chunk; o += cols) {
        const int64_t c = std::min(cols, chunk - o), cb = c * es;
        a.resize((size_t)(n * cb));
        b.resize((size_t)(n * cb));
        // The node's block for place q: the columns bound for C_q's
        // members, in C_q's order.
        for (int64_t q = 0; q < L; ++q)
          for (int64_t j = 0; j < M; ++j)
            std::memcpy(a.data() + (q * M + j) * cb, src + (places[q][j] * chunk + o) * es,
                        (size_t)cb);
        FSDP_RETURN_IF_ERROR(node->allToAll(a.data(), b.data(), M * c, dtype));
        // b holds, from each place q of this node, the columns bound for
        // C_l's member j; C_l's block j is what every place sends it.
        for (int64_t q = 0; q < L; ++q)
          for (int64_t j = 0; j < M; ++j)
            std::memcpy(a.data() + (j * L + q) * cb, b.data() + (q * M + j) * cb, (size_t)cb);
        FSDP_RETURN_IF_ERROR(cross->allToAll(a.data(), b.data(), L * c, dtype));
        // Block j came from C_l's member j's node: its place q is rank
        // nodes[that node][q].
        for (int64_t j = 0; j < M; ++j) {
          const std::vector<int64_t> &from = layout.nodes[layout.nodeOf[places[l][j]]];
          for (int64_t q = 0; q < L; ++q)
            std::memcpy(dst + (from[q] * chunk + o) * es, b.data() + (j * L + q) * cb, (size_t)cb);
        }
      }
      return Status::ok();
    });
  }

  Status broadcast(void *data, int64_t bytes, int64_t root) override {
    return guard("broadcast", [&] { return world->broadcast(data, bytes, root); });
  }

  Status barrier() override {
    return guard("barrier", [&] { return world->barrier(); });
  }

  Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                  std::unique_ptr<Communicator> &out) override;

private:
  /// The node level's blocks as they lie in the user's buffer of n blocks
  /// of `shard` elements of es bytes: place q's block is its M ranks'
  /// columns [o, o + c), node by node: the order the node level's
  /// collectives see (place q, then node j).
  BlockRuns placeRuns(int64_t shard, int64_t o, int64_t c, int64_t es) const {
    const int64_t M = (int64_t)places[0].size();
    return BlockRuns{M, c * es, [this, shard, o, es](int64_t q, int64_t j) {
                       return (places[q][j] * shard + o) * es;
                     }};
  }

  template <typename F> Status guard(const char *what, F f) {
    int64_t seq = recorder ? recorder->enter(what) : 0;
    Status st = f();
    if (st) {
      if (recorder)
        recorder->complete(seq);
      return st;
    }
    if (!recorder)
      return st;
    return FSDP_ERROR("rank ", rank(), ": ", what,
                      " failed: ", recorder->explain(seq, what, st.message()), ". ", st.message());
  }

  std::unique_ptr<Communicator> world; ///< Gloo over every member
  std::vector<std::string> keys;       ///< each member's node
  Layout layout;
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::string prefix;
  double timeoutSeconds;
  std::unique_ptr<FlightRecorder> recorder;
  std::unique_ptr<Communicator> node, cross; ///< null node: flat
  RunCollectives *runs = nullptr;            ///< node's collectives over runs
  std::vector<std::vector<int64_t>> places;  ///< C_l for each place l
  /// Why the collectives are Gloo's over every member (No: two levels).
  /// NoShm also tells subgroups not to try shared memory again.
  enum class Flat { No, UnequalNodes, NoShm } flat = Flat::No;
  /// Scratch per collective step ([Note: hybrid collectives]): larger
  /// collectives run in column ranges, so a rank holds at most this much
  /// besides the buffers the plan gave it (FSDP_HYBRID_CHUNK_BYTES
  /// overrides it, for tests).
  int64_t chunkBytes = chunkBytesFromEnv();
  std::vector<uint8_t> a, b; ///< the padded span and the piece buffers
};

Status HybridComm::subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                            std::unique_ptr<Communicator> &out) {
  int64_t index = 0;
  FSDP_RETURN_IF_ERROR(checkGroup(ranks, tag, index));
  if (!tag.empty() && tag[0] == ':') // the levels' own groups ([Note: hybrid collectives])
    return FSDP_ERROR("group tag '", tag, "' is reserved (it starts with ':')");
  if (ranks.size() == 1)
    return Communicator::subgroup(ranks, tag, out);
  std::vector<std::string> sub;
  for (int64_t r : ranks)
    sub.push_back(keys[r]);
  Layout inner(sub);
  const std::string name = prefix + "/" + tag;
  if (inner.nodes.size() == 1 && flat != Flat::NoShm) {
    Status st = makeShmGroup(store, name, index, (int64_t)ranks.size(), timeoutSeconds, out);
    if (!st)
      return FSDP_ERROR("rank ", rank(), ": connecting group '", tag, "' (", ranks.size(),
                        " ranks of one node) failed: ", st.message());
    return Status::ok();
  }
  std::unique_ptr<Communicator> gloo;
  FSDP_RETURN_IF_ERROR(world->subgroup(ranks, tag, gloo));
  if (inner.nodes.size() == ranks.size()) { // one rank a node
    out = std::move(gloo);
    return Status::ok();
  }
  auto h = std::make_unique<HybridComm>(std::move(gloo), std::move(sub), store, name,
                                        timeoutSeconds, nullptr);
  FSDP_RETURN_IF_ERROR(h->connect(flat == Flat::NoShm));
  out = std::move(h);
  return Status::ok();
}

} // namespace

Status makeHybridCommunicator(const JobEnv &job, double timeoutSeconds,
                              std::unique_ptr<Communicator> &out) {
  if (job.worldSize == 1) {
    out = makeSingleProcessCommunicator();
    return Status::ok();
  }
  auto timeout = std::chrono::milliseconds((int64_t)(timeoutSeconds * 1000));
  const std::string where = rendezvousName(job);
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::vector<std::string> keys;
  try {
    store = openRendezvousStore(job, timeout);
    const std::string mine = nodeIdentity(job);
    store->set("fsdp-node/" + std::to_string(job.rank),
               std::vector<char>(mine.begin(), mine.end()));
    for (int64_t r = 0; r < job.worldSize; ++r) {
      const std::string key = "fsdp-node/" + std::to_string(r);
      store->wait({key}, timeout);
      std::vector<char> v = store->get(key);
      keys.emplace_back(v.begin(), v.end());
    }
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, " of ", job.worldSize, ": rendezvous through '", where,
                      "' failed (", job.source, "): ", e.what());
  }
  Layout layout(keys);
  if (layout.nodes.size() == keys.size()) // one rank a node: Gloo it is
    return makeGlooCommunicatorOn(job, store, timeoutSeconds, /*withRecorder=*/true, out);
  std::unique_ptr<Communicator> world;
  FSDP_RETURN_IF_ERROR(
      makeGlooCommunicatorOn(job, store, timeoutSeconds, /*withRecorder=*/false, world));
  std::unique_ptr<FlightRecorder> recorder;
  try {
    recorder = makeJobFlightRecorder(job, timeout);
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, ": the flight recorder's store failed: ", e.what());
  }
  auto h = std::make_unique<HybridComm>(std::move(world), std::move(keys), store, "fsdp-hybrid",
                                        timeoutSeconds, std::move(recorder));
  FSDP_RETURN_IF_ERROR(h->connect(/*shmRefused=*/false));
  out = std::move(h);
  return Status::ok();
}

} // namespace fsdp
