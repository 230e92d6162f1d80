//===- RuntimeTest.cpp - runtime pieces without a plan from the compiler --===//
//
// Initialization is shard-consistent, safetensors round-trips and rejects
// truncated files, writes are atomic, the LR schedule has the documented
// values, token files are validated, and the plan reader rejects bad plans.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Data.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Init.h"
#include "runtime/core/OpRules.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SafeTensors.h"
#include "runtime/core/SwapFile.h"
#include "test/unit/TestPlans.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sys/stat.h>

using namespace fsdp;

namespace {

std::string tempPath(const std::string &name) {
  return (std::filesystem::temp_directory_path() /
          ("fsdp-runtime-test-" + std::to_string(::getpid()) + "-" + name))
      .string();
}

TEST(InitTest, ShardsInitializeLikeTheWholeTensor) {
  Param p;
  p.name = "layers.0.weight";
  p.shape = {10, 7};
  p.init = "normal";
  p.scale = 0.02;
  std::vector<float> whole(70), part(30);
  initParam(p, 1234, 0, 70, whole.data());
  initParam(p, 1234, 25, 30, part.data());
  for (int i = 0; i < 30; ++i)
    EXPECT_EQ(part[i], whole[25 + i]);
  // Another seed or name gives other values; the statistics are right.
  std::vector<float> other(70);
  initParam(p, 99, 0, 70, other.data());
  EXPECT_NE(other[0], whole[0]);
  p.name = "layers.1.weight";
  initParam(p, 1234, 0, 70, other.data());
  EXPECT_NE(other[0], whole[0]);
  double s = 0, s2 = 0;
  Param big = p;
  big.shape = {100000};
  std::vector<float> v(100000);
  initParam(big, 7, 0, 100000, v.data());
  for (float x : v) {
    s += x;
    s2 += (double)x * x;
  }
  EXPECT_NEAR(s / 1e5, 0.0, 5e-4);
  EXPECT_NEAR(std::sqrt(s2 / 1e5), 0.02, 5e-4);
  big.init = "uniform";
  big.scale = 0.5;
  initParam(big, 7, 0, 100000, v.data());
  for (float x : v)
    ASSERT_LE(std::fabs(x), 0.5f);
}

// A tensor large enough for initParam to split it over threads (more than
// one grain of 2^20 elements per thread, with an odd length and offset):
// every element is still initValue's, as one thread would write it.
TEST(InitTest, LargeTensorsSplitOverThreadsGiveTheSameBits) {
  Param p;
  p.name = "layers.3.mlp.weight";
  p.init = "normal";
  p.scale = 0.02;
  const int64_t first = 777, count = 3 * (int64_t(1) << 20) + 12345;
  p.shape = {first + count};
  std::vector<float> v(count);
  initParam(p, 42, first, count, v.data());
  for (int64_t i = 0; i < count; ++i)
    ASSERT_EQ(v[i], initValue(p, 42, first + i)) << "element " << i;
  p.init = "uniform";
  initParam(p, 42, first, count, v.data());
  for (int64_t i = 0; i < count; i += 4099)
    ASSERT_EQ(v[i], initValue(p, 42, first + i)) << "element " << i;
}

TEST(SafeTensorsTest, RoundTripAndTruncation) {
  std::string path = tempPath("a.safetensors");
  TensorMap m;
  Tensor t;
  t.shape = {2, 3};
  std::vector<float> vals{1, 2, 3, 4, 5, 6};
  t.data.assign(reinterpret_cast<uint8_t *>(vals.data()),
                reinterpret_cast<uint8_t *>(vals.data()) + 24);
  m["w"] = t;
  ASSERT_TRUE(writeSafeTensors(path, m).isOk());
  // No temporary file is left behind.
  for (auto &e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path()))
    EXPECT_EQ(e.path().string().find(path + ".tmp"), std::string::npos);
  TensorMap back;
  ASSERT_TRUE(readSafeTensors(path, back).isOk());
  ASSERT_EQ(back["w"].shape, t.shape);
  EXPECT_EQ(back["w"].data, t.data);
  // Truncate the data: the reader must refuse.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  TensorMap bad;
  Status st = readSafeTensors(path, bad);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.message();
  std::remove(path.c_str());
}

TEST(SafeTensorsTest, WritesOnlyRegularFiles) {
  // A FIFO or a directory at the target is refused and left as it was
  // (renaming over it would replace it); a regular file is replaced.
  std::string fifo = tempPath("out.fifo"), dir = tempPath("out.dir");
  std::remove(fifo.c_str());
  std::filesystem::remove_all(dir);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  std::filesystem::create_directory(dir);
  for (const std::string &target : {fifo, dir}) {
    Status st = writeFileAtomic(target, "data");
    ASSERT_FALSE(st.isOk()) << target;
    EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st.message();
  }
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  std::string file = tempPath("out.txt");
  ASSERT_TRUE(writeFileAtomic(file, "one").isOk());
  ASSERT_TRUE(writeFileAtomic(file, "two").isOk());
  std::ifstream in(file);
  std::string back;
  in >> back;
  EXPECT_EQ(back, "two");
  std::remove(fifo.c_str());
  std::remove(file.c_str());
  std::filesystem::remove_all(dir);
}

TEST(SafeTensorsTest, DirectWritesCutToSize) {
  // writeFileAtomicDirect (--async-save's writer): sizes that are not a
  // multiple of the block come out cut to size, in the temp directory and
  // in /dev/shm (tmpfs: O_DIRECT since Linux 6.6, the page cache before);
  // an unaligned buffer is an error, not an EINVAL half way.
  constexpr size_t kCap = 3 * kDirectWriteAlign;
  auto *buf = static_cast<uint8_t *>(std::aligned_alloc(kDirectWriteAlign, kCap));
  for (size_t i = 0; i < kCap; ++i)
    buf[i] = (uint8_t)(i * 7 + 1);
  std::vector<std::string> dirs = {std::filesystem::temp_directory_path().string()};
  if (std::filesystem::is_directory("/dev/shm"))
    dirs.push_back("/dev/shm");
  for (const std::string &dir : dirs)
    for (size_t n :
         {size_t(1), kDirectWriteAlign, kDirectWriteAlign + 5, 2 * kDirectWriteAlign + 4095}) {
      std::string path = dir + "/fsdp-direct-" + std::to_string(::getpid()) + ".bin";
      bool direct = false;
      Status st = writeFileAtomicDirect(path, buf, n, direct);
      ASSERT_TRUE(st.isOk()) << dir << " n=" << n << ": " << st.message();
      std::ifstream in(path, std::ios::binary);
      std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      ASSERT_EQ(back.size(), n) << dir;
      EXPECT_EQ(std::memcmp(back.data(), buf, n), 0) << dir << " n=" << n;
      std::remove(path.c_str());
    }
  bool direct = false;
  Status st = writeFileAtomicDirect(tempPath("unaligned.bin"), buf + 1, 10, direct);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("not aligned"), std::string::npos) << st.message();
  std::free(buf);
}

TEST(SwapFileTest, ZerosRoundTripBoundsAndNothingLeftBehind) {
  // fsdp-offload's nvme: the file starts as zeros (the optimizer state's
  // initial value), reads back what was written at any offset, refuses a
  // transfer outside it by name, and is gone from the directory while
  // open (unlinked at once) and after.
  std::string dir = tempPath("swapdir");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directory(dir);
  {
    SwapFile f;
    ASSERT_TRUE(f.open(dir, 3, 4096).isOk());
    EXPECT_TRUE(std::filesystem::is_empty(dir));
    EXPECT_FALSE(f.direct()); // buffered unless asked
    std::vector<float> z(1024, 1.0f);
    ASSERT_TRUE(f.swapIn(0, z.data(), 4096).isOk());
    for (float v : z)
      ASSERT_EQ(v, 0.0f);
    std::vector<float> a(100), b(100);
    for (int i = 0; i < 100; ++i)
      a[i] = 0.25f * (float)i - 3.0f;
    ASSERT_TRUE(f.swapOut(1000, a.data(), 400).isOk());
    ASSERT_TRUE(f.read(1000, b.data(), 400).isOk());
    EXPECT_EQ(a, b);
    // Only the swaps count (not the checkpoints' exact reads and writes).
    ASSERT_TRUE(f.write(2000, a.data(), 400).isOk());
    EXPECT_EQ(f.bytesRead(), 4096);
    EXPECT_EQ(f.bytesWritten(), 400);
    // Just written through the page cache: its pages are there (dirty).
    const int64_t cached = f.cachedBytes();
    EXPECT_GT(cached, 0);
    // settle (the calibration's duplex phase) writes a range back and
    // drops it where the file system takes the advice: never more cached,
    // the bytes the same.
    ASSERT_TRUE(f.settle(0, 4096).isOk());
    EXPECT_LE(f.cachedBytes(), cached);
    ASSERT_TRUE(f.read(1000, b.data(), 400).isOk());
    EXPECT_EQ(a, b);
    // A range only read is only dropped: the bytes stay the same.
    ASSERT_TRUE(f.settle(0, 4096, /*written=*/false).isOk());
    ASSERT_TRUE(f.read(1000, b.data(), 400).isOk());
    EXPECT_EQ(a, b);
    Status st = f.read(4000, b.data(), 400);
    ASSERT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("outside its 4096 bytes"), std::string::npos) << st.message();
    EXPECT_FALSE(f.write(-4, a.data(), 4).isOk());
    // Reopened: a new file, zeros again.
    ASSERT_TRUE(f.open(dir, 3, 512).isOk());
    ASSERT_TRUE(f.read(0, b.data(), 400).isOk());
    EXPECT_EQ(b, std::vector<float>(100, 0.0f));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  SwapFile g;
  EXPECT_FALSE(g.settle(0, 64).isOk()); // not open
  Status st = g.open(dir + "/missing", 0, 64);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("is not a directory"), std::string::npos) << st.message();
  std::filesystem::remove_all(dir);
}

TEST(SwapFileTest, DirectIoMovesWholeBlocksPastThePageCache) {
  // [Note: swap file I/O]: with the plan's alignment the swaps move whole
  // blocks with O_DIRECT (the page cache holds none of the file), the
  // exact transfers bounce and keep their neighbours' bytes, and where
  // direct I/O is impossible "direct" fails by name and "auto" falls back
  // to buffered, saying why.
  std::string dir = tempPath("swapdirect");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directory(dir);
  constexpr int64_t kBlock = 4096;
  {
    SwapFile f;
    ASSERT_TRUE(f.open(dir, 0, 4 * kBlock, SwapIoMode::Auto, kBlock, true).isOk());
    if (!f.direct()) {
      std::filesystem::remove_all(dir);
      GTEST_SKIP() << "O_DIRECT is not available in " << dir << ": " << f.directNote();
    }
    EXPECT_TRUE(f.directNote().empty());
    struct Free {
      void operator()(void *p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, Free> a(
        static_cast<uint8_t *>(std::aligned_alloc(kBlock, 2 * kBlock))),
        b(static_cast<uint8_t *>(std::aligned_alloc(kBlock, 2 * kBlock)));
    for (int64_t i = 0; i < 2 * kBlock; ++i)
      a.get()[i] = (uint8_t)(i * 7 + 1);
    // 5000 state bytes: the swap moves 2 whole blocks, counts 5000.
    ASSERT_TRUE(f.swapOut(kBlock, a.get(), 5000).isOk());
    std::memset(b.get(), 0, 2 * kBlock);
    ASSERT_TRUE(f.swapIn(kBlock, b.get(), 5000).isOk());
    EXPECT_EQ(std::memcmp(a.get(), b.get(), 2 * kBlock), 0);
    EXPECT_EQ(f.bytesRead(), 5000);
    EXPECT_EQ(f.bytesWritten(), 5000);
    // Not on a block: refused by name, nothing moved.
    Status st = f.swapIn(100, b.get(), 5000);
    ASSERT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("whole 4096-byte blocks"), std::string::npos) << st.message();
    EXPECT_FALSE(f.swapIn(kBlock, b.get() + 64, 5000).isOk());
    // An exact write across a block boundary at an odd offset and address
    // (a checkpoint's) changes its own bytes only.
    std::vector<uint8_t> small(3000);
    for (size_t i = 0; i < small.size(); ++i)
      small[i] = (uint8_t)(250 - i % 200);
    ASSERT_TRUE(f.write(kBlock + 3001, small.data() + 1, 2999).isOk());
    std::vector<uint8_t> back(8000);
    ASSERT_TRUE(f.read(kBlock - 100, back.data() + 1, 7000).isOk());
    int64_t wrong = 0;
    for (int64_t i = 0; i < 7000; ++i) {
      int64_t at = kBlock - 100 + i; // file offset
      uint8_t want = at < kBlock ? 0
                     : at >= kBlock + 3001 && at < kBlock + 6000
                         ? small[(size_t)(at - kBlock - 3001 + 1)]
                     : at < kBlock + 2 * kBlock ? a.get()[at - kBlock]
                                                : 0;
      wrong += back[(size_t)i + 1] != want;
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(f.bytesRead(), 5000); // the exact transfers do not count
    EXPECT_FALSE(f.read(3 * kBlock, back.data(), 2 * kBlock).isOk()); // past the end
    // Nothing of the file in the page cache.
    EXPECT_EQ(f.cachedBytes(), 0);
    // Across the bounce buffer's 1 MiB chunks, both ends off a block.
    const int64_t big = 3 << 20, at = 3 * kBlock + 7, n = (2 << 20) + 100;
    ASSERT_TRUE(f.open(dir, 0, big, SwapIoMode::Direct, kBlock, true).isOk());
    ASSERT_TRUE(f.direct());
    std::vector<uint8_t> src((size_t)n), whole((size_t)big, 1);
    for (int64_t i = 0; i < n; ++i)
      src[(size_t)i] = (uint8_t)(i % 251 + 1);
    ASSERT_TRUE(f.write(at, src.data(), n).isOk());
    ASSERT_TRUE(f.read(0, whole.data(), big).isOk());
    int64_t bad = 0;
    for (int64_t i = 0; i < big; ++i)
      bad += whole[(size_t)i] != (i >= at && i < at + n ? src[(size_t)(i - at)] : 0);
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(f.cachedBytes(), 0);
  }
  {
    // No alignment in the plan, or staging not on blocks: auto says why.
    SwapFile f;
    ASSERT_TRUE(f.open(dir, 0, 4 * kBlock, SwapIoMode::Auto, 0, true).isOk());
    EXPECT_FALSE(f.direct());
    EXPECT_NE(f.directNote().find("no swap_alignment"), std::string::npos) << f.directNote();
    ASSERT_TRUE(f.open(dir, 0, 4 * kBlock, SwapIoMode::Auto, kBlock, false).isOk());
    EXPECT_FALSE(f.direct());
    EXPECT_NE(f.directNote().find("staging buffers are not on 4096-byte"), std::string::npos)
        << f.directNote();
    ASSERT_TRUE(f.open(dir, 0, 4 * kBlock + 64, SwapIoMode::Auto, kBlock, true).isOk());
    EXPECT_NE(f.directNote().find("not whole blocks of 4096"), std::string::npos) << f.directNote();
    Status st = f.open(dir, 0, 4 * kBlock, SwapIoMode::Direct, 0, true);
    ASSERT_FALSE(st.isOk());
    EXPECT_NE(st.message().find("--nvme-io direct"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("no swap_alignment"), std::string::npos) << st.message();
    EXPECT_FALSE(f.isOpen());
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  SwapIoMode m;
  EXPECT_TRUE(parseSwapIoMode("buffered", m) && m == SwapIoMode::Buffered);
  EXPECT_TRUE(parseSwapIoMode("direct", m) && m == SwapIoMode::Direct);
  EXPECT_FALSE(parseSwapIoMode("fast", m));
  std::filesystem::remove_all(dir);
}

TEST(ScheduleTest, WarmupThenCosine) {
  auto lr = [](const char *kind, double minLr, int64_t warmup, int64_t steps, int64_t t) {
    return scheduledLr(LrSchedule{kind, 1.0, minLr, warmup, steps, 0}, t);
  };
  EXPECT_DOUBLE_EQ(lr("constant", 0, 0, 10, 5), 1.0);
  EXPECT_DOUBLE_EQ(lr("constant", 0, 4, 10, 2), 0.5);
  EXPECT_DOUBLE_EQ(lr("cosine", 0.1, 0, 10, 10), 0.1);
  EXPECT_NEAR(lr("cosine", 0.0, 2, 12, 7), 0.5, 1e-12);
}

// Linear (Hugging Face's get_linear_schedule_with_warmup with a floor) and
// warmup-stable-decay: the warmup they share, the value at each end of the
// decay, a midpoint, and no step outside [min_lr, lr].
TEST(ScheduleTest, LinearAndWarmupStableDecay) {
  LrSchedule lin{"linear", 2.0, 0.5, 4, 24, 0};
  EXPECT_DOUBLE_EQ(scheduledLr(lin, 1), 0.5);   // 2 * 1 / 4
  EXPECT_DOUBLE_EQ(scheduledLr(lin, 4), 2.0);   // the peak, at the warmup's end
  EXPECT_DOUBLE_EQ(scheduledLr(lin, 14), 1.25); // half way: 0.5 + 1.5 * 10 / 20
  EXPECT_DOUBLE_EQ(scheduledLr(lin, 24), 0.5);  // the floor, at the last step
  LrSchedule wsd{"wsd", 2.0, 0.5, 4, 24, 6};
  EXPECT_DOUBLE_EQ(scheduledLr(wsd, 2), 1.0);
  for (int64_t t = 4; t <= 18; ++t) // stable until the last 6 steps
    EXPECT_DOUBLE_EQ(scheduledLr(wsd, t), 2.0) << "step " << t;
  EXPECT_DOUBLE_EQ(scheduledLr(wsd, 21), 1.25); // 0.5 + 1.5 * 3 / 6
  EXPECT_DOUBLE_EQ(scheduledLr(wsd, 24), 0.5);
  // The stable phase is the peak bit for bit (0.001 + 0.009 rounds to
  // 0.010000000000000002), as a constant schedule would give it.
  LrSchedule odd{"wsd", 0.01, 0.001, 0, 8, 3};
  for (int64_t t = 1; t <= 5; ++t)
    EXPECT_EQ(scheduledLr(odd, t), 0.01) << "step " << t;
  // wsd's other decay shapes over its last 6 steps, f = (t - 18) / 6 done:
  // cosine (1 + cos(pi f)) / 2 and 1-sqrt 1 - sqrt(f), the same stable
  // phase and ends.
  LrSchedule cosTail = wsd, sqrtTail = wsd;
  cosTail.decayShape = "cosine";
  sqrtTail.decayShape = "1-sqrt";
  EXPECT_DOUBLE_EQ(scheduledLr(cosTail, 21), 1.25);             // f = 1/2: (1 + 0) / 2
  EXPECT_DOUBLE_EQ(scheduledLr(cosTail, 20), 0.5 + 1.5 * 0.75); // f = 1/3: cos = 1/2
  EXPECT_DOUBLE_EQ(scheduledLr(sqrtTail, 19), 0.5 + 1.5 * (1 - std::sqrt(1.0 / 6)));
  EXPECT_DOUBLE_EQ(scheduledLr(sqrtTail, 22), 0.5 + 1.5 * (1 - std::sqrt(4.0 / 6)));
  for (const LrSchedule &s : {cosTail, sqrtTail}) {
    EXPECT_EQ(scheduledLr(s, 18), 2.0) << s.decayShape;
    EXPECT_DOUBLE_EQ(scheduledLr(s, 24), 0.5) << s.decayShape;
  }
  // 1-sqrt drops fastest at first, cosine slowest (f = 1/6).
  EXPECT_LT(scheduledLr(sqrtTail, 19), scheduledLr(wsd, 19));
  EXPECT_GT(scheduledLr(cosTail, 19), scheduledLr(wsd, 19));
  for (const LrSchedule &s : {lin, wsd, cosTail, sqrtTail})
    for (int64_t t = 5; t <= 24; ++t) {
      EXPECT_LE(scheduledLr(s, t), scheduledLr(s, t - 1)) << s.kind << " step " << t;
      EXPECT_GE(scheduledLr(s, t), 0.5) << s.kind << " step " << t;
    }
}

TEST(DataTest, TokenFileErrors) {
  Plan plan;
  plan.buffers.resize(2);
  for (int i = 0; i < 2; ++i) {
    plan.buffers[i].id = i;
    plan.buffers[i].shape = {2, 4};
    plan.buffers[i].dtype = DType::I32;
    plan.buffers[i].bytes = 32;
  }
  plan.inputs = {{"input", "input", 0, "", 50}, {"target", "target", 1, "", 50}};
  std::unique_ptr<DataSource> src;
  std::string path = tempPath("tokens.bin");
  ASSERT_TRUE(writeTokenFile(path, {1, 2, 3}).isOk());
  Status st = makeDataSource(path, plan, 0, 1, 1, src);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("fewer than one window of 5"), std::string::npos) << st.message();
  std::vector<uint16_t> toks(80);
  for (int i = 0; i < 80; ++i)
    toks[i] = (uint16_t)(i % 60); // ids 50..59 exceed the vocabulary
  ASSERT_TRUE(writeTokenFile(path, toks).isOk());
  ASSERT_TRUE(makeDataSource(path, plan, 0, 1, 1, src).isOk());
  std::vector<uint8_t> mem(64);
  auto addr = [](void *ctx, int64_t id) { return static_cast<uint8_t *>(ctx) + id * 32; };
  ASSERT_TRUE(src->fill(1, addr, mem.data()).isOk());
  const int32_t *x = reinterpret_cast<const int32_t *>(mem.data());
  const int32_t *y = x + 8;
  EXPECT_EQ(x[5], 5);                  // second window starts at token 4
  EXPECT_EQ(y[5], 6);                  // targets are shifted by one
  st = src->fill(7, addr, mem.data()); // windows 12, 13 reach ids >= 50
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("outside the model's vocabulary of 50"), std::string::npos);
  std::ofstream(path) << "not a token file";
  EXPECT_NE(makeDataSource(path, plan, 0, 1, 1, src).message().find("too short"),
            std::string::npos);
  std::remove(path.c_str());
}

TEST(PlanTest, RejectsWhatIsWrong) {
  Plan plan;
  EXPECT_NE(parsePlan("{\"format\": \"other\"}", plan).message().find("expected 'fsdp-plan'"),
            std::string::npos);
  plan = Plan();
  EXPECT_NE(parsePlan("{\"format\": \"fsdp-plan\", \"version\": 7}", plan)
                .message()
                .find("plan version 7 is newer than this runtime (2)"),
            std::string::npos);
  // A feature it lacks refuses the plan by name, before the rest is read.
  plan = Plan();
  EXPECT_NE(parsePlan("{\"format\": \"fsdp-plan\", \"version\": 2, \"requires\": "
                      "[\"optimizer-state-bf16\", \"zero-4\"]}",
                      plan)
                .message()
                .find("plan requires the feature 'zero-4', which this runtime does not have"),
            std::string::npos);
  plan = Plan();
  EXPECT_NE(parsePlan("{\"format\": \"fsdp-plan\", \"vers", plan).message().find("not valid JSON"),
            std::string::npos);
  plan = Plan();
  EXPECT_NE(parsePlan("{\"format\": \"fsdp-plan\", \"version\": 1}", plan)
                .message()
                .find("is missing \"world_size\""),
            std::string::npos);
}

/// This binary links runtime/core alone (no backend): the whole plan
/// validation, every op's shape rules included, lives in core.
TEST(PlanTest, CoreChecksEveryOpWithoutABackend) {
  int compute = 0;
  for (const OpSchema &op : kOps)
    if (op.kind == OpKind::Compute) {
      ++compute;
      EXPECT_TRUE(hasOpRule(op.name)) << op.name;
    }
  EXPECT_GE(compute, 50);
  Plan plan;
  for (int i = 0; i < 3; ++i) {
    Buffer b;
    b.id = i;
    b.shape = i == 1 ? std::vector<int64_t>{4, 5} : std::vector<int64_t>{2, 3};
    b.bytes = shapeNumel(b.shape) * 4;
    plan.buffers.push_back(b);
  }
  Instruction mm;
  mm.op = "matmul";
  mm.in = {0, 1};
  mm.out = {2};
  EXPECT_NE(checkInstruction(plan, mm).message().find("contracting sizes"), std::string::npos)
      << checkInstruction(plan, mm).message();
  Instruction ag = mm;
  ag.op = "all_gather";
  ag.in = {0};
  plan.worldSize = plan.meshShards = 2;
  EXPECT_NE(checkInstruction(plan, ag).message().find("do not fit"), std::string::npos)
      << checkInstruction(plan, ag).message(); // 6 -> 6 over 2 ranks
  plan.buffers[2].shape = {2, 6};
  plan.buffers[2].bytes = 48;
  EXPECT_TRUE(checkInstruction(plan, ag).isOk()) << checkInstruction(plan, ag).message();
  Instruction arity = mm;
  arity.in = {0};
  EXPECT_NE(checkInstruction(plan, arity).message().find("expected 2-3 inputs"), std::string::npos)
      << checkInstruction(plan, arity).message(); // matmul: an optional accumulator
}

/// checkInstruction's message ("" when it accepts the instruction).
std::string checkMessage(const Plan &plan, const Instruction &inst) {
  Status st = checkInstruction(plan, inst);
  return st.isOk() ? std::string() : st.message();
}

/// checkInstruction refuses `inst` with a message containing `what`.
void expectRefused(const Plan &plan, const Instruction &inst, const char *what) {
  std::string m = checkMessage(plan, inst);
  EXPECT_NE(m.find(what), std::string::npos) << "\"" << m << "\" lacks \"" << what << "\"";
}

/// The mesh's node size (hierarchical qgZ): read from "mesh", checked
/// (1 < node < shards, dividing shards), and the groups "node" and "cross"
/// it makes, refused by collectives without it.
TEST(PlanTest, MeshNodeSplitsShardGroups) {
  using nlohmann::json;
  json buffers = json::array();
  testplans::addF32Buffer(buffers, "a", "activation", "device", 0, 8, false, true, -1, 0);
  testplans::addF32Buffer(buffers, "b", "activation", "device", 64, 8, false, true, -1, 0);
  testplans::addF32Buffer(buffers, "loss", "activation", "device", 128, 1, true, true, -1, 0);
  testplans::OneRankPlan p;
  p.arenaBytes = 192;
  p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 2}}};
  auto planWith = [&](json mesh) {
    json j = json::parse(testplans::oneRankPlan(p, buffers, json::array()));
    j["world_size"] = 16;
    j["mesh"] = mesh;
    return j.dump();
  };
  Plan plan;
  Status st = parsePlan(planWith({{"replicas", 2}, {"shards", 8}, {"node", 2}}), plan);
  ASSERT_TRUE(st.isOk()) << st.message();
  EXPECT_EQ(plan.meshNode, 2);
  EXPECT_EQ(plan.groupSize("node"), 2);
  EXPECT_EQ(plan.groupSize("cross"), 4);
  Instruction a2a;
  a2a.op = "all_to_all";
  a2a.in = {0};
  a2a.out = {1};
  for (const char *g : {"node", "cross"}) {
    a2a.attrs["group"] = g;
    EXPECT_TRUE(checkInstruction(plan, a2a).isOk()) << g << ": " << checkMessage(plan, a2a);
  }
  for (int64_t bad : {1, 3, 8, 16, -2}) {
    plan = Plan();
    std::string m =
        parsePlan(planWith({{"replicas", 2}, {"shards", 8}, {"node", bad}}), plan).message();
    const std::string want = bad < 0 ? "node" // the reader's range check
                                     : "plan: mesh node of " + std::to_string(bad) +
                                           " ranks: expected 1 < node < shards (8) dividing it";
    EXPECT_NE(m.find(want), std::string::npos) << bad << ": " << m;
  }
  // Without a node size: no such groups.
  plan = Plan();
  st = parsePlan(planWith({{"replicas", 2}, {"shards", 8}}), plan);
  ASSERT_TRUE(st.isOk()) << st.message();
  EXPECT_EQ(plan.meshNode, 0);
  EXPECT_EQ(plan.groupSize("node"), 0);
  EXPECT_EQ(plan.groupSize("cross"), 0);
  for (const char *g : {"node", "cross"}) {
    a2a.attrs["group"] = g;
    expectRefused(plan, a2a, "(with a mesh node size) \"node\" or \"cross\", found \"");
  }
}

/// [Note: node comm stream] and [Note: async windows]: a collective marked
/// "stream": "node" is on a stream of its own, so a collective on the comm
/// stream that reads what it writes before its wait races it and is
/// refused; on one stream the two run in order and the plan loads.
TEST(PlanTest, NodeCommStreamIsALaneOfItsOwn) {
  using nlohmann::json;
  json buffers = json::array();
  testplans::addF32Buffer(buffers, "a", "activation", "device", 0, 8, false, true, -1, 0);
  testplans::addF32Buffer(buffers, "b", "activation", "device", 64, 8, false, true, -1, 0);
  testplans::addF32Buffer(buffers, "c", "activation", "device", 128, 8, false, true, -1, 0);
  testplans::addF32Buffer(buffers, "loss", "activation", "device", 192, 1, true, true, -1, 0);
  testplans::OneRankPlan p;
  p.arenaBytes = 256;
  p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 3}}};
  auto planWith = [&](json nodeAttrs, json secondAttrs = {{"group", "cross"}}) {
    json program = json::array();
    program.push_back({{"op", "all_to_all"}, {"in", {0}}, {"out", {1}}, {"attrs", nodeAttrs}});
    program.push_back({{"op", "all_to_all"}, {"in", {1}}, {"out", {2}}, {"attrs", secondAttrs}});
    program.push_back({{"op", "wait"}, {"in", {1}}, {"out", {1}}});
    json j = json::parse(testplans::oneRankPlan(p, buffers, program));
    j["world_size"] = 16;
    j["mesh"] = {{"replicas", 2}, {"shards", 8}, {"node", 2}};
    return j.dump();
  };
  Plan plan;
  Status st = parsePlan(planWith({{"group", "node"}, {"async", true}}), plan);
  EXPECT_TRUE(st.isOk()) << "one comm stream: " << st.message();
  plan = Plan();
  st = parsePlan(planWith({{"group", "node"}, {"async", true}, {"stream", "node"}}), plan);
  ASSERT_FALSE(st.isOk()) << "a comm-stream read of a node-stream collective's output in its "
                             "window was accepted";
  EXPECT_NE(st.message().find("instruction #1 (all_to_all) reads buffer 1 (b), which async "
                              "instruction #0 (all_to_all, on the node comm stream) writes until "
                              "its wait #2: the two are not ordered"),
            std::string::npos)
      << st.message();
  // The node group's collectives on both streams could run at once on
  // its one communicator: refused, naming both.
  plan = Plan();
  st = parsePlan(planWith({{"group", "node"}, {"stream", "node"}}, {{"group", "node"}}), plan);
  ASSERT_FALSE(st.isOk()) << "node-group collectives on two streams were accepted";
  EXPECT_NE(st.message().find("instruction #1 (all_to_all over group node) runs on the comm "
                              "stream but instruction #0 (all_to_all over the same group) on "
                              "the node stream"),
            std::string::npos)
      << st.message();
  plan = Plan();
  st = parsePlan(
      planWith({{"group", "node"}, {"stream", "node"}}, {{"group", "node"}, {"stream", "node"}}),
      plan);
  EXPECT_TRUE(st.isOk()) << "both on the node stream: " << st.message();
  // Marking a collective of another group is refused by name.
  plan = Plan();
  st = parsePlan(planWith({{"group", "cross"}, {"async", true}, {"stream", "node"}}), plan);
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("attribute stream: expected \"comm\" (\"node\" is for group node "
                              "only), found \"node\""),
            std::string::npos)
      << st.message();
}

/// An accumulator has its result's dtype (the dialect's verifiers): a plan
/// whose accumulator differs is refused by name before widening would make
/// both f32, for every op that takes one.
TEST(PlanTest, AccumulatorsHaveTheirResultsDtype) {
  // 0 a [4, 3], 1 b [3, 2], 2 / 3 the product [4, 2] f32 / bf16,
  // 4 dy [4, 2] (bias grad [2]: 5 f32, 6 bf16), 7 x [4, 3], 8 / 9 dW [2, 3] f32 / bf16
  Plan plan;
  std::vector<std::pair<std::vector<int64_t>, DType>> bufs{
      {{4, 3}, DType::BF16}, {{3, 2}, DType::BF16}, {{4, 2}, DType::F32}, {{4, 2}, DType::BF16},
      {{4, 2}, DType::BF16}, {{2}, DType::F32},     {{2}, DType::BF16},   {{4, 3}, DType::BF16},
      {{2, 3}, DType::F32},  {{2, 3}, DType::BF16}};
  for (size_t i = 0; i < bufs.size(); ++i) {
    Buffer b;
    b.id = (int64_t)i;
    b.shape = bufs[i].first;
    b.dtype = bufs[i].second;
    b.bytes = shapeNumel(b.shape) * dtypeSize(b.dtype);
    plan.buffers.push_back(b);
  }
  auto message = [&](const Instruction &inst) { return checkMessage(plan, inst); };
  auto has = [&](const Instruction &inst, const char *what) { expectRefused(plan, inst, what); };
  Instruction mm{"matmul", {0, 1, 2}, {2}, {}}; // an f32 sum of a bf16 product
  EXPECT_EQ(message(mm), "");
  mm.in[2] = 3;
  has(mm, "matmul: expected accumulator (operand 2) of its result's dtype f32, "
          "found bf16");
  Instruction mbg{"matmul_bias_grad", {4, 7, 8, 5}, {8, 5}, {{"transpose_lhs", true}}};
  EXPECT_EQ(message(mbg), "");
  mbg.in[3] = 6;
  has(mbg, "matmul_bias_grad: expected accumulator (operand 3) of its result's "
           "dtype f32, found bf16");
  mbg.in = {4, 7, 9, 5};
  has(mbg, "matmul_bias_grad: expected accumulator (operand 2) of its result's "
           "dtype f32, found bf16");
}

/// LAMB's plan rules: the unit's segments, the sums' size, f32 operands,
/// a decayed prefix that ends at a parameter bound, the optional operands.
TEST(PlanTest, ChecksTheLambOps) {
  // 0 p, 1 g, 2 m, 3 v [24]; 4 the sums [8]; 5 lr, 6 step, 7 skip, 8 scale;
  // 9 sums of the wrong size [6]; 10 a bf16 gradient [24]
  Plan plan;
  std::vector<std::vector<int64_t>> shapes{{24}, {24}, {24}, {24}, {8}, {}, {}, {}, {}, {6}, {24}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    Buffer b;
    b.id = (int64_t)i;
    b.shape = shapes[i];
    b.dtype = i == 10 ? DType::BF16 : DType::F32;
    b.bytes = shapeNumel(b.shape) * dtypeSize(b.dtype);
    plan.buffers.push_back(b);
  }
  auto message = [&](const Instruction &inst) { return checkMessage(plan, inst); };
  auto has = [&](const Instruction &inst, const char *what) { expectRefused(plan, inst, what); };
  nlohmann::json attrs = {
      {"segments", {0, 6, 10, 13, 20}}, {"decay_numel", 13}, {"shard_stride", 24}, {"eps", 1e-6},
      {"skip_nonfinite", true},         {"grad_scale", true}};
  Instruction update{"lamb_update", {0, 1, 2, 3, 4, 5, 6, 7, 8}, {0, 2, 3}, attrs};
  EXPECT_EQ(message(update), "");
  Instruction norms{"lamb_norms", {0, 1, 2, 3, 6, 8}, {4}, attrs};
  norms.attrs.erase("skip_nonfinite");
  EXPECT_EQ(message(norms), "");
  // shard_stride and decay_numel each alone, and neither
  Instruction bare = norms;
  bare.attrs.erase("decay_numel");
  EXPECT_EQ(message(bare), "");
  bare.attrs.erase("shard_stride");
  EXPECT_EQ(message(bare), "");
  bare.attrs["decay_numel"] = 20;
  EXPECT_EQ(message(bare), "");
  bare.attrs["decay_numel"] = 30; // the padding decays too
  EXPECT_EQ(message(bare), "");

  Instruction bad = update;
  bad.attrs["segments"] = {0, 6, 6, 13, 20};
  has(bad, "lamb_update: segments must rise strictly from 0");
  bad.attrs["segments"] = {1, 6, 10, 13, 20};
  has(bad, "segments must rise strictly from 0");
  bad.attrs["segments"] = {0};
  has(bad, "segments must rise strictly from 0");
  bad.attrs["segments"] = {0, 6, 10, (int64_t(1) << 48) + 1};
  has(bad, "to at most 2^48");
  bad.attrs["segments"] = {0, 6.5, 10};
  has(bad, "attribute segments: expected an array of at most 4096 integers");
  bad.attrs.erase("segments");
  has(bad, "lamb_update: missing attribute segments");
  bad = update;
  bad.attrs["segments"] = {0, 6, 10, 20}; // K = 3: 6 sums
  has(bad, "lamb_update: expected per-parameter sums (2 x the segments' K) of shape 6, found 8");
  bad = norms;
  bad.out = {9};
  has(bad, "lamb_norms: expected per-parameter sums (2 x the segments' K) of shape 8, found 6");
  bad = update;
  bad.in[1] = 10;
  has(bad, "lamb_update: expected f32 operands only, found bf16 operand 1 (the gradient)");
  bad = norms;
  bad.in[1] = 10;
  has(bad, "lamb_norms: expected f32 operands only, found bf16 operand 1");
  bad = update;
  bad.attrs["decay_numel"] = 8;
  has(bad, "lamb_update: decay_numel = 8 falls inside parameter 1 [6, 10)");
  bad.attrs["decay_numel"] = -1;
  has(bad, "decay_numel must be an integer in [0, 2^48]");
  bad = update;
  bad.attrs["shard_stride"] = 12;
  has(bad, "shard_stride must be 0 (the whole unit) or the operand's 24 elements");
  bad = norms;
  bad.attrs["skip_nonfinite"] = true; // (7 inputs: the schema's arity refuses them)
  has(bad, "lamb_norms: skip_nonfinite is lamb_update's");
  bad = update;
  bad.attrs.erase("skip_nonfinite"); // the skip operand is now unmarked
  has(bad, "lamb_update: 9 operands, expected 8");
  bad = update;
  bad.in[5] = 4; // lr: the sums
  has(bad, "lamb_update: expected scalar lr/step operands");
  bad = update;
  bad.out = {0, 2, 4};
  has(bad, "lamb_update: result 2 has the wrong size");
}

} // namespace

namespace {

/// A one-rank offloaded plan: x (device) -> g = x * x -> to_host -> an
/// adamw_update of a host parameter, marked async with `updateAttrs`, and
/// its wait when `wait`; `mulAttrs` on the device mul; `beforeWait` (with
/// `wait`) placed between the update and its wait.
std::string offloadedPlan(const nlohmann::json &updateAttrs, bool wait,
                          const nlohmann::json &mulAttrs = nlohmann::json::object(),
                          const nlohmann::json &beforeWait = nullptr) {
  using nlohmann::json;
  const int64_t n = 16, vb = 64;
  json program = {{{"op", "mul"}, {"in", {0, 0}}, {"out", {1}}, {"attrs", mulAttrs}},
                  {{"op", "to_host"}, {"in", {1}}, {"out", {7}}},
                  {{"op", "adamw_update"},
                   {"in", {3, 7, 4, 5, 6, 8}},
                   {"out", {3, 4, 5}},
                   {"attrs", updateAttrs}}};
  if (wait && !beforeWait.is_null())
    program.push_back(beforeWait);
  if (wait)
    program.push_back({{"op", "wait"}, {"in", {3}}, {"out", {3}}});
  program.push_back(
      {{"op", "fill"}, {"in", json::array()}, {"out", {2}}, {"attrs", {{"value", 1.0}}}});
  const int64_t end = (int64_t)program.size();
  const int64_t waitAt = beforeWait.is_null() ? 3 : 4;
  json buffers = json::array();
  auto buf = [&](const char *name, const char *kind, bool host, int64_t offset, bool scalar,
                 int64_t first, int64_t last) {
    bool persistent = first < 0;
    testplans::addF32Buffer(buffers, name, kind, host ? "host" : "device", offset, n, scalar,
                            persistent, persistent ? -1 : first, persistent ? end : last);
  };
  buf("x", "input", false, 0, false, -1, 0);                    // 0
  buf("g", "grad", false, vb, false, 0, 1);                     // 1
  buf("loss", "activation", false, 2 * vb, true, end - 1, end); // 2
  buf("p", "param", true, 0, false, -1, 0);                     // 3
  buf("m", "state", true, vb, false, -1, 0);                    // 4
  buf("v", "state", true, 2 * vb, false, -1, 0);                // 5
  buf("lr", "input", true, 3 * vb, true, -1, 0);                // 6
  buf("gh", "grad", true, 4 * vb, false, 1, wait ? waitAt : 2); // 7
  buf("step", "input", true, 5 * vb, true, -1, 0);              // 8
  testplans::OneRankPlan p;
  p.arenaBytes = 3 * vb;
  p.hostArenaBytes = 6 * vb;
  p.units = {
      {{"name", "u"}, {"flat_numel", n}, {"padded_numel", n}, {"shard_numel", n}, {"buffer", -1}}};
  p.params = {{{"name", "w"},
               {"shape", {n}},
               {"dtype", "f32"},
               {"init", "zeros"},
               {"scale", 0.0},
               {"trainable", true},
               {"unit", 0},
               {"flat_offset", 0},
               {"buffer", 3}}};
  p.inputs = {{{"name", "x"}, {"role", "input"}, {"buffer", 0}},
              {{"name", "lr"}, {"role", "lr"}, {"buffer", 6}},
              {{"name", "step"}, {"role", "step"}, {"buffer", 8}}};
  p.outputs = {{{"name", "loss"}, {"role", "loss"}, {"buffer", 2}}};
  return testplans::oneRankPlan(p, buffers, program);
}

} // namespace

/// [Note: async windows] Nothing on another stream may write what an async
/// instruction reads, nor touch what it writes, between its issue and its
/// wait: here a host fill of the gradient copy the async update still
/// reads, and a blocking host update rewriting its parameter, are refused
/// naming both instructions; without them the plan loads.
TEST(PlanTest, AsyncWindowsRefuseRacesBetweenStreams) {
  nlohmann::json async = {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"async", true}};
  nlohmann::json fill = {
      {"op", "fill"}, {"in", nlohmann::json::array()}, {"out", {7}}, {"attrs", {{"value", 0.0}}}};
  Plan plan;
  Status st = parsePlan(offloadedPlan(async, true, nlohmann::json::object(), fill), plan);
  ASSERT_FALSE(st.isOk()) << "a write of an async update's operand before its wait was accepted";
  EXPECT_NE(st.message().find("instruction #3 (fill) writes buffer 7 (gh), which async "
                              "instruction #2 (adamw_update, on the host stream) reads until "
                              "its wait #4: the two are not ordered"),
            std::string::npos)
      << st.message();
  nlohmann::json blocking = {{"op", "adamw_update"},
                             {"in", {3, 7, 4, 5, 6, 8}},
                             {"out", {3, 4, 5}},
                             {"attrs", {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}}}};
  plan = Plan();
  st = parsePlan(offloadedPlan(async, true, nlohmann::json::object(), blocking), plan);
  ASSERT_FALSE(st.isOk()) << "a second update of the same parameter in the window was accepted";
  EXPECT_NE(st.message().find("instruction #3 (adamw_update) writes buffer 3 (p), which async "
                              "instruction #2 (adamw_update, on the host stream) writes"),
            std::string::npos)
      << st.message();
  // The fill on the device's loss after the wait is in every variant:
  // without the racing instruction the plan loads.
  plan = Plan();
  st = parsePlan(offloadedPlan(async, true), plan);
  EXPECT_TRUE(st.isOk()) << st.message();
}

/// "async": true belongs to work off the compute stream: collectives,
/// copies between the arenas and host instructions (fsdp-offload's
/// update, joined by a wait); on device compute it is refused at load.
TEST(PlanTest, AsyncIsForCollectivesCopiesAndHostInstructions) {
  nlohmann::json adam = {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}};
  Plan plan;
  Status st = parsePlan(offloadedPlan(adam, false), plan);
  EXPECT_TRUE(st.isOk()) << st.message();
  nlohmann::json async = adam;
  async["async"] = true;
  plan = Plan();
  st = parsePlan(offloadedPlan(async, true), plan);
  EXPECT_TRUE(st.isOk()) << "an async host update and its wait: " << st.message();
  plan = Plan();
  st = parsePlan(offloadedPlan(adam, false, {{"async", true}}), plan);
  ASSERT_FALSE(st.isOk()) << "async device compute was accepted";
  EXPECT_NE(st.message().find("instruction #0 (mul) is marked \"async\": true, but async is "
                              "for collectives, copies between the arenas (to_host / "
                              "to_device) and host instructions"),
            std::string::npos)
      << st.message();
  plan = Plan();
  EXPECT_TRUE(parsePlan(offloadedPlan(adam, false, {{"async", false}}), plan).isOk())
      << "async false is the default";
  plan = Plan();
  async["async"] = "yes";
  st = parsePlan(offloadedPlan(async, true), plan);
  EXPECT_NE(st.message().find("attribute async: expected"), std::string::npos) << st.message();
}
