//===- CommTest.cpp - the host communicators, ranks as threads -------------===//
//
// N ranks as threads of one process (one communicator each, met through a
// shared FileStore directory), for both host backends, Gloo (TCP) and
// shared memory: every collective against a reference computed here, for
// N = 2, 3 (not a power of two) and 4, with uneven values and several
// collectives in a row (the pattern that exposed Gloo's reduce-scatter bug
// at N = 3); all-to-all bit for bit, in f32 and i8; buffers larger than a
// shared-memory slot (chunked); a dead peer turning into an error; and the
// flight recorder naming the rank a timed-out collective waited for, with
// the directory store and with the TCP store; and the executor's mesh
// groups of a node size (node, cross) on CPU devices.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/GlooComm.h"
#include "runtime/comm/ShmComm.h"
#include "runtime/core/Bf16.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Plan.h"
#include "runtime/cpu/CpuDevice.h"
#include "test/unit/TestPlans.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <netinet/in.h>
#include <set>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unistd.h>

using namespace fsdp;

namespace {

std::string freshDir(const std::string &tag) {
  auto dir = std::filesystem::temp_directory_path() /
             ("fsdp-commtest-" + std::to_string(::getpid()) + "-" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

/// A free TCP port on the loopback interface (for the TCP store).
int freePort() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr *>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

/// Runs `body(rank, comm)` on n threads; returns the first failure. An
/// empty `dir` meets through a TCP store on `port` instead.
std::string runRanks(int n, const std::string &dir, double timeout,
                     const std::function<std::string(int, Communicator &)> &body,
                     int port = 0, const std::string &backend = "gloo") {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  // "hybridc": the two-level communicator in chunks of 64 KiB (its
  // default is 8 MiB), so every collective above a few thousand elements
  // runs in several column ranges.
  if (backend == "hybridc")
    ::setenv("FSDP_HYBRID_CHUNK_BYTES", "65536", 1);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      JobEnv job;
      job.rank = r;
      job.worldSize = n;
      job.storeDir = dir;
      // "hybrid": nodes of two consecutive ranks; "hybridx": ranks
      // alternate between two nodes (a node's ranks are not consecutive).
      std::string kind = backend;
      if (backend == "hybrid" || backend == "hybridc" || backend == "hybridx") {
        job.node = std::to_string(backend == "hybridx" ? r % 2 : r / 2);
        kind = "hybrid";
      }
      if (dir.empty()) {
        job.masterAddr = "127.0.0.1";
        job.masterPort = port;
      }
      std::unique_ptr<Communicator> comm;
      Status st = makeHostCommunicator(kind, job, timeout, comm);
      if (!st) {
        errors[r] = st.message();
        return;
      }
      errors[r] = body(r, *comm);
    });
  for (auto &t : threads)
    t.join();
  ::unsetenv("FSDP_HYBRID_CHUNK_BYTES");
  for (auto &e : errors)
    if (!e.empty())
      return e;
  return "";
}

/// (backend, world size)
class CommTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

/// The /dev/shm entries named like this process's segments
/// ("fsdp-<pid>-..."): a process of an earlier run that had this pid and
/// was killed before unlinking (a dead-rank test) may have left some.
static std::set<std::string> shmSegmentsOfThisPid() {
  std::set<std::string> names;
  std::string mine = "fsdp-" + std::to_string(::getpid()) + "-";
  if (std::filesystem::exists("/dev/shm"))
    for (auto &e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(mine, 0) == 0)
        names.insert(e.path().filename().string());
  return names;
}

TEST_P(CommTest, CollectivesMatchAReference) {
  auto [backend, n] = GetParam();
  const std::set<std::string> before = shmSegmentsOfThisPid();
  // 600001 elements (2.4 MB): larger than a shared-memory slot (at most
  // 2 MiB), so every collective is chunked.
  for (int64_t shardSize : {5, 704, 4097, 600001}) {
    std::string err = runRanks(
        n, freshDir(backend + std::to_string(n) + "-" + std::to_string(shardSize)), 30,
        [&](int r, Communicator &comm) -> std::string {
          auto value = [](int rank, int64_t i, int round) {
            return (float)((rank + 1) * 0.5 + i * 0.25 + round);
          };
          for (int round = 0; round < 6; ++round) {
            // Alternate buffer sizes, as consecutive units of a model do.
            int64_t shard = round % 2 ? 11 : shardSize;
            std::vector<float> whole(n * shard), mine(shard), gathered(n * shard);
            for (int64_t i = 0; i < n * shard; ++i)
              whole[i] = value(r, i, round);
            // Skew the ranks as compute between collectives does in a real step.
            std::this_thread::sleep_for(std::chrono::milliseconds((r * 7 + round * 3) % 5));
            if (!comm.reduceScatter(whole.data(), mine.data(), shard, DType::F32,
                                    round % 2 ? ReduceOp::Mean : ReduceOp::Sum))
              return "reduce_scatter failed";
            for (int64_t i = 0; i < shard; ++i) {
              double want = 0;
              for (int q = 0; q < n; ++q)
                want += value(q, r * shard + i, round);
              if (round % 2)
                want /= n;
              if (std::fabs(mine[i] - want) > 1e-5)
                return "reduce_scatter: rank " + std::to_string(r) + " element " +
                       std::to_string(i) + " is " + std::to_string(mine[i]) + ", expected " +
                       std::to_string(want);
            }
            if (!comm.allGather(mine.data(), gathered.data(), shard, DType::F32))
              return "all_gather failed";
            std::vector<float> sum = whole;
            if (!comm.allReduce(sum.data(), sum.data(), (int64_t)sum.size(), DType::F32,
                                ReduceOp::Sum))
              return "all_reduce failed";
            for (int64_t i = 0; i < n * shard; ++i) {
              float want = sum[i] / (round % 2 ? n : 1);
              if (std::fabs(gathered[i] - want) > 1e-5)
                return "all_gather/all_reduce disagree at " + std::to_string(i);
            }
          }
          return "";
        },
        0, backend);
    EXPECT_EQ(err, "") << "shards of " << shardSize;
  }
  // The segments were unlinked once mapped: nothing of this process is
  // left in /dev/shm ([Note: shared-memory collectives]); only what was
  // there before it ran (pids are reused) may be.
  for (const std::string &name : shmSegmentsOfThisPid())
    EXPECT_TRUE(before.count(name)) << "/dev/shm/" << name << " left behind";
}
// [Note: Gloo buffers] The communicator keeps what it registers with Gloo
// per (address, bytes). A plan reuses fixed arena addresses with new
// contents every step, in f32 and in f16, and host callers pass many
// passing addresses (more than the cache keeps: it is flushed).
TEST_P(CommTest, ReusedAddressesSeeTheirNewContents) {
  auto [backend, n] = GetParam();
  std::string err = runRanks(n, freshDir("reuse" + backend + std::to_string(n)), 30,
                             [&](int r, Communicator &comm) -> std::string {
    const int64_t shard = 37;
    std::vector<float> pool[3], mine(shard), gathered(n * shard);
    for (auto &b : pool)
      b.resize(n * shard);
    std::vector<uint16_t> half(n * shard), halfMine(shard);
    for (int round = 0; round < 12; ++round) {
      std::vector<float> &whole = pool[round % 3]; // three "units", reused
      for (int64_t i = 0; i < n * shard; ++i)
        whole[i] = (float)(r + 1) * 0.5f + (float)((i + round) % 9);
      if (!comm.reduceScatter(whole.data(), mine.data(), shard, DType::F32, ReduceOp::Sum))
        return "reduce_scatter failed";
      if (!comm.allGather(mine.data(), gathered.data(), shard, DType::F32))
        return "all_gather failed";
      // f16 sums of small integers and halves are exact.
      for (int64_t i = 0; i < n * shard; ++i)
        half[i] = roundToHalf(whole[i]);
      if (!comm.reduceScatter(half.data(), halfMine.data(), shard, DType::F16, ReduceOp::Sum))
        return "f16 reduce_scatter failed";
      for (int64_t i = 0; i < n * shard; ++i) {
        double want = 0;
        for (int q = 0; q < n; ++q)
          want += (q + 1) * 0.5 + (double)((i + round) % 9);
        if (gathered[i] != (float)want)
          return "round " + std::to_string(round) + ": element " + std::to_string(i) + " is " +
                 std::to_string(gathered[i]) + ", expected " + std::to_string(want);
        if (i / shard == r && widenHalf(halfMine[i % shard]) != (float)want)
          return "round " + std::to_string(round) + ": f16 element " + std::to_string(i) +
                 " is " + std::to_string(widenHalf(halfMine[i % shard]));
      }
    }
    // 1100 distinct addresses (the cache keeps 1024, then starts over).
    std::vector<float> big(1100 + n), out(n);
    for (int64_t k = 0; k < 1100; ++k) {
      big[k] = (float)(r * 1000 + k);
      if (!comm.allGather(&big[k], out.data(), 1, DType::F32))
        return "all_gather " + std::to_string(k) + " failed";
      for (int q = 0; q < n; ++q)
        if (out[q] != (float)(q * 1000 + k))
          return "all_gather " + std::to_string(k) + ": rank " + std::to_string(q) +
                 "'s value is " + std::to_string(out[q]);
    }
    return "";
  }, 0, backend);
  EXPECT_EQ(err, "");
}

/// All-to-all moves bytes: every chunk arrives bit for bit (f32 as
/// arbitrary bit patterns, NaNs among them, and i8 through all 256
/// values), for empty, one-element, odd and large chunks (300000 bytes:
/// several shared-memory rounds, and several column ranges of the
/// two-level communicator in 64 KiB chunks), into buffers reused across
/// rounds with skewed ranks; the input is left intact and bytesSent()
/// grows by the ring volume, (N - 1) x chunk bytes.
TEST_P(CommTest, AllToAllMovesEveryChunkExactly) {
  auto [backend, n] = GetParam();
  std::string err = runRanks(
      n, freshDir("a2a" + backend + std::to_string(n)), 30,
      [&](int r, Communicator &comm) -> std::string {
        // Byte i of the chunk rank `from` sends rank `to` in `round`.
        auto byte = [](int from, int to, int64_t i, int round) {
          uint32_t h =
              (uint32_t)(from * 131 + to * 29 + round * 13) * 2654435761u ^ (uint32_t)i * 40503u;
          return (uint8_t)((h >> 11) ^ (h >> 3) ^ (uint32_t)i);
        };
        for (DType dtype : {DType::F32, DType::I8}) {
          const int64_t es = dtypeSize(dtype);
          for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(37), 300000 / es}) {
            const int64_t bytes = chunk * es;
            std::vector<uint8_t> in(n * bytes), out(n * bytes), want(n * bytes);
            for (int round = 0; round < 4; ++round) {
              for (int j = 0; j < n; ++j)
                for (int64_t i = 0; i < bytes; ++i) {
                  in[j * bytes + i] = byte(r, j, i, round);
                  want[j * bytes + i] = byte(j, r, i, round);
                }
              std::vector<uint8_t> sent = in;
              std::fill(out.begin(), out.end(), 0xA5); // stale contents must go
              std::this_thread::sleep_for(std::chrono::milliseconds((r * 7 + round * 3) % 5));
              const int64_t before = comm.bytesSent();
              Status st = comm.allToAll(in.data(), out.data(), chunk, dtype);
              std::string what = std::string(dtypeName(dtype)) + " chunk " + std::to_string(chunk) +
                                 " round " + std::to_string(round);
              if (!st)
                return "all_to_all " + what + " failed: " + st.message();
              if (comm.bytesSent() - before != (n - 1) * bytes)
                return "all_to_all " + what + ": bytesSent grew by " +
                       std::to_string(comm.bytesSent() - before) + ", expected " +
                       std::to_string((n - 1) * bytes);
              if (in != sent)
                return "all_to_all " + what + " wrote its input";
              auto bad = std::mismatch(out.begin(), out.end(), want.begin());
              if (bad.first != out.end()) {
                int64_t at = bad.first - out.begin();
                return "all_to_all " + what + ": rank " + std::to_string(r) + " byte " +
                       std::to_string(at % bytes) + " of rank " + std::to_string(at / bytes) +
                       "'s chunk is " + std::to_string(*bad.first) + ", expected " +
                       std::to_string(*bad.second);
              }
            }
          }
        }
        return "";
      },
      0, backend);
  EXPECT_EQ(err, "");
}

std::string backendAndSize(const ::testing::TestParamInfo<std::tuple<std::string, int>> &i) {
  return std::get<0>(i.param) + std::to_string(std::get<1>(i.param));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CommTest,
                         ::testing::Combine(::testing::Values("gloo", "shm"),
                                            ::testing::Values(2, 3, 4)),
                         backendAndSize);
// Two-level (HybridComm.h): one node of 2 (no network level), nodes of 2,
// 1 (unequal: Gloo throughout), 2 x 2, 3 x 2, 2 nodes of 2 and of 3 whose
// ranks alternate, and 2 x 2, 3 x 2 in 64 KiB chunks. (At the default 8
// MiB, the largest case, 600001-element shards, runs in 2 chunks at N = 4
// and 6.)
INSTANTIATE_TEST_SUITE_P(
    Hybrid, CommTest,
    ::testing::Values(std::make_tuple("hybrid", 2), std::make_tuple("hybrid", 3),
                      std::make_tuple("hybrid", 4), std::make_tuple("hybrid", 6),
                      std::make_tuple("hybridx", 4), std::make_tuple("hybridx", 6),
                      std::make_tuple("hybridc", 4), std::make_tuple("hybridc", 6)),
    backendAndSize);

/// The executor's mesh groups of a node size (hierarchical qgZ, [Note:
/// node groups] in Executor.cpp): every rank of a replicas x shards mesh,
/// CPU device and shared memory, runs an all_to_all over "node" and one
/// over "cross"; each must exchange chunks with exactly the ranks the plan
/// format names (node: the L consecutive ranks of its shard group's node;
/// cross: the ranks of its shard group at its place on their nodes,
/// ascending), and commBytes() counts both groups.
TEST(ExecutorGroupsTest, NodeAndCrossGroupsHoldTheirRanks) {
  using nlohmann::json;
  const int64_t numel = 12; // divides into groups of 2, 3, 4
  struct Mesh {
    int replicas, shards, node;
  };
  for (const Mesh &m : {Mesh{2, 4, 2}, Mesh{1, 6, 2}, Mesh{1, 6, 3}}) {
    const int world = m.replicas * m.shards;
    SCOPED_TRACE(std::to_string(m.replicas) + "x" + std::to_string(m.shards) + " node " +
                 std::to_string(m.node));
    json buffers = json::array();
    for (int i = 0; i < 3; ++i)
      testplans::addF32Buffer(buffers, ("b" + std::to_string(i)).c_str(), "activation", "device",
                              64 * i, numel, false, true, -1, 2);
    testplans::addF32Buffer(buffers, "loss", "activation", "device", 192, 1, true, true, -1, 2);
    json program = json::array();
    program.push_back(
        {{"op", "all_to_all"}, {"in", {0}}, {"out", {1}}, {"attrs", {{"group", "node"}}}});
    program.push_back(
        {{"op", "all_to_all"}, {"in", {0}}, {"out", {2}}, {"attrs", {{"group", "cross"}}}});
    testplans::OneRankPlan p;
    p.arenaBytes = 256;
    p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 3}}};
    json j = json::parse(testplans::oneRankPlan(p, buffers, program));
    j["world_size"] = world;
    j["mesh"] = {{"replicas", m.replicas}, {"shards", m.shards}, {"node", m.node}};
    Plan plan;
    Status parsed = parsePlan(j.dump(), plan);
    ASSERT_TRUE(parsed.isOk()) << parsed.message();
    // The groups by their definition: same shard group, same node / same
    // place on the node.
    auto members = [&](int r, bool node) {
      std::vector<int> g;
      for (int q = 0; q < world; ++q) {
        const int s = q % m.shards, t = r % m.shards;
        if (q / m.shards == r / m.shards &&
            (node ? s / m.node == t / m.node : s % m.node == t % m.node))
          g.push_back(q);
      }
      return g;
    };
    std::string err = runRanks(
        world, freshDir("groups" + std::to_string(world) + "-" + std::to_string(m.node)), 30,
        [&](int r, Communicator &comm) -> std::string {
          std::unique_ptr<Device> dev;
          Status st = cpu::createCpuDevice(DeviceOptions{}, dev);
          if (!st)
            return st.message();
          Executor ex(plan, comm, *dev);
          if (!(st = ex.init(1)))
            return "init: " + st.message();
          std::vector<float> in(numel);
          for (int64_t i = 0; i < numel; ++i)
            in[i] = (float)(r * 100 + i);
          if (!(st = ex.writeBuffer(0, in.data())))
            return st.message();
          const int64_t before = ex.commBytes();
          float loss = 0;
          if (!(st = ex.step(1, 0.0, loss)))
            return "rank " + std::to_string(r) + ": " + st.message();
          int64_t sent = 0;
          for (int which = 1; which <= 2; ++which) {
            const std::vector<int> g = members(r, which == 1);
            const int64_t w = (int64_t)g.size(), chunk = numel / w;
            const int64_t me = std::find(g.begin(), g.end(), r) - g.begin();
            sent += (w - 1) * chunk * 4;
            std::vector<float> out(numel);
            if (!(st = ex.readBuffer(which, out.data())))
              return st.message();
            for (int64_t k = 0; k < numel; ++k) {
              // Chunk k / chunk came from member k / chunk: its chunk `me`.
              const float want = (float)(g[k / chunk] * 100 + me * chunk + k % chunk);
              if (out[k] != want)
                return std::string(which == 1 ? "node" : "cross") + " group: rank " +
                       std::to_string(r) + " value " + std::to_string(k) + " is " +
                       std::to_string(out[k]) + ", expected " + std::to_string(want);
            }
          }
          if (ex.commBytes() - before != sent)
            return "rank " + std::to_string(r) + ": commBytes grew by " +
                   std::to_string(ex.commBytes() - before) + ", expected " + std::to_string(sent);
          return "";
        },
        0, "shm");
    EXPECT_EQ(err, "");
  }
}

/// Which transport each kind of group gets, and that each one sums and
/// exchanges right: 2 nodes x 2 ranks.
TEST(HybridCommTest, GroupsTakeTheTransportOfTheirNodes) {
  std::string err = runRanks(
      4, freshDir("hybrid-groups"), 30,
      [&](int r, Communicator &comm) -> std::string {
        if (std::string(comm.backend()) != "shm+gloo" ||
            comm.describe() != "shm+gloo (2 nodes of 2 ranks)")
          return "world: " + comm.describe();
        // Consecutive ranks share a node; ranks r and r + 2 share a place.
        std::vector<int64_t> node{r / 2 * 2, r / 2 * 2 + 1}, place{r % 2, r % 2 + 2},
            all{0, 1, 2, 3};
        std::unique_ptr<Communicator> a, b, c;
        for (auto [ranks, tag, out] : {std::make_tuple(node, "node-" + std::to_string(r / 2), &a),
                                       std::make_tuple(place, "place-" + std::to_string(r % 2), &b),
                                       std::make_tuple(all, std::string("all"), &c)})
          if (Status st = comm.subgroup(ranks, tag, *out); !st)
            return "subgroup " + tag + ": " + st.message();
        if (std::string(a->backend()) != "shm" || std::string(b->backend()) != "gloo" ||
            std::string(c->backend()) != "shm+gloo")
          return std::string("backends ") + a->backend() + " " + b->backend() + " " + c->backend();
        for (auto [g, members] : {std::make_pair(a.get(), node), std::make_pair(b.get(), place),
                                  std::make_pair(c.get(), all)}) {
          std::vector<float> v(1001);
          for (size_t i = 0; i < v.size(); ++i)
            v[i] = (float)(r * 10 + i % 7);
          if (!g->allReduce(v.data(), v.data(), (int64_t)v.size(), DType::F32, ReduceOp::Sum))
            return std::string(g->backend()) + " all_reduce failed";
          for (size_t i = 0; i < v.size(); ++i) {
            float want = 0;
            for (int64_t q : members)
              want += (float)(q * 10 + i % 7);
            if (v[i] != want)
              return std::string(g->backend()) + " element " + std::to_string(i) + " is " +
                     std::to_string(v[i]) + ", expected " + std::to_string(want);
          }
          // And exchanges: chunk j goes to the group's j-th member.
          const int64_t k = (int64_t)members.size();
          const int64_t me = std::find(members.begin(), members.end(), r) - members.begin();
          std::vector<int8_t> in(k * 5), out(k * 5);
          for (int64_t j = 0; j < k; ++j)
            for (int64_t i = 0; i < 5; ++i)
              in[j * 5 + i] = (int8_t)(r * 16 + j * 4 + i);
          if (!g->allToAll(in.data(), out.data(), 5, DType::I8))
            return std::string(g->backend()) + " all_to_all failed";
          for (int64_t j = 0; j < k; ++j)
            for (int64_t i = 0; i < 5; ++i)
              if (out[j * 5 + i] != (int8_t)(members[j] * 16 + me * 4 + i))
                return std::string(g->backend()) + " all_to_all: byte " +
                       std::to_string(j * 5 + i) + " is " + std::to_string(out[j * 5 + i]);
        }
        return "";
      },
      0, "hybrid");
  EXPECT_EQ(err, "");
}

/// An all-gather whose input is the rank's own block of its output (in
/// place), and an all-reduce in place, both in several chunks.
TEST(HybridCommTest, InPlaceCollectivesInChunks) {
  std::string err = runRanks(
      4, freshDir("hybrid-inplace"), 30,
      [&](int r, Communicator &comm) -> std::string {
        const int64_t shard = 40001; // 640 KB gathered: 10 chunks of 64 KiB
        std::vector<float> all(4 * shard, -1.0f);
        for (int64_t i = 0; i < shard; ++i)
          all[r * shard + i] = (float)(r * 100000 + i);
        if (!comm.allGather(all.data() + r * shard, all.data(), shard, DType::F32))
          return "all_gather failed";
        for (int64_t i = 0; i < 4 * shard; ++i)
          if (all[i] != (float)(i / shard * 100000 + i % shard))
            return "all_gather: element " + std::to_string(i) + " is " + std::to_string(all[i]);
        std::vector<float> v(3 * shard + 1);
        for (size_t i = 0; i < v.size(); ++i)
          v[i] = (float)(r + i % 5);
        if (!comm.allReduce(v.data(), v.data(), (int64_t)v.size(), DType::F32, ReduceOp::Sum))
          return "all_reduce failed";
        for (size_t i = 0; i < v.size(); ++i)
          if (v[i] != (float)(6 + 4 * (i % 5)))
            return "all_reduce: element " + std::to_string(i) + " is " + std::to_string(v[i]);
        // An odd count on nodes of 2: the last span is padded (it passes
        // through the scratch), the others go straight from `in` to `out`,
        // which is another buffer here; `in` is left as it was.
        std::vector<float> w(3 * shard + 2), sum(w.size(), -1.0f);
        for (size_t i = 0; i < w.size(); ++i)
          w[i] = (float)(r + i % 7);
        if (!comm.allReduce(w.data(), sum.data(), (int64_t)w.size(), DType::F32, ReduceOp::Sum))
          return "all_reduce (odd count) failed";
        for (size_t i = 0; i < w.size(); ++i) {
          if (sum[i] != (float)(6 + 4 * (i % 7)))
            return "all_reduce (odd count): element " + std::to_string(i) + " is " +
                   std::to_string(sum[i]);
          if (w[i] != (float)(r + i % 7))
            return "all_reduce (odd count) wrote its input at " + std::to_string(i);
        }
        return "";
      },
      0, "hybridc");
  EXPECT_EQ(err, "");
}

/// A measurement, not a check (run with --gtest_also_run_disabled_tests):
/// each two-level collective against its own levels called one after the
/// other on buffers already in the order each level wants (all-reduce: the
/// node's reduce-scatter, the place group's all-reduce of the piece, the
/// node's all-gather; reduce-scatter: the node's, then the place group's;
/// all-gather: the place group's, then the node's), 4 ranks as 2 nodes of
/// 2 on threads of this process; the medians of 31 calls each and their
/// ratio. What the composition adds beyond its levels (copies, the guard)
/// shows in the ratio. docs/BENCHMARKS.md "The two-level collectives
/// without their copies".
TEST(HybridCommTest, DISABLED_CollectivesAgainstTheirLevels) {
  for (int64_t count : {int64_t(1) << 16, int64_t(1) << 19, int64_t(1) << 22}) {
    const int64_t shard = count / 4;
    double whole[3] = {0, 0, 0}, levels[3] = {0, 0, 0};
    std::string err = runRanks(
        4, freshDir("hybrid-levels"), 60,
        [&](int r, Communicator &comm) -> std::string {
          Communicator *node = nullptr, *cross = nullptr;
          int64_t perNode = 0;
          if (!comm.levels(node, cross, perNode))
            return "not two-level";
          const int64_t p = count / perNode; // a node piece: M shards
          std::vector<float> v(count, 1.0f), piece(p), mine(shard, 1.0f);
          auto median = [&](const std::function<Status()> &f, double &ms) -> std::string {
            std::vector<double> ts;
            for (int i = 0; i < 31; ++i) {
              if (!comm.barrier())
                return "barrier failed";
              auto t0 = std::chrono::steady_clock::now();
              if (!f())
                return "collective failed";
              ts.push_back(
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count());
            }
            std::sort(ts.begin(), ts.end());
            if (r == 0)
              ms = ts[ts.size() / 2];
            return "";
          };
          const ReduceOp mean = ReduceOp::Mean;
          const std::function<Status()> fs[3][2] = {
              {[&] { return comm.allReduce(v.data(), v.data(), count, DType::F32, mean); },
               [&]() -> Status {
                 FSDP_RETURN_IF_ERROR(
                     node->reduceScatter(v.data(), piece.data(), p, DType::F32, mean));
                 FSDP_RETURN_IF_ERROR(
                     cross->allReduce(piece.data(), piece.data(), p, DType::F32, mean));
                 return node->allGather(piece.data(), v.data(), p, DType::F32);
               }},
              {[&] { return comm.reduceScatter(v.data(), mine.data(), shard, DType::F32, mean); },
               [&]() -> Status {
                 FSDP_RETURN_IF_ERROR(
                     node->reduceScatter(v.data(), piece.data(), p, DType::F32, mean));
                 return cross->reduceScatter(piece.data(), mine.data(), shard, DType::F32, mean);
               }},
              {[&] { return comm.allGather(mine.data(), v.data(), shard, DType::F32); },
               [&]() -> Status {
                 FSDP_RETURN_IF_ERROR(
                     cross->allGather(mine.data(), piece.data(), shard, DType::F32));
                 return node->allGather(piece.data(), v.data(), p, DType::F32);
               }}};
          for (int k = 0; k < 3; ++k)
            for (int w = 0; w < 2; ++w) {
              std::string e = median(fs[k][w], w ? levels[k] : whole[k]);
              if (!e.empty())
                return e;
            }
          return "";
        },
        0, "hybrid");
    ASSERT_EQ(err, "");
    const char *names[3] = {"all_reduce", "reduce_scatter", "all_gather"};
    for (int k = 0; k < 3; ++k)
      std::printf("%-14s of %6.2f MiB: whole %8.3f ms, its levels %8.3f ms, ratio %.2f\n", names[k],
                  count * 4.0 / (1 << 20), whole[k], levels[k], whole[k] / levels[k]);
  }
}

/// Nodes of unequal sizes: Gloo between all ranks, and the header says why.
/// The ranks meet in a barrier before they tear down: a rank that closed
/// its connections straight after connecting could cut a peer's Gloo
/// rendezvous short ("Connection closed by peer", seen once in CI).
TEST(HybridCommTest, UnequalNodesRunGlooThroughout) {
  std::string err = runRanks(
      3, freshDir("hybrid-unequal"), 30,
      [&](int, Communicator &comm) -> std::string {
        std::string why;
        if (comm.describe() != "gloo (2 nodes: nodes hold unequal numbers of ranks, Gloo "
                               "between all ranks)")
          why = comm.describe();
        if (Status st = comm.barrier(); !st)
          return "barrier failed: " + st.message();
        return why;
      },
      0, "hybrid");
  EXPECT_EQ(err, "");
}

/// A communicator built and destroyed at once (a job that fails right
/// after connecting, a probe): no rank may close its connections while a
/// peer is still in its rendezvous. The Gloo factories meet in a barrier
/// after connecting; without it 5 of 6 runs of this test's Gloo and
/// hybrid jobs failed here with "Connection closed by peer" (a job in some
/// dozens; CI's Cooperlake sweep in session 42), with it none of 15.
/// Shared memory: every rank has mapped the segment before any leaves.
TEST(CommTest, CommunicatorsBuiltAndDestroyedAtOnce) {
  for (const std::string backend : {"gloo", "hybrid", "shm"})
    for (int job = 0; job < 40; ++job) {
      SCOPED_TRACE(backend + " job " + std::to_string(job));
      std::string err = runRanks(
          3, freshDir("at-once-" + backend + std::to_string(job)), 30,
          [&](int, Communicator &) { return std::string(); }, 0, backend);
      EXPECT_EQ(err, "");
    }
}

class CommFailureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CommFailureTest, DeadPeerIsAnErrorNotAHang) {
  std::signal(SIGPIPE, SIG_IGN); // as fsdp-run does: EPIPE, not death
  std::atomic<bool> sawError{false};
  auto start = std::chrono::steady_clock::now();
  std::string err = runRanks(
      2, freshDir("dead" + GetParam()), 3,
      [&](int r, Communicator &comm) -> std::string {
        // Both meet once; then rank 1 leaves and its context is destroyed.
        if (!comm.barrier())
          return r == 0 ? "barrier failed" : "";
        if (r == 1)
          return "";
        std::vector<float> v(1000, 1.0f);
        for (int i = 0; i < 3; ++i) {
          Status st = comm.allReduce(v.data(), v.data(), 1000, DType::F32, ReduceOp::Sum);
          if (!st) {
            sawError = st.message().find("all_reduce failed") != std::string::npos;
            return "";
          }
        }
        return "the collectives succeeded without a peer";
      },
      0, GetParam());
  // Either the collective fails (the usual case) or, if the peer was
  // faster still, the barrier does: an error both ways, never a hang.
  EXPECT_TRUE(err.empty() || err == "barrier failed") << err;
  EXPECT_TRUE(sawError || err == "barrier failed");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}
INSTANTIATE_TEST_SUITE_P(Backends, CommFailureTest, ::testing::Values("gloo", "shm", "hybridx"),
                         [](const ::testing::TestParamInfo<std::string> &i) { return i.param; });

/// Rank 1 of 3 skips the fourth all-reduce and stays alive (its heartbeat
/// goes on) until the others gave up: their errors must name rank 1 as the
/// one that did not arrive, not the neighbour Gloo was talking to.
/// (backend, TCP store)
class CommFlightRecorderTest
    : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(CommFlightRecorderTest, TimeoutNamesTheRankThatDidNotArrive) {
  std::signal(SIGPIPE, SIG_IGN);
  auto [backend, tcp] = GetParam();
  std::atomic<int> gaveUp{0};
  std::vector<std::string> messages(3);
  auto start = std::chrono::steady_clock::now();
  std::string err = runRanks(
      3, tcp ? "" : freshDir("recorder" + backend), /*timeout=*/4,
      [&](int r, Communicator &comm) -> std::string {
        std::vector<float> v(64, 1.0f);
        for (int i = 0; i < 3; ++i)
          if (!comm.allReduce(v.data(), v.data(), 64, DType::F32, ReduceOp::Sum))
            return "all_reduce #" + std::to_string(i + 1) + " failed";
        if (r == 1) {
          // Alive, but never comes: wait (bounded) until both peers failed.
          auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (gaveUp < 2 && std::chrono::steady_clock::now() < limit)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return "";
        }
        Status st = comm.allReduce(v.data(), v.data(), 64, DType::F32, ReduceOp::Sum);
        ++gaveUp;
        if (st)
          return "the fourth all_reduce succeeded without rank 1";
        messages[r] = st.message();
        return "";
      },
      tcp ? freePort() : 0, backend);
  EXPECT_EQ(err, "");
  for (int r : {0, 2}) {
    // (On a loaded host the message may also say, between the two, that
    // this rank itself was starved of CPU: true then, and beside the
    // point here.)
    EXPECT_NE(messages[r].find("collective #4 (all_reduce): "), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("rank 1 did not arrive: it is alive but still computing after "
                               "collective #3 (all_reduce)"),
              std::string::npos)
        << messages[r];
    EXPECT_EQ(messages[r].find("rank 0 did not arrive"), std::string::npos) << messages[r];
    EXPECT_EQ(messages[r].find("rank 2 did not arrive"), std::string::npos) << messages[r];
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}
INSTANTIATE_TEST_SUITE_P(Stores, CommFlightRecorderTest,
                         ::testing::Combine(::testing::Values("gloo", "shm", "hybrid"),
                                            ::testing::Values(false, true)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, bool>> &i) {
                           return std::get<0>(i.param) +
                                  (std::get<1>(i.param) ? "TcpStore" : "Directory");
                         });

/// The same for an all-to-all (the recorder's live record names it by its
/// index in kCollectiveKinds, the last one): rank 1 of 3 skips the fourth.
TEST(CommFlightRecorderTest, AStalledAllToAllIsNamed) {
  std::signal(SIGPIPE, SIG_IGN);
  for (const std::string backend : {"gloo", "shm", "hybrid"}) {
    SCOPED_TRACE(backend);
    std::atomic<int> gaveUp{0};
    std::vector<std::string> messages(3);
    std::string err = runRanks(
        3, freshDir("recorder-a2a" + backend), /*timeout=*/4,
        [&](int r, Communicator &comm) -> std::string {
          std::vector<int8_t> in(3 * 16, (int8_t)r), out(3 * 16);
          for (int i = 0; i < 3; ++i)
            if (!comm.allToAll(in.data(), out.data(), 16, DType::I8))
              return "all_to_all #" + std::to_string(i + 1) + " failed";
          if (r == 1) {
            auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
            while (gaveUp < 2 && std::chrono::steady_clock::now() < limit)
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            return "";
          }
          Status st = comm.allToAll(in.data(), out.data(), 16, DType::I8);
          ++gaveUp;
          if (st)
            return "the fourth all_to_all succeeded without rank 1";
          messages[r] = st.message();
          return "";
        },
        0, backend);
    EXPECT_EQ(err, "");
    for (int r : {0, 2}) {
      EXPECT_NE(messages[r].find("collective #4 (all_to_all): "), std::string::npos) << messages[r];
      EXPECT_NE(messages[r].find("rank 1 did not arrive: it is alive but still computing after "
                                 "collective #3 (all_to_all)"),
                std::string::npos)
          << messages[r];
    }
  }
}

TEST(CommEnvTest, ReadsTheJobFromTheEnvironment) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "3", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  JobEnv job;
  ASSERT_TRUE(jobFromEnvironment(job).isOk());
  EXPECT_EQ(job.rank, 1);
  EXPECT_EQ(job.worldSize, 3);
  EXPECT_EQ(job.masterPort, 29500);
  EXPECT_EQ(job.node, ""); // no node rank: this machine's identity names the node
  EXPECT_EQ(nodeIdentity(job).rfind("machine ", 0), 0u) << nodeIdentity(job);
  ::setenv("GROUP_RANK", "2", 1); // torchrun's node rank
  ASSERT_TRUE(jobFromEnvironment(job).isOk());
  EXPECT_EQ(nodeIdentity(job), "node 2");
  ::setenv("GROUP_RANK", "two", 1);
  EXPECT_NE(jobFromEnvironment(job).message().find("GROUP_RANK='two' is not an integer"),
            std::string::npos);
  ::unsetenv("GROUP_RANK");
  ::setenv("WORLD_SIZE", "x", 1);
  EXPECT_NE(jobFromEnvironment(job).message().find("is not an integer"), std::string::npos);
  ::unsetenv("WORLD_SIZE");
  EXPECT_NE(jobFromEnvironment(job).message().find("only one of RANK and WORLD_SIZE"),
            std::string::npos);
  ::unsetenv("RANK");
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
  ASSERT_TRUE(jobFromEnvironment(job).isOk());
  EXPECT_EQ(job.worldSize, 1);
}

/// srun's variables: the rank, world, this node's share and its node id
/// (which the hybrid communicator groups ranks by).
TEST(CommEnvTest, ReadsASlurmJob) {
  const char *vars[][2] = {{"SLURM_PROCID", "5"},   {"SLURM_NTASKS", "8"},
                           {"SLURM_LOCALID", "1"},  {"SLURM_NTASKS_PER_NODE", "4"},
                           {"SLURM_NODEID", "1"},   {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "29500"}};
  for (auto &v : vars)
    ::setenv(v[0], v[1], 1);
  JobEnv job;
  ASSERT_TRUE(jobFromEnvironment(job).isOk());
  EXPECT_EQ(job.source, "srun (Slurm)");
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.worldSize, 8);
  EXPECT_EQ(job.localRank, 1);
  EXPECT_EQ(job.localWorldSize, 4);
  EXPECT_EQ(nodeIdentity(job), "node 1");
  ::setenv("SLURM_NODEID", "-", 1);
  EXPECT_NE(jobFromEnvironment(job).message().find("SLURM_NODEID='-' is not an integer"),
            std::string::npos);
  for (auto &v : vars)
    ::unsetenv(v[0]);
}

} // namespace
