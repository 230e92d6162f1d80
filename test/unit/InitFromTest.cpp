//===- InitFromTest.cpp - lazy checkpoint reading for --init-from ---------===//
//
// The header-only safetensors reader keeps every check of the whole-file
// one; BF16 and F16 widen to f32 exactly and F64 rounds to nearest, over
// any element range; a slice of a 4 GiB (sparse) file is read without
// reading the file; Hugging Face indexes resolve and every inconsistency
// is an error naming the file and the tensor.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Bf16.h"
#include "runtime/core/InitFrom.h"
#include "runtime/core/SafeTensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sys/resource.h>
#include <unistd.h>

using namespace fsdp;

namespace {

namespace fs = std::filesystem;

/// A fresh directory for one test, removed with it.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string &name) {
    path = (fs::temp_directory_path() /
            ("fsdp-initfrom-test-" + std::to_string(::getpid()) + "-" + name))
               .string();
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string &f) const { return path + "/" + f; }
};

template <typename T> Tensor tensorOf(DType dtype, std::vector<int64_t> shape,
                                      const std::vector<T> &v) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(v.size() * sizeof(T));
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[i] = (char)(v >> (8 * i));
  return s;
}

/// A safetensors file written by hand (dtypes writeSafeTensors cannot
/// write, such as F64): header JSON and data.
void writeRaw(const std::string &path, const std::string &header,
              const std::string &data) {
  std::ofstream out(path, std::ios::binary);
  out << le64(header.size()) << header << data;
}

void writeText(const std::string &path, const std::string &text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::string openError(const std::string &path) {
  std::unique_ptr<CheckpointReader> r;
  Status st = CheckpointReader::open(path, r);
  return st.isOk() ? std::string("OK") : st.message();
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << (msg)

TEST(SafeTensorsHeaderTest, ReadsOnlyTheHeaderWithEveryCheck) {
  TempDir dir("header");
  std::string path = dir / "a.safetensors";
  TensorMap m;
  m["a"] = tensorOf<float>(DType::F32, {2, 3}, {1, 2, 3, 4, 5, 6});
  m["b"] = tensorOf<uint16_t>(DType::BF16, {4}, {1, 2, 3, 4});
  ASSERT_TRUE(writeSafeTensors(path, m, {{"format", "pt"}}).isOk());
  SafeTensorsHeader h;
  Status st = readSafeTensorsHeader(path, h);
  ASSERT_TRUE(st.isOk()) << st.message();
  EXPECT_EQ(h.fileSize, fs::file_size(path));
  ASSERT_EQ(h.tensors.size(), 2u);
  const TensorEntry &a = h.tensors.at("a"), &b = h.tensors.at("b");
  EXPECT_EQ(a.dtype, "F32");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.numel(), 6);
  EXPECT_EQ(b.dtype, "BF16");
  EXPECT_EQ(b.elementSize, 2);
  // The ranges are absolute: the bytes there are the tensors'.
  std::ifstream in(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(all.substr(a.begin, a.end - a.begin),
            std::string(m["a"].data.begin(), m["a"].data.end()));
  EXPECT_EQ(all.substr(b.begin, b.end - b.begin),
            std::string(m["b"].data.begin(), m["b"].data.end()));
  EXPECT_EQ(b.end, h.fileSize);

  // Truncated data: refused from the header and the size alone.
  fs::resize_file(path, h.fileSize - 2);
  st = readSafeTensorsHeader(path, h);
  ASSERT_FALSE(st.isOk());
  EXPECT_HAS(st.message(), "truncated");
  EXPECT_HAS(st.message(), "a.safetensors");

  // The whole-file reader's checks, on the header reader: the same inputs
  // the fuzz regression suite holds.
  auto headerError = [&](const std::string &header, const std::string &data) {
    writeRaw(path, header, data);
    SafeTensorsHeader hh;
    Status s = readSafeTensorsHeader(path, hh);
    return s.isOk() ? std::string("OK") : s.message();
  };
  EXPECT_HAS(headerError("[]", ""), "expected a JSON object");
  EXPECT_HAS(headerError("{\"a\":1", ""), "not valid JSON");
  EXPECT_HAS(headerError("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
                         "\"data_offsets\":[0,0]}}", ""),
             "needs more than");
  EXPECT_HAS(headerError("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
                         "\"data_offsets\":[18446744073709551615,18446744073709551615]}}",
                         "abcd"),
             "past the data section");
  EXPECT_HAS(headerError("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                         std::string(8, '\0')),
             "overlap");
  EXPECT_HAS(headerError("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                         std::string(8, '\0')),
             "needs 4");
  EXPECT_HAS(headerError("{\"w\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                         "a"),
             "unsupported");
  {
    std::string h = le64(UINT64_MAX) + "{}";
    writeText(path, h);
    SafeTensorsHeader hh;
    EXPECT_HAS(readSafeTensorsHeader(path, hh).message(), "header length");
  }
  // Every safetensors dtype is accepted by the header reader; the
  // whole-file reader keeps its plan dtypes only.
  std::string f64 = "{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}";
  EXPECT_EQ(headerError(f64, std::string(8, '\0')), "OK");
  TensorMap whole;
  Status s = readSafeTensors(path, whole);
  ASSERT_FALSE(s.isOk());
  EXPECT_HAS(s.message(), "unsupported");

  SafeTensorsHeader hh;
  EXPECT_HAS(readSafeTensorsHeader(dir / "none.safetensors", hh).message(), "cannot open");
  EXPECT_HAS(readSafeTensorsHeader(dir.path, hh).message(), "not a regular file");
}

/// F16 -> f32 computed independently of Bf16.h: the value's definition.
float halfReference(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float mag;
  if (exp == 0)
    mag = std::ldexp((float)mant, -24);
  else if (exp == 31)
    mag = mant ? NAN : INFINITY;
  else
    mag = std::ldexp((float)(mant | 0x400), exp - 25);
  return sign ? -mag : mag;
}

TEST(InitFromTest, WidensBf16AndF16ExactlyAndRoundsF64) {
  TempDir dir("widen");
  // Every 16-bit pattern, as BF16 and as F16.
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i)
    all[i] = (uint16_t)i;
  TensorMap m;
  m["bf"] = tensorOf(DType::BF16, {256, 256}, all);
  m["h"] = tensorOf(DType::F16, {65536}, all);
  std::string path = dir / "narrow.safetensors";
  ASSERT_TRUE(writeSafeTensors(path, m).isOk());
  std::unique_ptr<CheckpointReader> r;
  Status st = CheckpointReader::open(path, r);
  ASSERT_TRUE(st.isOk()) << st.message();
  std::vector<float> out(65536);
  ASSERT_TRUE(r->readF32("bf", 0, 65536, out.data()).isOk());
  for (int i = 0; i < 65536; ++i)
    ASSERT_EQ(bits(out[i]), (uint32_t)i << 16) << "bf16 pattern " << i;
  ASSERT_TRUE(r->readF32("h", 0, 65536, out.data()).isOk());
  for (int i = 0; i < 65536; ++i) {
    float ref = halfReference((uint16_t)i);
    if (std::isnan(ref))
      ASSERT_TRUE(std::isnan(out[i])) << "f16 pattern " << i;
    else
      ASSERT_EQ(bits(out[i]), bits(ref)) << "f16 pattern " << i;
  }
  // A range in the middle reads those elements only.
  std::vector<float> part(7, -1.0f);
  ASSERT_TRUE(r->readF32("bf", 1001, 5, part.data()).isOk());
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(bits(part[i]), (uint32_t)(1001 + i) << 16);
  EXPECT_EQ(part[5], -1.0f);
  Status past = r->readF32("h", 65530, 7, part.data());
  ASSERT_FALSE(past.isOk());
  EXPECT_HAS(past.message(), "'h'");

  // F64 rounds to the nearest f32, ties to even, as static_cast and
  // torch's copy_ do.
  std::vector<double> d{0.1, 1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24),
                        1e39, -1e39, 1e-45, -0.0, -2.5};
  std::vector<uint32_t> want{0x3dcccccd, 0x3f800000, 0x3f800002, 0x7f800000,
                             0xff800000, 0x00000001, 0x80000000, 0xc0200000};
  std::string data(reinterpret_cast<const char *>(d.data()), d.size() * 8);
  std::string f64 = dir / "f64.safetensors";
  writeRaw(f64, "{\"__metadata__\":{\"format\":\"pt\"},\"d\":{\"dtype\":\"F64\",\"shape\":[2,4],"
                "\"data_offsets\":[0,64]}}",
           data);
  ASSERT_TRUE(CheckpointReader::open(f64, r).isOk());
  ASSERT_TRUE(r->readF32("d", 0, 8, out.data()).isOk());
  for (size_t i = 0; i < d.size(); ++i)
    EXPECT_EQ(bits(out[i]), want[i]) << "f64 " << d[i];
  ASSERT_TRUE(r->readF32("d", 3, 2, out.data()).isOk());
  EXPECT_EQ(bits(out[0]), want[3]);
  EXPECT_EQ(bits(out[1]), want[4]);

  // Integers are not converted: an error naming the tensor and the dtype.
  m.clear();
  m["steps"] = tensorOf<int32_t>(DType::I32, {2}, {1, 2});
  std::string ints = dir / "int.safetensors";
  ASSERT_TRUE(writeSafeTensors(ints, m).isOk());
  ASSERT_TRUE(CheckpointReader::open(ints, r).isOk());
  st = r->readF32("steps", 0, 2, out.data());
  ASSERT_FALSE(st.isOk());
  EXPECT_HAS(st.message(), "'steps'");
  EXPECT_HAS(st.message(), "I32");
}

long maxRssKiB() {
  rusage u;
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

TEST(InitFromTest, ReadsASliceOfAHugeFileWithoutReadingTheFile) {
  // A 4 GiB tensor in a sparse file: the header check and a slice at its
  // end must not read (or allocate) the file. Whole-file reading would
  // raise this process's peak RSS by 4 GiB or more.
  TempDir dir("huge");
  std::string path = dir / "huge.safetensors";
  const uint64_t n = uint64_t(1) << 30;
  std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
                       "],\"data_offsets\":[0," + std::to_string(4 * n) + "]}}";
  writeText(path, le64(header.size()) + header);
  uint64_t dataStart = 8 + header.size();
  int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, (off_t)(dataStart + 4 * n)), 0);
  float tail[4] = {1.5f, -2.0f, 3.25f, 4.0f};
  ASSERT_EQ(::pwrite(fd, tail, 16, (off_t)(dataStart + 4 * (n - 4))), 16);
  ::close(fd);

  long before = maxRssKiB();
  std::unique_ptr<CheckpointReader> r;
  Status st = CheckpointReader::open(path, r);
  ASSERT_TRUE(st.isOk()) << st.message();
  std::vector<float> out(6);
  ASSERT_TRUE(r->readF32("w", (int64_t)n - 6, 6, out.data()).isOk());
  EXPECT_EQ(out, (std::vector<float>{0, 0, 1.5f, -2.0f, 3.25f, 4.0f}));
  long grown = maxRssKiB() - before;
  EXPECT_LT(grown, 64 * 1024) << "peak RSS grew by " << grown << " KiB";
}

/// A Hugging Face style checkpoint: shards of 2 tensors and the index.
struct HfCheckpoint {
  TempDir dir;
  std::string index;
  explicit HfCheckpoint(const std::string &name) : dir(name) {
    index = dir / "model.safetensors.index.json";
    TensorMap s1, s2;
    s1["a"] = tensorOf<float>(DType::F32, {2}, {1, 2});
    s1["b"] = tensorOf<uint16_t>(DType::BF16, {3}, {0x3f80, 0x4000, 0xc040});
    s2["c"] = tensorOf<uint16_t>(DType::F16, {1}, {0x3c00});
    s2["d"] = tensorOf<float>(DType::F32, {1, 1}, {7});
    EXPECT_TRUE(writeSafeTensors(dir / "model-00001-of-00002.safetensors", s1).isOk());
    EXPECT_TRUE(writeSafeTensors(dir / "model-00002-of-00002.safetensors", s2).isOk());
    writeIndex("{\"a\": \"model-00001-of-00002.safetensors\", "
               "\"b\": \"model-00001-of-00002.safetensors\", "
               "\"c\": \"model-00002-of-00002.safetensors\", "
               "\"d\": \"model-00002-of-00002.safetensors\"}");
  }
  void writeIndex(const std::string &weightMap) {
    writeText(index, "{\"metadata\": {\"total_size\": 20}, \"weight_map\": " + weightMap +
                         "}");
  }
};

TEST(InitFromTest, ResolvesIndexesAndDirectories) {
  HfCheckpoint ck("resolve");
  for (const std::string &path : {ck.index, ck.dir.path, ck.dir.path + "/"}) {
    std::unique_ptr<CheckpointReader> r;
    Status st = CheckpointReader::open(path, r);
    ASSERT_TRUE(st.isOk()) << path << ": " << st.message();
    ASSERT_EQ(r->tensors().size(), 4u);
    EXPECT_EQ(r->files().size(), 2u);
    std::vector<float> out(3);
    ASSERT_TRUE(r->readF32("b", 0, 3, out.data()).isOk());
    EXPECT_EQ(out, (std::vector<float>{1, 2, -3}));
    ASSERT_TRUE(r->readF32("c", 0, 1, out.data()).isOk());
    EXPECT_EQ(out[0], 1.0f);
    ASSERT_TRUE(r->readF32("d", 0, 1, out.data()).isOk());
    EXPECT_EQ(out[0], 7.0f);
  }
  // Without the index, the directory's model.safetensors.
  TempDir single("single");
  TensorMap m;
  m["x"] = tensorOf<float>(DType::F32, {1}, {5});
  ASSERT_TRUE(writeSafeTensors(single / "model.safetensors", m).isOk());
  std::unique_ptr<CheckpointReader> r;
  ASSERT_TRUE(CheckpointReader::open(single.path, r).isOk());
  EXPECT_EQ(r->tensors().count("x"), 1u);
  // Neither: both names in the message.
  TempDir empty("empty");
  std::string msg = openError(empty.path);
  EXPECT_HAS(msg, "model.safetensors.index.json");
  EXPECT_HAS(msg, "nor 'model.safetensors'");
}

TEST(InitFromTest, InconsistentIndexesAreErrorsNamingFileAndTensor) {
  HfCheckpoint ck("bad");
  const std::string one = "model-00001-of-00002.safetensors";
  const std::string two = "model-00002-of-00002.safetensors";
  // A shard that does not exist.
  ck.writeIndex("{\"a\": \"" + one + "\", \"b\": \"" + one + "\", \"c\": \"" + two +
                "\", \"d\": \"" + two + "\", \"e\": \"model-00003-of-00003.safetensors\"}");
  std::string msg = openError(ck.index);
  EXPECT_HAS(msg, "model-00003-of-00003.safetensors");
  EXPECT_HAS(msg, "'e'");
  EXPECT_HAS(msg, "model.safetensors.index.json");
  // weight_map of the wrong type, or with a value that is no file name.
  ck.writeIndex("[\"" + one + "\"]");
  EXPECT_HAS(openError(ck.index), "weight_map: expected an object");
  ck.writeIndex("{\"a\": 3}");
  EXPECT_HAS(openError(ck.index), "weight_map['a']");
  writeText(ck.index, "{\"metadata\": {}}");
  EXPECT_HAS(openError(ck.index), "no \"weight_map\"");
  writeText(ck.index, "{\"weight_map\": ");
  EXPECT_HAS(openError(ck.index), "not valid JSON");
  // A tensor the index puts in a shard that lacks it.
  ck.writeIndex("{\"a\": \"" + one + "\", \"b\": \"" + one + "\", \"c\": \"" + one +
                "\", \"d\": \"" + two + "\"}");
  msg = openError(ck.index);
  EXPECT_HAS(msg, "which has no tensor 'c'");
  EXPECT_HAS(msg, one);
  // A tensor in two shards.
  TensorMap s2;
  s2["c"] = tensorOf<uint16_t>(DType::F16, {1}, {0x3c00});
  s2["d"] = tensorOf<float>(DType::F32, {1, 1}, {7});
  s2["a"] = tensorOf<float>(DType::F32, {2}, {1, 2});
  ASSERT_TRUE(writeSafeTensors(ck.dir / two, s2).isOk());
  ck.writeIndex("{\"a\": \"" + one + "\", \"b\": \"" + one + "\", \"c\": \"" + two +
                "\", \"d\": \"" + two + "\"}");
  msg = openError(ck.index);
  EXPECT_HAS(msg, "tensor 'a' is in two shards");
  EXPECT_HAS(msg, one);
  EXPECT_HAS(msg, two);
  // A shard tensor the index does not list.
  s2.erase("a");
  s2["z"] = tensorOf<float>(DType::F32, {1}, {0});
  ASSERT_TRUE(writeSafeTensors(ck.dir / two, s2).isOk());
  msg = openError(ck.index);
  EXPECT_HAS(msg, "tensor 'z'");
  EXPECT_HAS(msg, "does not list");
  // A corrupt shard: the shard's own header error, with the index's context.
  writeText(ck.dir / two, le64(1000) + "{}");
  msg = openError(ck.index);
  EXPECT_HAS(msg, two);
  EXPECT_HAS(msg, "truncated");
}

} // namespace
