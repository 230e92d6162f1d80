//===- fsdp-ckpt.cpp - offline tools for fsdp-run checkpoints -------------===//
//
// `fsdp-ckpt export CKPT OUT.safetensors [--dtype f32|bf16]` consolidates
// the parameters of a sharded checkpoint (CKPT: a checkpoint directory, or
// a --ckpt-dir whose newest complete checkpoint is taken) into one
// safetensors file under the model's own tensor names, loadable by PyTorch
// and by `fsdp-run --init-from`, without running the model or knowing the
// plan: the index's shard map says where every element lives. F32 by
// default (bf16-stored parameters widened exactly); --dtype bf16 writes
// BF16, each value rounded to nearest even (torch's .to(torch.bfloat16)),
// exact for parameters stored in bf16 (master-dtype=bf16): half the bytes. `fsdp-ckpt info CKPT`
// prints the index. `fsdp-ckpt reshard CKPT --plan OTHER.plan OUT` converts it for another plan of
// the same model (another world size, stage or unit grouping): `fsdp-run OTHER.plan --resume OUT`
// continues the training. Exit codes: 0 success, 1 error, 2 usage.
//
//===----------------------------------------------------------------------===//

#include "runtime/core/Bf16.h"
#include "runtime/core/Checkpoint.h"

#include <cstdio>
#include <cstring>
#include <string>

using namespace fsdp;

static const char *kUsage =
    "usage: fsdp-ckpt export CKPT OUT.safetensors [--dtype f32|bf16]\n"
    "                                               consolidated parameters\n"
    "       fsdp-ckpt info CKPT                     step, layout, data position\n"
    "       fsdp-ckpt reshard CKPT --plan P OUT     the checkpoint for plan P, in OUT\n"
    "CKPT: a checkpoint directory (step-NNNNNNNN) or the --ckpt-dir holding them\n"
    "(its newest complete checkpoint).\n";

static int fail(const Status &st) {
  std::fprintf(stderr, "fsdp-ckpt: error: %s\n", st.message().c_str());
  return 1;
}

int main(int argc, char **argv) {
  if (argc >= 2 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::printf("%s", kUsage);
    return 0;
  }
  std::string cmd = argc >= 2 ? argv[1] : "";
  const bool typed = cmd == "export" && argc == 6 && !std::strcmp(argv[4], "--dtype");
  if (!((cmd == "export" && (argc == 4 || typed)) || (cmd == "info" && argc == 3) ||
        (cmd == "reshard" && argc == 6 && !std::strcmp(argv[3], "--plan")))) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const std::string dtype = typed ? argv[5] : "f32";
  if (dtype != "f32" && dtype != "bf16") {
    std::fprintf(stderr, "fsdp-ckpt: error: --dtype '%s': expected f32 or bf16\n%s", dtype.c_str(),
                 kUsage);
    return 2;
  }
  std::string path;
  Status st = latestCheckpoint(argv[2], path);
  if (!st)
    return fail(st);
  if (cmd == "info") {
    nlohmann::json index;
    if (!(st = readCheckpointIndex(path, index)))
      return fail(st);
    int64_t world = index["world_size"].get<int64_t>();
    const nlohmann::json &mesh = index.value("mesh", nlohmann::json());
    bool meshed = mesh.is_array() && mesh.size() == 2 && mesh[0].is_number_integer() &&
                  mesh[1].is_number_integer();
    std::printf("%s: step %lld, %lld rank(s) (mesh %lldx%lld), stage %lld, model %s, %zu "
                "parameters\n",
                path.c_str(), (long long)index["step"].get<int64_t>(), (long long)world,
                (long long)(meshed ? mesh[0].get<int64_t>() : 1),
                (long long)(meshed ? mesh[1].get<int64_t>() : world),
                (long long)index["stage"].get<int64_t>(),
                index["model"].is_string() ? index["model"].get<std::string>().c_str() : "?",
                index["shard_map"]["params"].size());
    // The storage dtypes: whether the optimizer state is f32 or bf16
    // (optimizer-state-dtype) before a resume converts it.
    if (std::string storage = checkpointStorage(index); !storage.empty())
      std::printf("  storage: %s\n", storage.c_str());
    // Where the data stands, for a resume on another layout.
    const nlohmann::json &data = index.value("data", nlohmann::json());
    if (data.is_object() && data.value("spec", nlohmann::json()).is_string()) {
      std::string spec = data["spec"];
      std::printf("  data: %s", spec.empty() ? "(not recorded)" : spec.c_str());
      const nlohmann::json &items = data.value("items_per_step", nlohmann::json());
      if (items.is_number_integer() && items.get<int64_t>() > 0)
        std::printf(", %lld per step", (long long)items.get<int64_t>());
      const nlohmann::json &rows = data.value("rows_consumed", nlohmann::json());
      if (rows.is_number_integer() && rows.get<int64_t>() >= 0)
        std::printf(", %lld rows of the stream consumed", (long long)rows.get<int64_t>());
      std::printf("\n");
    }
    return 0;
  }
  if (cmd == "reshard") {
    Plan target;
    std::vector<std::string> converted;
    if (!(st = loadPlan(argv[4], target)) ||
        !(st = reshardCheckpoint(path, target, argv[5], &converted)))
      return fail(st);
    std::printf("%s: the checkpoint of %s for %s (%lld rank(s), stage %lld)\n", argv[5],
                path.c_str(), argv[4], (long long)target.worldSize, (long long)target.stage);
    if (!converted.empty())
      std::printf("converted: %s\n", conversionNote(converted).c_str());
    return 0;
  }
  TensorMap params;
  if (!(st = exportCheckpoint(path, params)))
    return fail(st);
  if (dtype == "bf16")
    for (auto &[name, t] : params) {
      if (t.dtype != DType::F32) // exportCheckpoint's tensors are f32
        return fail(FSDP_ERROR(name, ": exported as ", dtypeName(t.dtype), ", not f32"));
      std::vector<uint8_t> narrow(t.data.size() / 2);
      narrowParams(DType::BF16, reinterpret_cast<const float *>(t.data.data()),
                   (int64_t)(t.data.size() / 4), narrow.data());
      t.dtype = DType::BF16;
      t.data = std::move(narrow);
    }
  if (!(st = writeSafeTensors(argv[3], params,
                              {{"format", "pt"}, {"producer", "fsdp-ckpt"}})))
    return fail(st);
  std::printf("%s: %zu parameters from %s (%s)\n", argv[3], params.size(), path.c_str(),
              dtype == "bf16" ? "BF16, rounded to nearest" : "F32");
  return 0;
}
