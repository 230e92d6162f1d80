//===- safetensors_fuzzer.cpp - libFuzzer harness: the safetensors reader -===//
//
// Input: the bytes of a .safetensors file. parseSafeTensors is what
// readSafeTensors (fsdp-run --init-from) runs on a file's contents. A file it
// accepts is then loaded into the parameters of a small real plan
// (fuzz/corpus/plan/mlp-w1-adamw.json, ZeRO-3 at world size 1), as
// --init-from does, so the tensors' shapes, dtypes and byte sizes are
// exercised against real parameter storage.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Comm.h"
#include "runtime/core/Executor.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SafeTensors.h"
#include "runtime/devices/Devices.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

using namespace fsdp;

namespace {
Plan gPlan;
std::unique_ptr<Communicator> gComm;
std::unique_ptr<Device> gDevice;
std::unique_ptr<Executor> gExec;
} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  DeviceOptions options;
  options.threads = 1;
  Status st = createDevice("cpu", options, gDevice);
  if (!st.isOk())
    std::abort();
  const char *env = std::getenv("FSDP_FUZZ_PLAN");
  std::string path = env ? env : FSDP_FUZZ_DIR "/corpus/plan/mlp-w1-adamw.json";
  st = loadPlan(path, gPlan);
  if (!st.isOk()) {
    std::fprintf(stderr, "safetensors_fuzzer: %s\n", st.message().c_str());
    std::abort();
  }
  gComm = makeSingleProcessCommunicator();
  gExec = std::make_unique<Executor>(gPlan, *gComm, *gDevice);
  st = gExec->init(1);
  if (!st.isOk()) {
    std::fprintf(stderr, "safetensors_fuzzer: %s\n", st.message().c_str());
    std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::string bytes(reinterpret_cast<const char *>(data), size);
  TensorMap tensors;
  if (!parseSafeTensors("fuzz.safetensors", bytes, tensors).isOk())
    return 0;
  for (auto &[name, t] : tensors) {
    // The reader's contract: the bytes are exactly shape x dtype size.
    size_t n = (size_t)dtypeSize(t.dtype);
    for (int64_t d : t.shape)
      n *= (size_t)d;
    if (n != t.data.size())
      std::abort();
  }
  (void)gExec->loadParams(tensors);
  return 0;
}
