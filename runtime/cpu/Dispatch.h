//===- Dispatch.h - plan instructions to CPU kernels ------------*- C++ -*-===//
//
// Maps one plan instruction (op name, buffer ids, attributes) to a kernel
// call. checkInstruction runs at plan load and rejects an instruction whose
// operands do not fit its op; runInstruction executes it on the arena.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CPU_DISPATCH_H
#define FSDP_RUNTIME_CPU_DISPATCH_H

#include "runtime/core/Plan.h"

#include <cstdint>
#include <string>

namespace fsdp::cpu {

/// Checks that `inst` names a known op with the right number of operands,
/// dtypes and shapes. The message names the op and the problem.
Status checkInstruction(const Plan &plan, const Instruction &inst);

/// Runs one compute instruction; `rank` (the shard index,
/// Plan::shardIndex) places shard views. Collectives
/// are not handled here (see isCollectiveOp).
Status runInstruction(const Plan &plan, const Instruction &inst,
                      uint8_t *arena, int64_t rank);

/// Largest f32 scratch (bytes, per thread) that instructions on bf16 / f16
/// operands used so far: memory outside the arena ([Note: bf16 storage,
/// f32 compute] in Dispatch.cpp).
int64_t widenedScratchHighWater();

/// all_reduce, reduce_scatter, all_gather: executed by the communicator.
bool isCollectiveOp(const std::string &op);

/// The address of buffer `id` for the rank holding shard `rank`.
inline uint8_t *bufferAddress(const Plan &plan, int64_t id, uint8_t *arena,
                              int64_t rank) {
  const Buffer &b = plan.buffers[id];
  return arena + b.offset + rank * b.rankStride;
}

} // namespace fsdp::cpu

#endif // FSDP_RUNTIME_CPU_DISPATCH_H
