//===- SafeTensorsFuzzRegressionTest.cpp - hostile checkpoints and data ---===//
//
// Regression inputs for the safetensors and llm.c token-file readers (the
// classes fuzz/ looks for): every one is an error naming the file and the
// field, never a crash, an overflow or a huge allocation.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Data.h"
#include "runtime/core/SafeTensors.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

using namespace fsdp;

namespace {

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[i] = (char)(v >> (8 * i));
  return s;
}

std::string st(const std::string &header, const std::string &data = "") {
  return le64(header.size()) + header + data;
}

std::string parseError(const std::string &bytes) {
  TensorMap m;
  Status s = parseSafeTensors("x.safetensors", bytes, m);
  return s.isOk() ? std::string("OK") : s.message();
}

void expectError(const std::string &bytes, const std::string &what) {
  std::string msg = parseError(bytes);
  EXPECT_NE(msg, "OK") << what;
  EXPECT_NE(msg.find("x.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
}

TEST(SafeTensorsFuzzRegression, HeaderLength) {
  expectError("", "truncated");
  expectError(std::string(7, '\0'), "truncated");
  expectError(le64(UINT64_MAX) + "{}", "header length");
  expectError(le64(1ULL << 63) + "{}", "header length");
  expectError(le64(0), "too short");
  expectError(st("[]"), "expected a JSON object");
  expectError(st("{\"a\":1"), "not valid JSON");
}

TEST(SafeTensorsFuzzRegression, FieldTypes) {
  expectError(st("{\"w\":[]}"), "tensor 'w': expected an object");
  expectError(st("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd"),
              "missing field 'dtype'");
  expectError(st("{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd"),
              "dtype");
  expectError(st("{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                 std::string(8, '\0')), "unsupported");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,4]}}", "abcd"),
              "shape: expected an array");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", "abcd"),
              "shape[0]");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", "abcd"),
              "shape[0]");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", "abcd"),
              "data_offsets");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", "abcd"),
              "data_offsets[0]");
  expectError(st("{\"__metadata__\":[1]}"), "__metadata__");
}

TEST(SafeTensorsFuzzRegression, SizesWithoutOverflow) {
  // 2^62 x 4 x 4 bytes wraps to 0 in 64 bits: must not match a 0-byte range.
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
                 "\"data_offsets\":[0,0]}}"),
              "needs more than");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[18446744073709551615],"
                 "\"data_offsets\":[0,4]}}", "abcd"),
              "shape[0]");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
                 "\"data_offsets\":[0,9223372036854775807]}}", "abcd"),
              "past the data section");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
                 "\"data_offsets\":[18446744073709551615,18446744073709551615]}}", "abcd"),
              "past the data section");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,0]}}",
                 std::string(8, '\0')), "exceeds end");
  expectError(st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                 std::string(8, '\0')), "needs 4");
  // A zero-sized dimension anywhere makes the tensor empty.
  TensorMap m;
  ASSERT_TRUE(parseSafeTensors("x.safetensors",
                               st("{\"e\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,0],"
                                  "\"data_offsets\":[0,0]}}"), m).isOk());
  EXPECT_TRUE(m.at("e").data.empty());
}

TEST(SafeTensorsFuzzRegression, OverlappingRanges) {
  expectError(st("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                 std::string(8, '\0')), "overlap");
  TensorMap m;
  ASSERT_TRUE(
      parseSafeTensors("x.safetensors",
                       st("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                          "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,8]}}",
                          std::string(8, '\0')),
                       m)
          .isOk());
  EXPECT_EQ(m.size(), 2u);
}

std::string tokenFile(int32_t magic, int32_t version, int32_t count,
                      const std::string &body) {
  int32_t h[256] = {};
  h[0] = magic;
  h[1] = version;
  h[2] = count;
  return std::string(reinterpret_cast<const char *>(h), sizeof h) + body;
}

TEST(TokenFileFuzzRegression, HeaderAgainstSize) {
  std::vector<uint16_t> t;
  auto err = [&](const std::string &b) {
    Status s = parseTokenFile("d.bin", b, t);
    return s.isOk() ? std::string("OK") : s.message();
  };
  EXPECT_NE(err("").find("too short"), std::string::npos);
  EXPECT_NE(err(tokenFile(7, 1, 0, "")).find("bad magic"), std::string::npos);
  EXPECT_NE(err(tokenFile(20240520, 2, 0, "")).find("version"), std::string::npos);
  EXPECT_NE(err(tokenFile(20240520, 1, -5, "")).find("negative"), std::string::npos);
  // INT32_MAX tokens announced in a 1 KiB file: an error before any allocation.
  EXPECT_NE(err(tokenFile(20240520, 1, INT32_MAX, "")).find("truncated"), std::string::npos);
  EXPECT_NE(err(tokenFile(20240520, 1, 1, "abc")).find("bytes after"), std::string::npos);
  ASSERT_EQ(err(tokenFile(20240520, 1, 2, std::string("\x01\x00\x02\x01", 4))), "OK");
  EXPECT_EQ(t, (std::vector<uint16_t>{1, 258}));
}

TEST(TokenFileFuzzRegression, PlanShapesAndRange) {
  Plan plan;
  plan.buffers.resize(2);
  for (int i = 0; i < 2; ++i) {
    plan.buffers[i].id = i;
    plan.buffers[i].shape = {2, 4};
    plan.buffers[i].dtype = DType::I32;
    plan.buffers[i].bytes = 32;
  }
  plan.inputs = {{"x", "input", 0, "", 0}, {"y", "target", 1, "", 50}};
  std::unique_ptr<DataSource> src;
  std::vector<uint16_t> toks(100, 1);
  Status s = makeTokenDataSource("d.bin", toks, plan, 0, 1, src);
  EXPECT_NE(s.message().find("range"), std::string::npos) << s.message();
  s = makeDataSource("synthetic", plan, 0, 1, 1, src); // range 0: was SIGFPE
  EXPECT_NE(s.message().find("range"), std::string::npos) << s.message();
  plan.inputs[0].range = 50;
  plan.buffers[0].shape = plan.buffers[1].shape = {0, 4}; // batch of 0
  s = makeDataSource("synthetic", plan, 0, 1, 1, src);
  EXPECT_NE(s.message().find("positive size"), std::string::npos) << s.message();
  plan.buffers[0].shape = plan.buffers[1].shape = {2, 4};
  plan.buffers[1].bytes = 16; // smaller than 2 x 4 x i32
  s = makeTokenDataSource("d.bin", toks, plan, 0, 1, src);
  EXPECT_NE(s.message().find("do not fit"), std::string::npos) << s.message();
  plan.buffers[1].bytes = 32;
  EXPECT_FALSE(makeTokenDataSource("d.bin", toks, plan, 2, 2, src).isOk());
  ASSERT_TRUE(makeTokenDataSource("d.bin", toks, plan, 1, 2, src).isOk());
}

} // namespace
