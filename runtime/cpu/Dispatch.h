//===- Dispatch.h - plan instructions to CPU kernels ------------*- C++ -*-===//
//
// Maps one compute instruction (op name, buffer ids, attributes) to a
// kernel call on the arena. The instruction was checked at plan load
// (runtime/core/OpRules.h); the CPU device (CpuDevice.h) calls this.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CPU_DISPATCH_H
#define FSDP_RUNTIME_CPU_DISPATCH_H

#include "runtime/core/Dropout.h"
#include "runtime/core/Plan.h"

#include <cstdint>
#include <string>

namespace fsdp::cpu {

/// Runs one compute instruction; `rank` (the shard index,
/// Plan::shardIndex) places shard views. Collectives are not handled here
/// (isCollectiveOp, PlanSchema.h).
/// `dropout` is the step's (Device::dropoutContext). Host-arena buffers
/// ([Note: two arenas] in Plan.h) are in the same block as `arena`, or at
/// `hostArena` when given (the CUDA device runs fsdp-offload's host
/// instructions here, on its pinned host arena).
Status runInstruction(const Plan &plan, const Instruction &inst,
                      uint8_t *arena, int64_t rank,
                      const DropoutContext &dropout = DropoutContext{},
                      uint8_t *hostArena = nullptr);

/// True when this backend has a kernel for compute op `op`.
bool implementsOp(const std::string &op);

/// Largest f32 scratch (bytes, per thread) that instructions on bf16 / f16
/// operands used so far: memory outside the arena ([Note: bf16 storage,
/// f32 compute] in runtime/core/OpRules.cpp).
int64_t widenedScratchHighWater();

} // namespace fsdp::cpu

#endif // FSDP_RUNTIME_CPU_DISPATCH_H
