//===- tokens_fuzzer.cpp - libFuzzer harness: llm.c token files -----------===//
//
// Input: one byte choosing the batch geometry (rows 1-4, T 1-16, I32 or
// I64 ids), one byte the vocabulary (1-256), two bytes rank / world, then
// the bytes of a token file. The file goes through parseTokenFile (what
// fsdp-run --data FILE reads) and, when accepted, through the token data
// source for steps 1-3 into buffers of exactly the plan's size.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Data.h"
#include "runtime/core/Plan.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

using namespace fsdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 4)
    return 0;
  int64_t rows = 1 + (data[0] & 3), T = 1 + ((data[0] >> 2) & 15);
  DType dt = (data[0] & 0x40) ? DType::I64 : DType::I32;
  int64_t range = 1 + data[1];
  int64_t world = 1 + (data[3] & 7), rank = data[2] % world;
  std::string bytes(reinterpret_cast<const char *>(data) + 4, size - 4);
  std::vector<uint16_t> tokens;
  if (!parseTokenFile("fuzz.bin", bytes, tokens).isOk())
    return 0;
  Plan plan;
  plan.buffers.resize(2);
  for (int i = 0; i < 2; ++i) {
    plan.buffers[i].id = i;
    plan.buffers[i].shape = {rows, T};
    plan.buffers[i].dtype = dt;
    plan.buffers[i].bytes = rows * T * dtypeSize(dt);
  }
  plan.inputs = {{"x", "input", 0, "", range}, {"y", "target", 1, "", range}};
  std::unique_ptr<DataSource> src;
  if (!makeTokenDataSource("fuzz.bin", std::move(tokens), plan, rank, world, src)
           .isOk())
    return 0;
  // Each buffer in its own allocation, so ASan catches a write past either.
  std::vector<std::unique_ptr<uint8_t[]>> mem;
  for (int i = 0; i < 2; ++i)
    mem.emplace_back(new uint8_t[plan.buffers[i].bytes]);
  auto addr = [](void *ctx, int64_t id) {
    return (*static_cast<std::vector<std::unique_ptr<uint8_t[]>> *>(ctx))[id].get();
  };
  for (int64_t step = 1; step <= 3; ++step)
    if (!src->fill(step, addr, &mem).isOk())
      break;
  return 0;
}
