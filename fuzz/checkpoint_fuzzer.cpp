//===- checkpoint_fuzzer.cpp - libFuzzer harness: checkpoint indexes -----===//
//
// Input: the text of a checkpoint's index.json, the file that tells every
// reader of a checkpoint (fsdp-run --resume and --init-from, fsdp-ckpt
// export and reshard) where each parameter and optimizer state lies: the
// shard map. At start the harness writes real rank files into one
// directory: a checkpoint of a small plan at world size 1
// (fuzz/corpus/plan/mlp-w1-adamw.json, ZeRO-3) and the same checkpoint
// converted offline for 2 ranks (mlp-w2-z3-adamw.json), so that an index
// naming either set, or a mix, points at real tensors. Each input becomes
// that directory's index.json, and then runs:
//   loadCheckpoint into the world-size-1 plan (its own layout: each buffer
//     from its file; any other: resharded on load, range reads through the
//     shard map),
//   initParamsFromCheckpoint (the parameters only),
//   exportCheckpoint (whole parameters, no plan),
//   reshardCheckpoint onto the 2-rank plan (into a directory removed after).
// The seeds, corpus/checkpoint/, are the two real indexes, and three
// edits of the 2-rank one that the fuzzer found or that lie beside its
// find: an id and a shape given as floats far outside int64 (nlohmann
// converts those with undefined behaviour unless checked first), and a
// mesh whose factors' product overflows.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Checkpoint.h"
#include "runtime/core/Comm.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Plan.h"
#include "runtime/devices/Devices.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

using namespace fsdp;
namespace fs = std::filesystem;

namespace {
Plan gPlan, gPlan2;
std::unique_ptr<Communicator> gComm;
std::unique_ptr<Device> gDevice;
std::unique_ptr<Executor> gExec;
std::string gDir; ///< the rank files; each input is written as its index.json
std::string gRoot; ///< the temporary directory holding gDir, removed at exit

[[noreturn]] void die(const char *what, const Status &st) {
  std::fprintf(stderr, "checkpoint_fuzzer: %s: %s\n", what, st.message().c_str());
  std::abort();
}
} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  DeviceOptions options;
  options.threads = 1;
  Status st = createDevice("cpu", options, gDevice);
  if (!st)
    die("device", st);
  if (!(st = loadPlan(FSDP_FUZZ_DIR "/corpus/plan/mlp-w1-adamw.json", gPlan)))
    die("plan", st);
  if (!(st = loadPlan(FSDP_FUZZ_DIR "/corpus/plan/mlp-w2-z3-adamw.json", gPlan2)))
    die("plan", st);
  gComm = makeSingleProcessCommunicator();
  gExec = std::make_unique<Executor>(gPlan, *gComm, *gDevice);
  if (!(st = gExec->init(1)))
    die("init", st);
  char tmpl[] = "/tmp/checkpoint-fuzzer.XXXXXX";
  if (!::mkdtemp(tmpl))
    std::abort();
  std::string root = tmpl;
  gRoot = root;
  // libFuzzer ends by exit() (after -runs / -max_total_time, or on a crash
  // report): the directory goes with the process.
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(gRoot, ec);
  });
  TrainingPosition pos;
  pos.step = 1;
  if (!(st = saveCheckpoint(root + "/one", 0, gPlan, *gExec, *gComm, pos)))
    die("save", st);
  if (!(st = reshardCheckpoint(root + "/one/step-00000001", gPlan2, root + "/two")))
    die("reshard", st);
  // Both sets of rank files in one directory (their names differ).
  gDir = root + "/one/step-00000001";
  for (const auto &e : fs::directory_iterator(root + "/two/step-00000001"))
    if (e.path().extension() == ".safetensors")
      fs::copy_file(e.path(), gDir + "/" + e.path().filename().string());
  // What the seeds are: the indexes of both layouts (FSDP_FUZZ_SEEDS=DIR
  // writes them there).
  if (const char *seeds = std::getenv("FSDP_FUZZ_SEEDS")) {
    fs::copy_file(gDir + "/index.json", std::string(seeds) + "/w1-z3.json",
                  fs::copy_options::overwrite_existing);
    fs::copy_file(root + "/two/step-00000001/index.json", std::string(seeds) + "/w2-z3.json",
                  fs::copy_options::overwrite_existing);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  {
    std::ofstream out(gDir + "/index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char *>(data), (std::streamsize)size);
  }
  TrainingPosition pos;
  LoadReport report;
  (void)loadCheckpoint(gDir, gPlan, *gExec, 0, pos, &report);
  std::string used;
  (void)initParamsFromCheckpoint(gDir, gPlan, *gExec, used);
  TensorMap params;
  if (exportCheckpoint(gDir, params)) {
    // The reader's contract: whole f32 tensors of their shapes.
    for (auto &[name, t] : params) {
      size_t n = 4;
      for (int64_t d : t.shape)
        n *= (size_t)d;
      if (n != t.data.size())
        std::abort();
    }
  }
  std::string out = gDir + ".out";
  (void)reshardCheckpoint(gDir, gPlan2, out);
  std::error_code ec;
  fs::remove_all(out, ec);
  return 0;
}
