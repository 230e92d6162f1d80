//===- PlanTypes.cpp - dtype and buffer-kind helpers of the plan format ---===//
//
// The small helpers of Plan.h that the kernels need too; kept apart from the
// plan reader so the CPU library does not depend on it.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Plan.h"

namespace fsdp {

int64_t dtypeSize(DType t) {
  switch (t) {
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::BF16:
  case DType::F16:
    return 2;
  case DType::I64:
    return 8;
  }
  return 4;
}

const char *dtypeName(DType t) {
  switch (t) {
  case DType::F32:
    return "f32";
  case DType::BF16:
    return "bf16";
  case DType::F16:
    return "f16";
  case DType::I32:
    return "i32";
  case DType::I64:
    return "i64";
  }
  return "?";
}

bool parseDType(const std::string &s, DType &out) {
  static const std::pair<const char *, DType> names[] = {
      {"f32", DType::F32}, {"bf16", DType::BF16}, {"f16", DType::F16},
      {"i32", DType::I32}, {"i64", DType::I64}};
  for (auto &[n, t] : names)
    if (s == n) {
      out = t;
      return true;
    }
  return false;
}

const char *bufferKindName(BufferKind k) {
  switch (k) {
  case BufferKind::Input:
    return "input";
  case BufferKind::Param:
    return "param";
  case BufferKind::State:
    return "state";
  case BufferKind::Grad:
    return "grad";
  case BufferKind::Activation:
    return "activation";
  case BufferKind::Temp:
    return "temp";
  case BufferKind::Comm:
    return "comm";
  }
  return "?";
}

bool parseBufferKind(const std::string &s, BufferKind &out) {
  static const std::pair<const char *, BufferKind> names[] = {
      {"input", BufferKind::Input},           {"param", BufferKind::Param},
      {"state", BufferKind::State},           {"grad", BufferKind::Grad},
      {"activation", BufferKind::Activation}, {"temp", BufferKind::Temp},
      {"comm", BufferKind::Comm}};
  for (auto &[n, k] : names)
    if (s == n) {
      out = k;
      return true;
    }
  return false;
}

static int64_t product(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s)
    n *= d;
  return n;
}

int64_t Buffer::numel() const { return product(shape); }
int64_t Param::numel() const { return product(shape); }

} // namespace fsdp
