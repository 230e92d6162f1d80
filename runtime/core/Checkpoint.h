//===- Checkpoint.h - sharded training-state checkpoints --------*- C++ -*-===//
//
// A checkpoint is a directory `DIR/step-NNNNNNNN/` holding one safetensors
// file per rank with the bytes of every persistent buffer that rank owns
// (parameter shards or whole parameters, optimizer state: everything a step
// reads that the previous step wrote), an `index.json` written by rank 0
// (the shard map, the step, the schedule, the seed, the data position) and
// a `COMMIT` file that rank 0 writes after a barrier, once every rank's file
// is durable. Only committed checkpoints are read, so a job killed during a
// save leaves the previous one usable. Each rank writes its own file with
// no communication but the barrier. The format: docs/CHECKPOINTS.md.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_CHECKPOINT_H
#define FSDP_RUNTIME_CORE_CHECKPOINT_H

#include "runtime/core/Comm.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SafeTensors.h"

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp {

/// The format version of index.json this runtime writes and reads.
constexpr int kCheckpointVersion = 1;

/// What a checkpoint records beside the buffers, for an exact resume.
struct TrainingPosition {
  int64_t step = 0; ///< last completed step (the next one is step + 1)
  uint64_t seed = 0;
  nlohmann::json schedule; ///< lr, schedule, warmup, min_lr, steps
  std::string data;        ///< the data source spec (position = step)
  /// The dynamic loss scaler (plans with loss scaling): {scale,
  /// growth_tracker, skipped_steps}; null otherwise.
  nlohmann::json lossScale;
  /// Samples or tokens one step trained on, all ranks together (0:
  /// unknown, a checkpoint written before it was recorded).
  int64_t itemsPerStep = 0;
  /// Rows of a token file's stream consumed so far (DataSource::
  /// consumedAfter); -1: a source keyed by the step alone, or unknown.
  int64_t rowsConsumed = -1;
};

/// How loadCheckpoint restored this rank's buffers.
struct LoadReport {
  /// Written for another layout (world size, mesh, stage, unit grouping
  /// or storage dtypes) and resharded on load; `from` says what it was
  /// written for ("2 rank(s) (mesh 1x2) at stage 3").
  bool resharded = false;
  std::string from, to; ///< the checkpoint's layout, and the plan's
  /// Bytes this rank read of the rank files, and their total size.
  uint64_t readBytes = 0, checkpointBytes = 0;
  /// Storage the load converted, one entry for the parameters or an
  /// optimizer-state kind: "exp_avg f32 -> bf16". A narrowing rounds each
  /// value to nearest even; a widening is exact; encoding into 8-bit
  /// moments ("exp_avg f32 -> 8bit", or "exp_avg 8bit -> 8bit in other
  /// blocks (re-encoded)") rounds each to its block's nearest code, and
  /// decoding them is exact.
  std::vector<std::string> converted;
};

/// The storage dtypes a checkpoint index's shard map records, for
/// `fsdp-ckpt info`: "parameters f32, exp_avg bf16, exp_avg_sq bf16"
/// (empty when it records none).
std::string checkpointStorage(const nlohmann::json &index);

/// What a tool prints for LoadReport::converted: "exp_avg f32 -> bf16,
/// exp_avg_sq f32 -> bf16 (narrowed to nearest even)", each kind of
/// conversion said once.
std::string conversionNote(const std::vector<std::string> &converted);

/// Writes the checkpoint of `position.step` under `dir` (every rank calls
/// it: one barrier), then, on rank 0, removes older checkpoints beyond the
/// newest `keep` (0 keeps all) and any incomplete one.
Status saveCheckpoint(const std::string &dir, int64_t keep, const Plan &plan,
                      Executor &ex, Communicator &comm,
                      const TrainingPosition &position);

/// Checkpoints written in the background (`fsdp-run --async-save`, like
/// torch.distributed.checkpoint.async_save): save() blocks only for the
/// directory's barrier and a snapshot of this rank's buffers in host memory;
/// a thread writes the file, and on rank 0 commits once every rank's file
/// is durable. [Note: async save] in Checkpoint.cpp.
class AsyncCheckpointer {
public:
  AsyncCheckpointer() = default;
  AsyncCheckpointer(const AsyncCheckpointer &) = delete;
  AsyncCheckpointer &operator=(const AsyncCheckpointer &) = delete;
  /// Stops rank 0's wait for other ranks' files (no COMMIT) and joins.
  ~AsyncCheckpointer();

  /// Waits for the save in flight (its error, if it failed), then starts
  /// the save of `position.step` (every rank calls it: one barrier).
  Status save(const std::string &dir, int64_t keep, const Plan &plan, Executor &ex,
              Communicator &comm, const TrainingPosition &position);
  /// The end of training (every rank calls it: one barrier): the save in
  /// flight is complete, committed on rank 0, when this returns ok.
  Status finish(Communicator &comm);
  /// Whether a save is in flight.
  bool busy() const { return worker.joinable(); }
  /// How long the last save() waited for the one before it (ms).
  double lastWaitMs() const { return waitMs; }
  /// Whether the last file written went past the page cache (O_DIRECT);
  /// read it when no save is in flight.
  bool wroteDirect() const { return direct; }
  /// Whether the staging image is page-locked for the device's copies.
  bool pinned() const { return pinnedOn != nullptr; }

private:
  Status join();
  /// This rank's file of `step`, as it will be on disk, into `image`.
  Status stage(const Plan &plan, Executor &ex, int64_t step);
  Status writeInBackground(const std::string &dir, const std::string &path, int64_t keep,
                           int64_t rank, int64_t world, int64_t step, const nlohmann::json &index);

  struct Free {
    void operator()(uint8_t *p) const { std::free(p); }
  };
  /// This rank's file as of the save in flight, in host memory aligned for
  /// O_DIRECT (kept for the next save).
  std::unique_ptr<uint8_t, Free> image;
  size_t imageBytes = 0, imageCapacity = 0;
  /// The device `image` is page-locked for (null: pageable).
  Device *pinnedOn = nullptr;
  void releaseImage();
  bool direct = false; ///< the last file went past the page cache
  std::thread worker;
  Status result = Status::ok();
  std::mutex mu;
  std::condition_variable wake;
  bool cancelled = false;
  double waitMs = 0;
};

/// The newest committed checkpoint under `dir` (a checkpoint directory
/// itself is accepted too); an error when there is none.
Status latestCheckpoint(const std::string &dir, std::string &path);

/// Restores this rank's buffers from the checkpoint at `path`. Written for
/// this plan's layout (world size, mesh, stage, every saved buffer's id,
/// name, size and dtype), each buffer is read from this rank's file.
/// Written for another layout of the same model and optimizer, it is
/// resharded on load ([Note: resharding on load]): this rank reads only
/// the byte ranges of its own slices from whichever rank files hold them.
/// Another model (a parameter's name or shape) or optimizer (a state kind
/// the plan needs) is an error. Host memory is bounded by a piece of
/// kLoadPieceBytes, not by the checkpoint.
Status loadCheckpoint(const std::string &path, const Plan &plan, Executor &ex, int64_t rank,
                      TrainingPosition &position, LoadReport *report = nullptr);

/// The piece a load reads and writes at a time (16 MiB).
constexpr int64_t kLoadPieceBytes = int64_t(16) << 20;

/// Whether `path` is a directory of fsdp-run checkpoints (holding
/// step-NNNNNNNN directories) or one checkpoint (holding index.json).
bool isTrainingCheckpoint(const std::string &path);

/// fsdp-run --init-from a training checkpoint: the parameters of the newest
/// committed checkpoint under `path` (`used` names it), whatever its
/// layout, each rank reading only its slices as resharding on load does.
/// Only the parameters: the optimizer (any, also another one), the step,
/// the schedule and the data start fresh, as from a .safetensors file.
/// Another model is an error.
Status initParamsFromCheckpoint(const std::string &path, const Plan &plan, Executor &ex,
                                std::string &used);

/// Reads the index of the checkpoint at `path`.
Status readCheckpointIndex(const std::string &path, nlohmann::json &index);

/// Consolidates the parameters of the checkpoint at `path` (whole tensors
/// under the model's own names) without the plan or any rank running.
Status exportCheckpoint(const std::string &path, TensorMap &params);

/// Converts the checkpoint at `path` (any world size and stage) into one
/// for the `target` plan (another world size, stage or unit grouping of the
/// same model and optimizer), written as `outDir/step-NNNNNNNN/`, without
/// running the model: each target rank's buffers are assembled from the
/// ranges of the source's rank files that hold them (the shard map says
/// where every parameter and its optimizer state lie), the same way
/// loadCheckpoint reshards on load.
/// `converted` (when given) receives the storage it converted, as
/// LoadReport::converted.
Status reshardCheckpoint(const std::string &path, const Plan &target, const std::string &outDir,
                         std::vector<std::string> *converted = nullptr);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_CHECKPOINT_H
