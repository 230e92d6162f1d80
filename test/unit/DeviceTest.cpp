//===- DeviceTest.cpp - the conformance suite of the Device interface -----===//
//
// Written once against runtime/core/Device.h and instantiated per backend
// (IREE's CTS pattern): the CPU device here; runtime/cuda/ adds its own
// INSTANTIATE_TEST_SUITE_P line, skipped where no GPU exists. Every check is
// made through the interface only (device memory is read back with
// copyToHost), so the same tests hold for a device whose memory the host
// cannot touch.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Device.h"
#include "runtime/core/Bf16.h"
#include "runtime/core/Comm.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/OpRules.h"
#include "runtime/core/PlanSchema.h"
#include "runtime/core/Quantize.h"
#include "runtime/core/ShapeRules.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/devices/Devices.h"
#include "test/unit/TestPlans.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace fsdp;

namespace {

/// A communicator that delegates to another after a delay, or fails: makes
/// the ordering of a collective against compute observable.
class SlowComm final : public Communicator {
public:
  SlowComm(std::unique_ptr<Communicator> inner, int delayMs, bool fail = false)
      : inner(std::move(inner)), delayMs(delayMs), fail(fail) {}
  int64_t rank() const override { return inner->rank(); }
  int64_t size() const override { return inner->size(); }
  Status allReduce(const void *in, void *out, int64_t n, DType t, ReduceOp op, Stream *s) override {
    FSDP_RETURN_IF_ERROR(delay("all_reduce"));
    return inner->allReduce(in, out, n, t, op, s);
  }
  Status reduceScatter(const void *in, void *out, int64_t n, DType t, ReduceOp op,
                       Stream *s) override {
    FSDP_RETURN_IF_ERROR(delay("reduce_scatter"));
    return inner->reduceScatter(in, out, n, t, op, s);
  }
  Status allGather(const void *in, void *out, int64_t n, DType t, Stream *s) override {
    FSDP_RETURN_IF_ERROR(delay("all_gather"));
    return inner->allGather(in, out, n, t, s);
  }
  Status allToAll(const void *in, void *out, int64_t n, DType t, Stream *s) override {
    FSDP_RETURN_IF_ERROR(delay("all_to_all"));
    return inner->allToAll(in, out, n, t, s);
  }
  Status broadcast(void *d, int64_t b, int64_t r) override { return inner->broadcast(d, b, r); }
  Status barrier() override { return inner->barrier(); }
  int calls = 0;

private:
  Status delay(const char *what) {
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    if (fail)
      return FSDP_ERROR(what, ": injected failure");
    return Status::ok();
  }
  std::unique_ptr<Communicator> inner;
  int delayMs;
  bool fail;
};

/// The communicator that matches a device's memory (one rank).
std::unique_ptr<Communicator> communicatorFor(const std::string &device) {
  (void)device; // cpu: host memory; cuda will pass a one-rank NCCL comm
  return makeSingleProcessCommunicator();
}

/// A plan of f32 vectors of `n` elements at 64-byte offsets, and `program`.
Plan vectorPlan(int nbuf, int64_t n, std::vector<Instruction> program) {
  Plan p;
  int64_t offset = 0;
  for (int i = 0; i < nbuf; ++i) {
    Buffer b;
    b.id = i;
    b.shape = {n};
    b.bytes = n * 4;
    b.offset = offset;
    b.persistent = true;
    b.name = "b" + std::to_string(i);
    offset += (b.bytes + 63) / 64 * 64;
    p.buffers.push_back(b);
  }
  p.arenaBytes = offset;
  p.program = std::move(program);
  return p;
}

Instruction inst(const char *op, std::vector<int64_t> in, std::vector<int64_t> out,
                 nlohmann::json attrs = nlohmann::json::object()) {
  Instruction i;
  i.op = op;
  i.in = std::move(in);
  i.out = std::move(out);
  i.attrs = std::move(attrs);
  return i;
}

class DeviceConformance : public ::testing::TestWithParam<std::string> {
protected:
  void SetUp() override {
    Status st = checkDevice(GetParam());
    if (!st)
      GTEST_SKIP() << st.message();
    ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
  }
  /// Allocates the plan's arena, checks and binds the plan, zeroes it.
  void bind(const Plan &plan) {
    for (const Instruction &i : plan.program)
      ASSERT_TRUE(checkInstruction(plan, i).isOk()) << checkInstruction(plan, i).message();
    ASSERT_TRUE(dev->allocateArena(plan.arenaBytes, 0).isOk());
    ASSERT_TRUE(dev->prepare(plan, 0).isOk());
    std::vector<uint8_t> zeros(dev->arenaBytes(), 0);
    ASSERT_TRUE(dev->copyToDevice(dev->arenaBase(), zeros.data(), zeros.size()).isOk());
  }
  std::vector<float> read(const Plan &plan, int64_t id) {
    std::vector<float> v(plan.buffers[id].numel());
    EXPECT_TRUE(dev->copyToHost(v.data(), dev->arenaBase() + plan.buffers[id].offset,
                                plan.buffers[id].bytes)
                    .isOk());
    return v;
  }
  /// A fresh device of this suite's kind in place of `dev`.
  void freshDevice() {
    std::unique_ptr<Device> d;
    ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, d).isOk());
    dev.swap(d);
  }
  /// Every instruction of the bound plan run under the stochastic draws'
  /// context {seed 77, step 5}, and the device synchronised.
  void runDrawing(const Plan &plan) {
    ASSERT_TRUE(dev->setDropoutContext({77, 5, 0, true}).isOk());
    for (size_t i = 0; i < plan.program.size(); ++i)
      ASSERT_TRUE(dev->run(i).isOk());
    ASSERT_TRUE(dev->synchronize().isOk());
  }
  /// Buffer `id` set from `src` (its bytes, any dtype), and its 16-bit
  /// values (bf16 bits) read back.
  void put(const Plan &plan, int64_t id, const void *src) {
    ASSERT_TRUE(
        dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, src, plan.buffers[id].bytes)
            .isOk());
  }
  std::vector<uint16_t> bits(const Plan &plan, int64_t id) {
    std::vector<uint16_t> v(plan.buffers[id].numel());
    EXPECT_TRUE(
        dev->copyToHost(v.data(), dev->arenaBase() + plan.buffers[id].offset, v.size() * 2).isOk());
    return v;
  }
  /// A buffer's bytes (8-bit state: codes, then scales).
  std::vector<uint8_t> bytes(const Plan &plan, int64_t id) {
    std::vector<uint8_t> v(plan.buffers[id].bytes);
    EXPECT_TRUE(
        dev->copyToHost(v.data(), dev->arenaBase() + plan.buffers[id].offset, v.size()).isOk());
    return v;
  }
  void write(const Plan &plan, int64_t id, const std::vector<float> &v) {
    ASSERT_EQ((int64_t)v.size() * 4, plan.buffers[id].bytes);
    ASSERT_TRUE(
        dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, v.data(), v.size() * 4)
            .isOk());
  }
  /// bind(plan), buffers `ids` filled with f(i, id), every instruction run
  /// and the device synchronised; the host copies of the filled buffers
  /// (by id; the others empty).
  std::vector<std::vector<float>> bindFillRun(const Plan &plan, std::initializer_list<int> ids,
                                              const std::function<float(size_t, int)> &f) {
    std::vector<std::vector<float>> host(plan.buffers.size());
    bind(plan);
    for (int id : ids) {
      host[id].resize(plan.buffers[id].numel());
      for (size_t i = 0; i < host[id].size(); ++i)
        host[id][i] = f(i, id);
      write(plan, id, host[id]);
    }
    for (size_t i = 0; i < plan.program.size(); ++i) {
      Status st = dev->run(i);
      EXPECT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
    }
    EXPECT_TRUE(dev->synchronize().isOk());
    return host;
  }
  std::unique_ptr<Device> dev;
};

TEST_P(DeviceConformance, ArenaIsAlignedAndSizedOnce) {
  EXPECT_EQ(dev->arenaBase(), nullptr);
  ASSERT_TRUE(dev->allocateArena(1000, 0).isOk());
  ASSERT_NE(dev->arenaBase(), nullptr);
  EXPECT_EQ((uintptr_t)dev->arenaBase() % Device::kArenaAlignment, 0u);
  EXPECT_GE(dev->arenaBytes(), 1000);
  EXPECT_FALSE(dev->allocateArena(1000, 0).isOk()) << "a second arena";
  std::unique_ptr<Device> empty;
  ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, empty).isOk());
  EXPECT_TRUE(empty->allocateArena(0, 0).isOk()) << "a plan may need no arena";
  EXPECT_NE(empty->arenaBase(), nullptr);
  EXPECT_FALSE(empty->allocateArena(-1, 0).isOk());
  // An offloading plan's host arena starts on a page (hostArenaStart), so
  // the swap file's direct transfers reach its staging buffers
  // ([Note: swap file I/O] in SwapFile.cpp), whatever the device arena's
  // size.
  for (int64_t devBytes : {0, 1000, 4096, 70000}) {
    std::unique_ptr<Device> two;
    ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, two).isOk());
    ASSERT_TRUE(two->allocateArena(devBytes, 8192).isOk());
    EXPECT_EQ((uintptr_t)two->address(hostArenaStart(devBytes)) % kSwapAlignment, 0u)
        << "device arena of " << devBytes << " bytes";
  }
}

TEST_P(DeviceConformance, HostCopiesRoundTripWithoutTouchingNeighbours) {
  ASSERT_TRUE(dev->allocateArena(4096, 0).isOk());
  std::vector<uint8_t> fill(4096, 0xAB), back(4096);
  ASSERT_TRUE(dev->copyToDevice(dev->arenaBase(), fill.data(), 4096).isOk());
  // Unaligned offsets and odd sizes: a copy is bytes, not elements.
  for (int64_t off : {0, 1, 63, 100, 4000})
    for (int64_t n : {1, 3, 64, 96}) {
      std::vector<uint8_t> pattern(n);
      for (int64_t i = 0; i < n; ++i)
        pattern[i] = (uint8_t)(off * 7 + i * 13 + 1);
      ASSERT_TRUE(dev->copyToDevice(dev->arenaBase() + off, pattern.data(), n).isOk());
      std::vector<uint8_t> got(n);
      ASSERT_TRUE(dev->copyToHost(got.data(), dev->arenaBase() + off, n).isOk());
      EXPECT_EQ(got, pattern) << "offset " << off << ", " << n << " bytes";
      // Restore and check the bytes around the copy kept their value.
      ASSERT_TRUE(dev->copyToDevice(dev->arenaBase() + off, fill.data(), n).isOk());
    }
  ASSERT_TRUE(dev->copyToHost(back.data(), dev->arenaBase(), 4096).isOk());
  EXPECT_EQ(back, fill);
}

TEST_P(DeviceConformance, CopiesIntoPinnedHostMemory) {
  // --async-save's staging image: page-locked where the device pins
  // (cuda), refused where host memory is the device's (cpu); either way
  // copies into it land, and unpinning leaves it ordinary memory.
  ASSERT_TRUE(dev->allocateArena(1 << 16, 0).isOk());
  std::vector<uint8_t> pattern(1 << 16);
  for (size_t i = 0; i < pattern.size(); ++i)
    pattern[i] = (uint8_t)(i * 31 + 7);
  ASSERT_TRUE(dev->copyToDevice(dev->arenaBase(), pattern.data(), 1 << 16).isOk());
  auto *host = static_cast<uint8_t *>(std::aligned_alloc(4096, 1 << 16));
  Status pin = dev->pinHost(host, 1 << 16);
  EXPECT_EQ(pin.isOk(), std::string(dev->name()) != "cpu") << pin.message();
  ASSERT_TRUE(dev->copyToHost(host + 5, dev->arenaBase() + 3, 40000).isOk());
  EXPECT_EQ(std::memcmp(host + 5, pattern.data() + 3, 40000), 0);
  if (pin.isOk()) {
    // Registered twice, or unregistered at another address: refused.
    EXPECT_FALSE(dev->pinHost(host + 4096, 4096).isOk());
    EXPECT_FALSE(dev->unpinHost(host + 4096).isOk());
    EXPECT_TRUE(dev->unpinHost(host).isOk());
  }
  std::free(host);
}

TEST_P(DeviceConformance, FillsWordsOfBothArenasWithoutTouchingNeighbours) {
  // The arenas' sentinel (Executor::prepare): device and host arena,
  // word patterns kept bit for bit (a NaN pattern too), the words around
  // untouched; a fill longer than the default's 1 MiB chunk.
  const int64_t devBytes = 3 << 20, hostBytes = 8192;
  ASSERT_TRUE(dev->allocateArena(devBytes, hostBytes).isOk());
  const int64_t hostAt = hostArenaStart(devBytes);
  for (auto [at, bytes] : {std::pair<int64_t, int64_t>{0, devBytes}, {hostAt, hostBytes}}) {
    std::vector<uint32_t> zeros(bytes / 4, 0u), got(bytes / 4);
    ASSERT_TRUE(dev->copyToDevice(dev->address(at), zeros.data(), bytes).isOk());
    const int64_t from = bytes == devBytes ? 4096 : 64, n = bytes - 2 * from;
    for (uint32_t word : {0x7FC0DEADu, 0xFFFFFFFFu}) {
      Status filled = dev->fillWords(dev->address(at + from), word, n);
      ASSERT_TRUE(filled.isOk()) << filled.message();
      ASSERT_TRUE(dev->copyToHost(got.data(), dev->address(at), bytes).isOk());
      int64_t wrong = 0;
      for (int64_t i = 0; i < bytes / 4; ++i)
        wrong += got[i] != (i >= from / 4 && i < (from + n) / 4 ? word : 0u);
      EXPECT_EQ(wrong, 0) << (at ? "host" : "device") << " arena, word " << std::hex << word;
    }
  }
}

TEST_P(DeviceConformance, ImplementsEveryComputeOpOfTheSchema) {
  for (const OpSchema &op : kOps) {
    if (op.kind != OpKind::Compute)
      continue;
    EXPECT_TRUE(dev->implementsOp(std::string(op.name))) << op.name;
    EXPECT_TRUE(hasOpRule(op.name)) << op.name << " has no check in core";
  }
  EXPECT_FALSE(dev->implementsOp("conv2d"));
}

TEST_P(DeviceConformance, RunsInstructionsOnTheArena) {
  // b2 = b0 + b1; b3 = 2.5 * b2; b4 = matmul([2,3] view of b0.., ...) is
  // left to the kernel tests: here the device's addressing and dispatch.
  Plan plan =
      vectorPlan(4, 5, {inst("add", {0, 1}, {2}), inst("scale", {2}, {3}, {{"factor", 2.5}})});
  bind(plan);
  write(plan, 0, {1, 2, 3, 4, 5});
  write(plan, 1, {10, 20, 30, 40, 50});
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->run(1).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(read(plan, 2), (std::vector<float>{11, 22, 33, 44, 55}));
  EXPECT_EQ(read(plan, 3), (std::vector<float>{27.5, 55, 82.5, 110, 137.5}));
  EXPECT_EQ(read(plan, 0), (std::vector<float>{1, 2, 3, 4, 5})) << "inputs unchanged";
}

/// [Note: stamped trace]: a device that times its compute stream measures
/// the time between two stamps there (here a 40 ms host wait between them:
/// the stream idle, then stamped after it); one that cannot says so.
TEST_P(DeviceConformance, TimingStampsMeasureTheComputeStream) {
  Plan plan =
      vectorPlan(4, 5, {inst("add", {0, 1}, {2}), inst("scale", {2}, {3}, {{"factor", 2.5}})});
  bind(plan);
  double ms = -1;
  if (!dev->stampsCompute()) {
    Status st = dev->stampCompute(0);
    ASSERT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("cannot time"), std::string::npos) << st.message();
    EXPECT_FALSE(dev->stampGapMs(0, 1, ms).isOk());
    return;
  }
  for (int round = 0; round < 2; ++round) { // a second round re-stamps the same slots
    ASSERT_TRUE(dev->stampCompute(0).isOk());
    ASSERT_TRUE(dev->run(0).isOk());
    ASSERT_TRUE(dev->stampCompute(1).isOk());
    ASSERT_TRUE(dev->synchronize().isOk()); // stamp 1 taken before the sleep starts
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    ASSERT_TRUE(dev->run(1).isOk());
    ASSERT_TRUE(dev->stampCompute(2).isOk());
    ASSERT_TRUE(dev->stampCompute(3).isOk());
    ASSERT_TRUE(dev->synchronize().isOk());
    double a = -1, b = -1, c = -1, whole = -1;
    ASSERT_TRUE(dev->stampGapMs(0, 1, a).isOk());
    ASSERT_TRUE(dev->stampGapMs(1, 2, b).isOk());
    ASSERT_TRUE(dev->stampGapMs(2, 3, c).isOk());
    ASSERT_TRUE(dev->stampGapMs(0, 3, whole).isOk());
    EXPECT_GE(a, 0);
    EXPECT_GE(b, 40 - 0.5) << "the 40 ms between stamps 1 and 2"; // event resolution ~0.5 us
    EXPECT_LT(a, b);
    EXPECT_GE(c, 0);
    EXPECT_LT(c, b);
    EXPECT_NEAR(whole, a + b + c, 0.01);
    EXPECT_EQ(read(plan, 3), (std::vector<float>(5, 0.f))) << "zeros in, zeros out";
  }
  Status st = dev->stampGapMs(0, 4, ms);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("only 4 exist"), std::string::npos) << st.message();
  EXPECT_FALSE(dev->stampCompute(-1).isOk());
}

/// [Note: step capture]: a device that captures records the work instead
/// of running it, and each replay runs it on the arena's current contents;
/// one that cannot says so.
TEST_P(DeviceConformance, CapturedStepReplaysOnNewInputs) {
  Plan plan =
      vectorPlan(4, 5, {inst("add", {0, 1}, {2}), inst("scale", {2}, {3}, {{"factor", 2.5}})});
  bind(plan);
  if (!dev->canCapture()) {
    Status st = dev->beginCapture();
    ASSERT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("cannot capture a step"), std::string::npos) << st.message();
    return;
  }
  write(plan, 0, {1, 2, 3, 4, 5});
  write(plan, 1, {10, 20, 30, 40, 50});
  ASSERT_TRUE(dev->beginCapture().isOk());
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->run(1).isOk());
  ASSERT_TRUE(dev->endCapture(true).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(read(plan, 3), std::vector<float>(5, 0.f)) << "recorded, not run";
  ASSERT_TRUE(dev->replay().isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(read(plan, 3), (std::vector<float>{27.5, 55, 82.5, 110, 137.5}));
  write(plan, 1, {0, 0, 0, 0, 1});
  ASSERT_TRUE(dev->replay().isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(read(plan, 3), (std::vector<float>{2.5, 5, 7.5, 10, 15}));
}

TEST_P(DeviceConformance, RunsNarrowFloatInstructions) {
  // bf16 storage: the device computes as it likes but stores bf16.
  Plan plan = vectorPlan(3, 4, {inst("add", {0, 1}, {2})});
  for (Buffer &b : plan.buffers) {
    b.dtype = DType::BF16;
    b.bytes = 8;
  }
  bind(plan);
  // 1.0, 2.0, 3.0, 0.5 and 0.25, 0.5, 1.0, 4.0 in bf16.
  std::vector<uint16_t> a{0x3f80, 0x4000, 0x4040, 0x3f00}, b{0x3e80, 0x3f00, 0x3f80, 0x4080};
  ASSERT_TRUE(dev->copyToDevice(dev->arenaBase() + plan.buffers[0].offset, a.data(), 8).isOk());
  ASSERT_TRUE(dev->copyToDevice(dev->arenaBase() + plan.buffers[1].offset, b.data(), 8).isOk());
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  std::vector<uint16_t> c(4);
  ASSERT_TRUE(dev->copyToHost(c.data(), dev->arenaBase() + plan.buffers[2].offset, 8).isOk());
  // 1.25, 2.5, 4.0, 4.5
  EXPECT_EQ(c, (std::vector<uint16_t>{0x3fa0, 0x4020, 0x4080, 0x4090}));
}

TEST_P(DeviceConformance, RunsHostInstructionsAndCopiesBetweenArenas) {
  // fsdp-offload's shape of work ([Note: two arenas] in Plan.h): b0 and
  // b3 in the device arena, b1 and b2 in the host arena; a copy to the
  // host, an instruction there (CUDA: the CPU kernel on pinned memory,
  // after the compute stream drains) and a copy back, in stream order.
  Plan plan = vectorPlan(
      4, 5, {inst("to_host", {0}, {1}), inst("add", {1, 1}, {2}), inst("to_device", {2}, {3})});
  plan.buffers[1].host = plan.buffers[2].host = true;
  plan.buffers[1].offset = 0;
  plan.buffers[2].offset = 64;
  plan.buffers[3].offset = 64;
  plan.arenaBytes = 128;
  plan.hostArenaBytes = 128;
  for (const Instruction &i : plan.program)
    ASSERT_TRUE(checkInstruction(plan, i).isOk()) << checkInstruction(plan, i).message();
  ASSERT_TRUE(dev->allocateArena(plan.arenaBytes, plan.hostArenaBytes).isOk());
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  auto at = [&](int64_t id) { return dev->address(bufferOffset(plan, id, 0)); };
  std::vector<float> zeros(32, 0.f), x{1, -2, 3.5f, 4, 1e-3f};
  ASSERT_TRUE(dev->copyToDevice(dev->address(0), zeros.data(), 128).isOk());
  ASSERT_TRUE(dev->copyToDevice(at(1), zeros.data(), 128).isOk()) << "the host arena";
  ASSERT_TRUE(dev->copyToDevice(at(0), x.data(), 20).isOk());
  for (size_t i = 0; i < plan.program.size(); ++i)
    ASSERT_TRUE(dev->run(i).isOk()) << plan.program[i].op;
  ASSERT_TRUE(dev->synchronize().isOk());
  std::vector<float> host(5), back(5), twice{2, -4, 7, 8, 2e-3f};
  ASSERT_TRUE(dev->copyToHost(host.data(), at(2), 20).isOk());
  ASSERT_TRUE(dev->copyToHost(back.data(), at(3), 20).isOk());
  EXPECT_EQ(host, twice);
  EXPECT_EQ(back, twice);
  EXPECT_NE(at(1), at(0)) << "the arenas do not share bytes";
}

TEST_P(DeviceConformance, PacksInputsThatPartlyOverlapTheirDestination) {
  // A 16-float packed buffer P (b0) whose memory the plan shares with two of
  // the inputs: X (b1, P[2..5]) goes to P[4..7] and W (b4, P[13..15]) to
  // P[12..14], each partly over its own source (one shifted up, one down);
  // Y (b2, P[8..11]) is in place (skipped); Z (b3) is elsewhere. The CPU
  // memmoves; a plain device copy of overlapping ranges is undefined.
  Plan plan = vectorPlan(5, 4, {});
  auto place = [&](int id, int64_t n, int64_t offset) {
    plan.buffers[id].shape = {n};
    plan.buffers[id].bytes = n * 4;
    plan.buffers[id].offset = offset;
  };
  place(0, 16, 0);
  place(1, 4, 8);
  place(2, 4, 32);
  place(3, 2, 64);
  place(4, 3, 52);
  plan.arenaBytes = 128;
  plan.program = {inst("pack", {3, 1, 2, 4}, {0}, {{"offsets", {0, 4, 8, 12}}})};
  bind(plan);
  write(plan, 0, {-1, -1, 1, 2, 3, 4, -1, -1, 5, 6, 7, 8, -1, 11, 12, 13});
  write(plan, 3, {10, 20});
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(read(plan, 0),
            (std::vector<float>{10, 20, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 0}));
}

/// A plan of f32 matrices of the given shapes, each at a 64-byte offset.
Plan matrixPlan(const std::vector<std::vector<int64_t>> &shapes, std::vector<Instruction> program) {
  Plan p = vectorPlan((int)shapes.size(), 1, std::move(program));
  int64_t offset = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Buffer &b = p.buffers[i];
    b.shape = shapes[i];
    b.bytes = b.numel() * 4;
    b.offset = offset;
    offset += (b.bytes + 63) / 64 * 64;
  }
  p.arenaBytes = offset;
  return p;
}

/// matrixPlan with the buffers `bf16` in bf16, the others f32.
Plan mixedPlan(const std::vector<std::vector<int64_t>> &shapes, const std::vector<int> &bf16,
               std::vector<Instruction> program) {
  Plan p = matrixPlan(shapes, std::move(program));
  int64_t offset = 0;
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    Buffer &b = p.buffers[i];
    bool narrow = std::find(bf16.begin(), bf16.end(), (int)i) != bf16.end();
    b.dtype = narrow ? DType::BF16 : DType::F32;
    b.bytes = b.numel() * (narrow ? 2 : 4);
    b.offset = offset;
    offset += (b.bytes + 63) / 64 * 64;
  }
  p.arenaBytes = offset;
  return p;
}

/// The runtime scratch a fresh device of `device` reserves at prepare for
/// `plan` (CudaDevice: f32 copies of the operands an instruction runs
/// widened on, beside the GEMM workspace).
int64_t preparedScratch(const std::string &device, const Plan &plan) {
  std::unique_ptr<Device> d;
  EXPECT_TRUE(createDevice(device, DeviceOptions{}, d).isOk());
  EXPECT_TRUE(d->allocateArena(plan.arenaBytes, 0).isOk());
  EXPECT_TRUE(d->prepare(plan, 0).isOk());
  return d->scratchHighWater();
}

/// matmul_bias (gelu, with its pre-activation) and matmul_gelu_grad (with
/// the bias gradient) against matmul, bias_add, gelu / matmul, gelu_grad,
/// sum_to on the same device and inputs. n = 16 lets cuBLASLt run the
/// epilogues (GELU_AUX_BIAS, DGELU_BGRAD: the aux leading dimension must
/// be a multiple of 8); n = 12 takes the GEMM + kernels path. The CPU runs
/// the unfused ops' kernels in the same order: bitwise. On CUDA the fused
/// GEMM may sum in another order than the unfused one: per element, both
/// GEMMs are within k 2^-24 sum|a_i b_i| of the exact product (2 of them,
/// and the GELU's slope is at most 1.13), and the epilogue's own
/// arithmetic (a bias add, a tanh-form GELU or its derivative) within 8
/// float32 ulps of the result plus 2^-24 of |pre|, and the error of its
/// tanh. cuBLASLt documents none; on the first H100 run (2026-11-26) its
/// GELU differed by up to 4.6e-6 at |pre| < 2 (about 2^-11 in tanh): the
/// accuracy of PTX's tanh.approx.f32 (relative error <= 2^-10.987, the PTX
/// ISA), taken here as |dt| <= 2^-10. gelu = x (1 + t) / 2 moves by
/// |x| dt / 2; gelu' = (1 + t) / 2 + x (1 - t^2) c (1 + 3a x^2) / 2 by at most
/// dt (1/2 + |x| c (1 + 3a x^2)) (c = sqrt(2/pi), a = 0.044715).
TEST_P(DeviceConformance, FusedMatmulsMatchTheUnfusedOps) {
  // n = 16: cuBLASLt's epilogues (DGELU, then a column sum for the bias
  // gradient); 12 (not a multiple of 8): the GEMM, then the unfused
  // kernels; 16 again with FSDP_CUDA_DGELU_BGRAD=1: the DGELU_BGRAD
  // epilogue.
  for (int pass = 0; pass < 3; ++pass) {
    const int64_t n = pass == 1 ? 12 : 16;
    SCOPED_TRACE("pass " + std::to_string(pass));
    if (pass > 0) { // a device allocates its arena once: a fresh one per plan
      if (pass == 2)
        ::setenv("FSDP_CUDA_DGELU_BGRAD", "1", 1);
      Status made = createDevice(GetParam(), DeviceOptions{}, dev);
      ::unsetenv("FSDP_CUDA_DGELU_BGRAD");
      ASSERT_TRUE(made.isOk()) << made.message();
    }
    const int64_t m = 6, k = 5, n2 = 7;
    // 0 x [m,k], 1 w [n,k], 2 b [n], 3 y [m,n], 4 pre [m,n], 5-7 the
    // unfused product, bias_add and gelu; 8 dz [m,n2], 9 w2 [n2,n],
    // 10 dh [m,n], 11 db [n], 12-13 the unfused product and gelu_grad,
    // 14 sum_to [n].
    Plan plan = matrixPlan(
        {{m, k},
         {n, k},
         {n},
         {m, n},
         {m, n},
         {m, n},
         {m, n},
         {m, n},
         {m, n2},
         {n2, n},
         {m, n},
         {n},
         {m, n},
         {m, n},
         {n}},
        {inst("matmul_bias", {0, 1, 2}, {3, 4}, {{"transpose_rhs", true}, {"gelu", true}}),
         inst("matmul", {0, 1}, {5}, {{"transpose_rhs", true}}), inst("bias_add", {5, 2}, {6}),
         inst("gelu", {6}, {7}), inst("matmul_gelu_grad", {8, 9, 4}, {10, 11}),
         inst("matmul", {8, 9}, {12}), inst("gelu_grad", {4, 12}, {13}),
         inst("sum_to", {13}, {14})});
    auto host = bindFillRun(plan, {0, 1, 2, 8, 9}, [](size_t i, int id) {
      return (float)std::sin(0.37 * double(i) + id) * 1.25f;
    });
    bool exact = GetParam() == "cpu";
    const double u = 1.0 / (1 << 24);
    // The epilogue's tanh error (the comment above): 0 on the CPU, where the
    // comparison is bitwise anyway.
    const double dt = std::ldexp(1.0, -10);
    auto geluGradSlope = [](double x) {
      return 0.5 + std::fabs(x) * 0.7978845608 * (1 + 3 * 0.044715 * x * x);
    };
    // sum |a_i b_i| of each product's element (row-major C = A B^T / A B).
    auto absDot = [&](int a, int b, int64_t r, int64_t c, int64_t kk, bool bt) {
      double s = 0;
      for (int64_t t = 0; t < kk; ++t)
        s += std::fabs(host[a][r * kk + t]) *
             std::fabs(bt ? host[b][c * kk + t] : host[b][t * n + c]);
      return s;
    };
    auto compare = [&](int fused, int unfused, auto slackOf, const char *what) {
      std::vector<float> f = read(plan, fused), g = read(plan, unfused);
      for (size_t i = 0; i < f.size(); ++i) {
        double tol = exact ? 0.0 : slackOf((int64_t)i) + 8 * u * std::fabs(g[i]);
        EXPECT_LE(std::fabs((double)f[i] - g[i]), tol)
            << what << " n=" << n << " element " << i << ": fused " << f[i] << ", unfused " << g[i];
      }
    };
    std::vector<float> pre = read(plan, 6);
    compare(
        4, 6, [&](int64_t i) { return 2 * k * u * absDot(0, 1, i / n, i % n, k, true); },
        "pre-activation");
    compare(
        3, 7,
        [&](int64_t i) {
          return 1.13 * 2 * k * u * absDot(0, 1, i / n, i % n, k, true) + u * std::fabs(pre[i]) +
                 0.5 * dt * std::fabs(pre[i]);
        },
        "gelu");
    // gelu'(pre) is at most 1.13 in magnitude; d the unfused product.
    std::vector<float> d = read(plan, 12);
    auto dhSlack = [&](int64_t i) {
      return 1.13 * 2 * n2 * u * absDot(8, 9, i / n, i % n, n2, false) +
             dt * geluGradSlope(pre[i]) * std::fabs(d[i]);
    };
    compare(10, 13, dhSlack, "gelu gradient");
    // The sum over m rows of those, each side summed in its own order
    // (within m u sum_r |dh| of the exact sum).
    std::vector<float> dh = read(plan, 13);
    compare(
        11, 14,
        [&](int64_t c) {
          double s = 0, mag = 0;
          for (int64_t r = 0; r < m; ++r) {
            s += dhSlack(r * n + c);
            mag += std::fabs(dh[r * n + c]);
          }
          return s + 2 * m * u * mag;
        },
        "bias gradient");
  }
}

/// matmul_bias_grad (a linear layer's weight gradient dy^T x with its bias
/// gradient, the column sums of dy) against matmul transpose_lhs + sum_to
/// on the same device: bitwise on the CPU (the same kernels in turn); on
/// CUDA one cuBLASLt GEMM with the BGRADB epilogue (or the GEMM and
/// sum_to's kernel), each sum in its own order: 2 m u sum|terms|. A second
/// pass with FSDP_CUDA_BIAS_BGRAD=0: the GEMM, then sum_to's kernel, so
/// the bias gradient is sum_to's bits on every device.
TEST_P(DeviceConformance, FusedBiasGradientMatchesTheUnfusedOps) {
  // Pass 1: FSDP_CUDA_BIAS_BGRAD=0 (the column sum: sum_to's bits); pass
  // 2: FSDP_CUDA_BGRAD_SPLITK=0 (the epilogue without split-K, or any
  // algorithm where there is none: the epilogue's bounds).
  const char *env[3] = {nullptr, "FSDP_CUDA_BIAS_BGRAD", "FSDP_CUDA_BGRAD_SPLITK"};
  for (int pass = 0; pass < 3; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    if (pass > 0) { // a device allocates its arena once: a fresh one per plan
      ::setenv(env[pass], "0", 1);
      Status made = createDevice(GetParam(), DeviceOptions{}, dev);
      ::unsetenv(env[pass]);
      ASSERT_TRUE(made.isOk()) << made.message();
    }
    const int64_t m = 9, n = 16, k = 12;
    // 0 dy [m,n], 1 x [m,k], 2 dw [n,k], 3 db [n], 4 matmul, 5 sum_to.
    Plan plan = matrixPlan({{m, n}, {m, k}, {n, k}, {n}, {n, k}, {n}},
                           {inst("matmul_bias_grad", {0, 1}, {2, 3}, {{"transpose_lhs", true}}),
                            inst("matmul", {0, 1}, {4}, {{"transpose_lhs", true}}),
                            inst("sum_to", {0}, {5})});
    auto host = bindFillRun(plan, {0, 1}, [](size_t i, int id) {
      return (float)std::sin(0.41 * double(i) + id) * 1.5f;
    });
    bool exact = GetParam() == "cpu";
    const double u = 1.0 / (1 << 24);
    std::vector<float> fw = read(plan, 2), uw = read(plan, 4), fb = read(plan, 3),
                       ub = read(plan, 5);
    for (int64_t i = 0; i < n; ++i) {
      double magB = 0;
      for (int64_t r = 0; r < m; ++r)
        magB += std::fabs(host[0][r * n + i]);
      EXPECT_LE(std::fabs((double)fb[i] - ub[i]), exact || pass == 1 ? 0.0 : 2 * m * u * magB)
          << "bias gradient element " << i;
      for (int64_t j = 0; j < k; ++j) {
        double mag = 0;
        for (int64_t r = 0; r < m; ++r)
          mag += std::fabs(host[0][r * n + i]) * std::fabs(host[1][r * k + j]);
        EXPECT_LE(std::fabs((double)fw[i * k + j] - uw[i * k + j]), exact ? 0.0 : 2 * m * u * mag)
            << "weight gradient element " << i << ", " << j;
      }
    }
  }
}

/// matmul_bias_grad with accumulators aw, ab (fsdp-fuse-epilogues'
/// gradient-accumulation fusion: dw = aw + dy^T x, db = ab + dy's column
/// sums) against the unfused matmul_bias_grad and two adds on the same
/// device, with f32 operands and with bf16 ones (f32 results and sums, the
/// mixed-precision case), once into buffers of their own and once in place
/// over the accumulators (the memory plan's layout). The CPU sums the
/// column sums first and adds once, as sum_to and add: the bias gradient
/// bitwise; its GEMM adds the m products to aw in the BLAS's order, so the
/// weight gradient and everything on CUDA (its own column sum or BGRADB, its
/// own GEMM order) agree within (m + 1) e (sum|dy x| + |aw|), e = 2 u per
/// f32 term and the tensor cores' 2^-22 + u per bf16 one (as above); the
/// in-place results are the others' bits on the CPU. On CUDA twice: the
/// GEMM with beta = 1 and BGRADB into scratch, then (FSDP_CUDA_BIAS_BGRAD=0)
/// with sum_to's column sum instead.
TEST_P(DeviceConformance, AccumulatingBiasGradientMatchesTheUnfusedSum) {
  const int64_t m = 24, n = 16, k = 8;
  for (int pass = 0; pass < 4; ++pass) {
    const bool narrow = pass % 2, columnSum = pass >= 2;
    SCOPED_TRACE(std::string(narrow ? "bf16 operands" : "f32 operands") +
                 (columnSum ? ", FSDP_CUDA_BIAS_BGRAD=0" : ""));
    if (pass > 0) { // a device allocates its arena once: a fresh one per plan
      if (columnSum)
        ::setenv("FSDP_CUDA_BIAS_BGRAD", "0", 1);
      Status made = createDevice(GetParam(), DeviceOptions{}, dev);
      ::unsetenv("FSDP_CUDA_BIAS_BGRAD");
      ASSERT_TRUE(made.isOk()) << made.message();
    }
    // 0 dy [m,n], 1 x [m,k] (bf16 when narrow), 2 aw [n,k], 3 ab [n],
    // 4 dw, 5 db (fused), 6 dw, 7 db (unfused terms), 8 aw + 6, 9 ab + 7,
    // 10 aw', 11 ab' (copies of 2, 3), 12 dw, 13 db in place over 10, 11.
    std::vector<std::vector<int64_t>> shapes{{m, n}, {m, k}, {n, k}, {n},    {n, k}, {n},    {n, k},
                                             {n},    {n, k}, {n},    {n, k}, {n},    {n, k}, {n}};
    nlohmann::json tl{{"transpose_lhs", true}};
    Plan plan = mixedPlan(shapes, narrow ? std::vector<int>{0, 1} : std::vector<int>{},
                          {inst("matmul_bias_grad", {0, 1, 2, 3}, {4, 5}, tl),
                           inst("matmul_bias_grad", {0, 1}, {6, 7}, tl), inst("add", {2, 6}, {8}),
                           inst("add", {3, 7}, {9}),
                           inst("matmul_bias_grad", {0, 1, 10, 11}, {12, 13}, tl)});
    plan.buffers[12].offset = plan.buffers[10].offset;
    plan.buffers[13].offset = plan.buffers[11].offset;
    bind(plan);
    // dy and x exact in bf16 (so both variants hold the same values).
    auto value = [&](size_t i, int id) {
      float v = id == 0   ? (float)std::sin(0.61 * double(i)) * 1.7f
                : id == 1 ? (float)std::cos(0.29 * double(i) + 1) * 0.9f
                          : (float)std::sin(0.37 * double(i) + id % 8) * 3.f;
      return id <= 1 ? widenBf16(roundToBf16(v)) : v;
    };
    std::vector<std::vector<float>> host(plan.buffers.size());
    for (int id : {0, 1, 2, 3, 10, 11}) {
      const Buffer &b = plan.buffers[id];
      host[id].resize(b.numel());
      std::vector<uint16_t> h(b.numel());
      for (int64_t i = 0; i < b.numel(); ++i)
        h[i] = roundToBf16(host[id][i] = value(i, id == 10 ? 2 : id == 11 ? 3 : id));
      const void *src = b.dtype == DType::BF16 ? (const void *)h.data() : host[id].data();
      ASSERT_TRUE(dev->copyToDevice(dev->arenaBase() + b.offset, src, b.bytes).isOk());
    }
    for (size_t i = 0; i < plan.program.size(); ++i) {
      Status st = dev->run(i);
      ASSERT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
    }
    ASSERT_TRUE(dev->synchronize().isOk());
    const bool cpu = GetParam() == "cpu";
    const double u = std::ldexp(1.0, -24), e = narrow && !cpu ? std::ldexp(1.0, -22) + u : 2 * u;
    std::vector<float> dw = read(plan, 4), db = read(plan, 5), rw = read(plan, 8),
                       rb = read(plan, 9), iw = read(plan, 12), ib = read(plan, 13);
    const std::vector<float> &dy = host[0], &x = host[1], &aw = host[2], &ab = host[3];
    for (int64_t i = 0; i < n; ++i) {
      double magB = std::fabs(ab[i]);
      for (int64_t r = 0; r < m; ++r)
        magB += std::fabs(dy[r * n + i]);
      EXPECT_LE(std::fabs((double)db[i] - rb[i]), cpu ? 0.0 : (m + 1) * 2 * u * magB)
          << "bias gradient element " << i;
      EXPECT_LE(std::fabs((double)ib[i] - db[i]), cpu ? 0.0 : (m + 1) * 2 * u * magB)
          << "in-place bias gradient element " << i;
      for (int64_t j = 0; j < k; ++j) {
        double mag = std::fabs(aw[i * k + j]);
        for (int64_t r = 0; r < m; ++r)
          mag += std::fabs(dy[r * n + i]) * std::fabs(x[r * k + j]);
        double slack = (m + 1) * e * mag;
        EXPECT_LE(std::fabs((double)dw[i * k + j] - rw[i * k + j]), slack)
            << "weight gradient element " << i << ", " << j;
        EXPECT_LE(std::fabs((double)iw[i * k + j] - dw[i * k + j]), cpu ? 0.0 : slack)
            << "in-place weight gradient element " << i << ", " << j;
      }
    }
  }
}

/// matmul_gelu_grad with its bias gradient in f32 from bf16 operands
/// (fsdp-fuse-epilogues' widened bias gradient of an MLP's input layer)
/// against the same op returning a bf16 one: dh is the same bits (the same
/// GEMM and GELU gradient), the f32 bias gradient is the sum over dh's
/// rows unrounded, within 2 m u sum|dh| of the sum of the bf16 dh on CUDA
/// (which sums the rounded dh) plus, on the CPU (which sums the f32 dh
/// before rounding it), half a bf16 ulp of each term; and the bf16 one is
/// within one bf16 rounding of it (bitwise its rounding on the CPU, whose
/// two ops sum alike). On CUDA with cuBLASLt's epilogues, without them
/// (CUDAEMU_EPILOGUES=0) and with FSDP_CUDA_DGELU_BGRAD=1 (whose bias
/// gradient has the product's type, so the f32 one is still sum_to's);
/// natively: no more scratch than the bf16 op's.
TEST_P(DeviceConformance, WidenedGeluBiasGradientIsTheUnroundedSum) {
  const int64_t m = 24, n2 = 12, n = 16;
  // 0 dz [m,n2], 1 w [n2,n], 2 pre [m,n] (bf16); 3 dh bf16, 4 db f32;
  // 5 dh bf16, 6 db bf16.
  const std::vector<std::vector<int64_t>> shapes{{m, n2}, {n2, n}, {m, n}, {m, n},
                                                 {n},     {m, n},  {n}};
  auto typed = [&](std::vector<Instruction> program) {
    return mixedPlan(shapes, {0, 1, 2, 3, 5, 6}, std::move(program));
  };
  const Instruction wide = inst("matmul_gelu_grad", {0, 1, 2}, {3, 4}),
                    narrow = inst("matmul_gelu_grad", {0, 1, 2}, {5, 6});
  Plan plan = typed({wide, narrow});
  std::vector<uint16_t> dz(m * n2), w(n2 * n), pre(m * n);
  for (size_t i = 0; i < dz.size(); ++i)
    dz[i] = roundToBf16((float)std::sin(0.61 * double(i)) * 1.7f);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = roundToBf16((float)std::cos(0.29 * double(i) + 1) * 0.9f);
  for (size_t i = 0; i < pre.size(); ++i)
    pre[i] = roundToBf16((float)std::sin(0.37 * double(i) + 2) * 2.5f);
  const bool cpu = GetParam() == "cpu";
  struct Unset {
    ~Unset() {
      unsetenv("CUDAEMU_EPILOGUES");
      unsetenv("FSDP_CUDA_DGELU_BGRAD");
    }
  } unset;
  for (int pass = 0; pass < (cpu ? 1 : 3); ++pass) {
    const char *where = pass == 0 ? "" : pass == 1 ? " (epilogues declined)" : " (DGELU_BGRAD)";
    SCOPED_TRACE(std::string("pass") + where);
    if (pass > 0) { // a device allocates its arena once: a fresh one per plan
      setenv(pass == 1 ? "CUDAEMU_EPILOGUES" : "FSDP_CUDA_DGELU_BGRAD", pass == 1 ? "0" : "1", 1);
      Status made = createDevice(GetParam(), DeviceOptions{}, dev);
      unsetenv("FSDP_CUDA_DGELU_BGRAD"); // read at creation; the emulator's at prepare
      ASSERT_TRUE(made.isOk()) << made.message();
    }
    bind(plan);
    unsetenv("CUDAEMU_EPILOGUES");
    for (auto [id, src] :
         {std::pair<int, const void *>{0, dz.data()}, {1, w.data()}, {2, pre.data()}})
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, src, plan.buffers[id].bytes)
              .isOk());
    for (size_t i = 0; i < plan.program.size(); ++i) {
      Status st = dev->run(i);
      ASSERT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
    }
    ASSERT_TRUE(dev->synchronize().isOk());
    auto bits = [&](int id) {
      std::vector<uint16_t> h(plan.buffers[id].numel());
      EXPECT_TRUE(dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[id].offset,
                                  plan.buffers[id].bytes)
                      .isOk());
      return h;
    };
    std::vector<uint16_t> dh = bits(3), dbNarrow = bits(6);
    EXPECT_EQ(dh, bits(5)) << "dh differs with the bias gradient's type" << where;
    std::vector<float> db = read(plan, 4);
    const double u = std::ldexp(1.0, -24);
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (int64_t r = 0; r < m; ++r) {
        double v = widenBf16(dh[r * n + j]);
        sum += v;
        mag += std::fabs(v);
      }
      // CPU: the f32 dh, each within half a bf16 ulp (2^-9 relative) of the bf16 one read here.
      double slack = 2 * m * u * mag + (cpu ? std::ldexp(mag, -8) : 0.0);
      EXPECT_LE(std::fabs(db[j] - sum), slack) << "f32 bias gradient element " << j << where;
      float rounded = widenBf16(roundToBf16(db[j]));
      EXPECT_LE(std::fabs((double)widenBf16(dbNarrow[j]) - rounded),
                cpu ? 0.0 : 2 * slack + std::ldexp(std::fabs((double)db[j]) + slack, -7))
          << "bf16 bias gradient element " << j << where << ": " << widenBf16(dbNarrow[j])
          << " vs the f32 one rounded " << rounded;
    }
  }
  if (cpu)
    return;
  // Native: the f32 bias gradient costs no more scratch than the bf16 one.
  EXPECT_EQ(preparedScratch(GetParam(), typed({wide})),
            preparedScratch(GetParam(), typed({narrow})))
      << "a widened bias gradient ran on widened f32 copies";
}

/// fsdp-fuse-epilogues' widened products: matmul and matmul_bias_grad on
/// bf16 operands with f32 results (the f32 accumulation unrounded) against
/// the f32 ops on the widened operands and the bf16 ops. The CPU widens and
/// runs the f32 kernels: bitwise the f32 ops, and rounded to bf16 bitwise
/// the bf16 ones. On CUDA (one cuBLASLt GEMM with D in f32, BGRADB's bias
/// gradient in f32): each product within m (2^-22 + 2^-24) sum|a_i b_i| of
/// the f32 GEMM's (CudaGemm.h: the tensor cores' f32 sum, and the f32
/// GEMM's own), each bias gradient within 2 m u sum|dy| of sum_to's; the
/// bf16 results within that plus one bf16 ulp of the f32 ones. And the f32
/// results take the native path, not f32 copies of the operands: the
/// device's scratch is that of the bf16 plan.
TEST_P(DeviceConformance, WidenedProductsMatchTheF32Ops) {
  const int64_t m = 24, n = 16, k = 8;
  // 0 dy [m,n] bf16, 1 x [m,k] bf16, 2 dw [n,k] f32, 3 db [n] f32, 4 dw bf16,
  // 5 db bf16, 6 matmul f32, 7 matmul bf16, 8 dy f32, 9 x f32, 10 dw f32
  // (f32 operands), 11 db f32 (sum_to).
  const std::vector<std::vector<int64_t>> shapes{{m, n}, {m, k}, {n, k}, {n},    {n, k}, {n},
                                                 {n, k}, {n, k}, {m, n}, {m, k}, {n, k}, {n}};
  auto typed = [&](std::vector<Instruction> program) {
    return mixedPlan(shapes, {0, 1, 4, 5, 7}, std::move(program));
  };
  nlohmann::json tl{{"transpose_lhs", true}};
  Instruction fusedF32 = inst("matmul_bias_grad", {0, 1}, {2, 3}, tl),
              fusedBf16 = inst("matmul_bias_grad", {0, 1}, {4, 5}, tl);
  Plan plan =
      typed({fusedF32, fusedBf16, inst("matmul", {0, 1}, {6}, tl), inst("matmul", {0, 1}, {7}, tl),
             inst("matmul", {8, 9}, {10}, tl), inst("sum_to", {8}, {11})});
  // Operands exact in bf16; the f32 copies hold the same values.
  std::vector<uint16_t> dy(m * n), x(m * k);
  std::vector<float> dy32(m * n), x32(m * k);
  for (int64_t i = 0; i < m * n; ++i)
    dy32[i] = widenBf16(dy[i] = roundToBf16((float)std::sin(0.61 * double(i)) * 1.7f));
  for (int64_t i = 0; i < m * k; ++i)
    x32[i] = widenBf16(x[i] = roundToBf16((float)std::cos(0.29 * double(i) + 1) * 0.9f));
  // On the emulator also with its heuristic declining every epilogue
  // (CUDAEMU_EPILOGUES=0): the GEMM then the f32 column sum, the device's
  // fallback when cuBLASLt has no BGRADB algorithm for these types. A GPU
  // ignores the variable (the same run twice).
  struct Unset {
    ~Unset() { unsetenv("CUDAEMU_EPILOGUES"); }
  } unset;
  for (bool fallback : {false, true}) {
    if (fallback) {
      if (GetParam() == "cpu")
        break;
      setenv("CUDAEMU_EPILOGUES", "0", 1);
      ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
    }
    const char *where = fallback ? " (epilogues declined)" : "";
    bind(plan);
    auto put = [&](int id, const void *src) {
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, src, plan.buffers[id].bytes)
              .isOk());
    };
    put(0, dy.data());
    put(1, x.data());
    put(8, dy32.data());
    put(9, x32.data());
    for (size_t i = 0; i < plan.program.size(); ++i) {
      Status st = dev->run(i);
      ASSERT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
    }
    ASSERT_TRUE(dev->synchronize().isOk());
    auto readBf16 = [&](int id) {
      std::vector<uint16_t> h(plan.buffers[id].numel());
      EXPECT_TRUE(dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[id].offset,
                                  plan.buffers[id].bytes)
                      .isOk());
      std::vector<float> f(h.size());
      for (size_t i = 0; i < h.size(); ++i)
        f[i] = widenBf16(h[i]);
      return f;
    };
    const bool exact = GetParam() == "cpu";
    const double u = std::ldexp(1.0, -24), tc = std::ldexp(1.0, -22);
    std::vector<float> dwF = read(plan, 2), dbF = read(plan, 3), mmF = read(plan, 6),
                       dw32 = read(plan, 10), db32 = read(plan, 11);
    std::vector<float> dwB = readBf16(4), dbB = readBf16(5), mmB = readBf16(7);
    auto check = [&](const std::vector<float> &f32, const std::vector<float> &ref,
                     const std::vector<float> &bf16, auto magOf, double perTerm, const char *what) {
      for (size_t i = 0; i < f32.size(); ++i) {
        double slack = m * perTerm * magOf(i);
        EXPECT_LE(std::fabs((double)f32[i] - ref[i]), exact ? 0.0 : slack)
            << what << where << " element " << i << ": " << f32[i] << " vs the f32 op's " << ref[i];
        // The bf16 result: the f32 one rounded (CPU: bitwise; CUDA: within
        // the sums' slack and one bf16 ulp, 2^-7 of the magnitude).
        float rounded = widenBf16(roundToBf16(f32[i]));
        EXPECT_LE(std::fabs((double)bf16[i] - rounded),
                  exact ? 0.0 : 2 * slack + std::ldexp(std::fabs((double)f32[i]) + slack, -7))
            << what << where << " element " << i << ": bf16 " << bf16[i] << " vs rounded "
            << rounded;
      }
    };
    auto magW = [&](size_t i) {
      double s = 0;
      for (int64_t r = 0; r < m; ++r)
        s += std::fabs(dy32[r * n + i / k]) * std::fabs(x32[r * k + i % k]);
      return s;
    };
    auto magB = [&](size_t i) {
      double s = 0;
      for (int64_t r = 0; r < m; ++r)
        s += std::fabs(dy32[r * n + i]);
      return s;
    };
    check(dwF, dw32, dwB, magW, tc + u, "matmul_bias_grad weight gradient");
    check(dbF, db32, dbB, magB, 2 * u, "matmul_bias_grad bias gradient");
    check(mmF, dw32, mmB, magW, tc + u, "matmul");
  }
  unsetenv("CUDAEMU_EPILOGUES"); // the scratch below: with the epilogues
  if (GetParam() == "cpu")
    return;
  // Native: the f32 results cost no more scratch than the bf16 ones.
  EXPECT_EQ(preparedScratch(GetParam(), typed({fusedF32, inst("matmul", {0, 1}, {6}, tl)})),
            preparedScratch(GetParam(), typed({fusedBf16, inst("matmul", {0, 1}, {7}, tl)})))
      << "an f32 product of bf16 operands ran on widened f32 copies";
}

/// fsdp-fuse-epilogues' widened sums: sum_to and embedding_grad on a bf16
/// gradient with f32 results (GPT-2's position and token embedding
/// gradients in a mixed-precision plan) against the f32 ops on the widened
/// gradient and the bf16 ops. Every kernel sums in f32 and rounds once at
/// the store, so the f32 result rounded to bf16 is the bf16 result's bits
/// (one kernel, one order). Against the f32 ops: bitwise where the order
/// is the same (the CPU, which widens; the embedding gradient in row order
/// on CUDA too); CUDA's sum_to over leading rows is a two-pass column sum
/// where the f32 op sums row-major: within 2 (rows - 1) u sum|dy|. The f32
/// results take the native path: no more scratch than the bf16 ones.
TEST_P(DeviceConformance, WidenedSumsAreTheUnroundedSums) {
  const int64_t B = 3, T = 20, W = 16, vocab = 13;
  // 0 ids [B,T] i32, 1 dy bf16 [B,T,W], 2 dy f32 (the same values);
  // embedding_grad: 3 f32, 4 bf16, 5 of the f32 dy;
  // sum_to over the batch: 6 f32, 7 bf16, 8 of the f32 dy;
  // sum_to over T (a middle dim): 9 f32, 10 bf16, 11 of the f32 dy.
  const std::vector<std::vector<int64_t>> shapes{{B, T},     {B, T, W},  {B, T, W}, {vocab, W},
                                                 {vocab, W}, {vocab, W}, {T, W},    {T, W},
                                                 {T, W},     {B, 1, W},  {B, 1, W}, {B, 1, W}};
  auto typed = [&](std::vector<Instruction> program) {
    Plan p = mixedPlan(shapes, {1, 4, 7, 10}, std::move(program));
    p.buffers[0].dtype = DType::I32; // 4 bytes, as the f32 placed
    return p;
  };
  const std::vector<Instruction> wide{inst("embedding_grad", {0, 1}, {3}), inst("sum_to", {1}, {6}),
                                      inst("sum_to", {1}, {9})},
      narrow{inst("embedding_grad", {0, 1}, {4}), inst("sum_to", {1}, {7}),
             inst("sum_to", {1}, {10})};
  std::vector<Instruction> all = wide;
  all.insert(all.end(), narrow.begin(), narrow.end());
  for (Instruction i :
       {inst("embedding_grad", {0, 2}, {5}), inst("sum_to", {2}, {8}), inst("sum_to", {2}, {11})})
    all.push_back(i);
  Plan plan = typed(all);
  // Ids with repeats (up to 7 rows an id), ids 11 and 12 never used (zero
  // rows); a gradient of mixed signs and magnitudes, exact in bf16.
  std::vector<int32_t> ids(B * T);
  for (int64_t i = 0; i < B * T; ++i)
    ids[i] = (int32_t)((i * 7 + 3) % 11);
  std::vector<uint16_t> dy(B * T * W);
  std::vector<float> dy32(dy.size());
  for (size_t i = 0; i < dy.size(); ++i)
    dy32[i] = widenBf16(dy[i] = roundToBf16((float)(std::sin(0.73 * double(i)) *
                                                    std::exp(std::cos(0.11 * double(i)) * 3))));
  bind(plan);
  auto put = [&](int id, const void *src) {
    ASSERT_TRUE(
        dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, src, plan.buffers[id].bytes)
            .isOk());
  };
  put(0, ids.data());
  put(1, dy.data());
  put(2, dy32.data());
  for (size_t i = 0; i < plan.program.size(); ++i) {
    Status st = dev->run(i);
    ASSERT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
  }
  ASSERT_TRUE(dev->synchronize().isOk());
  auto bits16 = [&](int id) {
    std::vector<uint16_t> h(plan.buffers[id].numel());
    EXPECT_TRUE(dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[id].offset,
                                plan.buffers[id].bytes)
                    .isOk());
    return h;
  };
  const bool cpu = GetParam() == "cpu";
  const double u = std::ldexp(1.0, -24);
  // what: the op; f32, bf16, ref: its buffers; rows: the terms an element
  // sums; magOf(i): sum |dy| over element i's terms; exact: same order.
  auto check = [&](const char *what, int f32, int bf16, int ref, int64_t rows, auto magOf,
                   bool exact) {
    std::vector<float> got = read(plan, f32), want = read(plan, ref);
    std::vector<uint16_t> narrowBits = bits16(bf16);
    bool rounding = false; // some element where the bf16 sum is not the f32 one
    for (size_t i = 0; i < got.size(); ++i) {
      double slack = exact ? 0.0 : 2.0 * double(rows - 1) * u * magOf(i);
      EXPECT_LE(std::fabs((double)got[i] - want[i]), slack)
          << what << " element " << i << ": " << got[i] << " vs the f32 op's " << want[i];
      EXPECT_EQ(roundToBf16(got[i]), narrowBits[i])
          << what << " element " << i << ": the f32 sum " << got[i] << " rounded is not the bf16 "
          << widenBf16(narrowBits[i]);
      rounding |= widenBf16(narrowBits[i]) != got[i];
    }
    EXPECT_TRUE(rounding) << what << ": every sum exact in bf16, the test shows nothing";
  };
  check(
      "embedding_grad", 3, 4, 5, B * T,
      [&](size_t i) {
        double s = 0;
        for (int64_t r = 0; r < B * T; ++r)
          if (ids[r] == (int32_t)(i / W))
            s += std::fabs(dy32[r * W + i % W]);
        return s;
      },
      true);
  check(
      "sum_to over the batch", 6, 7, 8, B,
      [&](size_t i) {
        double s = 0;
        for (int64_t b = 0; b < B; ++b)
          s += std::fabs(dy32[b * T * W + i]);
        return s;
      },
      cpu);
  check(
      "sum_to over T", 9, 10, 11, T,
      [&](size_t i) {
        double s = 0;
        for (int64_t t = 0; t < T; ++t)
          s += std::fabs(dy32[(i / W) * T * W + t * W + i % W]);
        return s;
      },
      cpu);
  if (cpu)
    return;
  // Native: the f32 sums cost no more scratch than the bf16 ones.
  EXPECT_EQ(preparedScratch(GetParam(), typed(wide)), preparedScratch(GetParam(), typed(narrow)))
      << "a widened sum ran on widened f32 copies";
}

/// layer_norm_grad and layer_norm_grad_acc on bf16 with f32 d_gamma /
/// d_beta (fsdp-fuse-epilogues' widened parameter gradients) against the
/// same ops with bf16 ones, on the same device: the kernels sum the same
/// f32 partials in the same order and only the last store differs, so
/// the bf16 results are the f32 ones rounded, bitwise, and d_input is the
/// same bits; on the CPU (widened f32 kernels) the f32 results are also
/// bitwise the f32 op's on the widened operands. On CUDA the f32 results
/// take the native kernels (the scratch of the bf16 plan).
TEST_P(DeviceConformance, WidenedLayerNormGradientsAreTheUnroundedSums) {
  const int64_t rows = 40, cols = 24;
  // 0 x, 1 gamma, 2 dy, 3 acc (bf16); 4-6 dx, dg, db with f32 dg/db;
  // 7-9 all bf16; 10-12 the _acc op with f32 dg/db; 13-15 all bf16;
  // 16 x, 17 gamma, 18 dy f32 (the widened values); 19-21 the f32 op.
  const std::vector<std::vector<int64_t>> shapes{
      {rows, cols}, {cols},       {rows, cols}, {rows, cols}, {rows, cols}, {cols},
      {cols},       {rows, cols}, {cols},       {cols},       {rows, cols}, {cols},
      {cols},       {rows, cols}, {cols},       {cols},       {rows, cols}, {cols},
      {rows, cols}, {rows, cols}, {cols},       {cols}};
  auto typed = [&](std::vector<Instruction> program) {
    return mixedPlan(shapes, {0, 1, 2, 3, 4, 7, 8, 9, 10, 13, 14, 15}, std::move(program));
  };
  nlohmann::json eps{{"epsilon", 1e-5}};
  Instruction gradF32 = inst("layer_norm_grad", {0, 1, 2}, {4, 5, 6}, eps),
              gradBf16 = inst("layer_norm_grad", {0, 1, 2}, {7, 8, 9}, eps),
              accF32 = inst("layer_norm_grad_acc", {0, 1, 2, 3}, {10, 11, 12}, eps),
              accBf16 = inst("layer_norm_grad_acc", {0, 1, 2, 3}, {13, 14, 15}, eps);
  Plan plan = typed({gradF32, gradBf16, accF32, accBf16,
                     inst("layer_norm_grad", {16, 17, 18}, {19, 20, 21}, eps)});
  std::vector<std::vector<uint16_t>> bits(4);
  std::vector<std::vector<float>> wide(3);
  for (int id = 0; id < 4; ++id) {
    bits[id].resize(plan.buffers[id].numel());
    for (size_t i = 0; i < bits[id].size(); ++i) {
      bits[id][i] =
          roundToBf16((float)std::sin(0.53 * double(i) + 1.7 * id) * (id == 1 ? 1.1f : 2.f));
      if (id < 3)
        wide[id].push_back(widenBf16(bits[id][i]));
    }
  }
  bind(plan);
  auto put = [&](int id, const void *src) {
    ASSERT_TRUE(
        dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, src, plan.buffers[id].bytes)
            .isOk());
  };
  for (int id = 0; id < 4; ++id)
    put(id, bits[id].data());
  for (int id = 0; id < 3; ++id)
    put(16 + id, wide[id].data());
  for (size_t i = 0; i < plan.program.size(); ++i) {
    Status st = dev->run(i);
    ASSERT_TRUE(st.isOk()) << plan.program[i].op << ": " << st.message();
  }
  ASSERT_TRUE(dev->synchronize().isOk());
  auto raw = [&](int id) {
    std::vector<uint16_t> h(plan.buffers[id].numel());
    EXPECT_TRUE(dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[id].offset,
                                plan.buffers[id].bytes)
                    .isOk());
    return h;
  };
  auto rounded = [](const std::vector<float> &v) {
    std::vector<uint16_t> r(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      r[i] = roundToBf16(v[i]);
    return r;
  };
  EXPECT_EQ(raw(4), raw(7)) << "layer_norm_grad: d_input";
  EXPECT_EQ(rounded(read(plan, 5)), raw(8)) << "layer_norm_grad: d_gamma";
  EXPECT_EQ(rounded(read(plan, 6)), raw(9)) << "layer_norm_grad: d_beta";
  EXPECT_EQ(raw(10), raw(13)) << "layer_norm_grad_acc: d_input";
  EXPECT_EQ(rounded(read(plan, 11)), raw(14)) << "layer_norm_grad_acc: d_gamma";
  EXPECT_EQ(rounded(read(plan, 12)), raw(15)) << "layer_norm_grad_acc: d_beta";
  if (GetParam() == "cpu") {
    EXPECT_EQ(read(plan, 5), read(plan, 20)) << "d_gamma: the f32 op's";
    EXPECT_EQ(read(plan, 6), read(plan, 21)) << "d_beta: the f32 op's";
    return;
  }
  EXPECT_EQ(preparedScratch(GetParam(), typed({gradF32, accF32})),
            preparedScratch(GetParam(), typed({gradBf16, accBf16})))
      << "f32 layer-norm parameter gradients ran on widened f32 copies";
}

/// An optimizer update with grad_scale (fsdp-fuse-epilogues folds the
/// clipping mul into it) against the mul and the update of its product, on
/// the same device: bitwise on both (the update rounds the product first,
/// as the mul does). AdamW also with skip_nonfinite (finite: not skipped)
/// before grad_scale.
TEST_P(DeviceConformance, UpdatesWithGradScaleMatchTheClippingMul) {
  const int64_t n = 1000;
  // 0 p, 1 g, 2 m, 3 v, 4 lr, 5 step, 6 coef, 7 sumsq, 8 g * coef;
  // results: fused 9-11, 15, 17-18; unfused 12-14, 16, 19-20.
  std::vector<std::vector<int64_t>> shapes(21, {n});
  for (int s : {4, 5, 6, 7})
    shapes[s] = {};
  nlohmann::json adam = {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  nlohmann::json scaled = adam;
  scaled["skip_nonfinite"] = true;
  scaled["grad_scale"] = true;
  nlohmann::json mom = {
      {"momentum", 0.9}, {"dampening", 0.1}, {"weight_decay", 0.1}, {"nesterov", true}};
  nlohmann::json momScaled = mom;
  momScaled["grad_scale"] = true;
  Plan plan = matrixPlan(
      shapes,
      {inst("mul", {1, 6}, {8}),
       inst("adamw_update", {0, 1, 2, 3, 4, 5, 7, 6}, {9, 10, 11}, scaled),
       inst("adamw_update", {0, 8, 2, 3, 4, 5}, {12, 13, 14}, adam),
       inst("sgd_update", {0, 1, 4, 6}, {15}, {{"weight_decay", 0.1}, {"grad_scale", true}}),
       inst("sgd_update", {0, 8, 4}, {16}, {{"weight_decay", 0.1}}),
       inst("sgd_momentum_update", {0, 1, 2, 4, 5, 6}, {17, 18}, momScaled),
       inst("sgd_momentum_update", {0, 8, 2, 4, 5}, {19, 20}, mom)});
  bindFillRun(plan, {0, 1, 2, 3, 4, 5, 6, 7}, [](size_t i, int id) {
    switch (id) {
    case 3:
      return (float)std::fabs(std::sin(0.3 * double(i))) + 0.01f; // v >= 0
    case 4:
      return 1e-2f; // lr
    case 5:
      return 3.f; // step
    case 6:
      return 0.3712f; // coef
    case 7:
      return 4.f; // sumsq
    default:
      return (float)std::sin(0.37 * double(i) + id) * 1.5f;
    }
  });
  auto same = [&](int a, int b) {
    std::vector<float> x = read(plan, a), y = read(plan, b);
    return std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
  };
  EXPECT_TRUE(same(9, 12) && same(10, 13) && same(11, 14)) << "adamw_update grad_scale";
  EXPECT_TRUE(same(15, 16)) << "sgd_update grad_scale";
  EXPECT_TRUE(same(17, 19) && same(18, 20)) << "sgd_momentum_update grad_scale";
  EXPECT_FALSE(same(9, 0)) << "the update ran";
}

/// adamw_update with bf16 moments (state-dtype=bf16) against the f32
/// update on the same device from the widened moments: the parameters
/// bitwise, the new moments that update's rounded once, to nearest or
/// with stateRoundingKey's draws; a skipped step leaves everything as it
/// was; and the second half run as shard 1 of two (shard_stride) stores
/// the whole vector's second half, so N ranks draw what one rank draws.
TEST_P(DeviceConformance, Bf16MomentsAreTheF32UpdateRoundedOnce) {
  const int64_t n = 3000, half = n / 2, key = 5;
  // 0 p, 1 g, 2 m16, 3 v16, 4 lr, 5 step, 6 sumsq (inf: skip), 7 m32, 8 v32;
  // results: nearest 9-11, stochastic 12-14, f32 15-17, skipped 18-20.
  std::vector<std::vector<int64_t>> shapes(21, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  const std::vector<int> bf16 = {2, 3, 10, 11, 13, 14, 19, 20};
  nlohmann::json adam = {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  nlohmann::json sr = adam;
  sr["stochastic"] = true;
  sr["key"] = key;
  nlohmann::json skip = sr;
  skip["skip_nonfinite"] = true;
  Plan plan = mixedPlan(shapes, bf16,
                        {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {9, 10, 11}, adam),
                         inst("adamw_update", {0, 1, 2, 3, 4, 5}, {12, 13, 14}, sr),
                         inst("adamw_update", {0, 1, 7, 8, 4, 5}, {15, 16, 17}, adam),
                         inst("adamw_update", {0, 1, 2, 3, 4, 5, 6}, {18, 19, 20}, skip)});
  std::vector<float> p(n), g(n), m32(n), v32(n);
  std::vector<uint16_t> m16(n), v16(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = (float)std::sin(0.37 * double(i)) * 1.5f;
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    m16[i] = roundToBf16((float)std::sin(0.05 * double(i)) * 0.01f);
    v16[i] = roundToBf16((float)std::fabs(std::sin(0.3 * double(i))) * 1e-4f + 1e-8f);
    m32[i] = widenBf16(m16[i]);
    v32[i] = widenBf16(v16[i]);
  }
  auto load = [&](const Plan &pl, int64_t shard, int64_t from) {
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    put(pl, 0, p.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2, m16.data() + from);
    put(pl, 3, v16.data() + from);
    write(pl, 4, {1e-2f});
    write(pl, 5, {3.f});
    write(pl, 6, {std::numeric_limits<float>::infinity()});
    if (pl.buffers.size() > 7) {
      put(pl, 7, m32.data() + from);
      put(pl, 8, v32.data() + from);
    }
  };
  load(plan, 0, 0);
  runDrawing(plan);
  std::vector<float> np32 = read(plan, 15), nm32 = read(plan, 16), nv32 = read(plan, 17);
  const uint64_t k = stateRoundingKey(77, 5, key);
  std::vector<uint16_t> nearM(n), nearV(n), srM(n), srV(n);
  for (int64_t i = 0; i < n; ++i) {
    nearM[i] = roundToBf16(nm32[i]);
    nearV[i] = roundToBf16(nv32[i]);
    roundMomentsToBf16Stochastic(nm32[i], nv32[i], k, (uint64_t)i, srM[i], srV[i]);
  }
  EXPECT_EQ(read(plan, 9), np32) << "the parameters read the f32 moments";
  EXPECT_EQ(read(plan, 12), np32);
  EXPECT_EQ(bits(plan, 10), nearM);
  EXPECT_EQ(bits(plan, 11), nearV);
  std::vector<uint16_t> gotM = bits(plan, 13), gotV = bits(plan, 14);
  EXPECT_EQ(gotM, srM);
  EXPECT_EQ(gotV, srV);
  EXPECT_NE(gotV, nearV) << "the stochastic draws differ from nearest somewhere";
  EXPECT_EQ(read(plan, 18), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bits(plan, 19), m16);
  EXPECT_EQ(bits(plan, 20), v16);

  // The second half as shard 1 of two: the whole vector's second half.
  std::vector<std::vector<int64_t>> hs(15, {half});
  for (int s : {4, 5, 6})
    hs[s] = {};
  nlohmann::json shardSr = sr;
  shardSr["shard_stride"] = half;
  Plan shard = mixedPlan(hs, {2, 3, 13, 14},
                         {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {12, 13, 14}, shardSr)});
  freshDevice();
  load(shard, 1, half);
  runDrawing(shard);
  EXPECT_EQ(bits(shard, 13), std::vector<uint16_t>(srM.begin() + half, srM.end()));
  EXPECT_EQ(bits(shard, 14), std::vector<uint16_t>(srV.begin() + half, srV.end()));
}

/// master-dtype=bf16: adamw_update / sgd_update / sgd_momentum_update of
/// bf16 parameters with an f32 gradient against the same device's f32
/// update of the widened parameters: the new parameters that update's
/// rounded once, with the stochastic cast's draws (stochastic_param: the
/// device's {seed, step} and `key`, each element at its place in the unit)
/// or to nearest; the state bitwise the f32 update's (f32 moments, and bf16
/// moments with their own draws, which the parameters' never meet). A
/// skipped step keeps everything; the second half run as shard 1 of two
/// stores the whole vector's bits.
TEST_P(DeviceConformance, Bf16ParametersAreTheF32UpdateRoundedOnce) {
  const int64_t n = 3000, half = n / 2, key = 4;
  // 0 p16, 1 g, 2 m, 3 v, 4 lr, 5 step, 6 sumsq (inf: skip), 7 p32, 8 m16,
  // 9 v16, 10 buf; results: stochastic 11-13, nearest 14-16, f32 17-19,
  // skipped 20-22, bf16 moments 23-25 (the f32 moments are their widened
  // values: 17-19 are their reference too), sgd 26 (f32 27), sgd momentum
  // 28-29 (f32 30-31), adamw with decay on a prefix (decay_numel: the
  // kernels run in two parts) 32-34 (f32 35-37), sgd momentum with a bf16
  // buffer (38) and both draw streams 39-40 (f32 parameters 41-42).
  std::vector<std::vector<int64_t>> shapes(43, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  const std::vector<int> bf16 = {0, 8, 9, 11, 14, 20, 23, 24, 25, 26, 28, 32, 38, 39, 40, 42};
  nlohmann::json adam = {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  nlohmann::json sr = adam;
  sr["stochastic_param"] = true;
  sr["key"] = key;
  nlohmann::json skip = sr;
  skip["skip_nonfinite"] = true;
  nlohmann::json both = sr;
  both["stochastic"] = true; // the moments' draws too
  nlohmann::json sgd = {{"weight_decay", 0.01}, {"stochastic_param", true}, {"key", key}};
  nlohmann::json mom = {{"momentum", 0.9}, {"weight_decay", 0.01}};
  nlohmann::json prefix = sr, prefix32 = adam;
  prefix["decay_numel"] = prefix32["decay_numel"] = 1003;
  prefix["shard_stride"] = prefix32["shard_stride"] = 0;
  nlohmann::json mom16 = {{"momentum", 0.9}, {"weight_decay", 0.01}, {"stochastic", true},
                          {"key", key},      {"nesterov", true},     {"dampening", 0.1}},
                 mom16p = mom16;
  mom16p["stochastic_param"] = true;
  Plan plan = mixedPlan(shapes, bf16,
                        {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {11, 12, 13}, sr),
                         inst("adamw_update", {0, 1, 2, 3, 4, 5}, {14, 15, 16}, adam),
                         inst("adamw_update", {7, 1, 2, 3, 4, 5}, {17, 18, 19}, adam),
                         inst("adamw_update", {0, 1, 2, 3, 4, 5, 6}, {20, 21, 22}, skip),
                         inst("adamw_update", {0, 1, 8, 9, 4, 5}, {23, 24, 25}, both),
                         inst("sgd_update", {0, 1, 4}, {26}, sgd),
                         inst("sgd_update", {7, 1, 4}, {27}, {{"weight_decay", 0.01}}),
                         inst("sgd_momentum_update", {0, 1, 10, 4, 5}, {28, 29}, mom),
                         inst("sgd_momentum_update", {7, 1, 10, 4, 5}, {30, 31}, mom),
                         inst("adamw_update", {0, 1, 2, 3, 4, 5}, {32, 33, 34}, prefix),
                         inst("adamw_update", {7, 1, 2, 3, 4, 5}, {35, 36, 37}, prefix32),
                         inst("sgd_momentum_update", {0, 1, 38, 4, 5}, {39, 40}, mom16p),
                         inst("sgd_momentum_update", {7, 1, 38, 4, 5}, {41, 42}, mom16)});
  std::vector<float> p32(n), g(n), m(n), v(n), buf(n);
  std::vector<uint16_t> p16(n), m16(n), v16(n), b16(n);
  for (int64_t i = 0; i < n; ++i) {
    b16[i] = roundToBf16((float)std::sin(0.05 * double(i)) * 0.03f);
    p16[i] = roundToBf16((float)std::sin(0.37 * double(i)) * 1.5f);
    p32[i] = widenBf16(p16[i]);
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    m16[i] = roundToBf16((float)std::sin(0.05 * double(i)) * 0.01f);
    v16[i] = roundToBf16((float)std::fabs(std::sin(0.3 * double(i))) * 1e-4f + 1e-8f);
    m[i] = widenBf16(m16[i]);
    v[i] = widenBf16(v16[i]);
    buf[i] = (float)std::sin(0.7 * double(i)) * 0.01f;
  }
  auto load = [&](const Plan &pl, int64_t shard, int64_t from) {
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    put(pl, 0, p16.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2, m.data() + from);
    put(pl, 3, v.data() + from);
    write(pl, 4, {1e-2f});
    write(pl, 5, {3.f});
    write(pl, 6, {std::numeric_limits<float>::infinity()});
    if (pl.buffers.size() > 7) {
      put(pl, 7, p32.data() + from);
      put(pl, 8, m16.data() + from);
      put(pl, 9, v16.data() + from);
      put(pl, 10, buf.data() + from);
    }
    if (pl.buffers.size() > 38)
      put(pl, 38, b16.data() + from);
  };
  load(plan, 0, 0);
  runDrawing(plan);
  const std::vector<float> np32 = read(plan, 17);
  const uint64_t k = stochasticRoundingKey(77, 5, key);
  auto rounded = [&](const std::vector<float> &x, bool stochastic, int64_t from = 0) {
    std::vector<uint16_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = stochastic ? roundToBf16Stochastic(x[i], k, (uint64_t)(from + (int64_t)i))
                          : roundToBf16(x[i]);
    return out;
  };
  const std::vector<uint16_t> srP = rounded(np32, true);
  EXPECT_EQ(bits(plan, 11), srP);
  EXPECT_EQ(read(plan, 12), read(plan, 18)) << "the moments are the f32 update's";
  EXPECT_EQ(read(plan, 13), read(plan, 19));
  EXPECT_EQ(bits(plan, 14), rounded(np32, false));
  EXPECT_NE(bits(plan, 11), bits(plan, 14)) << "the stochastic draws differ from nearest somewhere";
  EXPECT_EQ(bits(plan, 20), p16) << "a skipped step keeps the parameters";
  EXPECT_EQ(read(plan, 21), m);
  // bf16 moments: the parameters drawn as above, the moments with their
  // own stream (roundMomentsToBf16Stochastic of the f32 update's moments).
  EXPECT_EQ(bits(plan, 23), srP);
  const std::vector<float> nm = read(plan, 18), nv = read(plan, 19);
  std::vector<uint16_t> srM(n), srV(n);
  for (int64_t i = 0; i < n; ++i)
    roundMomentsToBf16Stochastic(nm[i], nv[i], stateRoundingKey(77, 5, key), (uint64_t)i, srM[i],
                                 srV[i]);
  EXPECT_EQ(bits(plan, 24), srM);
  EXPECT_EQ(bits(plan, 25), srV);
  EXPECT_EQ(bits(plan, 26), rounded(read(plan, 27), true)) << "sgd_update";
  EXPECT_EQ(bits(plan, 28), rounded(read(plan, 30), false)) << "sgd_momentum_update";
  EXPECT_EQ(read(plan, 29), read(plan, 31));
  EXPECT_EQ(bits(plan, 32), rounded(read(plan, 35), true)) << "a decayed prefix";
  EXPECT_NE(read(plan, 35), np32) << "decay_numel moved the prefix's decay";
  EXPECT_EQ(read(plan, 33), read(plan, 36));
  EXPECT_EQ(bits(plan, 39), rounded(read(plan, 41), true)) << "sgd momentum, bf16 buffer";
  EXPECT_EQ(bits(plan, 40), bits(plan, 42)) << "the buffer's own draws";

  // The second half as shard 1 of two: the whole vector's second half.
  std::vector<std::vector<int64_t>> hs(14, {half});
  for (int s : {4, 5, 6})
    hs[s] = {};
  nlohmann::json shardSr = sr;
  shardSr["shard_stride"] = half;
  // (buffers 7-10 typed as above: load() fills them too)
  Plan shard = mixedPlan(hs, {0, 8, 9, 11},
                         {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {11, 12, 13}, shardSr)});
  freshDevice();
  load(shard, 1, half);
  runDrawing(shard);
  EXPECT_EQ(bits(shard, 11), std::vector<uint16_t>(srP.begin() + half, srP.end()));
}

/// sgd_momentum_update with a bf16 buffer (state-dtype=bf16) against the
/// f32 update on the same device from the widened buffer: the parameters
/// bitwise (they read the f32 buffer), and the new buffer that update's
/// rounded once, to nearest or with the draws of roundToBf16Stochastic
/// (keyed by the device's {seed, step} and `key`, placed by the element's
/// position in its unit). A skipped step keeps everything; the second
/// half run as shard 1 of two stores the whole vector's bits.
TEST_P(DeviceConformance, Bf16MomentumBufferIsTheF32UpdateRoundedOnce) {
  const int64_t n = 3000, half = n / 2, key = 3;
  // 0 p, 1 g, 2 b16, 3 lr, 4 step, 5 sumsq (inf: skip), 6 b32; results:
  // nearest 7-8, stochastic 9-10, f32 11-12, skipped 13-14.
  std::vector<std::vector<int64_t>> shapes(15, {n});
  for (int s : {3, 4, 5})
    shapes[s] = {};
  const std::vector<int> bf16 = {2, 8, 10, 14};
  nlohmann::json sgd = {
      {"momentum", 0.9}, {"dampening", 0.1}, {"weight_decay", 0.01}, {"nesterov", true}};
  nlohmann::json sr = sgd;
  sr["stochastic"] = true;
  sr["key"] = key;
  nlohmann::json skip = sr;
  skip["skip_nonfinite"] = true;
  Plan plan = mixedPlan(shapes, bf16,
                        {inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {7, 8}, sgd),
                         inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {9, 10}, sr),
                         inst("sgd_momentum_update", {0, 1, 6, 3, 4}, {11, 12}, sgd),
                         inst("sgd_momentum_update", {0, 1, 2, 3, 4, 5}, {13, 14}, skip)});
  std::vector<float> p(n), g(n), b32(n);
  std::vector<uint16_t> b16(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = (float)std::sin(0.37 * double(i)) * 1.5f;
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    b16[i] = roundToBf16((float)std::sin(0.05 * double(i)) * 0.03f);
    b32[i] = widenBf16(b16[i]);
  }
  auto load = [&](const Plan &pl, int64_t shard, int64_t from) {
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    put(pl, 0, p.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2, b16.data() + from);
    write(pl, 3, {0.1f});
    write(pl, 4, {3.f});
    write(pl, 5, {std::numeric_limits<float>::infinity()});
    if (pl.buffers.size() > 6)
      put(pl, 6, b32.data() + from);
  };
  load(plan, 0, 0);
  runDrawing(plan);
  std::vector<float> np32 = read(plan, 11), nb32 = read(plan, 12);
  const uint64_t k = stateRoundingKey(77, 5, key);
  std::vector<uint16_t> near(n), drawn(n);
  for (int64_t i = 0; i < n; ++i) {
    near[i] = roundToBf16(nb32[i]);
    drawn[i] = roundToBf16Stochastic(nb32[i], k, (uint64_t)i);
  }
  EXPECT_NE(np32, p) << "the update moved the parameters";
  EXPECT_EQ(read(plan, 7), np32) << "the parameters read the f32 buffer";
  EXPECT_EQ(read(plan, 9), np32);
  EXPECT_EQ(bits(plan, 8), near);
  std::vector<uint16_t> got = bits(plan, 10);
  EXPECT_EQ(got, drawn);
  EXPECT_NE(got, near) << "the stochastic draws differ from nearest somewhere";
  EXPECT_EQ(read(plan, 13), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bits(plan, 14), b16);

  // The second half as shard 1 of two: the whole vector's second half.
  std::vector<std::vector<int64_t>> hs(11, {half});
  for (int s : {3, 4, 5})
    hs[s] = {};
  nlohmann::json shardSr = sr;
  shardSr["shard_stride"] = half;
  Plan shard =
      mixedPlan(hs, {2, 10}, {inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {9, 10}, shardSr)});
  freshDevice();
  load(shard, 1, half);
  runDrawing(shard);
  EXPECT_EQ(bits(shard, 10), std::vector<uint16_t>(drawn.begin() + half, drawn.end()));
}

/// LAMB with bf16 moments (state-dtype=bf16) against the f32 ops on the
/// same device from the widened moments: lamb_norms' sums bitwise, the
/// update's parameters bitwise and its new moments the f32 update's
/// rounded once (to nearest, or with adamw_update's draws); a skipped step
/// keeps everything; the second half as shard 1 of two (the whole unit's
/// sums, as the all-reduce gives them) stores the whole vector's bits.
TEST_P(DeviceConformance, LambBf16MomentsAreTheF32UpdateRoundedOnce) {
  const int64_t n = 3000, half = n / 2, key = 4;
  // 0 p, 1 g, 2 m16, 3 v16, 4 step, 5 lr, 6 sumsq (inf: skip), 7 m32,
  // 8 v32, 9 norms of the bf16 moments, 10 of the f32 ones; updates:
  // nearest 11-13, stochastic 14-16, f32 17-19, skipped 20-22.
  std::vector<std::vector<int64_t>> shapes(23, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  shapes[9] = shapes[10] = {6};
  const std::vector<int> bf16 = {2, 3, 12, 13, 15, 16, 21, 22};
  nlohmann::json lamb = {{"beta1", 0.9},
                         {"beta2", 0.999},
                         {"eps", 1e-6},
                         {"weight_decay", 0.01},
                         {"segments", {0, 1000, 1003, 3000}},
                         {"decay_numel", 1003}};
  nlohmann::json sr = lamb;
  sr["stochastic"] = true;
  sr["key"] = key;
  nlohmann::json skip = sr;
  skip["skip_nonfinite"] = true;
  Plan plan = mixedPlan(shapes, bf16,
                        {inst("lamb_norms", {0, 1, 2, 3, 4}, {9}, lamb),
                         inst("lamb_norms", {0, 1, 7, 8, 4}, {10}, lamb),
                         inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {11, 12, 13}, lamb),
                         inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {14, 15, 16}, sr),
                         inst("lamb_update", {0, 1, 7, 8, 10, 5, 4}, {17, 18, 19}, lamb),
                         inst("lamb_update", {0, 1, 2, 3, 10, 5, 4, 6}, {20, 21, 22}, skip)});
  std::vector<float> p(n), g(n), m32(n), v32(n);
  std::vector<uint16_t> m16(n), v16(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = (float)std::sin(0.37 * double(i)) * 1.5f;
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    m16[i] = roundToBf16((float)std::sin(0.05 * double(i)) * 0.01f);
    v16[i] = roundToBf16((float)std::fabs(std::sin(0.3 * double(i))) * 1e-4f + 1e-8f);
    m32[i] = widenBf16(m16[i]);
    v32[i] = widenBf16(v16[i]);
  }
  bind(plan);
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  put(plan, 0, p.data());
  put(plan, 1, g.data());
  put(plan, 2, m16.data());
  put(plan, 3, v16.data());
  put(plan, 7, m32.data());
  put(plan, 8, v32.data());
  write(plan, 4, {3.f});
  write(plan, 5, {1e-2f});
  write(plan, 6, {std::numeric_limits<float>::infinity()});
  runDrawing(plan);
  std::vector<float> norms = read(plan, 10);
  EXPECT_EQ(read(plan, 9), norms) << "the sums read the widened moments";
  EXPECT_GT(norms[0], 0.f);
  std::vector<float> np32 = read(plan, 17), nm32 = read(plan, 18), nv32 = read(plan, 19);
  const uint64_t k = stateRoundingKey(77, 5, key);
  std::vector<uint16_t> nearM(n), nearV(n), srM(n), srV(n);
  for (int64_t i = 0; i < n; ++i) {
    nearM[i] = roundToBf16(nm32[i]);
    nearV[i] = roundToBf16(nv32[i]);
    roundMomentsToBf16Stochastic(nm32[i], nv32[i], k, (uint64_t)i, srM[i], srV[i]);
  }
  EXPECT_NE(np32, p);
  EXPECT_EQ(read(plan, 11), np32) << "the parameters read the f32 moments";
  EXPECT_EQ(read(plan, 14), np32);
  EXPECT_EQ(bits(plan, 12), nearM);
  EXPECT_EQ(bits(plan, 13), nearV);
  std::vector<uint16_t> gotM = bits(plan, 15), gotV = bits(plan, 16);
  EXPECT_EQ(gotM, srM);
  EXPECT_EQ(gotV, srV);
  EXPECT_NE(gotV, nearV) << "the stochastic draws differ from nearest somewhere";
  EXPECT_EQ(read(plan, 20), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bits(plan, 21), m16);
  EXPECT_EQ(bits(plan, 22), v16);

  // The second half as shard 1 of two, with the whole unit's sums.
  std::vector<std::vector<int64_t>> hs(17, {half});
  for (int s : {4, 5, 6})
    hs[s] = {};
  hs[9] = hs[10] = {6};
  nlohmann::json shardSr = sr;
  shardSr["shard_stride"] = half;
  Plan shard = mixedPlan(hs, {2, 3, 15, 16},
                         {inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {14, 15, 16}, shardSr)});
  freshDevice();
  bind(shard);
  ASSERT_TRUE(dev->prepare(shard, 1).isOk());
  put(shard, 0, p.data() + half);
  put(shard, 1, g.data() + half);
  put(shard, 2, m16.data() + half);
  put(shard, 3, v16.data() + half);
  write(shard, 4, {3.f});
  write(shard, 5, {1e-2f});
  write(shard, 10, norms);
  runDrawing(shard);
  EXPECT_EQ(read(shard, 14), std::vector<float>(np32.begin() + half, np32.end()));
  EXPECT_EQ(bits(shard, 15), std::vector<uint16_t>(srM.begin() + half, srM.end()));
  EXPECT_EQ(bits(shard, 16), std::vector<uint16_t>(srV.begin() + half, srV.end()));
}

namespace {

/// A packed 8-bit moment shard (Moments8.h) of moments m (or, root, the
/// roots of the second moment) in blocks of `block`, by the header's
/// per-element functions: what the kernels must store.
std::vector<uint8_t> pack8(const std::vector<float> &x, int64_t block, bool root) {
  namespace m8 = moments8;
  const int64_t n = (int64_t)x.size(), blocks = (n + block - 1) / block;
  std::vector<uint8_t> out(shapes::quantizedBytes(n, block), 0);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t o = j * block, len = std::min(block, n - o);
    float s, inv;
    m8::blockScale(m8::blockAmax([&](int64_t i) { return x[o + i]; }, len),
                   root ? m8::kMantV : m8::kMantM, s, inv);
    for (int64_t i = 0; i < len; ++i)
      out[o + i] = inv == 0 ? 0 : root ? m8::encodeV(x[o + i], inv) : m8::encodeM(x[o + i], inv);
    std::memcpy(out.data() + m8::scalesOffset(n) + 4 * j, &s, 4);
  }
  return out;
}

/// Buffers `packed` of the plan made 8-bit (or `bits` = 4) state of
/// `elements` elements in blocks of `block` (i8 vectors of
/// shapes::packedStateBytes bytes: codes, then scales), the arena laid out
/// again.
void packState8(Plan &pl, const std::vector<int> &packed, int64_t elements, int64_t block,
                int bits = 8) {
  int64_t offset = 0;
  for (size_t i = 0; i < pl.buffers.size(); ++i) {
    Buffer &b = pl.buffers[i];
    if (std::find(packed.begin(), packed.end(), (int)i) != packed.end()) {
      b.dtype = DType::I8;
      b.shape = {shapes::packedStateBytes(elements, block, bits)};
      b.bytes = b.numel();
    }
    b.offset = offset;
    offset += (b.bytes + 63) / 64 * 64;
  }
  pl.arenaBytes = offset;
}

/// The 8-bit update tests' inputs of n elements: parameters, gradients,
/// and the moments m and r (exp_avg_sq's roots) with magnitudes over
/// several decades within a block.
void eightBitInputs(int64_t n, std::vector<float> &p, std::vector<float> &g, std::vector<float> &m,
                    std::vector<float> &r) {
  p.resize(n), g.resize(n), m.resize(n), r.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = (float)std::sin(0.37 * double(i)) * 1.5f;
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    m[i] = (float)(std::sin(0.05 * double(i)) * std::pow(10.0, -2.0 - (i % 7)));
    r[i] = (float)(std::fabs(std::sin(0.3 * double(i))) * std::pow(10.0, -2.0 - (i % 5)));
  }
}

/// The f32 values a packed shard decodes to (exp_avg_sq: the root squared).
std::vector<float> unpack8(const std::vector<uint8_t> &q, int64_t n, int64_t block, bool root) {
  namespace m8 = moments8;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    float s;
    std::memcpy(&s, q.data() + m8::scalesOffset(n) + 4 * (i / block), 4);
    float r = root ? m8::decodeRoot(q[i], s) : m8::decodeM(q[i], s);
    x[i] = root ? r * r : r;
  }
  return x;
}

} // namespace

/// moments8::encodeShard, what a checkpoint load encodes f32 moments (or
/// 8-bit moments of other blocks, decoded) with, stores what the update
/// stores for them: pack8's bytes (exp_avg_sq: of the roots, sqrt of the
/// f32 v). 3000 elements over 60 binades, signed, with a short last block,
/// a block of zeros, one below 2^-100 (decodes to zeros), one holding a
/// NaN and one an infinity (decode to NaN), in blocks of 32 and 256. And
/// the host's decoders of whole shards and of ranges, against unpack8.
TEST(EightBitMoments, EncodedOnLoadAsTheUpdateEncodes) {
  namespace m8 = moments8;
  const int64_t n = 3000;
  std::vector<float> m(n), v(n);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto uniform = [&] { // splitmix64 in [0, 1)
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
  };
  for (int64_t i = 0; i < n; ++i) {
    m[i] = (float)((uniform() < 0.5 ? -1 : 1) * std::exp2(-30 + 30 * uniform()));
    v[i] = (float)std::exp2(-60 + 50 * uniform());
  }
  for (int64_t i = 256; i < 512; ++i)
    m[i] = v[i] = 0.0f;
  for (int64_t i = 512; i < 768; ++i)
    m[i] = v[i] = 1e-31f;
  m[800] = v[800] = std::nanf("");
  m[1100] = v[1100] = INFINITY;
  std::vector<float> roots(n);
  for (int64_t i = 0; i < n; ++i)
    roots[i] = std::sqrt(v[i]);
  for (int64_t block : {32, 256}) {
    const int64_t bytes = shapes::quantizedBytes(n, block);
    std::vector<uint8_t> qm(bytes, 0xff), qv(bytes, 0xff);
    m8::encodeShard(m.data(), n, block, false, qm.data());
    m8::encodeShard(v.data(), n, block, true, qv.data());
    EXPECT_EQ(qm, pack8(m, block, false)) << "exp_avg, blocks of " << block;
    EXPECT_EQ(qv, pack8(roots, block, true)) << "exp_avg_sq, blocks of " << block;
    const std::vector<float> dm = unpack8(qm, n, block, false), dv = unpack8(qv, n, block, true);
    // The host's block-wise decoders (checkpoint loads, dumps) give the
    // per-element functions' bits, for a whole shard and for a range that
    // starts and ends inside blocks.
    std::vector<float> got(n);
    m8::decodeShard(qm.data(), n, block, false, got.data());
    EXPECT_EQ(0, std::memcmp(got.data(), dm.data(), n * 4)) << "decodeShard, blocks of " << block;
    m8::decodeShard(qv.data(), n, block, true, got.data());
    EXPECT_EQ(0, std::memcmp(got.data(), dv.data(), n * 4)) << "decodeShard, blocks of " << block;
    const int64_t first = block + 7, count = 2 * block + 9;
    m8::decodeRange(qv.data() + first, qv.data() + m8::scalesOffset(n) + 4 * (first / block), first,
                    count, block, true, got.data());
    EXPECT_EQ(0, std::memcmp(got.data(), dv.data() + first, count * 4)) << "decodeRange";
    for (int64_t i : {300, 600})
      EXPECT_EQ(dm[i], 0.0f) << i;
    EXPECT_TRUE(std::isnan(dm[800]) && std::isnan(dv[800]) && std::isnan(dm[1100]) &&
                std::isnan(dv[1100]));
  }
}

/// LAMB with 8-bit moments (state-dtype=8bit) against the f32 ops on the
/// same device from the decoded moments: lamb_norms' sums bitwise, the
/// update's parameters bitwise (they read the f32 moments) and its new
/// moments the f32 update's encoded once. 3000 elements in blocks of 256;
/// the block [768, 1024) holds three parameters (one of 3 elements) of
/// two weight decays, so their trust ratios differ within it. A skipped
/// step keeps everything. Shard 1 of two over a 2560-element unit (whole
/// blocks each; a block holds a parameter's end and the next one's start,
/// padding after) given the whole unit's sums stores the whole unit's
/// second half.
TEST_P(DeviceConformance, LambEightBitMomentsAreTheF32UpdateEncodedOnce) {
  const int64_t n = 3000, block = 256;
  // 0 p, 1 g, 2 mq, 3 vq, 4 step, 5 lr, 6 sumsq (inf: skip), 7 m32, 8 v32,
  // 9 sums of the 8-bit moments, 10 of the f32 ones; updates: 8-bit
  // 11-13, f32 14-16, skipped 17-19.
  std::vector<std::vector<int64_t>> shapes(20, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  shapes[9] = shapes[10] = {6};
  const std::vector<int> packed = {2, 3, 12, 13, 18, 19};
  nlohmann::json lamb = {{"beta1", 0.9},
                         {"beta2", 0.999},
                         {"eps", 1e-6},
                         {"weight_decay", 0.01},
                         {"segments", {0, 1000, 1003, 3000}},
                         {"decay_numel", 1003}};
  nlohmann::json eight = lamb;
  eight["state_block"] = block;
  nlohmann::json skip = eight;
  skip["skip_nonfinite"] = true;
  Plan plan = mixedPlan(shapes, {},
                        {inst("lamb_norms", {0, 1, 2, 3, 4}, {9}, eight),
                         inst("lamb_norms", {0, 1, 7, 8, 4}, {10}, lamb),
                         inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {11, 12, 13}, eight),
                         inst("lamb_update", {0, 1, 7, 8, 10, 5, 4}, {14, 15, 16}, lamb),
                         inst("lamb_update", {0, 1, 2, 3, 10, 5, 4, 6}, {17, 18, 19}, skip)});
  packState8(plan, packed, n, block);
  std::vector<float> p, g, m, r;
  eightBitInputs(n, p, g, m, r);
  const std::vector<uint8_t> mq = pack8(m, block, false), vq = pack8(r, block, true);
  const std::vector<float> m32 = unpack8(mq, n, block, false), v32 = unpack8(vq, n, block, true);
  bind(plan);
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  put(plan, 0, p.data());
  put(plan, 1, g.data());
  put(plan, 2, mq.data());
  put(plan, 3, vq.data());
  write(plan, 4, {3.f});
  write(plan, 5, {1e-2f});
  write(plan, 6, {std::numeric_limits<float>::infinity()});
  put(plan, 7, m32.data());
  put(plan, 8, v32.data());
  runDrawing(plan);
  const std::vector<float> norms = read(plan, 10);
  EXPECT_EQ(read(plan, 9), norms) << "the sums read the decoded moments";
  EXPECT_NE(norms[0] / norms[3], norms[2] / norms[5]) << "the trust ratios differ";
  const std::vector<float> np32 = read(plan, 14), nm32 = read(plan, 15), nv32 = read(plan, 16);
  std::vector<float> nr32(n);
  for (int64_t i = 0; i < n; ++i)
    nr32[i] = std::sqrt(nv32[i]);
  EXPECT_NE(np32, p);
  EXPECT_EQ(read(plan, 11), np32) << "the parameters read the f32 moments";
  EXPECT_EQ(bytes(plan, 12), pack8(nm32, block, false));
  EXPECT_EQ(bytes(plan, 13), pack8(nr32, block, true));
  EXPECT_EQ(read(plan, 17), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bytes(plan, 18), mq);
  EXPECT_EQ(bytes(plan, 19), vq);

  // Shard 1 of two over 2560 elements (5 whole blocks each), from the
  // whole unit's run and its sums.
  const int64_t whole = 2560, half = whole / 2;
  nlohmann::json w8 = eight, s8 = eight;
  w8["segments"] = s8["segments"] = {0, 1000, 1003, 1500, 2500};
  w8["decay_numel"] = s8["decay_numel"] = 1500;
  s8["shard_stride"] = half;
  std::vector<std::vector<int64_t>> ws(14, {whole}), hs(14, {half});
  for (int s : {4, 5, 6})
    ws[s] = hs[s] = {};
  ws[10] = hs[10] = {8};
  Plan wplan = mixedPlan(ws, {},
                         {inst("lamb_norms", {0, 1, 2, 3, 4}, {10}, w8),
                          inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {11, 12, 13}, w8)});
  Plan splan = mixedPlan(hs, {}, {inst("lamb_update", {0, 1, 2, 3, 10, 5, 4}, {11, 12, 13}, s8)});
  packState8(wplan, packed, whole, block);
  packState8(splan, packed, half, block);
  auto run = [&](const Plan &pl, int64_t shard, int64_t from, int64_t len,
                 const std::vector<float> &sums) {
    freshDevice();
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    std::vector<float> sm(m.begin() + from, m.begin() + from + len),
        sr(r.begin() + from, r.begin() + from + len);
    put(pl, 0, p.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2, pack8(sm, block, false).data());
    put(pl, 3, pack8(sr, block, true).data());
    write(pl, 4, {3.f});
    write(pl, 5, {1e-2f});
    if (!sums.empty())
      write(pl, 10, sums);
    runDrawing(pl);
  };
  run(wplan, 0, 0, whole, {});
  const std::vector<float> wsums = read(wplan, 10), wp = read(wplan, 11);
  const std::vector<float> wm = unpack8(bytes(wplan, 12), whole, block, false),
                           wv = unpack8(bytes(wplan, 13), whole, block, true);
  run(splan, 1, half, half, wsums);
  EXPECT_EQ(read(splan, 11), std::vector<float>(wp.begin() + half, wp.end()));
  EXPECT_EQ(unpack8(bytes(splan, 12), half, block, false),
            std::vector<float>(wm.begin() + half, wm.end()));
  EXPECT_EQ(unpack8(bytes(splan, 13), half, block, true),
            std::vector<float>(wv.begin() + half, wv.end()));
}

/// adamw_update with 8-bit moments (state-dtype=8bit, `state_block`)
/// against the f32 update on the same device from the decoded moments:
/// the parameters bitwise (they read the f32 moments), and the new
/// moments that update's encoded once (exp_avg_sq by its root, sqrt of
/// the f32 v). 3000 elements in blocks of 256 (the last one short), with
/// the weight decay on a prefix that ends inside a block (decay_numel).
/// A skipped step keeps everything; the second half of 2560 run as shard
/// 1 of two (whole blocks) stores the whole vector's second half. With
/// bf16 parameters (master-dtype=bf16; p is bf16-exact here), the same
/// moments and the f32 update's parameters rounded once with the
/// stochastic cast's draws.
TEST_P(DeviceConformance, EightBitMomentsAreTheF32UpdateEncodedOnce) {
  const int64_t n = 3000, block = 256;
  // 0 p, 1 g, 2 mq, 3 vq, 4 lr, 5 step, 6 sumsq (inf: skip), 7 m32, 8 v32;
  // results: 8-bit 9-11, f32 12-14, skipped 15-17; 18 p16 and its 8-bit
  // update 19-21, skipped 22-24.
  std::vector<std::vector<int64_t>> shapes(25, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  const std::vector<int> packed = {2, 3, 10, 11, 16, 17, 20, 21, 23, 24};
  auto plan8 = [&](const std::vector<std::vector<int64_t>> &sh, int64_t elements,
                   std::vector<Instruction> program) {
    Plan pl = mixedPlan(sh, sh.size() > 18 ? std::vector<int>{18, 19, 22} : std::vector<int>{},
                        std::move(program));
    packState8(pl, packed, elements, block);
    return pl;
  };
  nlohmann::json adam = {{"beta1", 0.9},         {"beta2", 0.999},    {"eps", 1e-8},
                         {"weight_decay", 0.1}, {"decay_numel", 1003}, {"shard_stride", 0}};
  nlohmann::json eight = adam;
  eight["state_block"] = block;
  nlohmann::json skip = eight;
  skip["skip_nonfinite"] = true;
  nlohmann::json eight16 = eight, skip16 = skip;
  eight16["stochastic_param"] = skip16["stochastic_param"] = true;
  eight16["key"] = skip16["key"] = 6;
  Plan plan = plan8(shapes, n,
                    {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {9, 10, 11}, eight),
                     inst("adamw_update", {0, 1, 7, 8, 4, 5}, {12, 13, 14}, adam),
                     inst("adamw_update", {0, 1, 2, 3, 4, 5, 6}, {15, 16, 17}, skip),
                     inst("adamw_update", {18, 1, 2, 3, 4, 5}, {19, 20, 21}, eight16),
                     inst("adamw_update", {18, 1, 2, 3, 4, 5, 6}, {22, 23, 24}, skip16)});
  std::vector<float> p, g, m, r;
  eightBitInputs(n, p, g, m, r);
  std::vector<uint16_t> p16(n);
  for (int64_t i = 0; i < n; ++i) {
    p16[i] = roundToBf16(p[i]);
    p[i] = widenBf16(p16[i]); // bf16-exact, for the bf16-parameter runs
  }
  const std::vector<uint8_t> mq = pack8(m, block, false), vq = pack8(r, block, true);
  const std::vector<float> m32 = unpack8(mq, n, block, false), v32 = unpack8(vq, n, block, true);
  bind(plan);
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  put(plan, 0, p.data());
  put(plan, 1, g.data());
  put(plan, 2, mq.data());
  put(plan, 3, vq.data());
  write(plan, 4, {1e-2f});
  write(plan, 5, {3.f});
  write(plan, 6, {std::numeric_limits<float>::infinity()});
  put(plan, 7, m32.data());
  put(plan, 8, v32.data());
  put(plan, 18, p16.data());
  runDrawing(plan);
  const std::vector<float> np32 = read(plan, 12), nm32 = read(plan, 13), nv32 = read(plan, 14);
  std::vector<float> nr32(n);
  for (int64_t i = 0; i < n; ++i)
    nr32[i] = std::sqrt(nv32[i]);
  EXPECT_EQ(read(plan, 9), np32) << "the parameters read the f32 moments";
  EXPECT_EQ(bytes(plan, 10), pack8(nm32, block, false));
  EXPECT_EQ(bytes(plan, 11), pack8(nr32, block, true));
  EXPECT_NE(bytes(plan, 10), mq) << "the moments moved";
  EXPECT_EQ(read(plan, 15), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bytes(plan, 16), mq);
  EXPECT_EQ(bytes(plan, 17), vq);
  std::vector<uint16_t> srP(n);
  for (int64_t i = 0; i < n; ++i)
    srP[i] = roundToBf16Stochastic(np32[i], stochasticRoundingKey(77, 5, 6), (uint64_t)i);
  EXPECT_EQ(bits(plan, 19), srP) << "bf16 parameters: the f32 update's, rounded once";
  EXPECT_EQ(bytes(plan, 20), bytes(plan, 10));
  EXPECT_EQ(bytes(plan, 21), bytes(plan, 11));
  EXPECT_EQ(bits(plan, 22), p16) << "a skipped step keeps the bf16 parameters";
  EXPECT_EQ(bytes(plan, 23), mq);

  // Shard 1 of two over the first 2560 elements (5 whole blocks each):
  // the whole vector's second half, its blocks and scales.
  const int64_t whole = 2560, half = whole / 2;
  nlohmann::json w8 = eight, s8 = eight;
  w8["decay_numel"] = s8["decay_numel"] = 1500;
  s8["shard_stride"] = half;
  std::vector<std::vector<int64_t>> ws(12, {whole}), hs(12, {half});
  for (int s : {4, 5, 6})
    ws[s] = hs[s] = {};
  Plan wplan = plan8(ws, whole, {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {9, 10, 11}, w8)});
  Plan splan = plan8(hs, half, {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {9, 10, 11}, s8)});
  auto run = [&](const Plan &pl, int64_t shard, int64_t from, int64_t len) {
    freshDevice();
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    std::vector<float> sm(m.begin() + from, m.begin() + from + len),
        sr(r.begin() + from, r.begin() + from + len);
    put(pl, 0, p.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2, pack8(sm, block, false).data());
    put(pl, 3, pack8(sr, block, true).data());
    write(pl, 4, {1e-2f});
    write(pl, 5, {3.f});
    runDrawing(pl);
  };
  run(wplan, 0, 0, whole);
  const std::vector<float> wp = read(wplan, 9);
  const std::vector<float> wm = unpack8(bytes(wplan, 10), whole, block, false),
                           wv = unpack8(bytes(wplan, 11), whole, block, true);
  run(splan, 1, half, half);
  EXPECT_EQ(read(splan, 9), std::vector<float>(wp.begin() + half, wp.end()));
  EXPECT_EQ(unpack8(bytes(splan, 10), half, block, false),
            std::vector<float>(wm.begin() + half, wm.end()));
  EXPECT_EQ(unpack8(bytes(splan, 11), half, block, true),
            std::vector<float>(wv.begin() + half, wv.end()));
}

/// adamw_update with 4-bit moments (state-dtype=4bit, state_bits = 4)
/// against the f32 update on the same device from the decoded moments:
/// the parameters bitwise, the new moments that update's encoded once
/// (moments4::encodeShard, exp_avg_sq's roots); a decayed prefix ending
/// inside a block, an odd length (the last block short, its last byte
/// half used), a skipped step keeping every byte, and bf16 parameters
/// (master-dtype=bf16) rounded once beside the same moments.
TEST_P(DeviceConformance, FourBitMomentsAreTheF32UpdateEncodedOnce) {
  namespace m4 = moments4;
  const int64_t n = 1001, block = 128;
  // 0 p, 1 g, 2 mq, 3 vq, 4 lr, 5 step, 6 sumsq (inf: skip), 7 m32, 8 v32;
  // results: 4-bit 9-11, f32 12-14, skipped 15-17; 18 p16 and its 4-bit
  // update 19-21.
  std::vector<std::vector<int64_t>> shapes(22, {n});
  for (int s : {4, 5, 6})
    shapes[s] = {};
  Plan plan = mixedPlan(shapes, {18, 19}, {});
  packState8(plan, {2, 3, 10, 11, 16, 17, 20, 21}, n, block, 4);
  plan.features = {"optimizer-state-4bit"};
  nlohmann::json adam = {{"beta1", 0.9},        {"beta2", 0.999},     {"eps", 1e-8},
                         {"weight_decay", 0.1}, {"decay_numel", 333}, {"shard_stride", 0}};
  nlohmann::json four = adam;
  four["state_block"] = block;
  four["state_bits"] = 4;
  nlohmann::json skip = four;
  skip["skip_nonfinite"] = true;
  plan.program = {inst("adamw_update", {0, 1, 2, 3, 4, 5}, {9, 10, 11}, four),
                  inst("adamw_update", {0, 1, 7, 8, 4, 5}, {12, 13, 14}, adam),
                  inst("adamw_update", {0, 1, 2, 3, 4, 5, 6}, {15, 16, 17}, skip),
                  inst("adamw_update", {18, 1, 2, 3, 4, 5}, {19, 20, 21}, four)};
  std::vector<float> p, g, m, r;
  eightBitInputs(n, p, g, m, r);
  std::vector<uint16_t> p16(n);
  for (int64_t i = 0; i < n; ++i) {
    p16[i] = roundToBf16(p[i]);
    p[i] = widenBf16(p16[i]);
  }
  const int64_t qb = shapes::packedStateBytes(n, block, 4);
  std::vector<uint8_t> mq(qb), vq(qb);
  std::vector<float> v(n), m32(n), v32(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = r[i] * r[i];
  m4::encodeShard(m.data(), n, block, false, mq.data());
  m4::encodeShard(v.data(), n, block, true, vq.data());
  m4::decodeShard(mq.data(), n, block, false, m32.data());
  m4::decodeShard(vq.data(), n, block, true, v32.data());
  bind(plan);
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  put(plan, 0, p.data());
  put(plan, 1, g.data());
  put(plan, 2, mq.data());
  put(plan, 3, vq.data());
  write(plan, 4, {1e-2f});
  write(plan, 5, {3.f});
  write(plan, 6, {std::numeric_limits<float>::infinity()});
  put(plan, 7, m32.data());
  put(plan, 8, v32.data());
  put(plan, 18, p16.data());
  runDrawing(plan);
  const std::vector<float> np32 = read(plan, 12), nm32 = read(plan, 13), nv32 = read(plan, 14);
  std::vector<uint8_t> wantM(qb), wantV(qb);
  m4::encodeShard(nm32.data(), n, block, false, wantM.data());
  m4::encodeShard(nv32.data(), n, block, true, wantV.data());
  EXPECT_EQ(read(plan, 9), np32) << "the parameters read the decoded moments";
  EXPECT_EQ(bytes(plan, 10), wantM);
  EXPECT_EQ(bytes(plan, 11), wantV);
  EXPECT_NE(bytes(plan, 10), mq) << "the moments moved";
  EXPECT_EQ(read(plan, 15), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bytes(plan, 16), mq);
  EXPECT_EQ(bytes(plan, 17), vq);
  std::vector<uint16_t> np16(n);
  for (int64_t i = 0; i < n; ++i)
    np16[i] = roundToBf16(np32[i]);
  EXPECT_EQ(bits(plan, 19), np16) << "bf16 parameters: the f32 update's, rounded once";
  EXPECT_EQ(bytes(plan, 20), wantM);
  EXPECT_EQ(bytes(plan, 21), wantV);
}

/// sgd_momentum_update with an 8-bit buffer (state-dtype=8bit, coded as
/// exp_avg) against the f32 update on the same device from the decoded
/// buffer: the parameters bitwise, the new buffer that update's encoded
/// once; weight decay on a prefix ending inside a block (decay_numel), a
/// skipped step keeping everything, bf16 parameters (master-dtype=bf16)
/// rounded once with the stochastic cast's draws beside the same buffer,
/// and the second half of 2560 as shard 1 of two storing the whole
/// vector's second half.
TEST_P(DeviceConformance, EightBitMomentumBufferIsTheF32UpdateEncodedOnce) {
  const int64_t n = 3000, block = 256;
  // 0 p, 1 g, 2 bq, 3 lr, 4 step, 5 sumsq (inf: skip), 6 b32; results:
  // 8-bit 7-8, f32 9-10, skipped 11-12; 13 p16 and its update 14-15.
  auto plan8 = [&](int64_t len, int buffers, std::vector<Instruction> program) {
    std::vector<std::vector<int64_t>> sh(buffers, {len});
    for (int s : {3, 4, 5})
      sh[s] = {};
    Plan pl = mixedPlan(sh, buffers > 13 ? std::vector<int>{13, 14} : std::vector<int>{},
                        std::move(program));
    packState8(pl, {2, 8, 12, 15}, len, block);
    return pl;
  };
  nlohmann::json sgd = {{"momentum", 0.9},  {"dampening", 0.1},    {"weight_decay", 0.01},
                        {"nesterov", true}, {"decay_numel", 1003}, {"shard_stride", 0}};
  nlohmann::json eight = sgd;
  eight["state_block"] = block;
  nlohmann::json skip = eight;
  skip["skip_nonfinite"] = true;
  nlohmann::json eight16 = eight;
  eight16["stochastic_param"] = true;
  eight16["key"] = 6;
  Plan plan = plan8(n, 16,
                    {inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {7, 8}, eight),
                     inst("sgd_momentum_update", {0, 1, 6, 3, 4}, {9, 10}, sgd),
                     inst("sgd_momentum_update", {0, 1, 2, 3, 4, 5}, {11, 12}, skip),
                     inst("sgd_momentum_update", {13, 1, 2, 3, 4}, {14, 15}, eight16)});
  std::vector<float> p(n), g(n), b(n);
  std::vector<uint16_t> p16(n);
  for (int64_t i = 0; i < n; ++i) {
    p16[i] = roundToBf16((float)std::sin(0.37 * double(i)) * 1.5f);
    p[i] = widenBf16(p16[i]);
    g[i] = (float)std::cos(0.11 * double(i)) * 0.02f;
    b[i] = (float)(std::sin(0.05 * double(i)) * std::pow(10.0, -2.0 - (i % 7)));
  }
  const std::vector<uint8_t> bq = pack8(b, block, false);
  const std::vector<float> b32 = unpack8(bq, n, block, false);
  bind(plan);
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  put(plan, 0, p.data());
  put(plan, 1, g.data());
  put(plan, 2, bq.data());
  write(plan, 3, {0.1f});
  write(plan, 4, {3.f});
  write(plan, 5, {std::numeric_limits<float>::infinity()});
  put(plan, 6, b32.data());
  put(plan, 13, p16.data());
  runDrawing(plan);
  const std::vector<float> np32 = read(plan, 9);
  EXPECT_EQ(read(plan, 7), np32) << "the parameters read the f32 buffer";
  EXPECT_EQ(bytes(plan, 8), pack8(read(plan, 10), block, false));
  EXPECT_NE(bytes(plan, 8), bq) << "the buffer moved";
  EXPECT_EQ(read(plan, 11), p) << "a skipped step keeps the parameters";
  EXPECT_EQ(bytes(plan, 12), bq);
  std::vector<uint16_t> srP(n);
  for (int64_t i = 0; i < n; ++i)
    srP[i] = roundToBf16Stochastic(np32[i], stochasticRoundingKey(77, 5, 6), (uint64_t)i);
  EXPECT_EQ(bits(plan, 14), srP) << "bf16 parameters: the f32 update's, rounded once";
  EXPECT_EQ(bytes(plan, 15), bytes(plan, 8));

  // Shard 1 of two over the first 2560 elements (5 whole blocks each).
  const int64_t whole = 2560, half = whole / 2;
  nlohmann::json w8 = eight, s8 = eight;
  w8["decay_numel"] = s8["decay_numel"] = 1500;
  s8["shard_stride"] = half;
  auto run = [&](const Plan &pl, int64_t shard, int64_t from, int64_t len) {
    freshDevice();
    bind(pl);
    ASSERT_TRUE(dev->prepare(pl, shard).isOk());
    put(pl, 0, p.data() + from);
    put(pl, 1, g.data() + from);
    put(pl, 2,
        pack8(std::vector<float>(b.begin() + from, b.begin() + from + len), block, false).data());
    write(pl, 3, {0.1f});
    write(pl, 4, {3.f});
    runDrawing(pl);
  };
  Plan wplan = plan8(whole, 9, {inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {7, 8}, w8)});
  Plan splan = plan8(half, 9, {inst("sgd_momentum_update", {0, 1, 2, 3, 4}, {7, 8}, s8)});
  run(wplan, 0, 0, whole);
  const std::vector<float> wp = read(wplan, 7), wb = unpack8(bytes(wplan, 8), whole, block, false);
  run(splan, 1, half, half);
  EXPECT_EQ(read(splan, 7), std::vector<float>(wp.begin() + half, wp.end()));
  EXPECT_EQ(unpack8(bytes(splan, 8), half, block, false),
            std::vector<float>(wb.begin() + half, wb.end()));
}

/// residual_layer_norm and layer_norm_grad_acc against add + layer_norm /
/// layer_norm_grad + add on the same device. The CPU runs the unfused
/// kernels in order: bitwise. The CUDA kernels add in f32 before one
/// rounding where the unfused ops round twice (one ulp of the result
/// each), and may reduce a row in another order than the unfused layer
/// norm's kernel (the statistics of C = 40 values: within C ulps of
/// |x - mean| rstd each): 2 ulps of each output plus 2 C ulps times
/// max(|gamma|, 1) (|xhat| + 1) (the normalised value's error).
TEST_P(DeviceConformance, FusedResidualLayerNormsMatchTheUnfusedOps) {
  const int64_t rows = 6, C = 40;
  // 0 a, 1 b, 2 gamma, 3 beta, 4 sum, 5 y, 6 add, 7 layer_norm, 8 dy, 9 acc,
  // 10 dx, 11 dg, 12 db, 13-15 layer_norm_grad, 16 add.
  Plan plan = matrixPlan(
      {{rows, C},
       {rows, C},
       {C},
       {C},
       {rows, C},
       {rows, C},
       {rows, C},
       {rows, C},
       {rows, C},
       {rows, C},
       {rows, C},
       {C},
       {C},
       {rows, C},
       {C},
       {C},
       {rows, C}},
      {inst("residual_layer_norm", {0, 1, 2, 3}, {4, 5}), inst("add", {0, 1}, {6}),
       inst("layer_norm", {6, 2, 3}, {7}), inst("layer_norm_grad_acc", {4, 2, 8, 9}, {10, 11, 12}),
       inst("layer_norm_grad", {4, 2, 8}, {13, 14, 15}), inst("add", {13, 9}, {16})});
  auto host = bindFillRun(plan, {0, 1, 2, 3, 8, 9}, [](size_t i, int id) {
    return (float)std::cos(0.61 * double(i) + 2 * id) * 1.5f;
  });
  bool exact = GetParam() == "cpu";
  const double u = 1.0 / (1 << 24);
  double gmax = 1;
  for (float g : host[2])
    gmax = std::max(gmax, (double)std::fabs(g));
  auto compare = [&](int fused, int unfused, double scale, const char *what) {
    std::vector<float> f = read(plan, fused), g = read(plan, unfused);
    for (size_t i = 0; i < f.size(); ++i) {
      double tol = exact ? 0.0 : 2 * u * std::fabs(g[i]) + scale;
      EXPECT_LE(std::fabs((double)f[i] - g[i]), tol)
          << what << " element " << i << ": fused " << f[i] << ", unfused " << g[i];
    }
  };
  compare(4, 6, 0, "sum");
  // |xhat| <= sqrt(C) for any row.
  compare(5, 7, 2 * C * u * gmax * (std::sqrt((double)C) + 1), "layer norm");
  // The input gradient sums rows of C products of |dy| <= 1.5 and gamma:
  // its row reductions may be ordered differently too.
  compare(10, 16, 2 * C * u * gmax * 1.5 * 3 * (std::sqrt((double)C) + 1), "dx + acc");
}

/// The executor's protocol for an async collective ([Note: streams and
/// events]): the collective sees what compute wrote before it, and compute
/// after the wait sees what the collective wrote, although the collective
/// is slow.
TEST_P(DeviceConformance, AsyncCollectiveIsOrderedByEvents) {
  if (GetParam() == "cuda")
    GTEST_SKIP() << "SlowComm sleeps on the host: it models the CPU comm thread; CUDA's "
                    "stream ordering is checked end to end by test/lit/e2e/cuda.test";
  // 0: b0 = fill 3; 1: all_gather b0 -> b1 (slow); 2: b2 = fill 1 (overlaps);
  // 3: wait b1; 4: b3 = b1 + b0.
  Plan plan = vectorPlan(
      4, 8,
      {inst("fill", {}, {0}, {{"value", 3.0}}), inst("all_gather", {0}, {1}, {{"async", true}}),
       inst("fill", {}, {2}, {{"value", 1.0}}), inst("wait", {1}, {1}), inst("add", {1, 0}, {3})});
  plan.worldSize = plan.meshShards = 1;
  bind(plan);
  SlowComm comm(communicatorFor(GetParam()), /*delayMs=*/80);
  Stream &compute = dev->computeStream(), &commStream = dev->commStream();
  ASSERT_TRUE(dev->run(0).isOk());
  auto ready = dev->record(compute);
  ASSERT_TRUE(dev->wait(commStream, *ready).isOk());
  uint8_t *base = dev->arenaBase();
  dev->enqueue(commStream, [&comm, base, &commStream] {
    return comm.allGather(base, base + 64, 8, DType::F32, &commStream);
  });
  auto done = dev->record(commStream);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(dev->run(2).isOk());
  double issueMs =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(issueMs, 60) << "compute waited for the collective before its wait";
  ASSERT_TRUE(dev->wait(compute, *done).isOk());
  ASSERT_TRUE(dev->run(4).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(comm.calls, 1);
  EXPECT_EQ(read(plan, 1), std::vector<float>(8, 3.0f)) << "the collective ran before fill";
  EXPECT_EQ(read(plan, 3), std::vector<float>(8, 6.0f)) << "compute ran before the collective";
  EXPECT_EQ(read(plan, 2), std::vector<float>(8, 1.0f));
}

/// Collectives on the comm stream run in the order they were enqueued, and
/// a failure is sticky: later work on the stream is skipped and the error
/// comes back from the wait after it and from synchronize.
TEST_P(DeviceConformance, CommStreamIsInOrderAndFailuresAreSticky) {
  if (GetParam() == "cuda")
    GTEST_SKIP() << "SlowComm sleeps on the host: it models the CPU comm thread; CUDA's "
                    "stream ordering is checked end to end by test/lit/e2e/cuda.test";
  Plan plan = vectorPlan(2, 4, {});
  bind(plan);
  Stream &commStream = dev->commStream();
  std::vector<int> order;
  for (int k = 0; k < 5; ++k)
    dev->enqueue(commStream, [k, &order] {
      std::this_thread::sleep_for(std::chrono::milliseconds(k % 2 ? 1 : 10));
      order.push_back(k);
      return Status::ok();
    });
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));

  SlowComm failing(communicatorFor(GetParam()), 5, /*fail=*/true);
  uint8_t *base = dev->arenaBase();
  dev->enqueue(commStream, [&failing, base, &commStream] {
    return failing.allGather(base, base + 64, 4, DType::F32, &commStream);
  });
  bool ranAfter = false;
  dev->enqueue(commStream, [&ranAfter] {
    ranAfter = true;
    return Status::ok();
  });
  auto done = dev->record(commStream);
  Status waited = dev->wait(dev->computeStream(), *done);
  Status synced = dev->synchronize();
  EXPECT_FALSE(synced.isOk());
  EXPECT_NE(synced.message().find("injected failure"), std::string::npos) << synced.message();
  if (!waited.isOk()) { // devices that know it at the wait report it there
    EXPECT_NE(waited.message().find("injected failure"), std::string::npos);
  }
  EXPECT_FALSE(ranAfter) << "work after a failure on the stream ran";
}

/// The node comm stream ([Note: node comm stream] in Device.h): a stream
/// of its own beside the comm stream (the comm stream's job completes only
/// once the node stream's has run: on one thread this would time out),
/// in order, joined by events, and its failure is sticky and reported by
/// synchronizeDevice (the end of a step) as well as by synchronize.
TEST_P(DeviceConformance, NodeCommStreamRunsBesideTheCommStream) {
  if (GetParam() == "cuda")
    GTEST_SKIP() << "host jobs that block model the CPU comm threads; CUDA's enqueue launches "
                    "device work";
  Plan plan = vectorPlan(2, 4, {});
  bind(plan);
  Stream &comm = dev->commStream(), &node = dev->nodeCommStream();
  ASSERT_NE(&comm, &node);
  std::promise<void> nodeRan;
  std::atomic<bool> commSawNode{false};
  std::vector<int> order;
  std::mutex mu;
  auto log = [&](int k) {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(k);
  };
  dev->enqueue(comm, [&, f = nodeRan.get_future().share()] {
    commSawNode = f.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    log(1);
    return Status::ok();
  });
  auto commDone = dev->record(comm);
  dev->enqueue(node, [&] {
    log(0);
    nodeRan.set_value();
    return Status::ok();
  });
  // The node stream's next job runs after the comm stream's (an event).
  ASSERT_TRUE(dev->wait(node, *commDone).isOk());
  dev->enqueue(node, [&] {
    log(2);
    return Status::ok();
  });
  auto nodeDone = dev->record(node);
  ASSERT_TRUE(dev->wait(dev->computeStream(), *nodeDone).isOk());
  EXPECT_TRUE(commSawNode) << "the node stream's job did not run while the comm stream's waited";
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  ASSERT_TRUE(dev->synchronize().isOk());

  bool ranAfter = false;
  dev->enqueue(node, [] { return FSDP_ERROR("injected node failure"); });
  dev->enqueue(node, [&ranAfter] {
    ranAfter = true;
    return Status::ok();
  });
  Status synced = dev->synchronizeDevice();
  EXPECT_FALSE(synced.isOk());
  EXPECT_NE(synced.message().find("injected node failure"), std::string::npos) << synced.message();
  EXPECT_FALSE(ranAfter) << "work after a failure on the node stream ran";
  EXPECT_TRUE(dev->synchronize().isOk()) << "the failure was not cleared";
}

/// The swap streams ([Note: swap pipeline] in Executor.cpp): host threads
/// of their own, so a read runs while the host stream is busy with an
/// update (the swap-in stream's job completes a promise the host stream's
/// job is blocked on: on one thread this would time out), ordered by
/// events (the write after the update, the update after its read), and a
/// failed read fails the update and the write behind it, never running
/// them; synchronize drains all three and reports the failure.
TEST_P(DeviceConformance, SwapStreamsRunBesideTheHostStreamInEventOrder) {
  Plan plan = vectorPlan(2, 4, {});
  bind(plan);
  Stream &in = dev->swapInStream(), &out = dev->swapOutStream(), &host = dev->hostStream();
  std::set<Stream *> streams = {
      &in, &out, &host, &dev->computeStream(), &dev->commStream(), &dev->copyStream()};
  EXPECT_EQ(streams.size(), &dev->copyStream() == &dev->computeStream() ? 5u : 6u)
      << "a swap stream shares a thread with another stream";

  std::promise<void> readDone;
  std::atomic<bool> hostSawRead{false};
  std::vector<std::string> order;
  std::mutex mu;
  auto log = [&](const char *what) {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(what);
  };
  // The host stream's update blocks until the swap-in stream's read has
  // run: the two must be different threads.
  dev->enqueue(host, [&, f = readDone.get_future().share()] {
    hostSawRead = f.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    log("update");
    return Status::ok();
  });
  auto updated = dev->record(host);
  dev->enqueue(in, [&] {
    log("read");
    readDone.set_value();
    return Status::ok();
  });
  ASSERT_TRUE(dev->wait(out, *updated).isOk());
  dev->enqueue(out, [&] {
    log("write");
    return Status::ok();
  });
  auto written = dev->record(out);
  ASSERT_TRUE(dev->wait(dev->computeStream(), *written).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_TRUE(hostSawRead) << "the read did not run while the host stream was busy";
  EXPECT_EQ(order, (std::vector<std::string>{"read", "update", "write"}));

  // A failed read: the update waiting for it and the write behind that
  // are skipped, and the failure comes back.
  bool updateRan = false, writeRan = false;
  dev->enqueue(in, [] { return FSDP_ERROR("injected read failure"); });
  auto read = dev->record(in);
  ASSERT_TRUE(dev->wait(host, *read).isOk());
  dev->enqueue(host, [&] {
    updateRan = true;
    return Status::ok();
  });
  auto update = dev->record(host);
  ASSERT_TRUE(dev->wait(out, *update).isOk());
  dev->enqueue(out, [&] {
    writeRan = true;
    return Status::ok();
  });
  auto write = dev->record(out);
  Status waited = dev->wait(dev->computeStream(), *write);
  Status synced = dev->synchronize();
  EXPECT_FALSE(waited.isOk() && synced.isOk()) << "the read's failure was lost";
  for (const Status *st : {&waited, &synced})
    if (!st->isOk()) {
      EXPECT_NE(st->message().find("injected read failure"), std::string::npos) << st->message();
    }
  EXPECT_FALSE(updateRan) << "an update ran on state its read did not bring";
  EXPECT_FALSE(writeRan) << "a write-back ran after a failed update";
  // The streams run work again after synchronize.
  bool again = false;
  dev->enqueue(in, [&] {
    again = true;
    return Status::ok();
  });
  EXPECT_TRUE(dev->synchronize().isOk());
  EXPECT_TRUE(again);
}

// cuda runs where a GPU is and skips (with the reason) elsewhere.
/// swiglu and swiglu_grad against silu, mul, mul, silu_grad (what
/// autodiff derives for mul(silu(g), u)) on the same device and inputs: the
/// CPU computes each with the unfused kernels' arithmetic (bitwise); CUDA's
/// kernels evaluate the same f32 expressions, which a compiler may contract
/// differently (an fma in 1 + x (1 - s)): within 4 f32 ulps of the result
/// plus 4 ulps of each term's bound (|g u|; |dy| (|u| (1.1 |g| + 1) + 1)).
TEST_P(DeviceConformance, SwigluMatchesTheUnfusedOps) {
  const int64_t n = 777;
  // 0 g, 1 u, 2 dh | 3 s, 4 h, 5 t, 6 dg, 7 du | 8 h2, 9 dg2, 10 du2
  Plan plan =
      vectorPlan(11, n,
                 {inst("silu", {0}, {3}), inst("mul", {3, 1}, {4}), inst("mul", {2, 1}, {5}),
                  inst("silu_grad", {0, 5}, {6}), inst("mul", {2, 3}, {7}),
                  inst("swiglu", {0, 1}, {8}), inst("swiglu_grad", {0, 1, 2}, {9, 10})});
  auto host = bindFillRun(plan, {0, 1, 2}, [](size_t i, int id) {
    return (float)(std::sin(0.37 * (double)i + id) * (id == 0 ? 6.0 : 1.5));
  });
  const bool exact = GetParam() == "cpu";
  for (auto [fused, unfused, what] :
       {std::tuple(8, 4, "swiglu"), std::tuple(9, 6, "d_gate"), std::tuple(10, 7, "d_up")}) {
    std::vector<float> a = read(plan, fused), b = read(plan, unfused);
    for (int64_t i = 0; i < n; ++i) {
      double g = std::fabs(host[0][i]), u = std::fabs(host[1][i]), d = std::fabs(host[2][i]);
      double term = fused == 8 ? g * u : fused == 9 ? d * (u * (1.1 * g + 1) + 1) : d * g;
      double tol = exact ? 0.0 : 4 * 0x1p-24 * (std::fabs(b[i]) + term);
      ASSERT_LE(std::fabs((double)a[i] - b[i]), tol) << what << " element " << i;
    }
  }
}

/// fsdp.cast {stochastic} (f32 -> bf16, runtime/core/StochasticRounding.h):
/// every device writes the header's bits for every element (so the CPU and
/// the GPU, eager and replayed, agree bit for bit); a rank's shard
/// (`sharded`, shard index 1) draws what the whole vector draws there; each
/// result is x truncated or one bf16 ulp further from zero, up with
/// probability the fraction dropped (binomial bound below); the draw changes
/// with the step and an evaluation rounds to nearest.
/// ZeRO++'s qwZ on the device: quantize a shard, dequantize `parts`
/// gathered ones. b0: n values (`in`); b1: its quantized bytes; b2: the
/// gathered parts' bytes; b3: parts x n values (`out`).
Plan quantizePlan(int64_t n, int64_t block, int64_t parts, DType in, DType out) {
  const int64_t qb = shapes::quantizedBytes(n, block);
  Plan p;
  const std::vector<std::pair<int64_t, DType>> bufs = {
      {n, in}, {qb, DType::I8}, {parts * qb, DType::I8}, {parts * n, out}};
  int64_t offset = 0;
  for (size_t i = 0; i < bufs.size(); ++i) {
    Buffer b;
    b.id = (int64_t)i;
    b.shape = {bufs[i].first};
    b.dtype = bufs[i].second;
    b.bytes = b.numel() * dtypeSize(b.dtype);
    b.offset = offset;
    b.persistent = true;
    b.name = "b" + std::to_string(i);
    offset += (b.bytes + 63) / 64 * 64;
    p.buffers.push_back(b);
  }
  p.arenaBytes = offset;
  p.program = {inst("quantize", {0}, {1}, {{"block", block}}),
               inst("dequantize", {2}, {3}, {{"block", block}, {"parts", parts}})};
  return p;
}

/// A plan's quantize / dequantize / i8 buffers are checked at load: a
/// clear error for each way they can be wrong (the compiler never writes
/// them, a hand-edited or corrupt plan may).
TEST(QuantizeRules, RejectsBadPlansClearly) {
  auto error = [](Plan p, size_t i) {
    Status st = checkInstruction(p, p.program[i]);
    return st ? std::string("accepted") : st.message();
  };
  const Plan good = quantizePlan(10, 4, 2, DType::BF16, DType::F32);
  EXPECT_EQ(error(good, 0), "accepted");
  EXPECT_EQ(error(good, 1), "accepted");
  Plan p = good;
  p.program[0].attrs["block"] = 0;
  EXPECT_NE(error(p, 0).find("block >= 1"), std::string::npos) << error(p, 0);
  p = good;
  p.program[0].attrs["block"] = INT64_MAX; // one block: 12 + 4 bytes, no overflow
  EXPECT_NE(error(p, 0).find("take 16 bytes, found 24"), std::string::npos) << error(p, 0);
  p = good;
  p.program[0].attrs["block"] = "4";
  EXPECT_NE(error(p, 0).find("block: expected an integer"), std::string::npos) << error(p, 0);
  p = good;
  p.program[1].attrs["parts"] = 3; // 20 values do not split in 3
  EXPECT_NE(error(p, 1).find("parts >= 1 dividing 20"), std::string::npos) << error(p, 1);
  p = good;
  p.program[1].attrs["block"] = 8; // 2 x (12 + 8) bytes, not 2 x (12 + 12)
  EXPECT_NE(error(p, 1).find("take 40 bytes, found 48"), std::string::npos) << error(p, 1);
  p = good;
  p.buffers[1].dtype = DType::F32; // quantized bytes in a float buffer
  p.buffers[1].bytes *= 4;
  EXPECT_NE(error(p, 0).find("flat i8 bytes"), std::string::npos) << error(p, 0);
  p = good;
  p.program[0] = inst("cast", {0}, {1}); // a cast does not make bytes
  EXPECT_NE(error(p, 0).find("float tensors"), std::string::npos) << error(p, 0);
  // Collectives: an all-gather moves i8 bytes, a reduction never sums them.
  Plan c = good;
  c.worldSize = 2;
  c.program = {inst("all_gather", {1}, {2}), inst("all_reduce", {1}, {1}, {{"reduce", "sum"}})};
  EXPECT_EQ(error(c, 0), "accepted");
  EXPECT_NE(error(c, 1).find("one float dtype"), std::string::npos) << error(c, 1);
}

TEST_P(DeviceConformance, QuantizedGathersMatchTheReference) {
  // 1003 values in blocks of 64 (the last one 43): magnitudes across
  // blocks from 1e-3 to 1e2, exact ties x x (127 / m) = k + 1/2 included
  // (block 1: its max 127, so scale 1 and 2.5 -> 2, -3.5 -> -4).
  const int64_t n = 1003, block = 64, parts = 3, qb = shapes::quantizedBytes(n, block);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i)
    x[i] = std::sin(0.37f * (float)i) * std::pow(10.0f, (float)(i / block % 6) - 3.0f);
  x[64] = 127.0f, x[65] = 2.5f, x[66] = -3.5f, x[67] = -127.0f;
  for (int64_t i = 128; i < 192; ++i) // a block of zeros: scale 0, values 0
    x[i] = 0.0f;
  x[200] = std::nanf("");                          // block 3 dequantizes to NaN
  x[300] = std::numeric_limits<float>::infinity(); // block 4 too
  for (DType in : {DType::F32, DType::BF16})
    for (DType out : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(dtypeName(in)) + " -> " + dtypeName(out));
      Plan plan = quantizePlan(n, block, parts, in, out);
      dev.reset(); // an arena a device: a fresh one for each plan
      ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
      bind(plan);
      // The input in its dtype (a bf16 input is x rounded to bf16 first).
      std::vector<float> xs = x;
      std::vector<uint16_t> xb(n);
      for (int64_t i = 0; i < n; ++i) {
        xb[i] = roundToBf16(x[i]);
        if (in == DType::BF16)
          xs[i] = widenBf16(xb[i]);
      }
      const void *src = in == DType::F32 ? (const void *)x.data() : (const void *)xb.data();
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[0].offset, src, plan.buffers[0].bytes)
              .isOk());
      // Garbage in the padding: quantize must write it.
      std::vector<uint8_t> junk(qb, 0xAB);
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[1].offset, junk.data(), qb).isOk());
      ASSERT_TRUE(dev->run(0).isOk());
      ASSERT_TRUE(dev->synchronize().isOk());
      std::vector<uint8_t> got(qb), want(qb, 0xCD);
      ASSERT_TRUE(
          dev->copyToHost(got.data(), dev->arenaBase() + plan.buffers[1].offset, qb).isOk());
      quant::quantizeBlocks(xs.data(), n, block, want.data(), 0, shapes::quantizedBlocks(n, block));
      for (int64_t i = 0; i < qb; ++i)
        ASSERT_EQ(got[i], want[i]) << "byte " << i << " of " << qb
                                   << ": the quantized bytes differ from runtime/core/Quantize.h's";
      for (int64_t i = n; i < quant::valueBytes(n); ++i)
        EXPECT_EQ(got[i], 0) << "padding byte " << i;
      float s1;
      std::memcpy(&s1, got.data() + quant::valueBytes(n) + 4, 4);
      EXPECT_EQ(s1, 1.0f);
      EXPECT_EQ((int8_t)got[65], 2) << "2.5 rounds half to even";
      EXPECT_EQ((int8_t)got[66], -4) << "-3.5 rounds half to even";
      EXPECT_EQ((int8_t)got[67], -127);

      // The gather: this part, then two others (x scaled by -2 and 1/3,
      // quantized by the reference), dequantized in rank order.
      std::vector<uint8_t> gathered(parts * qb);
      std::vector<std::vector<float>> sources(parts, xs);
      for (int64_t p = 0; p < parts; ++p) {
        for (float &v : sources[p])
          v *= p == 0 ? 1.0f : p == 1 ? -2.0f : 1.0f / 3.0f;
        quant::quantizeBlocks(sources[p].data(), n, block, gathered.data() + p * qb, 0,
                              shapes::quantizedBlocks(n, block));
      }
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[2].offset, gathered.data(), parts * qb)
              .isOk());
      ASSERT_TRUE(dev->run(1).isOk());
      ASSERT_TRUE(dev->synchronize().isOk());
      std::vector<float> deq(parts * n);
      if (out == DType::F32) {
        deq = read(plan, 3);
      } else {
        std::vector<uint16_t> h(parts * n);
        ASSERT_TRUE(
            dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[3].offset, h.size() * 2)
                .isOk());
        for (size_t i = 0; i < h.size(); ++i)
          deq[i] = widenBf16(h[i]);
      }
      int64_t bad = 0;
      for (int64_t p = 0; p < parts; ++p)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t b = i / block;
          const float *blk = sources[p].data() + b * block;
          const int64_t len = std::min(block, n - b * block);
          // The reference value, and the bound, u = 2^-24: x x (127 / m)
          // is off x / scale by at most 127 x 2u (inv's rounding and the
          // product's), so q is within 0.5 + 254 u of it; the stored scale
          // is off by u of itself (|q| <= 127: 127 u scale) and q x scale
          // rounds once more (127 u scale): 0.5 scale + 508 u scale, taken
          // as 512; then the bf16 rounding of a narrow result.
          const float scale = quant::blockScale([&](int64_t k) { return blk[k]; }, len);
          const float ref = quant::dequantizeValue(gathered.data() + p * qb, n, block, i);
          const float v = deq[p * n + i], orig = sources[p][i];
          float exact = out == DType::F32 ? ref : widenBf16(roundToBf16(ref));
          if (!std::isfinite(scale)) {
            bad += !std::isnan(v); // a NaN or infinite block is NaN
            continue;
          }
          const double bound = 0.5 * scale + 512.0 * scale * 0x1p-24 +
                               (out == DType::F32 ? 0.0 : std::fabs(orig) * 0x1p-8 + scale);
          bad += v != exact || std::fabs((double)v - orig) > bound;
          if (v != exact || std::fabs((double)v - orig) > bound)
            ADD_FAILURE() << "part " << p << " value " << i << ": " << v << ", reference " << exact
                          << ", original " << orig << ", bound " << bound;
          if (bad > 5)
            return;
        }
      EXPECT_EQ(bad, 0);
    }
}

/// ZeRO++'s qgZ on the device: quantize `parts` parts of n values each
/// (`parts` attribute), and the dequantize that sums what an all-to-all
/// delivered (`reduce`). b0: parts x n values (`in`); b1: their quantized
/// parts; b2: the received parts' bytes; b3: n values (`out`).
Plan quantizedReducePlan(int64_t n, int64_t block, int64_t parts, DType in, DType out,
                         const char *reduce) {
  Plan p = quantizePlan(n, block, parts, in, out);
  p.buffers[0].shape = {parts * n};
  p.buffers[1].shape = {parts * shapes::quantizedBytes(n, block)};
  p.buffers[3].shape = {n};
  int64_t offset = 0;
  for (Buffer &b : p.buffers) {
    b.bytes = b.numel() * dtypeSize(b.dtype);
    b.offset = offset;
    offset += (b.bytes + 63) / 64 * 64;
  }
  p.arenaBytes = offset;
  p.program = {
      inst("quantize", {0}, {1}, {{"block", block}, {"parts", parts}}),
      inst("dequantize", {2}, {3}, {{"block", block}, {"parts", parts}, {"reduce", reduce}})};
  return p;
}

TEST(QuantizeRules, ChecksQuantizedReductions) {
  auto error = [](Plan p, size_t i) {
    Status st = checkInstruction(p, p.program[i]);
    return st ? std::string("accepted") : st.message();
  };
  const Plan good = quantizedReducePlan(10, 4, 3, DType::F32, DType::F32, "mean");
  EXPECT_EQ(error(good, 0), "accepted");
  EXPECT_EQ(error(good, 1), "accepted");
  Plan p = good;
  p.program[0].attrs["parts"] = 4; // 30 values do not split in 4
  EXPECT_NE(error(p, 0).find("parts >= 1 dividing 30"), std::string::npos) << error(p, 0);
  p = good;
  p.program[0].attrs["parts"] = 0;
  EXPECT_NE(error(p, 0).find("parts in 1..2^20"), std::string::npos) << error(p, 0);
  p = good;
  p.program[1].attrs["reduce"] = "max";
  EXPECT_NE(error(p, 1).find("reduce = \"sum\" or \"mean\""), std::string::npos) << error(p, 1);
  p = good;
  p.program[1].attrs["reduce"] = 1;
  EXPECT_NE(error(p, 1).find("reduce: expected a string"), std::string::npos) << error(p, 1);
  p = good;
  p.program[1].attrs["parts"] = 2; // 2 x 10 values take 2 x 24 bytes, not 3 x 24
  EXPECT_NE(error(p, 1).find("take 48 bytes, found 72"), std::string::npos) << error(p, 1);
  p = good;
  p.program[1].attrs["parts"] = int64_t(1) << 21;
  EXPECT_NE(error(p, 1).find("parts in 1..2^20"), std::string::npos) << error(p, 1);
  p = good; // 2^44 values x 2^20 parts would overflow the byte count
  p.buffers[3].shape = {int64_t(1) << 44};
  p.buffers[3].bytes = int64_t(1) << 46;
  p.program[1].attrs["parts"] = int64_t(1) << 20;
  EXPECT_NE(error(p, 1).find("values a part, more than 2^40"), std::string::npos) << error(p, 1);
  // all_to_all: i8 or float bytes, G equal parts, distinct buffers.
  Plan c = good;
  c.worldSize = 3;
  c.program = {inst("all_to_all", {1}, {2}), inst("all_to_all", {1}, {1})};
  EXPECT_EQ(error(c, 0), "accepted");
  EXPECT_NE(error(c, 1).find("distinct input and output"), std::string::npos) << error(c, 1);
  c.worldSize = 5; // 72 bytes are not 5 equal parts
  EXPECT_NE(error(c, 0).find("do not fit 5 rank(s)"), std::string::npos) << error(c, 0);
  c.worldSize = 3;
  c.buffers[2].shape = {24};
  c.buffers[2].bytes = 24;
  EXPECT_NE(error(c, 0).find("do not fit 3 rank(s)"), std::string::npos) << error(c, 0);
}

TEST_P(DeviceConformance, QuantizedReductionsMatchTheReference) {
  // 3 parts ("ranks") of 1003 values in blocks of 64; part p is x scaled
  // by 1, -2, 1/3, so blocks differ in scale across parts.
  const int64_t n = 1003, block = 64, parts = 3, qb = shapes::quantizedBytes(n, block);
  std::vector<float> x(parts * n);
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t i = 0; i < n; ++i)
      x[p * n + i] = std::sin(0.37f * (float)i + (float)p) *
                     std::pow(10.0f, (float)(i / block % 6) - 3.0f) *
                     (p == 0   ? 1.0f
                      : p == 1 ? -2.0f
                               : 1.0f / 3.0f);
  x[1 * n + 200] = std::nanf("");     // part 1's block 3: the sum's block 3 is NaN
  for (int64_t i = 128; i < 192; ++i) // block 2 of part 0 all zeros
    x[i] = 0.0f;
  for (const char *reduce : {"mean", "sum"})
    for (DType in : {DType::F32, DType::BF16})
      for (DType out : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(std::string(reduce) + " " + dtypeName(in) + " -> " + dtypeName(out));
        Plan plan = quantizedReducePlan(n, block, parts, in, out, reduce);
        dev.reset();
        ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
        bind(plan);
        std::vector<float> xs = x;
        std::vector<uint16_t> xb(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          xb[i] = roundToBf16(x[i]);
          if (in == DType::BF16)
            xs[i] = widenBf16(xb[i]);
        }
        const void *src = in == DType::F32 ? (const void *)x.data() : (const void *)xb.data();
        ASSERT_TRUE(
            dev->copyToDevice(dev->arenaBase() + plan.buffers[0].offset, src, plan.buffers[0].bytes)
                .isOk());
        std::vector<uint8_t> junk(parts * qb, 0xAB); // padding must be written
        ASSERT_TRUE(
            dev->copyToDevice(dev->arenaBase() + plan.buffers[1].offset, junk.data(), junk.size())
                .isOk());
        ASSERT_TRUE(dev->run(0).isOk());
        ASSERT_TRUE(dev->synchronize().isOk());
        // Each part quantized on its own: the reference's bytes, part by part.
        std::vector<uint8_t> got(parts * qb), want(parts * qb, 0xCD);
        ASSERT_TRUE(
            dev->copyToHost(got.data(), dev->arenaBase() + plan.buffers[1].offset, got.size())
                .isOk());
        for (int64_t p = 0; p < parts; ++p)
          quant::quantizeBlocks(xs.data() + p * n, n, block, want.data() + p * qb, 0,
                                shapes::quantizedBlocks(n, block));
        for (int64_t i = 0; i < parts * qb; ++i)
          ASSERT_EQ(got[i], want[i]) << "byte " << i % qb << " of part " << i / qb;
        // The reduce, on those bytes as an all-to-all would deliver them.
        ASSERT_TRUE(
            dev->copyToDevice(dev->arenaBase() + plan.buffers[2].offset, want.data(), want.size())
                .isOk());
        ASSERT_TRUE(dev->run(1).isOk());
        ASSERT_TRUE(dev->synchronize().isOk());
        std::vector<float> y(n);
        if (out == DType::F32) {
          y = read(plan, 3);
        } else {
          std::vector<uint16_t> h(n);
          ASSERT_TRUE(
              dev->copyToHost(h.data(), dev->arenaBase() + plan.buffers[3].offset, 2 * n).isOk());
          for (int64_t i = 0; i < n; ++i)
            y[i] = widenBf16(h[i]);
        }
        const bool mean = std::string(reduce) == "mean";
        std::vector<float> ref(n);
        quant::dequantizeSumBlocks(want.data(), parts, n, block, mean, 0,
                                   shapes::quantizedBlocks(n, block),
                                   [&](int64_t i, float v) { ref[i] = v; });
        int64_t bad = 0;
        for (int64_t i = 0; i < n && bad <= 5; ++i) {
          const int64_t b = i / block, len = std::min(block, n - b * block);
          // Against the sum of the unquantized parts: each dequantized
          // value is within 0.5 s + 512 u s of its original (s its block's
          // scale, QuantizedGathersMatchTheReference), the f32 sum of P
          // terms adds (P - 1) u sum |d_p|, the mean's division u |mean|,
          // a bf16 result its rounding (2^-8 relative).
          double err = 0, mag = 0, orig = 0;
          bool finite = true;
          for (int64_t p = 0; p < parts; ++p) {
            const float *blk = xs.data() + p * n + b * block;
            const float s = quant::blockScale([&](int64_t k) { return blk[k]; }, len);
            finite &= std::isfinite(s);
            err += 0.5 * s + 512.0 * s * 0x1p-24;
            mag += std::fabs(quant::dequantizeValue(want.data() + p * qb, n, block, i));
            orig += xs[p * n + i];
          }
          const double div = mean ? parts : 1;
          const float exact = out == DType::F32 ? ref[i] : widenBf16(roundToBf16(ref[i]));
          if (!finite) {
            bad += !std::isnan(y[i]);
            EXPECT_TRUE(std::isnan(y[i])) << "value " << i << " of a block with a NaN part";
            continue;
          }
          const double bound =
              (err + (parts - 1) * 0x1p-24 * mag) / div + 0x1p-24 * std::fabs(orig / div) +
              (out == DType::F32 ? 0.0 : std::fabs(orig / div) * 0x1p-8 + err / div);
          const bool wrong = y[i] != exact || std::fabs(y[i] - orig / div) > bound;
          bad += wrong;
          if (wrong)
            ADD_FAILURE() << "value " << i << ": " << y[i] << ", reference " << exact
                          << ", unquantized " << orig / div << ", bound " << bound;
        }
        EXPECT_EQ(bad, 0);
      }
}

/// Hierarchical qgZ's quantize: `parts` parts of the values taken as
/// `chunks` equal chunks, part p being chunks p, p + parts, ... b0: the
/// values (parts x n); b1: the parts' bytes (the rest as
/// quantizedReducePlan).
Plan chunkedQuantizePlan(int64_t n, int64_t block, int64_t parts, int64_t chunks, DType in) {
  Plan p = quantizedReducePlan(n, block, parts, in, DType::F32, "mean");
  p.program[0].attrs["chunks"] = chunks;
  return p;
}

/// Value k of part p of `x` (numel values in `chunks` chunks), as
/// quantize's `chunks` defines it.
float chunkedValue(const std::vector<float> &x, int64_t parts, int64_t chunks, int64_t p,
                   int64_t k) {
  const int64_t c = (int64_t)x.size() / chunks;
  return x[((k / c) * parts + p) * c + k % c];
}

TEST(QuantizeRules, ChecksChunkedQuantize) {
  auto error = [](Plan p, size_t i) {
    Status st = checkInstruction(p, p.program[i]);
    return st ? std::string("accepted") : st.message();
  };
  // 2 parts of 12 values: 24 values in 6 chunks of 4.
  const Plan good = chunkedQuantizePlan(12, 4, 2, 6, DType::F32);
  EXPECT_EQ(error(good, 0), "accepted");
  Plan p = good;
  p.program[0].attrs["chunks"] = 2; // chunks == parts: today's layout
  EXPECT_EQ(error(p, 0), "accepted");
  for (int64_t bad : {1, 5, 16, 48, 0, -2}) {
    p = good;
    p.program[0].attrs["chunks"] = bad;
    EXPECT_NE(error(p, 0).find("expected chunks a multiple of parts (2) dividing the 24 values, "
                               "found chunks " +
                               std::to_string(bad)),
              std::string::npos)
        << bad << ": " << error(p, 0);
  }
  p = good;
  p.program[0].attrs["chunks"] = "6";
  EXPECT_NE(error(p, 0).find("chunks: expected an integer"), std::string::npos) << error(p, 0);
  p = good;
  p.program[0].attrs.erase("parts");
  EXPECT_NE(error(p, 0).find("`chunks` needs `parts`"), std::string::npos) << error(p, 0);
  p = good;
  p.program[1].attrs["chunks"] = 6;
  EXPECT_NE(error(p, 1).find("`chunks` belongs to quantize"), std::string::npos) << error(p, 1);
}

TEST_P(DeviceConformance, ChunkedQuantizeMatchesTheReference) {
  struct Case {
    int64_t parts, chunks, c, block;
  };
  // A part of 150 values in blocks of 64 from chunks of 50 (a chunk
  // smaller than a block, blocks across chunks); chunks == parts (101
  // values a part); chunks of 173; chunks of 3 values in blocks of 5.
  for (const Case &k :
       {Case{2, 6, 50, 64}, Case{3, 3, 101, 64}, Case{2, 4, 173, 64}, Case{4, 8, 3, 5}})
    for (DType in : {DType::F32, DType::BF16}) {
      SCOPED_TRACE("parts " + std::to_string(k.parts) + " chunks " + std::to_string(k.chunks) +
                   " of " + std::to_string(k.c) + ", " + dtypeName(in));
      const int64_t numel = k.chunks * k.c, n = numel / k.parts;
      const int64_t qb = shapes::quantizedBytes(n, k.block);
      std::vector<float> x(numel);
      for (int64_t i = 0; i < numel; ++i) // magnitudes differ chunk to chunk
        x[i] = std::sin(0.37f * (float)i) * std::pow(10.0f, (float)(i / k.c % 5) - 2.0f);
      x[numel / 3] = std::nanf(""); // one block of one part NaN
      Plan plan = chunkedQuantizePlan(n, k.block, k.parts, k.chunks, in);
      dev.reset();
      ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
      bind(plan);
      std::vector<float> xs = x;
      std::vector<uint16_t> xb(numel);
      for (int64_t i = 0; i < numel; ++i) {
        xb[i] = roundToBf16(x[i]);
        if (in == DType::BF16)
          xs[i] = widenBf16(xb[i]);
      }
      const void *src = in == DType::F32 ? (const void *)x.data() : (const void *)xb.data();
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[0].offset, src, plan.buffers[0].bytes)
              .isOk());
      std::vector<uint8_t> junk(k.parts * qb, 0xAB); // padding must be written
      ASSERT_TRUE(
          dev->copyToDevice(dev->arenaBase() + plan.buffers[1].offset, junk.data(), junk.size())
              .isOk());
      ASSERT_TRUE(dev->run(0).isOk());
      ASSERT_TRUE(dev->synchronize().isOk());
      std::vector<uint8_t> got(k.parts * qb), want(k.parts * qb, 0xCD);
      ASSERT_TRUE(dev->copyToHost(got.data(), dev->arenaBase() + plan.buffers[1].offset, got.size())
                      .isOk());
      // The reference: each part's chunks gathered, then quantized alone.
      std::vector<float> part(n);
      for (int64_t p = 0; p < k.parts; ++p) {
        for (int64_t i = 0; i < n; ++i)
          part[i] = chunkedValue(xs, k.parts, k.chunks, p, i);
        quant::quantizeBlocks(part.data(), n, k.block, want.data() + p * qb, 0,
                              shapes::quantizedBlocks(n, k.block));
      }
      for (int64_t i = 0; i < k.parts * qb; ++i)
        ASSERT_EQ(got[i], want[i]) << "byte " << i % qb << " of part " << i / qb;
    }
}

/// Hierarchical qgZ, its four ops on one device with the all-to-alls done
/// here: L = 2 ranks a node, M = 3 nodes, shards of c values. Each rank
/// quantizes its gradient in L parts of M chunks (part l: the shards of
/// the node's rank l); the node's all-to-all; the mean over the node;
/// that in M parts (one a node); the all-to-all across nodes; the mean
/// over the nodes. Rank n L + l ends with the mean of every rank's shard
/// n L + l, within the two quantizations' bound.
TEST_P(DeviceConformance, HierarchicalQuantizedReduceScatterIsTheMean) {
  const int64_t L = 2, M = 3, R = L * M, c = 50, block = 64;
  const int64_t q1 = shapes::quantizedBytes(M * c, block), q2 = shapes::quantizedBytes(c, block);
  Plan plan;
  const std::vector<std::pair<int64_t, DType>> bufs = {
      {R * c, DType::F32}, {L * q1, DType::I8}, {L * q1, DType::I8}, {M * c, DType::F32},
      {M * q2, DType::I8}, {M * q2, DType::I8}, {c, DType::F32}};
  int64_t offset = 0;
  for (size_t i = 0; i < bufs.size(); ++i) {
    Buffer b;
    b.id = (int64_t)i;
    b.shape = {bufs[i].first};
    b.dtype = bufs[i].second;
    b.bytes = b.numel() * dtypeSize(b.dtype);
    b.offset = offset;
    b.persistent = true;
    b.name = "b" + std::to_string(i);
    offset += (b.bytes + 63) / 64 * 64;
    plan.buffers.push_back(b);
  }
  plan.arenaBytes = offset;
  plan.program = {
      inst("quantize", {0}, {1}, {{"block", block}, {"parts", L}, {"chunks", R}}),
      inst("dequantize", {2}, {3}, {{"block", block}, {"parts", L}, {"reduce", "mean"}}),
      inst("quantize", {3}, {4}, {{"block", block}, {"parts", M}}),
      inst("dequantize", {5}, {6}, {{"block", block}, {"parts", M}, {"reduce", "mean"}})};
  bind(plan);
  auto put = [&](int64_t id, const void *v) {
    ASSERT_TRUE(
        dev->copyToDevice(dev->arenaBase() + plan.buffers[id].offset, v, plan.buffers[id].bytes)
            .isOk());
  };
  auto get = [&](int64_t id, void *v) {
    ASSERT_TRUE(dev->synchronize().isOk());
    ASSERT_TRUE(
        dev->copyToHost(v, dev->arenaBase() + plan.buffers[id].offset, plan.buffers[id].bytes)
            .isOk());
  };
  // Rank r's gradient: magnitudes differ by shard and by rank.
  std::vector<std::vector<float>> g(R, std::vector<float>(R * c));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < R * c; ++i)
      g[r][i] = std::sin(0.61f * (float)i + 1.3f * (float)r) *
                std::pow(10.0f, (float)((i / c + r) % 4) - 2.0f);
  std::vector<std::vector<uint8_t>> first(R, std::vector<uint8_t>(L * q1));
  for (int64_t r = 0; r < R; ++r) {
    put(0, g[r].data());
    ASSERT_TRUE(dev->run(0).isOk());
    get(1, first[r].data());
  }
  // Rank n L + l receives part l of each rank of node n, in node order.
  std::vector<std::vector<uint8_t>> second(R, std::vector<uint8_t>(M * q2));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = r / L, l = r % L;
    std::vector<uint8_t> recv(L * q1);
    for (int64_t i = 0; i < L; ++i)
      std::memcpy(recv.data() + i * q1, first[n * L + i].data() + l * q1, q1);
    put(2, recv.data());
    ASSERT_TRUE(dev->run(1).isOk());
    ASSERT_TRUE(dev->run(2).isOk());
    get(4, second[r].data());
  }
  int64_t bad = 0;
  for (int64_t r = 0; r < R; ++r) {
    // ... then part n of each rank l of every node, in node order.
    const int64_t n = r / L, l = r % L;
    std::vector<uint8_t> recv(M * q2);
    for (int64_t j = 0; j < M; ++j)
      std::memcpy(recv.data() + j * q2, second[j * L + l].data() + n * q2, q2);
    put(5, recv.data());
    ASSERT_TRUE(dev->run(3).isOk());
    std::vector<float> y(c);
    get(6, y.data());
    for (int64_t k = 0; k < c && bad <= 5; ++k) {
      // The exact mean of shard r's value k, and the bound: half of each
      // rank's first scale (the value's block in part l: offset n c + k)
      // averaged, plus half of each node's second scale (part n's block
      // of value k) averaged, with room for f32 rounding.
      double exact = 0, err = 0, mag = 0;
      for (int64_t s = 0; s < R; ++s) {
        exact += g[s][r * c + k];
        mag += std::fabs(g[s][r * c + k]);
        float sc;
        std::memcpy(&sc,
                    first[s].data() + l * q1 + quant::valueBytes(M * c) + 4 * ((n * c + k) / block),
                    4);
        err += 0.5 * sc;
      }
      for (int64_t j = 0; j < M; ++j) {
        float sc;
        std::memcpy(&sc, second[j * L + l].data() + n * q2 + quant::valueBytes(c) + 4 * (k / block),
                    4);
        err += 0.5 * sc * L; // averaged over M nodes, not R ranks
      }
      exact /= R;
      const double bound = err / R * (1 + 1e-4) + 1e-6 * mag / R;
      if (!(std::fabs(y[k] - exact) <= bound)) {
        ++bad;
        ADD_FAILURE() << "rank " << r << " value " << k << ": " << y[k] << ", exact mean " << exact
                      << ", bound " << bound;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST_P(DeviceConformance, StochasticCastsAreUnbiasedAndShardInvariant) {
  // 4 values x 4096 draws each, then the special cases.
  const int64_t per = 4096;
  const float base[4] = {1.0f + 0x1p-9f,           // dropped fraction 1/4 of an ulp (2^-7)
                         -3.0f - 0x1p-7f,          // 1/2 (negative: away from zero)
                         0x1.1234p-20f + 0x1p-35f, // a small one, about 0.1 of an ulp
                         1.0f};                    // exact: never moves
  std::vector<float> x;
  for (float b : base)
    x.insert(x.end(), per, b);
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {inf, -inf, std::nanf(""), 0.0f, -0.0f, 0x1.fffffep127f})
    x.push_back(v);
  const int64_t n = (int64_t)x.size(), half = n / 2;
  ASSERT_EQ(n % 2, 0);
  const int64_t unit = 3;
  Plan plan =
      mixedPlan({{n}, {n}}, {1}, {inst("cast", {0}, {1}, {{"stochastic", true}, {"key", unit}})});
  auto expected = [&](int64_t step, int64_t from, int64_t count) {
    std::vector<uint16_t> e(count);
    uint64_t key = stochasticRoundingKey(77, step, unit);
    for (int64_t i = 0; i < count; ++i)
      e[i] = roundToBf16Stochastic(x[from + i], key, (uint64_t)(from + i));
    return e;
  };
  bind(plan);
  write(plan, 0, x);
  runDrawing(plan);
  std::vector<uint16_t> got = bits(plan, 1), want = expected(5, 0, n);
  ASSERT_EQ(got, want);

  // Truncated or one ulp up in magnitude, up with probability f: the count of
  // ups among `per` independent draws is Binomial(per, f); 6 standard
  // deviations (+1) bound it (the draws are a fixed hash: the test is
  // deterministic, the bound says how far a correct rounding can be off).
  for (int v = 0; v < 4; ++v) {
    uint32_t u;
    std::memcpy(&u, &base[v], 4);
    const double f = (u & 0xFFFF) / 65536.0;
    int64_t ups = 0;
    for (int64_t i = v * per; i < (v + 1) * per; ++i) {
      ASSERT_TRUE(got[i] == (u >> 16) || got[i] == (u >> 16) + 1) << i;
      ups += got[i] != (u >> 16);
    }
    EXPECT_LE(std::fabs(ups - per * f), 6 * std::sqrt(per * f * (1 - f)) + 1)
        << "value " << v << ": " << ups << " ups of " << per << ", fraction " << f;
  }
  const int64_t s0 = 4 * per;
  EXPECT_EQ(got[s0], 0x7f80);     // inf
  EXPECT_EQ(got[s0 + 1], 0xff80); // -inf
  EXPECT_TRUE((got[s0 + 2] & 0x7fff) > 0x7f80) << "NaN stays NaN";
  EXPECT_EQ(got[s0 + 3], 0x0000);
  EXPECT_EQ(got[s0 + 4], 0x8000);

  // Another step draws again; an evaluation rounds to nearest.
  ASSERT_TRUE(dev->setDropoutContext({77, 6, 0, true}).isOk());
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  std::vector<uint16_t> next = bits(plan, 1);
  EXPECT_EQ(next, expected(6, 0, n));
  EXPECT_NE(next, got);
  ASSERT_TRUE(dev->setDropoutContext({77, 6, 0, false}).isOk());
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  std::vector<uint16_t> nearest = bits(plan, 1);
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(x[i])) {
      ASSERT_EQ(nearest[i], roundToBf16(x[i])) << i;
    }

  // A captured step replays with the step it is replayed at.
  if (dev->canCapture()) {
    ASSERT_TRUE(dev->setDropoutContext({77, 8, 0, true}).isOk());
    ASSERT_TRUE(dev->beginCapture().isOk());
    ASSERT_TRUE(dev->run(0).isOk());
    ASSERT_TRUE(dev->endCapture(true).isOk());
    ASSERT_TRUE(dev->synchronize().isOk());
    ASSERT_TRUE(dev->setDropoutContext({77, 9, 0, true}).isOk());
    ASSERT_TRUE(dev->replay().isOk());
    ASSERT_TRUE(dev->synchronize().isOk());
    EXPECT_EQ(bits(plan, 1), expected(9, 0, n));
  }

  // The second half as shard 1 of two: the same bits as the whole vector's.
  Plan shardPlan =
      mixedPlan({{half}, {half}}, {1},
                {inst("cast", {0}, {1}, {{"stochastic", true}, {"key", unit}, {"sharded", true}})});
  freshDevice();
  ASSERT_TRUE(checkInstruction(shardPlan, shardPlan.program[0]).isOk());
  ASSERT_TRUE(dev->allocateArena(shardPlan.arenaBytes, 0).isOk());
  ASSERT_TRUE(dev->prepare(shardPlan, 1).isOk());
  write(shardPlan, 0, std::vector<float>(x.begin() + half, x.end()));
  runDrawing(shardPlan);
  EXPECT_EQ(bits(shardPlan, 1), std::vector<uint16_t>(want.begin() + half, want.end()));
}

/// The host stream ([Note: streams and events]): work enqueued there runs
/// after the compute event it waits for (it reads what a to_host copy
/// wrote) and before a compute wait on its event returns (compute
/// enqueued after the wait, a to_device copy, sees what it wrote), and
/// issuing it does not block the caller.
TEST_P(DeviceConformance, HostStreamIsOrderedByEvents) {
  // 0: b0 = fill 3 (device); 1: to_host b0 -> b1; host job: b1 = 2 b1 + 1
  // after a sleep; 2: to_device b1 -> b2.
  Plan plan = vectorPlan(3, 8,
                         {inst("fill", {}, {0}, {{"value", 3.0}}), inst("to_host", {0}, {1}),
                          inst("to_device", {1}, {2})});
  plan.buffers[1].host = true;
  plan.buffers[1].offset = 0;
  plan.buffers[2].offset = 64;
  plan.arenaBytes = 96;
  plan.hostArenaBytes = 64;
  for (const Instruction &i : plan.program)
    ASSERT_TRUE(checkInstruction(plan, i).isOk()) << checkInstruction(plan, i).message();
  ASSERT_TRUE(dev->allocateArena(plan.arenaBytes, plan.hostArenaBytes).isOk());
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  auto at = [&](int64_t id) { return dev->address(bufferOffset(plan, id, 0)); };
  std::vector<float> zeros(16, 0.f);
  ASSERT_TRUE(dev->copyToDevice(dev->address(0), zeros.data(), 64).isOk());
  ASSERT_TRUE(dev->copyToDevice(at(1), zeros.data(), 64).isOk());
  Stream &compute = dev->computeStream(), &host = dev->hostStream();
  ASSERT_TRUE(dev->run(0).isOk());
  ASSERT_TRUE(dev->run(1).isOk());
  auto ready = dev->record(compute);
  ASSERT_TRUE(dev->wait(host, *ready).isOk());
  ready.reset();                              // the device keeps what the queued wait needs
  auto *h = reinterpret_cast<float *>(at(1)); // the host arena: host memory
  std::vector<float> seen(8, -1.f);
  auto t0 = std::chrono::steady_clock::now();
  dev->enqueue(host, [h, &seen] {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    for (int i = 0; i < 8; ++i) {
      seen[i] = h[i];
      h[i] = 2 * h[i] + 1;
    }
    return Status::ok();
  });
  auto done = dev->record(host);
  double issueMs =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(issueMs, 45) << "issuing host-stream work waited for it";
  ASSERT_TRUE(dev->wait(compute, *done).isOk());
  ASSERT_TRUE(dev->run(2).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(seen, std::vector<float>(8, 3.0f)) << "the host job ran before the to_host copy";
  std::vector<float> back(8);
  ASSERT_TRUE(dev->copyToHost(back.data(), at(2), 32).isOk());
  EXPECT_EQ(back, std::vector<float>(8, 7.0f)) << "compute after the wait missed the host job";
}

/// A failure on the host stream is sticky (later work there is skipped),
/// comes back from the compute wait on an event after it and from
/// synchronize, after which the stream runs work again.
TEST_P(DeviceConformance, HostStreamFailuresAreStickyAndSynchronizeRecovers) {
  Plan plan = vectorPlan(1, 4, {});
  bind(plan);
  Stream &host = dev->hostStream();
  std::vector<int> order;
  for (int k = 0; k < 4; ++k)
    dev->enqueue(host, [k, &order] {
      std::this_thread::sleep_for(std::chrono::milliseconds(k % 2 ? 1 : 10));
      order.push_back(k);
      return Status::ok();
    });
  ASSERT_TRUE(dev->synchronize().isOk());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));

  dev->enqueue(host, [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return FSDP_ERROR("host update: injected failure");
  });
  bool ranAfter = false;
  dev->enqueue(host, [&ranAfter] {
    ranAfter = true;
    return Status::ok();
  });
  auto done = dev->record(host);
  Status waited = dev->wait(dev->computeStream(), *done);
  Status synced = dev->synchronize();
  EXPECT_FALSE(waited.isOk()) << "the compute wait on the host stream returned before it failed";
  EXPECT_NE(waited.message().find("injected failure"), std::string::npos) << waited.message();
  EXPECT_FALSE(synced.isOk());
  EXPECT_NE(synced.message().find("injected failure"), std::string::npos) << synced.message();
  EXPECT_FALSE(ranAfter) << "work after a failure on the stream ran";

  bool ranAgain = false;
  dev->enqueue(host, [&ranAgain] {
    ranAgain = true;
    return Status::ok();
  });
  EXPECT_TRUE(dev->synchronize().isOk()) << "the failure outlived synchronize";
  EXPECT_TRUE(ranAgain) << "the host stream did not recover after synchronize";
}

/// runOn(hostStream) runs a host instruction (the offloaded update) as
/// run() does: the same kernel, the same bits.
TEST_P(DeviceConformance, HostStreamUpdateMatchesRun) {
  const int64_t n = 1000;
  // host arena: 0-3 p, g, m, v (run); 4-7 the same (runOn host); 8 lr, 9 step
  std::vector<std::vector<int64_t>> shapes(10, {n});
  shapes[8] = shapes[9] = {};
  nlohmann::json adam = {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  nlohmann::json async = adam;
  async["async"] = true;
  Plan plan = matrixPlan(shapes, {inst("adamw_update", {0, 1, 2, 3, 8, 9}, {0, 2, 3}, adam),
                                  inst("adamw_update", {4, 5, 6, 7, 8, 9}, {4, 6, 7}, async)});
  for (Buffer &b : plan.buffers)
    b.host = true;
  plan.hostArenaBytes = plan.arenaBytes;
  plan.arenaBytes = 0;
  for (const Instruction &i : plan.program)
    ASSERT_TRUE(checkInstruction(plan, i).isOk()) << checkInstruction(plan, i).message();
  ASSERT_TRUE(dev->allocateArena(plan.arenaBytes, plan.hostArenaBytes).isOk());
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  auto at = [&](int64_t id) { return dev->address(bufferOffset(plan, id, 0)); };
  for (int id = 0; id < 10; ++id) {
    std::vector<float> v(plan.buffers[id].numel());
    for (size_t i = 0; i < v.size(); ++i) {
      int k = id < 8 ? id % 4 : id;
      v[i] = k == 3   ? (float)std::fabs(std::sin(0.3 * double(i))) + 0.01f // v >= 0
             : k == 8 ? 1e-2f                                               // lr
             : k == 9 ? 3.f                                                 // step
                      : (float)std::sin(0.37 * double(i) + k) * 1.5f;
    }
    ASSERT_TRUE(dev->copyToDevice(at(id), v.data(), v.size() * 4).isOk());
  }
  Stream &compute = dev->computeStream(), &host = dev->hostStream();
  ASSERT_TRUE(dev->run(0).isOk());
  auto ready = dev->record(compute);
  ASSERT_TRUE(dev->wait(host, *ready).isOk());
  std::unique_ptr<Event> done;
  ASSERT_TRUE(dev->runOn(host, 1, done).isOk());
  ASSERT_TRUE(done);
  ASSERT_TRUE(dev->wait(compute, *done).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  for (int k : {0, 2, 3}) {
    std::vector<float> a(n), b(n);
    ASSERT_TRUE(dev->copyToHost(a.data(), at(k), n * 4).isOk());
    ASSERT_TRUE(dev->copyToHost(b.data(), at(k + 4), n * 4).isOk());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * 4), 0) << "result " << k;
    if (k == 0) {
      EXPECT_NE(a[1], (float)std::sin(0.37 + 0) * 1.5f) << "the update ran";
    }
  }
}

/// The plan fields of two unsharded units u0, u1 of `n` elements, each one
/// parameter (w0, w1 at buffers `param`) with AdamW's two moments (at
/// buffers `moment`: u0's exp_avg, exp_avg_sq, then u1's).
void twoUnits(int64_t n, std::array<int64_t, 2> param, std::array<int64_t, 4> moment,
              nlohmann::json &units, nlohmann::json &params, nlohmann::json &states) {
  using nlohmann::json;
  units = params = states = json::array();
  for (int u = 0; u < 2; ++u) {
    std::string un = "u" + std::to_string(u);
    units.push_back({{"name", un},
                     {"flat_numel", n},
                     {"padded_numel", n},
                     {"shard_numel", n},
                     {"sharded", false},
                     {"buffer", -1}});
    params.push_back({{"name", "w" + std::to_string(u)},
                      {"shape", {n}},
                      {"dtype", "f32"},
                      {"init", "normal"},
                      {"scale", 0.5},
                      {"trainable", true},
                      {"unit", u},
                      {"flat_offset", 0},
                      {"buffer", param[u]}});
    states.push_back({{"name", un + ".exp_avg"}, {"kind", "exp_avg"}, {"buffer", moment[2 * u]}});
    states.push_back(
        {{"name", un + ".exp_avg_sq"}, {"kind", "exp_avg_sq"}, {"buffer", moment[2 * u + 1]}});
  }
}

/// An offloaded plan whose first unit's update is an async host
/// instruction, and the executor running it (fsdp-offload's shape):
///   0 g1 = x * x; 1 to_host g1 -> gh1; 2 adamw_update p1 (async);
///   3 g2 = g1 * x; 4 to_host g2 -> gh2; 5 wait p1; 6 to_device p1 -> d1;
///   7 q = d1 * d1; 8 adamw_update p2 (sync); 9 loss = fill 1.
/// `async` false: the same update synchronous, without the wait;
/// `wait` false: async without its wait (and without 6-7, which would
/// read p1 while it is written); `asyncCopy`: the copy 4 async (activation
/// offload's kind, on the copy stream), joined by a wait on gh2 before the
/// last update; `carried` (with async, without wait): the update joined in
/// the next step instead (fsdp-offload's next-step), by a carried wait on
/// p1 first in the program, gh1 live through the step.
std::string offloadPlan(bool async, bool wait, bool asyncCopy = false, bool carried = false) {
  const int64_t n = 64, vb = n * 4;
  using nlohmann::json;
  json buffers = json::array();
  // (Live ranges from the program, below.)
  auto buf = [&](const char *name, const char *kind, bool host, int64_t offset, bool scalar,
                 bool persistent) {
    testplans::addF32Buffer(buffers, name, kind, host ? "host" : "device", offset, n, scalar,
                            persistent, -1, -1);
  };
  // device: 0 x, 1 g1, 2 g2, 3 loss, 4 d1, 5 q
  buf("x", "input", false, 0, false, true);
  buf("g1", "grad", false, vb, false, false);
  buf("g2", "grad", false, 2 * vb, false, false);
  buf("loss", "activation", false, 3 * vb, true, false);
  buf("d1", "activation", false, 3 * vb + 64, false, false);
  buf("q", "activation", false, 4 * vb + 64, false, true);
  // host: 6 p1, 7 m1, 8 v1, 9 p2, 10 m2, 11 v2, 12 lr, 13 step, 14 gh1, 15 gh2
  const char *names[] = {"p1", "m1", "v1", "p2", "m2", "v2"};
  for (int k = 0; k < 6; ++k)
    buf(names[k], k % 3 ? "state" : "param", true, k * vb, false, true);
  buf("lr", "input", true, 6 * vb, true, true);
  buf("step", "input", true, 6 * vb + 64, true, true);
  buf("gh1", "grad", true, 6 * vb + 128, false, false);
  buf("gh2", "grad", true, 7 * vb + 128, false, false);
  json adam = {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  json asyncAdam = adam;
  if (async)
    asyncAdam["async"] = true;
  auto op = [](const char *name, std::vector<int64_t> in, std::vector<int64_t> out,
               json attrs = json::object()) {
    return json{{"op", name}, {"in", in}, {"out", out}, {"attrs", attrs}};
  };
  json copyAttrs = json::object();
  if (asyncCopy)
    copyAttrs["async"] = true;
  json program = {op("mul", {0, 0}, {1}), op("to_host", {1}, {14}),
                  op("adamw_update", {6, 14, 7, 8, 12, 13}, {6, 7, 8}, asyncAdam),
                  op("mul", {1, 0}, {2}), op("to_host", {2}, {15}, copyAttrs)};
  if (async && wait)
    program.push_back(op("wait", {6}, {6}));
  if (wait) {
    program.push_back(op("to_device", {6}, {4}));
    program.push_back(op("mul", {4, 4}, {5}));
  }
  if (asyncCopy)
    program.push_back(op("wait", {15}, {15}));
  program.push_back(op("adamw_update", {9, 15, 10, 11, 12, 13}, {9, 10, 11}, adam));
  program.push_back(op("fill", json::array(), {3}, {{"value", 1.0}}));
  if (carried)
    program.insert(program.begin(), op("wait", {6}, {6}, {{"carried", true}}));
  // Live ranges from the operands; an async host update's operands until
  // its wait, an async copy's input until its wait (what the compiler's
  // memory plan does).
  for (size_t i = 0; i < program.size(); ++i) {
    std::vector<int64_t> ids = program[i]["in"];
    for (int64_t o : program[i]["out"].get<std::vector<int64_t>>())
      ids.push_back(o);
    if (program[i]["op"] == "wait")
      ids = program[i]["in"][0] == 6 ? program[carried ? 3 : 2]["in"].get<std::vector<int64_t>>()
                                     : std::vector<int64_t>{2, 15};
    for (int64_t id : ids) {
      json &b = buffers[id];
      if (b["persistent"])
        continue;
      if (b["first"] == -1)
        b["first"] = i;
      b["last"] = i;
    }
  }
  buffers[3]["last"] = program.size(); // the loss output
  if (carried)
    buffers[14]["last"] = program.size(); // read until the next step's join
  for (json &b : buffers)
    if (b["persistent"])
      b["first"] = -1, b["last"] = program.size();
    else if (b["first"] == -1) // unused (d1 without the wait)
      b["first"] = b["last"] = 0;
  // The host arena's peak live: persistent 6 vectors + 2 scalars, and one
  // gradient copy, two while the async update's input waits for its wait.
  int64_t hostPeak = 6 * vb + 8 + ((async && wait) || carried ? 2 : 1) * vb;
  testplans::OneRankPlan p;
  p.arenaBytes = 5 * vb + 64;
  p.hostArenaBytes = 8 * vb + 128;
  p.hostMemory = {
      {"params", 2 * vb}, {"state", 4 * vb}, {"peak", 8 * vb + 128}, {"peak_live", hostPeak}};
  twoUnits(n, {6, 9}, {7, 8, 10, 11}, p.units, p.params, p.states);
  p.inputs = {{{"name", "x"}, {"role", "input"}, {"buffer", 0}},
              {{"name", "lr"}, {"role", "lr"}, {"buffer", 12}},
              {{"name", "step"}, {"role", "step"}, {"buffer", 13}}};
  p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 3}}};
  return testplans::oneRankPlan(p, buffers, program);
}

/// A device that forwards everything to another: the base of the probes
/// below, which see what the executor asks of a real device.
class ForwardingDevice : public Device {
public:
  explicit ForwardingDevice(std::unique_ptr<Device> d) : in(std::move(d)) {}

  const char *name() const override { return in->name(); }
  Status allocateArena(int64_t b, int64_t h) override { return in->allocateArena(b, h); }
  uint8_t *address(int64_t offset) const override { return in->address(offset); }
  uint8_t *arenaBase() const override { return in->arenaBase(); }
  int64_t arenaBytes() const override { return in->arenaBytes(); }
  Status copyToDevice(void *dst, const void *src, int64_t n) override {
    return in->copyToDevice(dst, src, n);
  }
  Status copyToHost(void *dst, const void *src, int64_t n) override {
    return in->copyToHost(dst, src, n);
  }
  Status fillWords(void *dst, uint32_t w, int64_t n) override { return in->fillWords(dst, w, n); }
  Status prepare(const Plan &p, int64_t shard) override { return in->prepare(p, shard); }
  Status run(int64_t i) override { return in->run(i); }
  Status runOn(Stream &s, int64_t i, std::unique_ptr<Event> &done) override {
    return in->runOn(s, i, done);
  }
  bool implementsOp(const std::string &op) const override { return in->implementsOp(op); }
  Stream &computeStream() override { return in->computeStream(); }
  Stream &commStream() override { return in->commStream(); }
  Stream &nodeCommStream() override { return in->nodeCommStream(); }
  Stream &hostStream() override { return in->hostStream(); }
  Stream &copyStream() override { return in->copyStream(); }
  Stream &swapInStream() override { return in->swapInStream(); }
  Stream &swapOutStream() override { return in->swapOutStream(); }
  void enqueue(Stream &s, std::function<Status()> w) override { in->enqueue(s, std::move(w)); }
  std::unique_ptr<Event> record(Stream &s) override { return in->record(s); }
  Status wait(Stream &s, Event &e) override { return in->wait(s, e); }
  Status synchronize() override { return in->synchronize(); }
  Status synchronizeDevice() override { return in->synchronizeDevice(); }
  Status setDropoutContext(const DropoutContext &c) override {
    FSDP_RETURN_IF_ERROR(Device::setDropoutContext(c));
    return in->setDropoutContext(c);
  }
  bool enqueuesAsync() const override { return in->enqueuesAsync(); }
  int64_t scratchHighWater() const override { return in->scratchHighWater(); }

protected:
  std::unique_ptr<Device> in;
};

/// Records the stream each runOn names: how the executor routes its async
/// instructions.
class RoutingProbe final : public ForwardingDevice {
public:
  using ForwardingDevice::ForwardingDevice;
  std::vector<std::pair<int64_t, std::string>> routed; ///< instruction, stream

  Status runOn(Stream &s, int64_t i, std::unique_ptr<Event> &done) override {
    // The copy stream first: on a CPU it is the compute stream.
    routed.push_back({i, &s == &in->copyStream()      ? "copy"
                         : &s == &in->hostStream()    ? "host"
                         : &s == &in->commStream()    ? "comm"
                         : &s == &in->computeStream() ? "compute"
                                                      : "?"});
    return in->runOn(s, i, done);
  }
};

/// Before the host instructions it names by their order (0: the first
/// runOn on the host stream), the host stream waits at a gate the test
/// opens (at most 20 s, then it notes that the gate was never opened):
/// what runs behind a held host update shows what waits for it. Counts
/// the host instructions done.
class GatedHost final : public ForwardingDevice {
public:
  using ForwardingDevice::ForwardingDevice;
  std::map<int, std::promise<void>> gates;
  std::atomic<int> hostDone{0};
  std::atomic<bool> gateTimedOut{false};
  int hostRuns = 0;

  Status runOn(Stream &s, int64_t i, std::unique_ptr<Event> &done) override {
    const bool host = &s == &in->hostStream();
    auto gate = host ? gates.find(hostRuns++) : gates.end();
    if (gate != gates.end())
      in->enqueue(s, [f = gate->second.get_future().share(), this]() {
        if (f.wait_for(std::chrono::seconds(20)) != std::future_status::ready)
          gateTimedOut = true;
        return Status::ok();
      });
    FSDP_RETURN_IF_ERROR(in->runOn(s, i, done));
    if (host)
      in->enqueue(s, [this] {
        ++hostDone;
        return Status::ok();
      });
    return Status::ok();
  }
};

/// What training offloadPlan(async, true, asyncCopy) for 3 steps on one
/// device gives: buffers 5-11 after, the stream of each runOn the executor
/// made (through a RoutingProbe), its memory measurement and the plan's
/// host peak live.
struct OffloadRun {
  std::vector<std::vector<float>> buffers;
  std::vector<std::pair<int64_t, std::string>> routed;
  MemoryMeasurement memory;
  int64_t plannedHostPeakLive = 0;
};
void trainOffloadPlan(const std::string &device, bool async, bool asyncCopy, OffloadRun &r) {
  Plan plan;
  Status st = parsePlan(offloadPlan(async, true, asyncCopy), plan);
  ASSERT_TRUE(st.isOk()) << st.message();
  std::unique_ptr<Device> d;
  ASSERT_TRUE(createDevice(device, DeviceOptions{}, d).isOk());
  RoutingProbe probe(std::move(d));
  auto comm = communicatorFor(device);
  Executor exec(plan, *comm, probe);
  ASSERT_TRUE(exec.init(1234).isOk());
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = (float)std::cos(0.21 * double(i)) * 0.8f;
  ASSERT_TRUE(exec.writeBuffer(0, x.data()).isOk());
  for (int64_t s = 1; s <= 3; ++s) {
    float loss = 0;
    st = exec.step(s, 1e-2, loss);
    ASSERT_TRUE(st.isOk()) << st.message();
  }
  for (int64_t id : {5, 6, 7, 8, 9, 10, 11}) {
    r.buffers.emplace_back(plan.buffers[id].numel());
    ASSERT_TRUE(exec.readBuffer(id, r.buffers.back().data()).isOk());
  }
  r.routed = probe.routed;
  r.memory = exec.measureMemory();
  r.plannedHostPeakLive = plan.memory.hostPeakLive;
}
/// The two runs' buffers hold the same bits.
void expectSameBits(const OffloadRun &a, const OffloadRun &b, const char *what) {
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t k = 0; k < a.buffers.size(); ++k)
    EXPECT_EQ(std::memcmp(a.buffers[k].data(), b.buffers[k].data(), a.buffers[k].size() * 4), 0)
        << "buffer #" << k << " differs between the sync and async " << what;
}

/// The executor runs an async host update on the host stream and joins it
/// at its wait: the same bits as the synchronous update, over steps; its
/// own host peak-live figure keeps the update's operands live until the
/// wait (the compiler's peak_live); a step that leaves it in flight fails.
TEST_P(DeviceConformance, ExecutorRunsAsyncHostUpdates) {
  OffloadRun sync, async;
  trainOffloadPlan(GetParam(), false, false, sync);
  trainOffloadPlan(GetParam(), true, false, async);
  for (const OffloadRun *r : {&sync, &async})
    EXPECT_EQ(r->memory.hostPeakLive, r->plannedHostPeakLive)
        << (r == &sync ? "sync" : "async")
        << ": the runtime's host peak live is not the compiler's";
  expectSameBits(sync, async, "update");
  EXPECT_EQ(async.memory.hostPeakLive - sync.memory.hostPeakLive, 64 * 4)
      << "gh1 lives until the wait";

  Plan plan;
  Status parsed = parsePlan(offloadPlan(true, false), plan);
  ASSERT_TRUE(parsed.isOk()) << parsed.message();
  std::unique_ptr<Device> d;
  ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, d).isOk());
  auto comm = communicatorFor(GetParam());
  Executor exec(plan, *comm, *d);
  ASSERT_TRUE(exec.init(1).isOk());
  float loss = 0;
  Status st = exec.step(1, 1e-2, loss);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("async collective, copy or host update without a wait"),
            std::string::npos)
      << st.message();
}

/// The copy stream ([Note: streams and events]): activation offload's
/// copies between the arenas, ordered by events with compute, never
/// behind the collectives' stream.
TEST_P(DeviceConformance, CopyStreamMovesBetweenTheArenasInOrder) {
  // 0: b0 = fill 5 (device); 1: to_host b0 -> b1 (async); 2: to_device
  // b1 -> b2 (async); 3: b3 = b2 + b2 (device).
  nlohmann::json async = {{"async", true}};
  Plan plan = vectorPlan(4, 8,
                         {inst("fill", {}, {0}, {{"value", 5.0}}), inst("to_host", {0}, {1}, async),
                          inst("to_device", {1}, {2}, async), inst("add", {2, 2}, {3})});
  plan.buffers[1].host = true;
  plan.buffers[1].offset = 0;
  plan.buffers[2].offset = 64;
  plan.buffers[3].offset = 128;
  plan.arenaBytes = 192;
  plan.hostArenaBytes = 64;
  for (const Instruction &i : plan.program)
    ASSERT_TRUE(checkInstruction(plan, i).isOk()) << checkInstruction(plan, i).message();
  ASSERT_TRUE(dev->allocateArena(plan.arenaBytes, plan.hostArenaBytes).isOk());
  ASSERT_TRUE(dev->prepare(plan, 0).isOk());
  Stream &compute = dev->computeStream(), &copy = dev->copyStream();
  EXPECT_NE(&copy, &dev->commStream()) << "copies would queue behind the collectives";
  EXPECT_NE(&copy, &dev->hostStream());
  ASSERT_TRUE(dev->run(0).isOk());
  auto ready = dev->record(compute);
  ASSERT_TRUE(dev->wait(copy, *ready).isOk());
  std::unique_ptr<Event> toHost, toDevice;
  ASSERT_TRUE(dev->runOn(copy, 1, toHost).isOk());
  ASSERT_TRUE(dev->runOn(copy, 2, toDevice).isOk()); // in order behind the first
  ASSERT_TRUE(toHost && toDevice);
  ASSERT_TRUE(dev->wait(compute, *toDevice).isOk());
  ASSERT_TRUE(dev->run(3).isOk());
  ASSERT_TRUE(dev->synchronize().isOk());
  std::vector<float> back(8);
  ASSERT_TRUE(dev->copyToHost(back.data(), dev->address(bufferOffset(plan, 3, 0)), 32).isOk());
  EXPECT_EQ(back, std::vector<float>(8, 10.0f)) << "compute after the wait missed the copies";
}

/// The executor issues an async copy on the copy stream and an async host
/// update on the host stream (never on the collectives' stream), and the
/// plan trains the same bits as with the copy synchronous.
TEST_P(DeviceConformance, ExecutorRoutesAsyncCopiesToTheCopyStream) {
  OffloadRun sync, async;
  trainOffloadPlan(GetParam(), true, false, sync);
  trainOffloadPlan(GetParam(), true, true, async);
  using R = std::vector<std::pair<int64_t, std::string>>;
  // Three steps; instruction 2 is the async update, 4 the async copy.
  EXPECT_EQ(sync.routed, (R{{2, "host"}, {2, "host"}, {2, "host"}}));
  EXPECT_EQ(async.routed,
            (R{{2, "host"}, {4, "copy"}, {2, "host"}, {4, "copy"}, {2, "host"}, {4, "copy"}}));
  EXPECT_EQ(async.memory.hostPeakLive, async.plannedHostPeakLive);
  expectSameBits(sync, async, "copy");
}

/// fsdp-offload's next-step: a step leaves its async host update running
/// (step 1 returns while the update is held at a gate), the next step
/// joins it at the carried wait, reading the host memory it writes outside
/// a step (readBuffer: a checkpoint) first finishes it (step 3's update,
/// held until 100 ms after the read began), and the plan trains the same
/// bits as with the update synchronous; the runtime's host peak live keeps
/// gh1 live through the step, as the plan does.
TEST_P(DeviceConformance, ExecutorJoinsCarriedHostUpdatesInTheNextStep) {
  OffloadRun sync;
  trainOffloadPlan(GetParam(), false, false, sync);
  Plan plan;
  Status st = parsePlan(offloadPlan(true, false, false, true), plan);
  ASSERT_TRUE(st.isOk()) << st.message();
  std::unique_ptr<Device> d;
  ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, d).isOk());
  GatedHost dev(std::move(d));
  dev.gates[0], dev.gates[2];
  auto comm = communicatorFor(GetParam());
  Executor exec(plan, *comm, dev);
  ASSERT_TRUE(exec.init(1234).isOk());
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = (float)std::cos(0.21 * double(i)) * 0.8f;
  ASSERT_TRUE(exec.writeBuffer(0, x.data()).isOk());
  float loss = 0;
  st = exec.step(1, 1e-2, loss);
  ASSERT_TRUE(st.isOk()) << st.message();
  EXPECT_EQ(dev.hostDone.load(), 0) << "step 1 waited for its host update";
  dev.gates[0].set_value();
  for (int64_t s = 2; s <= 3; ++s) {
    st = exec.step(s, 1e-2, loss);
    ASSERT_TRUE(st.isOk()) << st.message();
  }
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    dev.gates[2].set_value();
  });
  // The parameters and state (buffers 6-11; q is no output here).
  sync.buffers.erase(sync.buffers.begin());
  OffloadRun carried;
  for (int64_t id : {6, 7, 8, 9, 10, 11}) {
    carried.buffers.emplace_back(plan.buffers[id].numel());
    ASSERT_TRUE(exec.readBuffer(id, carried.buffers.back().data()).isOk());
  }
  opener.join();
  EXPECT_FALSE(dev.gateTimedOut.load()) << "the gate was never opened";
  expectSameBits(sync, carried, "update joined in the next step");
  EXPECT_EQ(exec.measureMemory().hostPeakLive, plan.memory.hostPeakLive);
  EXPECT_TRUE(exec.finishCarried().isOk());
}

/// Two async AdamW updates whose moments are in the swap file (offload-
/// nvme's shape, both in flight: [Note: swap pipeline]):
///   0 g1 = x * x; 1 to_host g1 -> gh1; 2 g2 = g1 * x; 3 to_host g2 -> gh2;
///   4 adamw_update p1 (async, swaps m1, v1 through staging 10, 11);
///   5 adamw_update p2 (async, swaps m2, v2 through staging 12, 13);
///   6 wait p1; 7 wait p2; 8 loss = fill 1.
/// With `readAt` >= 0 (offload-nvme's read-ahead) the first update is
/// joined before the second is issued (5 wait p1, 6 adamw_update p2 with
/// swap_read_at = readAt, its staging live from there, 7 wait p2).
std::string nvmePlan(int64_t readAt = -1) {
  const int64_t n = 64, vb = n * 4;
  using nlohmann::json;
  json buffers = json::array();
  auto buf = [&](const char *name, const char *kind, const char *space, int64_t offset, bool scalar,
                 bool persistent, int64_t first, int64_t last) {
    testplans::addF32Buffer(buffers, name, kind, space, offset, n, scalar, persistent,
                            persistent ? -1 : first, persistent ? 9 : last);
  };
  // device: 0 x, 1 g1, 2 g2, 3 loss
  buf("x", "input", "device", 0, false, true, 0, 0);
  buf("g1", "grad", "device", vb, false, false, 0, 2);
  buf("g2", "grad", "device", 2 * vb, false, false, 2, 3);
  buf("loss", "activation", "device", 3 * vb, true, false, 8, 9);
  // host: 4 p1, 5 p2, 6 lr, 7 step, 8 gh1, 9 gh2, 10-13 staging of m1, v1,
  // m2, v2 (live from their update to its wait)
  buf("p1", "param", "host", 0, false, true, 0, 0);
  buf("p2", "param", "host", vb, false, true, 0, 0);
  buf("lr", "input", "host", 2 * vb, true, true, 0, 0);
  buf("step", "input", "host", 2 * vb + 64, true, true, 0, 0);
  const bool ahead = readAt >= 0;
  buf("gh1", "grad", "host", 2 * vb + 128, false, false, 1, ahead ? 5 : 6);
  buf("gh2", "grad", "host", 3 * vb + 128, false, false, 3, 7);
  for (int k = 0; k < 4; ++k)
    buf(k % 2 ? "sv" : "sm", "temp", "host", (4 + k) * vb + 128, false, false,
        k < 2 ? 4 : (ahead ? readAt : 5), k < 2 ? (ahead ? 5 : 6) : 7);
  // the swap file: 14 m1, 15 v1, 16 m2, 17 v2
  const char *names[] = {"m1", "v1", "m2", "v2"};
  for (int k = 0; k < 4; ++k)
    buf(names[k], "state", "nvme", k * vb, false, true, 0, 0);
  json adam = {
      {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"async", true}};
  auto op = [](const char *name, std::vector<int64_t> in, std::vector<int64_t> out,
               json attrs = json::object()) {
    return json{{"op", name}, {"in", in}, {"out", out}, {"attrs", attrs}};
  };
  json a1 = adam, a2 = adam;
  a1["swap"] = {{14, 10, true}, {15, 11, true}};
  a2["swap"] = {{16, 12, true}, {17, 13, true}};
  json program = {op("mul", {0, 0}, {1}),
                  op("to_host", {1}, {8}),
                  op("mul", {1, 0}, {2}),
                  op("to_host", {2}, {9}),
                  op("adamw_update", {4, 8, 10, 11, 6, 7}, {4, 10, 11}, a1),
                  op("adamw_update", {5, 9, 12, 13, 6, 7}, {5, 12, 13}, a2),
                  op("wait", {4}, {4}),
                  op("wait", {5}, {5}),
                  op("fill", json::array(), {3}, {{"value", 1.0}})};
  if (ahead) {
    a2["swap_read_at"] = readAt;
    program[5] = op("wait", {4}, {4});
    program[6] = op("adamw_update", {5, 9, 12, 13, 6, 7}, {5, 12, 13}, a2);
  }
  testplans::OneRankPlan p;
  p.arenaBytes = 4 * vb;
  p.hostArenaBytes = 8 * vb + 128;
  p.nvmeBytes = 4 * vb;
  p.hostMemory = {
      {"params", 2 * vb}, {"state", 0}, {"peak", 8 * vb + 128}, {"peak_live", 8 * vb + 8}};
  twoUnits(n, {4, 5}, {14, 15, 16, 17}, p.units, p.params, p.states);
  p.inputs = {{{"name", "x"}, {"role", "input"}, {"buffer", 0}},
              {{"name", "lr"}, {"role", "lr"}, {"buffer", 6}},
              {{"name", "step"}, {"role", "step"}, {"buffer", 7}}};
  p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 3}}};
  return testplans::oneRankPlan(p, buffers, program);
}

/// What nvmeTwoSteps gives: buffers p1, p2, m1, v1, m2, v2 after two
/// steps, and the executor's own host peak live.
struct NvmeRun {
  std::vector<std::vector<float>> buffers;
  int64_t hostPeakLive = 0;
};

/// Waits (10 s at most) until `exec` has read at least `n` bytes of its
/// swap file; the bytes read then.
int64_t waitForReads(const Executor &exec, int64_t n) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (exec.swapFile()->bytesRead() < n && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return exec.swapFile()->bytesRead();
}

/// Trains `plan` (nvmePlan's buffers) two steps on `device`. With
/// `whileHeld`, the first host update is held at a gate during step 1
/// while it runs (it sees the executor and the count of host updates
/// done), then released. Checks what every such run must give: both
/// updates done and written back, the gate never timed out.
void nvmeTwoSteps(const std::string &device, const Plan &plan,
                  const std::function<void(const Executor &, int)> &whileHeld, NvmeRun &r) {
  const int64_t vb = 64 * 4;
  std::unique_ptr<Device> d;
  ASSERT_TRUE(createDevice(device, DeviceOptions{}, d).isOk());
  GatedHost dev(std::move(d));
  if (whileHeld)
    dev.gates[0];
  auto comm = communicatorFor(device);
  Executor exec(plan, *comm, dev);
  exec.setNvmeDir(::testing::TempDir());
  ASSERT_TRUE(exec.init(1234).isOk());
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = (float)std::cos(0.21 * double(i)) * 0.8f;
  ASSERT_TRUE(exec.writeBuffer(0, x.data()).isOk());
  Status stepped;
  float loss = 0;
  std::thread stepper([&] { stepped = exec.step(1, 1e-2, loss); });
  if (whileHeld) {
    whileHeld(exec, dev.hostDone.load());
    dev.gates[0].set_value();
  }
  stepper.join();
  ASSERT_TRUE(stepped.isOk()) << stepped.message();
  EXPECT_EQ(dev.hostDone.load(), 2);
  EXPECT_EQ(exec.swapFile()->bytesWritten(), 4 * vb);
  ASSERT_TRUE(exec.step(2, 1e-2, loss).isOk());
  EXPECT_FALSE(dev.gateTimedOut.load());
  r.hostPeakLive = exec.measureMemory().hostPeakLive;
  for (int64_t id : {4, 5, 14, 15, 16, 17}) {
    r.buffers.emplace_back(64);
    ASSERT_TRUE(exec.readBuffer(id, r.buffers.back().data()).isOk());
  }
}

void expectSameBuffers(const NvmeRun &a, const NvmeRun &b) {
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t k = 0; k < a.buffers.size(); ++k)
    EXPECT_EQ(std::memcmp(a.buffers[k].data(), b.buffers[k].data(), 64 * 4), 0) << "buffer #" << k;
  EXPECT_NE(b.buffers[2][0], 0.0f) << "the moments were not written back";
}

/// [Note: swap pipeline]: with the first update held at a gate on the
/// host stream (after its read), the executor still reads the second
/// update's state from the swap file: the read runs on the swap-in stream,
/// not behind the held update. Then both run and are written back, and a
/// second step trains on from the written state (the same bits as the
/// plan run without a gate).
TEST_P(DeviceConformance, ExecutorReadsTheNextUpdatesStateWhileAnUpdateRuns) {
  Plan plan;
  Status st = parsePlan(nvmePlan(), plan);
  ASSERT_TRUE(st.isOk()) << st.message();
  const int64_t vb = 64 * 4;
  NvmeRun held, free;
  nvmeTwoSteps(
      GetParam(), plan,
      [&](const Executor &exec, int done) {
        // Both updates' reads, while the first update cannot have run.
        EXPECT_EQ(waitForReads(exec, 4 * vb), 4 * vb)
            << "the second update's read waited for the first update";
        EXPECT_EQ(done, 0) << "the gate did not hold the first update";
      },
      held);
  nvmeTwoSteps(GetParam(), plan, nullptr, free);
  expectSameBuffers(held, free);
}

/// offload-nvme's read-ahead ([Note: swap pipeline]): the second update's
/// read is issued after instruction `readAt`, not when compute reaches the
/// update. With the first update held at a gate on the host stream,
/// compute stands at its wait (#5), before the second update is issued:
/// with a read ahead (after #0 or #4) its state is read all the same;
/// without one (the same join, the read at the update) it is not, until
/// the gate opens. Every way trains the same bits, two steps.
TEST_P(DeviceConformance, ExecutorReadsAheadWhereThePlanSays) {
  const int64_t vb = 64 * 4;
  auto train = [&](int64_t readAt, bool gated, NvmeRun &out) {
    std::string text = nvmePlan(readAt < 0 ? 4 : readAt);
    if (readAt < 0) { // the same program, read at the update
      auto j = nlohmann::json::parse(text);
      j["program"][6]["attrs"].erase("swap_read_at");
      text = j.dump();
    }
    Plan plan;
    Status st = parsePlan(text, plan);
    ASSERT_TRUE(st.isOk()) << st.message();
    auto whileHeld = [&](const Executor &exec, int done) {
      if (readAt >= 0) {
        EXPECT_EQ(waitForReads(exec, 4 * vb), 4 * vb)
            << "the second update's state was not read ahead of compute reaching it";
      } else {
        // (the first update's read; the second is not issued yet)
        waitForReads(exec, 2 * vb);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        EXPECT_EQ(exec.swapFile()->bytesRead(), 2 * vb)
            << "without a read ahead the second update's state was read before compute "
               "reached it";
      }
      EXPECT_EQ(done, 0) << "the gate did not hold the first update";
    };
    nvmeTwoSteps(GetParam(), plan,
                 gated ? std::function<void(const Executor &, int)>(whileHeld) : nullptr, out);
    // The runtime's own liveness: at #4-5 the parameters, lr and step,
    // both gradient copies and the first update's staging, and with a
    // read ahead the second's too (live from readAt), else not yet.
    EXPECT_EQ(out.hostPeakLive, (readAt < 0 ? 6 : 8) * vb + 8);
  };
  NvmeRun ref;
  train(-1, false, ref);
  for (auto [readAt, gated] :
       {std::pair<int64_t, bool>{-1, true}, {0, true}, {4, true}, {0, false}}) {
    SCOPED_TRACE("swap_read_at " + std::to_string(readAt) + (gated ? ", gated" : ""));
    NvmeRun got;
    train(readAt, gated, got);
    expectSameBuffers(got, ref);
  }
}

/// A plan whose instruction between a read ahead's point and its update
/// writes the staging the read fills (a race on the swap-in thread) is
/// refused by name; so is a read point at or after the update.
TEST(PlanValidation, ReadAheadWindowIsTheStagingsOwn) {
  auto j = nlohmann::json::parse(nvmePlan(0));
  Plan ok, raced, late;
  ASSERT_TRUE(parsePlan(j.dump(), ok).isOk());
  auto race = j;
  race["program"][3]["out"] = {12}; // to_host g2 into the second update's staging
  Status st = parsePlan(race.dump(), raced);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("instruction #3 (to_host) uses staging buffer 12"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("from after #0 (swap_read_at)"), std::string::npos) << st.message();
  j["program"][6]["attrs"]["swap_read_at"] = 6;
  st = parsePlan(j.dump(), late);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("a read ahead is issued after an earlier instruction"),
            std::string::npos)
      << st.message();
}

/// offload-nvme-params' shape ([Note: parameters on disk]): a parameter
/// p whose master copy is in the swap file (`onDisk`) or in the host arena:
///   0 fill loss;
///   1 to_device p -> w (from p's staging 7 when on disk, read ahead after
///     #0 with `readAhead`; async with `asyncCopy`, joined at 2, else 2
///     fills the loss again);
///   3 g = w * x; 4 to_host g -> gh;
///   5 adamw_update p (async; swaps its moments m, v through staging 10,
///     11, and p through staging 9 when on disk); 6 wait p; 7 fill loss.
std::string paramOnDiskPlan(bool onDisk, bool asyncCopy, bool readAhead = false) {
  const int64_t n = 64, vb = n * 4;
  using nlohmann::json;
  json buffers = json::array();
  auto buf = [&](const char *name, const char *kind, const char *space, int64_t offset, bool scalar,
                 bool persistent, int64_t first, int64_t last) {
    testplans::addF32Buffer(buffers, name, kind, space, offset, n, scalar, persistent,
                            persistent ? -1 : first, persistent ? 7 : last);
  };
  // device: 0 x, 1 w, 2 g, 3 loss
  buf("x", "input", "device", 0, false, true, 0, 0);
  buf("w", "temp", "device", vb, false, false, 1, 3);
  buf("g", "grad", "device", 2 * vb, false, false, 3, 4);
  buf("loss", "activation", "device", 3 * vb, true, false, 0, 7);
  // host: 4 lr, 5 step, 6 gh, 7 p's staging for the copy, 8 (unused),
  // 9-11 the update's staging of p, m, v
  buf("lr", "input", "host", 0, true, true, 0, 0);
  buf("step", "input", "host", 64, true, true, 0, 0);
  buf("gh", "grad", "host", 128, false, false, 4, 6);
  buf("p.copy", "temp", "host", vb + 128, false, false, readAhead ? 0 : 1, asyncCopy ? 2 : 1);
  buf("unused", "temp", "host", 2 * vb + 128, false, false, 0, 0);
  for (int k = 0; k < 3; ++k)
    buf(k == 0   ? "p.swap"
        : k == 1 ? "m.swap"
                 : "v.swap",
        "temp", "host", (3 + k) * vb + 128, false, false, 5, 6);
  // 12 p (on disk, or persistent in the host arena past the staging), 13
  // m, 14 v in the swap file
  buf("p", "param", onDisk ? "nvme" : "host", onDisk ? 0 : 6 * vb + 128, false, true, 0, 0);
  buf("m", "state", "nvme", vb, false, true, 0, 0);
  buf("v", "state", "nvme", 2 * vb, false, true, 0, 0);
  json adam = {
      {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"async", true}};
  auto op = [](const char *name, std::vector<int64_t> in, std::vector<int64_t> out,
               json attrs = json::object()) {
    return json{{"op", name}, {"in", in}, {"out", out}, {"attrs", attrs}};
  };
  json copy = json::object(), update = adam;
  if (asyncCopy)
    copy["async"] = true;
  if (onDisk) {
    copy["swap"] = {{12, 7, false}};
    if (readAhead)
      copy["swap_read_at"] = 0;
    update["swap"] = {{12, 9, true}, {13, 10, true}, {14, 11, true}};
  } else {
    update["swap"] = {{13, 10, true}, {14, 11, true}};
  }
  const int64_t p = onDisk ? 9 : 12;
  json program = {op("fill", json::array(), {3}, {{"value", 1.0}}),
                  op("to_device", {onDisk ? 7 : 12}, {1}, copy),
                  asyncCopy ? op("wait", {1}, {1})
                            : op("fill", json::array(), {3}, {{"value", 1.0}}),
                  op("mul", {1, 0}, {2}),
                  op("to_host", {2}, {6}),
                  op("adamw_update", {p, 6, 10, 11, 4, 5}, {p, 10, 11}, update),
                  op("wait", {p}, {p}),
                  op("fill", json::array(), {3}, {{"value", 1.0}})};
  testplans::OneRankPlan plan;
  plan.arenaBytes = 4 * vb;
  plan.hostArenaBytes = 7 * vb + 128;
  plan.nvmeBytes = 3 * vb;
  plan.units = json::array({{{"name", "u0"},
                             {"flat_numel", n},
                             {"padded_numel", n},
                             {"shard_numel", n},
                             {"sharded", false},
                             {"buffer", -1}}});
  plan.params = json::array({{{"name", "w0"},
                              {"shape", {n}},
                              {"dtype", "f32"},
                              {"init", "normal"},
                              {"scale", 0.5},
                              {"trainable", true},
                              {"unit", 0},
                              {"flat_offset", 0},
                              {"buffer", 12}}});
  plan.states = json::array({{{"name", "u0.exp_avg"}, {"kind", "exp_avg"}, {"buffer", 13}},
                             {{"name", "u0.exp_avg_sq"}, {"kind", "exp_avg_sq"}, {"buffer", 14}}});
  plan.inputs = {{{"name", "x"}, {"role", "input"}, {"buffer", 0}},
                 {{"name", "lr"}, {"role", "lr"}, {"buffer", 4}},
                 {{"name", "step"}, {"role", "step"}, {"buffer", 5}}};
  plan.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 3}}};
  return testplans::oneRankPlan(plan, buffers, program);
}

/// [Note: parameters on disk]: a copy of a parameter kept in the swap file
/// reads it into its staging first and copies that, sync on compute or
/// async on the copy stream (on CUDA a host function holds the copy stream
/// for the read); the update reads and writes the parameter with its
/// state, and the next step's copy reads what it wrote. Three steps train
/// the same bits as with the parameter in the host arena, and each step
/// reads the parameter twice (the copy, the update) and writes it once;
/// so too with the copy's read issued ahead, after the instruction before
/// it (swap_read_at).
TEST_P(DeviceConformance, ExecutorCopiesParametersFromTheSwapFile) {
  const int64_t vb = 64 * 4;
  auto train = [&](bool onDisk, bool asyncCopy, bool readAhead,
                   std::vector<std::vector<float>> &out) {
    Plan plan;
    Status st = parsePlan(paramOnDiskPlan(onDisk, asyncCopy, readAhead), plan);
    ASSERT_TRUE(st.isOk()) << st.message();
    std::unique_ptr<Device> dev;
    ASSERT_TRUE(createDevice(GetParam(), DeviceOptions{}, dev).isOk());
    auto comm = communicatorFor(GetParam());
    Executor exec(plan, *comm, *dev);
    exec.setNvmeDir(::testing::TempDir());
    ASSERT_TRUE(exec.init(1234).isOk());
    std::vector<float> x(64);
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = (float)std::cos(0.37 * double(i)) * 0.9f;
    ASSERT_TRUE(exec.writeBuffer(0, x.data()).isOk());
    float loss = 0;
    for (int s = 1; s <= 3; ++s) {
      st = exec.step(s, 1e-2, loss);
      ASSERT_TRUE(st.isOk()) << st.message();
    }
    // Per step: the state read and written; on disk the parameter too,
    // read twice (its copy and its update) and written once.
    EXPECT_EQ(exec.swapFile()->bytesRead(), 3 * (onDisk ? 4 : 2) * vb);
    EXPECT_EQ(exec.swapFile()->bytesWritten(), 3 * (onDisk ? 3 : 2) * vb);
    for (int64_t id : {12, 13, 14}) {
      out.emplace_back(64);
      ASSERT_TRUE(exec.readBuffer(id, out.back().data()).isOk());
    }
  };
  std::vector<std::vector<float>> ref;
  train(false, false, false, ref);
  EXPECT_NE(ref[1][0], 0.0f) << "the moments were not written back";
  for (auto [asyncCopy, readAhead] :
       {std::pair<bool, bool>{false, false}, {true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(std::string(asyncCopy ? "async copy" : "sync copy") +
                 (readAhead ? ", read ahead" : ""));
    std::vector<std::vector<float>> got;
    train(true, asyncCopy, readAhead, got);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t k = 0; k < got.size(); ++k)
      EXPECT_EQ(std::memcmp(got[k].data(), ref[k].data(), 64 * 4), 0) << "buffer #" << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceConformance,
                         ::testing::Values(std::string("cpu"), std::string("cuda")),
                         [](const auto &info) { return info.param; });

TEST(DeviceRegistry, CudaIsAClearErrorWithoutTheBackendOrAGpu) {
  if (checkDevice("cuda").isOk())
    GTEST_SKIP() << "a CUDA GPU is here: --device cuda works";
  std::unique_ptr<Device> dev;
  Status st = createDevice("cuda", DeviceOptions{}, dev);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("--device cpu"), std::string::npos) << st.message();
  EXPECT_EQ(dev, nullptr);
  EXPECT_FALSE(createDevice("tpu", DeviceOptions{}, dev).isOk());
}

} // namespace
