//===- mlir_fuzzer.cpp - libFuzzer harness for the compiler ---------------===//
//
// The compiler's untrusted input is model text. Each input is checked as
// fsdp-opt checks it (compiler/InputChecks.h: nesting depth), parsed with
// the fsdp and func dialects, verified, and, if it is a module, compiled by
// the whole pipeline (autodiff, optimizer, sharding, schedule, memory plan
// and, for some option sets, the plan export) under one of a table of
// option sets picked by a hash of the input: every ZeRO stage, several
// world sizes, HSDP, recomputation, mixed precision with loss scaling,
// gradient accumulation, optimizer (also frozen units) and activation offload (next-step
// too), the memory-budget search (with a host budget). Diagnostics are
// the expected outcome of most inputs and are dropped; a crash, a sanitizer
// report or a hang is a finding. A custom mutator rewrites one number or
// op name of the text three times in four, so mutants stay parseable.
// Seeds: fuzz/corpus/mlir/ (small models from examples/gen_models.py),
// dictionary fuzz/mlir.dict.
//
//===----------------------------------------------------------------------===//

#include "compiler/InputChecks.h"
#include "compiler/Pipeline.h"
#include "dialects/fsdp/FsdpOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"

#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

using namespace mlir;

namespace {

/// Pipeline option sets; "PLAN" becomes a per-process temporary path.
const char *const kOptions[] = {
    "optimizer=adamw report=false",
    "optimizer=sgd momentum=0.9 world-size=2 stage=3 report=false plan=PLAN",
    "optimizer=adamw world-size=3 stage=2 max-grad-norm=1.0 report=false",
    "optimizer=adamw world-size=2 stage=1 grad-accum=2 loss-chunks=auto report=false",
    "optimizer=adamw world-size=4 mesh=2x2 stage=3 report=false plan=PLAN",
    "optimizer=adamw world-size=2 stage=3 recompute=unit backward-prefetch=none report=false",
    "optimizer=adamw world-size=2 stage=3 recompute=selective reshard-after-forward=false "
    "report=false",
    "optimizer=adamw world-size=2 stage=3 param-dtype=bf16 loss-chunks=3 report=false "
    "plan=PLAN",
    "optimizer=adamw param-dtype=f16 loss-scale=dynamic report=false",
    "optimizer=adamw world-size=2 stage=3 offload=optimizer report=false plan=PLAN",
    "optimizer=adamw world-size=2 stage=3 memory-budget=1MiB report=false",
    "optimizer=none stage=0 world-size=2 report=false",
    "optimizer=adamw world-size=3 stage=3 unit-policy=size min-unit-numel=64 "
    "weight-decay-params=matrices report=false simulate=true",
    "optimizer=adamw world-size=2 stage=3 grad-accum=2 accum-reduce=microbatch "
    "prefetch-depth=2 backward-prefetch=post report=false",
    "optimizer=sgd world-size=2 stage=3 reshard-after-forward=2 report=false",
    "optimizer=adamw fuse-epilogues=false world-size=2 stage=2 report=false",
    "optimizer=adamw world-size=2 stage=3 recompute=unit offload-activations=true "
    "report=false plan=PLAN",
    "optimizer=adamw offload-activations=true offload=optimizer world-size=2 stage=3 "
    "grad-accum=2 reshard-after-backward=false report=false",
    "optimizer=lamb world-size=2 stage=3 max-grad-norm=1.0 weight-decay-params=matrices "
    "report=false plan=PLAN",
    "optimizer=adamw world-size=2 stage=3 offload=optimizer offload-next-step=true "
    "max-grad-norm=1.0 report=false plan=PLAN",
    "optimizer=adamw world-size=2 stage=3 memory-budget=1MiB offload=auto "
    "host-memory-budget=256KiB max-grad-norm=1.0 report=false",
    "optimizer=adamw world-size=2 stage=2 offload=all param-dtype=bf16 frozen-storage=compute "
    "report=false plan=PLAN",
    "optimizer=adamw world-size=2 stage=3 recompute=unit grad-accum=2 offload=all "
    "offload-next-step=true offload-prefetch=true max-grad-norm=1.0 report=false plan=PLAN",
    "optimizer=adamw world-size=3 stage=3 param-dtype=bf16 weight-quantization=int8 "
    "quantization-block=32 report=false plan=PLAN",
    "optimizer=adamw world-size=4 stage=2 mesh=2x2 gradient-quantization=int8 "
    "quantization-block=16 report=false plan=PLAN",
    "optimizer=adamw world-size=4 stage=3 gradient-quantization=int8 ranks-per-node=2 "
    "quantization-block=8 report=false plan=PLAN",
};
constexpr size_t kNumOptions = sizeof(kOptions) / sizeof(kOptions[0]);

MLIRContext &context() {
  static MLIRContext *ctx = [] {
    DialectRegistry registry;
    registry.insert<fsdp::FsdpDialect, func::FuncDialect>();
    auto *c = new MLIRContext(registry);
    c->loadAllAvailableDialects();
    c->disableMultithreading();
    // Errors are the expected answer to most inputs: dropped.
    c->getDiagEngine().registerHandler([](Diagnostic &) { return success(); });
    return c;
  }();
  return *ctx;
}

/// FSDP_FUZZ_STATS=1: at exit, how far the inputs got (most mutants of a
/// model are no longer valid text; the pipeline is reached through the
/// rest).
struct Stats {
  uint64_t inputs = 0, parsed = 0, compiled = 0;
  ~Stats() {
    if (std::getenv("FSDP_FUZZ_STATS"))
      std::fprintf(stderr, "mlir_fuzzer: %llu inputs, %llu parsed and verified, %llu compiled\n",
                   (unsigned long long)inputs, (unsigned long long)parsed,
                   (unsigned long long)compiled);
  }
} stats;

std::string planPath() {
  static std::string path = "/tmp/fsdp-mlir-fuzz-" + std::to_string(getpid()) + ".plan";
  return path;
}

} // namespace

/// LLVM's headers poison and unpoison their allocators' memory by hand
/// when compiled with ASan (llvm/Support/Compiler.h); Debian's LLVM/MLIR
/// libraries are not, so the two halves disagree about what is poisoned
/// (a false use-after-poison in MLIRContext's constructor). Manual
/// poisoning is ignored; ASan's own checks stay.
extern "C" const char *__asan_default_options() { return "allow_user_poisoning=0"; }

/// A token-aware mutation that keeps a model valid text: three times in
/// four it rewrites one number (a dimension, an attribute, a literal) to an
/// edge value or a neighbour, or swaps one op name for another of the
/// input's; otherwise libFuzzer's byte mutations. Mutants of a valid model
/// then mostly still parse and reach the verifiers and the pipeline with
/// odd shapes, heads, offsets and sizes (byte mutations alone leave under
/// 1% of inputs parseable).
extern "C" size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t maxSize);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t maxSize,
                                          unsigned int seed) {
  std::mt19937_64 rng(seed);
  std::string text(reinterpret_cast<char *>(data), size);
  if (rng() % 4 != 0) {
    // Numbers: maximal digit runs.
    std::vector<std::pair<size_t, size_t>> nums, ops;
    for (size_t i = 0; i < text.size();) {
      if (std::isdigit((unsigned char)text[i])) {
        size_t j = i;
        while (j < text.size() && std::isdigit((unsigned char)text[j]))
          ++j;
        nums.push_back({i, j - i});
        i = j;
      } else if (text.compare(i, 5, "fsdp.") == 0) {
        size_t j = i + 5;
        while (j < text.size() && (std::islower((unsigned char)text[j]) || text[j] == '_'))
          ++j;
        ops.push_back({i, j - i});
        i = j;
      } else {
        ++i;
      }
    }
    std::string with;
    size_t at = 0, len = 0;
    if (!nums.empty() && (ops.empty() || rng() % 3 != 0)) {
      auto [i, n] = nums[rng() % nums.size()];
      static const char *const kEdges[] = {"0", "1", "2", "3", "4", "7", "8", "63", "64",
                                           "65", "1023", "4096", "65536", "2147483647",
                                           "2147483648", "4294967296", "9223372036854775807",
                                           "18446744073709551616"};
      std::string old = text.substr(i, n);
      if (rng() % 2 && n < 18) {
        long long v = std::stoll(old) + (rng() % 2 ? 1 : -1);
        with = std::to_string(v < 0 ? 0 : v);
      } else {
        with = kEdges[rng() % (sizeof(kEdges) / sizeof(kEdges[0]))];
      }
      at = i, len = n;
    } else if (!ops.empty()) {
      auto [i, n] = ops[rng() % ops.size()];
      auto [j, m] = ops[rng() % ops.size()];
      with = text.substr(j, m);
      at = i, len = n;
    }
    if (len) {
      text.replace(at, len, with);
      if (text.size() <= maxSize) {
        std::memcpy(data, text.data(), text.size());
        return text.size();
      }
    }
  }
  return LLVMFuzzerMutate(data, size, maxSize);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ++stats.inputs;
  if (size == 0)
    return 0;
  // MLIR's lexer reads up to the NUL after the text (fsdp-opt's files come
  // in a null-terminated MemoryBuffer): a std::string has one.
  const std::string copy(reinterpret_cast<const char *>(data), size);
  llvm::StringRef text(copy);
  int line, col;
  if (fsdp::nestingDepth(text, fsdp::kMaxNesting, line, col) > fsdp::kMaxNesting)
    return 0; // fsdp-opt rejects it before parsing
  MLIRContext &ctx = context();
  ParserConfig config(&ctx);
  OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(text, config);
  if (!module)
    return 0;
  ++stats.parsed;
  // The option set: a hash of the whole input, so any mutation of a valid
  // model (which must stay valid text) also moves it to another set.
  uint64_t h = 1469598103934665603ull; // FNV-1a
  for (size_t i = 0; i < size; ++i)
    h = (h ^ data[i]) * 1099511628211ull;
  std::string opts = kOptions[h % kNumOptions];
  if (size_t at = opts.find("PLAN"); at != std::string::npos)
    opts.replace(at, 4, planPath());
  auto options = fsdp::FsdpPipelineOptions::createFromString(opts);
  if (!options)
    __builtin_trap(); // the table itself is wrong
  PassManager pm(&ctx);
  fsdp::buildFsdpPipeline(pm, *options);
  if (succeeded(pm.run(*module)))
    ++stats.compiled;
  return 0;
}
