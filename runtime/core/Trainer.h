//===- Trainer.h - the training loop of fsdp-run ----------------*- C++ -*-===//
//
// Options, the loop (data, schedule, step, logging) and the tools around
// it: dumps for the PyTorch oracle, consolidated checkpoints, and a
// finite-difference gradient check of a plan compiled without optimizer.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_TRAINER_H
#define FSDP_RUNTIME_CORE_TRAINER_H

#include "runtime/core/Comm.h"
#include "runtime/core/Device.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SwapFile.h"

#include <string>

namespace fsdp {

struct TrainOptions {
  std::string planPath;
  std::string device = "cpu"; ///< --device: which backend runs the plan
  std::string comm = "auto";  ///< --comm: auto | shm | gloo (the host collectives)
  bool allowTf32 = false;     ///< --allow-tf32 (CUDA GEMMs)
  bool cudaGraphs = false;    ///< --cuda-graphs: capture the step, replay it
  /// Ranks on this rank's node, as the launch says (LOCAL_WORLD_SIZE and
  /// its names; fsdp-run sets it from the job, not an option); 0: unknown.
  int64_t localWorldSize = 0;
  int64_t steps = 10;
  double lr = 1e-3;
  std::string schedule = "constant";
  int64_t warmup = 0;
  double minLr = 0;
  int64_t decaySteps = -1; ///< --decay-steps (wsd); -1: a tenth of the steps
  std::string decayShape;  ///< --decay-shape (wsd); empty: linear
  uint64_t seed = 1234;
  std::string data = "synthetic";
  std::string lossMask; ///< --loss-mask FILE: 0 entries are not targets
  int threads = 0;
  int64_t logEvery = 1;
  std::string dumpDir;
  std::string initFrom;
  std::string nvmeDir; ///< --nvme-dir: the swap file of fsdp-offload's nvme
  SwapIoMode nvmeIo = SwapIoMode::Auto; ///< --nvme-io
  std::string save;
  bool json = false;
  bool quiet = false;
  std::string ckptDir;    ///< --ckpt-dir: where checkpoints go
  int64_t saveEvery = 0;  ///< --save-every K (0: only --ckpt-dir's final one)
  int64_t keep = 0;       ///< --keep M newest checkpoints (0: all)
  bool asyncSave = false; ///< --async-save: checkpoints written in the background
  std::string resume;     ///< --resume DIR: latest complete checkpoint there
  std::string trace;      ///< --trace FILE: measured timeline (Chrome JSON)
  bool traceSync = false; ///< --trace-sync: synchronize after each instruction
  bool calibrate = false; ///< --calibrate: print this machine's profile
  int64_t evalEvery = 0;   ///< --eval-every N: validation loss every N steps (0: off)
  std::string evalData;    ///< --eval-data SPEC (default: held-out synthetic)
  std::string evalLossMask; ///< --eval-loss-mask FILE (--loss-mask for evalData)
  int64_t evalBatches = 4; ///< --eval-batches K: batches averaged per evaluation
  int64_t gradcheck = 0; ///< elements sampled per parameter; 0 = off
  double gradcheckTol = 2e-2;
};

/// Parses argv (without --nproc handling). On error returns a message;
/// `help` is set for --help.
Status parseTrainOptions(int argc, char **argv, TrainOptions &opt, bool &help);
const char *trainUsage();

/// Runs training (or the gradient check) on this rank, on `device`
/// (created from opt.device and opt.threads by the caller). Rank 0 prints.
Status train(const TrainOptions &opt, Communicator &comm, Device &device);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_TRAINER_H
