//===- Data.h - batches for the plan's input bindings -----------*- C++ -*-===//
//
// Each step, every rank fills its slice of the global batch (world_size x
// the per-rank batch the plan was compiled for; rank r takes rows
// [r B, (r+1) B)). Sources: a synthetic generator (the FSDP2 tutorial task
// for float inputs; a learnable token sequence for token inputs) and token
// files in llm.c's format.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_DATA_H
#define FSDP_RUNTIME_CORE_DATA_H

#include "runtime/core/Plan.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

class DataSource {
public:
  virtual ~DataSource() = default;
  /// Writes this rank's batch for `step` (1-based) into the buffers of the
  /// input / target bindings, located with `addr(bufferId)`.
  virtual Status fill(int64_t step, uint8_t *(*addr)(void *, int64_t),
                      void *ctx) = 0;
  /// "samples" or "tokens": what throughput is counted in.
  virtual const char *unit() const = 0;
  /// Items (samples or tokens) per rank and step.
  virtual int64_t itemsPerStep() const = 0;
  /// Streams (token files): the rows of the stream consumed once `step`
  /// has run, all ranks together; -1 for sources keyed by the step alone
  /// (synthetic data).
  virtual int64_t consumedAfter(int64_t step) const {
    (void)step;
    return -1;
  }
  /// Streams: the run continues after `step` with `consumed` rows already
  /// trained on, so step s > `step` starts at row consumed + (s - step - 1)
  /// x the global batch. A resumed run whose global batch differs from the
  /// checkpoint's goes on where that run stopped (torchtitan's stateful
  /// data loader), neither skipping nor repeating rows. Others ignore it.
  virtual void resumeAfter(int64_t step, int64_t consumed) {
    (void)step;
    (void)consumed;
  }
};

/// `spec` is "synthetic" or the path of a token file. `lossMask`: the
/// path of a token file of the same length whose 0 entries mark the
/// tokens that are not targets (fine-tuning's prompt and padding): the
/// label predicting such a token is written as the plan's cross-entropy
/// ignore_index (the plan must have one); empty: every label counts.
Status makeDataSource(const std::string &spec, const Plan &plan, int64_t rank, int64_t world,
                      uint64_t seed, std::unique_ptr<DataSource> &out,
                      const std::string &lossMask = "");

/// The token-file source on tokens already read (`name` for messages);
/// makeDataSource's file path ends here. Checks the plan's input / target
/// shapes itself.
Status makeTokenDataSource(const std::string &name, std::vector<uint16_t> tokens, const Plan &plan,
                           int64_t rank, int64_t world, std::unique_ptr<DataSource> &out,
                           std::vector<uint16_t> mask = {});

/// The ignore_index of the plan's cross-entropies (all must agree);
/// false when none has one.
Status planIgnoreIndex(const Plan &plan, bool &found, int64_t &index);

/// Reads a token file in llm.c's format: 256 little-endian int32 (magic
/// 20240520, version 1, token count), then exactly that many little-endian
/// uint16 tokens. `name` is used in messages; the count is checked against
/// the size before anything is allocated.
Status parseTokenFile(const std::string &name, const std::string &bytes,
                      std::vector<uint16_t> &tokens);
Status readTokenFile(const std::string &path, std::vector<uint16_t> &tokens);

/// Writes a token file in llm.c's format (used by tests and tools).
Status writeTokenFile(const std::string &path,
                      const std::vector<uint16_t> &tokens);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_DATA_H
