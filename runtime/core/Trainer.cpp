//===- Trainer.cpp - the training loop of fsdp-run ------------------------===//

#include "runtime/core/Trainer.h"

#include "runtime/core/Checkpoint.h"
#include "runtime/core/Data.h"
#include "runtime/core/Executor.h"
#include "runtime/core/InitFrom.h"
#include "runtime/core/SafeTensors.h"
#include "runtime/core/SwapFile.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdp {

const char *trainUsage() {
  return R"(usage: fsdp-run PLAN [options]

Runs the training step a plan describes (fsdp-opt --fsdp-pipeline=...plan=PLAN).

  --steps N            steps to run (default 10)
  --lr F               peak learning rate (default 1e-3)
  --schedule S         constant | cosine | linear | wsd (default constant).
                       Warmup is linear from 0: lr * t / W for t <= W (t from 1).
                       Then constant stays at lr; cosine decays as
                       min_lr + (lr - min_lr) (1 + cos(pi (t - W) / (steps - W))) / 2;
                       linear as min_lr + (lr - min_lr) (steps - t) / (steps - W);
                       wsd (warmup-stable-decay) stays at lr, then decays
                       to min_lr over the last D steps (--decay-shape). Each
                       decay reaches min_lr at the last step.
  --warmup W           warmup steps (default 0)
  --min-lr F           floor of the decaying schedules (default 0)
  --decay-steps D      wsd's decay steps (default: a tenth of --steps, at least 1)
  --decay-shape S      wsd's decay, f the fraction of its steps done: linear
                       (1 - f, default), cosine ((1 + cos(pi f)) / 2) or 1-sqrt
                       (1 - sqrt(f), Hagele et al. 2024's cooldown)
  --seed N             seed of the parameter init and synthetic data (default 1234)
  --data SPEC          synthetic (default) or the path of an llm.c token file
  --loss-mask FILE     with --data FILE: a token file of the same length whose
                       0 entries mark tokens that are not targets (a prompt,
                       padding): their labels become the plan's ignore_index
                       (cross_entropy's, e.g. -100), left out of the loss,
                       which is the mean over the kept labels of the whole
                       step (every rank and micro-batch)
  --device D           cpu (default) or cuda: the backend that runs the plan
  --comm C             auto (default), shm, gloo or hybrid: how ranks exchange
                       data on the host. shm: shared memory, all ranks on this
                       machine; gloo: TCP, any machines; hybrid: shared memory
                       within each node and Gloo between nodes (collectives in
                       two levels, as NCCL does); auto: shm when the launch
                       says every rank is on this machine (--nproc, LOCAL_WORLD_SIZE
                       == WORLD_SIZE), else hybrid where nodes hold several
                       ranks, else gloo. Same plan, same losses up to the
                       summation order
  --allow-tf32         cuda: float32 GEMMs may round inputs to TF32 (off: exact f32)
                       (a plan does not depend on it)
  --cuda-graphs        cuda: capture the second step as a CUDA graph and replay
                       it every later step (one launch per step; NCCL only:
                       not with ranks sharing a GPU, nor with --trace)
  --threads N          compute threads per rank (OpenMP + OpenBLAS)
  --log-every N        print every N steps (default 1)
  --dump-dir DIR       write init/final parameters, the parameters after every
                       step, batches, gradients and a log for the PyTorch
                       oracle (small models: it keeps every step in memory)
  --init-from PATH     start from the parameters of a checkpoint: a .safetensors
                       file, a Hugging Face sharded checkpoint's index
                       (model.safetensors.index.json: each tensor's shard file,
                       relative to the index), or a directory holding that
                       index or else model.safetensors. Every tensor must be a
                       parameter of the model and vice versa, shapes equal;
                       F32, BF16, F16 (widened exactly) and F64 (rounded to
                       nearest) load as torch's load_state_dict does. Each
                       rank reads only its own slice of every parameter.
                       Or an fsdp-run checkpoint directory (--ckpt-dir, any
                       world size and stage): the newest committed one's
                       parameters, without its optimizer state or step
  --nvme-dir DIR        where a plan compiled with offload-nvme=true keeps its
                       optimizer state: one swap file a rank, reserved at start
                       and unlinked at once (nothing is left behind); put it on
                       a fast local disk
  --nvme-io MODE       how the swap file is read and written: auto (default:
                       O_DIRECT, past the page cache, where the plan and the
                       file system allow it, else buffered, saying why),
                       direct (O_DIRECT or an error) or buffered (pread /
                       pwrite through the page cache)
  --save FILE          write the final parameters (consolidated) as .safetensors
  --ckpt-dir DIR       write sharded training-state checkpoints (parameters,
                       optimizer state, step, schedule, data position) under
                       DIR/step-NNNNNNNN/, at the last step and every
                       --save-every steps (docs/CHECKPOINTS.md)
  --save-every K       checkpoint every K steps (needs --ckpt-dir)
  --keep M             keep the newest M checkpoints (default 0: all)
  --async-save         write checkpoints in the background: a save blocks
                       training only for a copy of this rank's state into
                       host memory; the file is written, and the checkpoint
                       committed, while the next steps run (one save in
                       flight; the end of training waits for the last)
  --resume DIR         continue from the newest complete checkpoint in DIR
                       (or that checkpoint directory): bitwise the run that
                       was not interrupted, with the same plan and --steps
  --eval-every N       validation loss before the first step, every N steps
                       and after the last: the step's forward pass on
                       --eval-batches batches of --eval-data, averaged over
                       them and the ranks; training is unchanged by it
  --eval-data SPEC     synthetic (default: a held-out stream, another seed than
                       training's) or an llm.c token file (needed when --data
                       is a file); each evaluation reads its first batches
  --eval-batches K     batches per evaluation (default 4)
  --eval-loss-mask FILE  --loss-mask for --eval-data's token file
  --trace FILE         write the measured timeline of every step (each
                       instruction on the compute thread, each collective on
                       the communication thread, every rank) as Chrome trace
                       JSON: open it in ui.perfetto.dev beside fsdp-sim's
                       predicted one. cuda: each instruction's span is the
                       GPU's time between timing events on the compute stream
                       (the step runs as it does untraced)
  --trace-sync         with --trace on cuda: synchronize after every
                       instruction instead (each one's cost alone, no overlap)
  --calibrate          no plan: time this machine's kernels and (with --nproc N)
                       collectives and print the device profile fsdp-sim reads;
                       with --nvme-dir also the swap file's disk rates there
  --json               one JSON object per step instead of the human line
                       (plans that clip or scale the loss add the step's global
                       gradient norm before clipping: "norm" in the line,
                       "grad_norm" in JSON, "grad_norms" in --dump-dir's log.json)
  --quiet              only the summary
  --gradcheck K        plans compiled with optimizer=none: compare K sampled
                       elements per parameter with central finite differences
  --gradcheck-tol F    relative tolerance of the gradient check (default 2e-2)
  --nproc N            launch N local ranks (CPU; shared memory by default)
  --nnodes K           with --nproc N: as K nodes of N / K consecutive ranks each
                       (a multi-node job's layout on one machine: --comm auto
                       runs hybrid)
)";
}

Status parseTrainOptions(int argc, char **argv, TrainOptions &opt, bool &help) {
  help = false;
  auto need = [&](int &i) -> const char * {
    return i + 1 < argc ? argv[++i] : nullptr;
  };
  // Whole-string numbers only; out of range (errno) is invalid, not clamped.
  auto toInt = [](const char *s, int64_t &v) {
    char *end;
    errno = 0;
    v = std::strtoll(s, &end, 10);
    return *s && !*end && errno == 0;
  };
  auto toDouble = [](const char *s, double &v) {
    char *end;
    errno = 0;
    v = std::strtod(s, &end);
    return *s && !*end && errno == 0 && std::isfinite(v);
  };
  static const char *valued[] = {
      "--steps",         "--lr",          "--schedule",       "--warmup",     "--min-lr",
      "--decay-steps",   "--decay-shape", "--seed",           "--data",       "--threads",
      "--log-every",     "--dump-dir",    "--init-from",      "--save",       "--gradcheck",
      "--gradcheck-tol", "--ckpt-dir",    "--save-every",     "--keep",       "--resume",
      "--trace",         "--device",      "--comm",           "--eval-every", "--eval-data",
      "--eval-batches",  "--loss-mask",   "--eval-loss-mask", "--nvme-dir",   "--nvme-io"};
  bool evalBatchesSet = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help = true;
      return Status::ok();
    }
    if (a.rfind("--", 0) != 0) {
      if (!opt.planPath.empty())
        return FSDP_ERROR("unexpected argument '", a, "' (the plan is '",
                          opt.planPath, "')");
      opt.planPath = a;
      continue;
    }
    if (a == "--calibrate") {
      opt.calibrate = true;
      continue;
    }
    if (a == "--async-save") {
      opt.asyncSave = true;
      continue;
    }
    if (a == "--allow-tf32") {
      opt.allowTf32 = true;
      continue;
    }
    if (a == "--cuda-graphs") {
      opt.cudaGraphs = true;
      continue;
    }
    if (a == "--trace-sync") {
      opt.traceSync = true;
      continue;
    }
    if (a == "--json" || a == "--quiet") {
      (a == "--json" ? opt.json : opt.quiet) = true;
      continue;
    }
    if (std::find_if(std::begin(valued), std::end(valued), [&](const char *o) {
          return a == o;
        }) == std::end(valued))
      return FSDP_ERROR("unknown option '", a, "' (fsdp-run --help lists them)");
    const char *v = need(i);
    if (!v)
      return FSDP_ERROR("option ", a, " needs a value");
    int64_t iv = 0;
    double dv = 0;
    auto badValue = [&]() {
      return FSDP_ERROR("invalid value '", v, "' for ", a);
    };
    if (a == "--steps") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.steps = iv;
    } else if (a == "--lr") {
      if (!toDouble(v, dv) || dv < 0)
        return badValue();
      opt.lr = dv;
    } else if (a == "--schedule") {
      opt.schedule = v;
      if (!isLrScheduleKind(opt.schedule))
        return FSDP_ERROR("--schedule must be ", lrScheduleKinds(), ", found '", v, "'");
    } else if (a == "--warmup") {
      if (!toInt(v, iv) || iv < 0)
        return badValue();
      opt.warmup = iv;
    } else if (a == "--min-lr") {
      if (!toDouble(v, dv) || dv < 0)
        return badValue();
      opt.minLr = dv;
    } else if (a == "--decay-shape") {
      if (!isLrDecayShape(v))
        return FSDP_ERROR("--decay-shape must be ", lrDecayShapes(), ", found '", v, "'");
      opt.decayShape = v;
    } else if (a == "--decay-steps") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.decaySteps = iv;
    } else if (a == "--seed") {
      if (!toInt(v, iv) || iv < 0)
        return badValue();
      opt.seed = (uint64_t)iv;
    } else if (a == "--data") {
      opt.data = v;
    } else if (a == "--loss-mask") {
      opt.lossMask = v;
    } else if (a == "--device") {
      if (std::strcmp(v, "cpu") != 0 && std::strcmp(v, "cuda") != 0)
        return FSDP_ERROR("--device must be cpu or cuda, found '", v, "'");
      opt.device = v;
    } else if (a == "--comm") {
      if (std::strcmp(v, "auto") != 0 && std::strcmp(v, "shm") != 0 &&
          std::strcmp(v, "gloo") != 0 && std::strcmp(v, "hybrid") != 0)
        return FSDP_ERROR("--comm must be auto, shm, gloo or hybrid, found '", v, "'");
      opt.comm = v;
    } else if (a == "--threads") {
      if (!toInt(v, iv) || iv < 1 || iv > 1024)
        return badValue();
      opt.threads = (int)iv;
    } else if (a == "--log-every") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.logEvery = iv;
    } else if (a == "--dump-dir") {
      opt.dumpDir = v;
    } else if (a == "--init-from") {
      opt.initFrom = v;
    } else if (a == "--nvme-dir") {
      opt.nvmeDir = v;
    } else if (a == "--nvme-io") {
      if (!parseSwapIoMode(v, opt.nvmeIo))
        return FSDP_ERROR("--nvme-io: expected auto, direct or buffered, found '", v, "'");
    } else if (a == "--save") {
      opt.save = v;
    } else if (a == "--ckpt-dir") {
      opt.ckptDir = v;
    } else if (a == "--save-every") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.saveEvery = iv;
    } else if (a == "--keep") {
      if (!toInt(v, iv) || iv < 0)
        return badValue();
      opt.keep = iv;
    } else if (a == "--resume") {
      opt.resume = v;
    } else if (a == "--trace") {
      opt.trace = v;
    } else if (a == "--eval-every") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.evalEvery = iv;
    } else if (a == "--eval-data") {
      opt.evalData = v;
    } else if (a == "--eval-loss-mask") {
      opt.evalLossMask = v;
    } else if (a == "--eval-batches") {
      if (!toInt(v, iv) || iv < 1 || iv > 1000000)
        return badValue();
      opt.evalBatches = iv;
      evalBatchesSet = true;
    } else if (a == "--gradcheck") {
      if (!toInt(v, iv) || iv < 1)
        return badValue();
      opt.gradcheck = iv;
    } else if (a == "--gradcheck-tol") {
      if (!toDouble(v, dv) || dv <= 0)
        return badValue();
      opt.gradcheckTol = dv;
    }
  }
  if (opt.planPath.empty() && !opt.calibrate)
    return FSDP_ERROR("no plan file given");
  if (opt.saveEvery > 0 && opt.ckptDir.empty())
    return FSDP_ERROR("--save-every needs --ckpt-dir");
  if (opt.asyncSave && opt.ckptDir.empty())
    return FSDP_ERROR("--async-save needs --ckpt-dir");
  if (opt.traceSync && opt.trace.empty())
    return FSDP_ERROR("--trace-sync needs --trace FILE");
  if ((!opt.evalData.empty() || evalBatchesSet || !opt.evalLossMask.empty()) && opt.evalEvery == 0)
    return FSDP_ERROR("--eval-data, --eval-batches and --eval-loss-mask need --eval-every N");
  if (opt.evalEvery > 0 && opt.evalData.empty() && opt.data != "synthetic")
    return FSDP_ERROR("--eval-every: training reads the token file '", opt.data,
                      "'; name the held-out one with --eval-data");
  if (opt.evalEvery > 0 && opt.gradcheck > 0)
    return FSDP_ERROR("--gradcheck does not train: --eval-every has nothing to do");
  if (!opt.resume.empty() && !opt.initFrom.empty())
    return FSDP_ERROR("--resume and --init-from both set the parameters: pick one");
  if (opt.schedule != "constant" && opt.minLr > opt.lr)
    return FSDP_ERROR("--min-lr (", opt.minLr, ") exceeds --lr (", opt.lr, ")");
  if (opt.decaySteps >= 0 && opt.schedule != "wsd")
    return FSDP_ERROR("--decay-steps is wsd's (warmup-stable-decay); --schedule is ", opt.schedule);
  if (!opt.decayShape.empty() && opt.schedule != "wsd")
    return FSDP_ERROR("--decay-shape is wsd's (warmup-stable-decay); --schedule is ", opt.schedule);
  if (opt.schedule == "wsd") {
    if (opt.decaySteps < 0)
      opt.decaySteps = std::max<int64_t>(1, opt.steps / 10);
    if (opt.warmup + opt.decaySteps > opt.steps)
      return FSDP_ERROR("--schedule wsd: --warmup ", opt.warmup, " and --decay-steps ",
                        opt.decaySteps, " exceed --steps ", opt.steps);
  }
  return Status::ok();
}

namespace {

/// What a checkpoint records of the LR schedule (TrainingPosition's
/// `schedule`): a resumed run with another record is told so. wsd's decay
/// length only where it means something.
nlohmann::json scheduleRecord(const LrSchedule &s) {
  nlohmann::json j = {{"lr", s.lr},
                      {"schedule", s.kind},
                      {"warmup", s.warmup},
                      {"min_lr", s.minLr},
                      {"steps", s.steps}};
  if (s.kind == "wsd") {
    j["decay_steps"] = s.decaySteps;
    if (s.decayShape != "linear") // checkpoints from before --decay-shape stay the same run
      j["decay_shape"] = s.decayShape;
  }
  return j;
}

std::string human(double bytes) {
  const char *u[] = {"B", "KiB", "MiB", "GiB"};
  int i = 0;
  while (bytes >= 1024 && i < 3) {
    bytes /= 1024;
    ++i;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, i ? "%.2f %s" : "%.0f %s", bytes, u[i]);
  return buf;
}

Status makeDir(const std::string &dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    return FSDP_ERROR("cannot create directory '", dir, "': ", std::strerror(errno));
  return Status::ok();
}

/// Copies the current batch (input/target bindings) into `out`.
void recordBatch(const Plan &plan, const Executor &ex, int64_t step, TensorMap &out) {
  for (const Binding &b : plan.inputs) {
    if (b.role != "input" && b.role != "target")
      continue;
    const Buffer &buf = plan.buffers[b.buffer];
    Tensor t;
    t.dtype = buf.dtype;
    t.shape = buf.shape;
    t.data.resize(buf.bytes);
    (void)ex.readBuffer(b.buffer, t.data.data());
    out["step" + std::to_string(step) + "." + b.name] = std::move(t);
  }
}

/// Ulps of the float32 loss that central differences cannot resolve at
/// least (the loss's final float32 store, half an ulp in each of the two
/// evaluations, and a few downstream roundings): a floor under the noise
/// measured per parameter; see [Note: finite-difference noise].
constexpr double kNoiseUlps = 4;
/// Standard deviations of the measured noise that bound one evaluation's.
constexpr double kNoiseSigmas = 5;

double ulpOf(double x) {
  float f = (float)x;
  return (double)std::nextafter(f, INFINITY) - (double)f;
}

/// The standard deviation of the rounding noise in the float32 loss as a
/// function of one parameter element, measured as More and Wild's ECnoise
/// does: the loss at 9 points spanning the central difference's step (so
/// the values downstream round as differently as they do there), and
/// sigma_j^2 = (j!)^2 / (2j)! mean((Delta^j f)^2) from the j-th
/// differences, which annihilate the smooth part (its j-th derivative
/// times (1.25e-4 relative)^j, far below a float32 ulp for j >= 4) and
/// leave the noise. The largest of sigma_4 .. sigma_6.
Status measureLossNoise(Executor &ex, const Param &p, int64_t i, float v, double &sigma) {
  constexpr int kPoints = 9;
  double f[kPoints];
  double d = 1e-3 * std::max(1.0f, std::fabs(v)) / (kPoints - 1);
  for (int j = 0; j < kPoints; ++j) {
    float l;
    FSDP_RETURN_IF_ERROR(ex.setParamElement(p, i, (float)(v + (j - kPoints / 2) * d)));
    FSDP_RETURN_IF_ERROR(ex.step(1, 0.0, l));
    f[j] = l;
  }
  FSDP_RETURN_IF_ERROR(ex.setParamElement(p, i, v));
  sigma = 0;
  double gamma = 1; // (j!)^2 / (2j)!
  for (int j = 1; j <= 6; ++j) {
    for (int m = 0; m + j < kPoints; ++m)
      f[m] = f[m + 1] - f[m];
    gamma *= double(j) / (2 * (2 * j - 1));
    if (j < 4)
      continue;
    double sum2 = 0;
    for (int m = 0; m + j < kPoints; ++m)
      sum2 += f[m] * f[m];
    sigma = std::max(sigma, std::sqrt(gamma * sum2 / (kPoints - j)));
  }
  return Status::ok();
}

Status gradCheck(const TrainOptions &opt, const Plan &plan, Executor &ex,
                 DataSource &data, Communicator &comm) {
  bool hasGrads = false;
  for (const Binding &b : plan.outputs)
    hasGrads |= b.role == "grad";
  if (!hasGrads)
    return FSDP_ERROR("--gradcheck needs a plan that outputs gradients: compile "
                      "with optimizer=none");
  if (comm.size() != 1)
    return FSDP_ERROR("--gradcheck runs on one rank");
  for (const Buffer &b : plan.buffers)
    if (b.dtype == DType::BF16 || b.dtype == DType::F16)
      return FSDP_ERROR("--gradcheck compares float32 central differences; this "
                        "plan computes in ", dtypeName(b.dtype), " (buffer ", b.name,
                        "), whose rounding (2^-8 for bf16) swamps them: check the "
                        "gradient rules on a plan compiled with param-dtype=f32");
  FSDP_RETURN_IF_ERROR(ex.fillInputs(data, 1));
  float loss0;
  FSDP_RETURN_IF_ERROR(ex.step(1, 0.0, loss0));
  TensorMap grads;
  FSDP_RETURN_IF_ERROR(ex.gradOutputs(grads));
  int failures = 0;
  std::printf("gradient check: %lld sampled elements per parameter, central "
              "differences in float32\n", (long long)opt.gradcheck);
  for (const Param &p : plan.params) {
    if (!p.trainable)
      continue;
    auto it = grads.find(p.name);
    if (it == grads.end())
      return FSDP_ERROR("the plan publishes no gradient for ", p.name);
    const float *g = reinterpret_cast<const float *>(it->second.data.data());
    int64_t n = p.numel();
    double maxAbs = 0;
    for (int64_t i = 0; i < n; ++i)
      maxAbs = std::max(maxAbs, (double)std::fabs(g[i]));
    int64_t k = std::min(opt.gradcheck, n);
    double errNorm2 = 0, gNorm2 = 0, noise2 = 0, worst = 0;
    int64_t kinks = 0;
    double sigma = -1; // the loss's rounding noise, measured at the first element
    for (int64_t j = 0; j < k; ++j) {
      int64_t i = (j * n) / k + (n / k) / 2;
      if (!ex.holdsParamElement(p, i))
        continue;
      float v;
      FSDP_RETURN_IF_ERROR(ex.getParamElement(p, i, v));
      if (sigma < 0)
        FSDP_RETURN_IF_ERROR(measureLossNoise(ex, p, i, v, sigma));
      // The perturbed values as float32 stores them: dividing by the step
      // actually taken removes the representation error of v +- h.
      float vp = (float)(v + 1e-3 * std::max(1.0f, std::fabs(v)));
      float vm = (float)(v - 1e-3 * std::max(1.0f, std::fabs(v)));
      float lp, lm;
      FSDP_RETURN_IF_ERROR(ex.setParamElement(p, i, vp));
      FSDP_RETURN_IF_ERROR(ex.step(1, 0.0, lp));
      FSDP_RETURN_IF_ERROR(ex.setParamElement(p, i, vm));
      FSDP_RETURN_IF_ERROR(ex.step(1, 0.0, lm));
      FSDP_RETURN_IF_ERROR(ex.setParamElement(p, i, v));
      double step = (double)vp - (double)vm;
      double fd = ((double)lp - (double)lm) / step;
      // [Note: finite-difference noise] The loss comes back as a float32,
      // and every value downstream of the perturbed element rounds afresh
      // in each evaluation: lp and lm each carry a rounding error that no
      // formula of this plan's arithmetic bounds tightly (it depends on
      // every op between the element and the loss, and on the BLAS
      // kernel's summation order). So it is measured: sigma, the standard
      // deviation of the loss's rounding noise near this parameter
      // (measureLossNoise); each evaluation is within kNoiseSigmas sigma of
      // the exact value, and never credited with less than kNoiseUlps ulps
      // of the loss between the two. An element whose gradient is below
      // what this resolves is checked only through the norm-wise test.
      double noise = std::max(kNoiseUlps * ulpOf(std::max(std::fabs(lp), std::fabs(lm))),
                              2 * kNoiseSigmas * sigma) /
                     step;
      double err = std::fabs(fd - g[i]);
      double allowed = opt.gradcheckTol * std::fabs(g[i]) + noise;
      // A kink (relu at 0, max) within the step: the one-sided differences
      // disagree although each is a fair estimate of a one-sided slope.
      // There is no derivative to check there; a smooth function's
      // one-sided differences agree to its curvature times the step.
      double right = ((double)lp - (double)loss0) / ((double)vp - (double)v);
      double left = ((double)loss0 - (double)lm) / ((double)v - (double)vm);
      if (std::fabs(right - left) > 2 * (allowed + 2 * noise) &&
          std::fabs(right - left) > 0.5 * std::max(std::fabs(right), std::fabs(left))) {
        ++kinks;
        continue;
      }
      worst = std::max(worst, err / allowed);
      if (err > allowed) {
        ++failures;
        std::printf("  MISMATCH %s[%lld]: analytic %.6e, finite difference %.6e "
                    "(allowed difference %.2e)\n",
                    p.name.c_str(), (long long)i, g[i], fd, allowed);
      }
      errNorm2 += err * err;
      gNorm2 += (double)g[i] * g[i];
      noise2 += noise * noise;
    }
    // Norm-wise over the sampled elements: a wrong rule moves the whole
    // vector, rounding noise adds at most its own norm.
    double normErr = std::sqrt(errNorm2);
    double normAllowed = opt.gradcheckTol * std::sqrt(gNorm2) + std::sqrt(noise2);
    if (normErr > normAllowed) {
      ++failures;
      std::printf("  MISMATCH %s: |analytic - finite difference| = %.3e over the "
                  "sampled elements, allowed %.3e\n",
                  p.name.c_str(), normErr, normAllowed);
    }
    std::printf("  %-40s %8lld elements  max |g| %.3e  worst err/allowed %.2f  "
                "norm err/allowed %.2f  loss noise %.2f ulps%s\n",
                p.name.c_str(), (long long)n, maxAbs, worst,
                normAllowed > 0 ? normErr / normAllowed : 0.0,
                sigma > 0 ? sigma / ulpOf(loss0) : 0.0,
                kinks ? ("  (" + std::to_string(kinks) +
                         " at a kink, not differentiable within the step)")
                            .c_str()
                      : "");
    // Kinks are rare at random points; a rule that is wrong everywhere
    // cannot hide behind them.
    if (2 * kinks > k) {
      ++failures;
      std::printf("  MISMATCH %s: %lld of %lld sampled elements have one-sided "
                  "differences that disagree\n",
                  p.name.c_str(), (long long)kinks, (long long)k);
    }
  }
  if (failures)
    return FSDP_ERROR("gradient check failed for ", failures, " element(s)");
  std::printf("gradient check passed\n");
  return Status::ok();
}

/// Checked before training, so a bad path costs seconds, not the whole run
/// (the writer checks again: the file system may change meanwhile).
Status checkOutputPath(const std::string &path, const char *option) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return FSDP_ERROR(option, " '", path, "' exists and is not a regular file; "
                      "refusing to replace it");
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  if (dir.empty())
    dir = ".";
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return FSDP_ERROR(option, " '", path, "': the directory '", dir,
                      "' does not exist");
  return Status::ok();
}

} // namespace

/// Chrome trace JSON of every rank's spans, written by rank 0: each rank's
/// events travel to rank 0 by broadcast (so it works across machines),
/// one process per rank, threads "compute" and "communication", "host"
/// when the plan has async host updates (fsdp-offload), and "swap-in" and
/// "swap-out" when it swaps optimizer state with a file (offload-nvme),
/// "node communication" when it runs collectives on the node comm stream
/// ([Note: node comm stream] in Device.h). A
/// collective's span also names its group and the whole buffer's bytes
/// (fsdp-sim's predicted trace does the same).
static Status writeTrace(const std::string &path, const Plan &plan, Executor &ex,
                         Communicator &comm) {
  nlohmann::json mine = nlohmann::json::array();
  for (const TraceEvent &e : ex.traceEvents()) {
    nlohmann::json args = {{"step", e.step}, {"instruction", e.index}};
    if ((e.track == kCommTrack || e.track == kNodeCommTrack) && e.index >= 0 &&
        e.index < (int64_t)plan.program.size()) {
      const Instruction &inst = plan.program[e.index];
      auto g = inst.attrs.find("group");
      args["group"] = g != inst.attrs.end() && g->is_string() ? g->get<std::string>() : "world";
      int64_t whole = inst.op == "all_gather" ? inst.out[0] : inst.in[0];
      args["bytes"] = plan.buffers[whole].bytes;
    }
    static const char *const kCategory[] = {"compute", "comm", "host", "copy",
                                            "swap",    "swap", "comm"};
    mine.push_back({{"name", e.name},
                    {"cat", kCategory[e.track]},
                    {"ph", "X"},
                    {"pid", comm.rank()},
                    {"tid", e.track},
                    {"ts", e.startUs},
                    {"dur", e.durUs},
                    {"args", std::move(args)}});
  }
  const bool host =
      std::any_of(plan.program.begin(), plan.program.end(),
                  [&](const Instruction &i) { return isHostInstruction(plan, i) && isAsync(i); });
  const bool swaps = std::any_of(plan.program.begin(), plan.program.end(),
                                 [](const Instruction &i) { return !i.swaps.empty(); });
  std::vector<int> threads = {kComputeTrack, kCommTrack};
  if (host || swaps)
    threads.push_back(kHostTrack);
  if (swaps)
    threads.insert(threads.end(), {kSwapInTrack, kSwapOutTrack});
  if (std::any_of(plan.program.begin(), plan.program.end(), onNodeCommStream))
    threads.push_back(kNodeCommTrack);
  nlohmann::json all = nlohmann::json::array();
  for (int64_t r = 0; r < comm.size(); ++r) {
    std::string text = r == comm.rank() ? mine.dump() : std::string();
    int64_t n = (int64_t)text.size();
    FSDP_RETURN_IF_ERROR(comm.broadcast(&n, sizeof n, r));
    text.resize(n);
    FSDP_RETURN_IF_ERROR(comm.broadcast(text.data(), n, r));
    if (comm.rank() != 0)
      continue;
    for (auto &e : nlohmann::json::parse(text))
      all.push_back(std::move(e));
    all.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r},
                   {"args", {{"name", "rank " + std::to_string(r)}}}});
    static const char *const kThread[] = {
        "compute", "communication", "host", "copy", "swap-in", "swap-out", "node communication"};
    for (int t : threads)
      all.push_back({{"name", "thread_name"},
                     {"ph", "M"},
                     {"pid", r},
                     {"tid", t},
                     {"args", {{"name", kThread[t]}}}});
  }
  if (comm.rank() != 0)
    return Status::ok();
  nlohmann::json doc = {{"traceEvents", all}, {"displayTimeUnit", "ms"},
                        {"otherData", {{"source", "fsdp-run (measured)"}}}};
  return writeFileAtomic(path, doc.dump());
}

namespace {

/// One fsdp-run training run, in the order run() calls its steps:
/// loadPlan, resumeFrom, openData (or the gradient check), openDump,
/// printHeader, a first validation, then for each step runStep (fill the
/// batch, step, record, checkpoint, report, validate), and at the end
/// writeOutputs (trace, dump folder, --save) and printSummary. What a step
/// finds is kept in the members below it.
class TrainingRun {
public:
  TrainingRun(const TrainOptions &opt, Communicator &comm, Device &device)
      : opt(opt), comm(comm), device(device), root(comm.rank() == 0) {}

  Status run() {
    FSDP_RETURN_IF_ERROR(loadPlan());
    FSDP_RETURN_IF_ERROR(resumeFrom());
    FSDP_RETURN_IF_ERROR(openData());
    if (opt.gradcheck > 0)
      return gradCheck(opt, plan, *ex, *data, comm);
    FSDP_RETURN_IF_ERROR(openDump());
    printHeader();
    FSDP_RETURN_IF_ERROR(startLoop());
    if (evalSource)
      FSDP_RETURN_IF_ERROR(validate(firstStep - 1));
    for (int64_t s = firstStep; s <= opt.steps; ++s)
      FSDP_RETURN_IF_ERROR(runStep(s));
    MemoryMeasurement m = ex->measureMemory();
    FSDP_RETURN_IF_ERROR(writeOutputs(m));
    if (saver.busy()) { // the last checkpoint, written while the outputs were
      auto t = std::chrono::steady_clock::now();
      FSDP_RETURN_IF_ERROR(saver.finish(comm));
      finishMs =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
    }
    if (root)
      printSummary(m);
    return Status::ok();
  }

private:
  /// The plan, its executor with initialized parameters, and --init-from.
  Status loadPlan() {
    FSDP_RETURN_IF_ERROR(fsdp::loadPlan(opt.planPath, plan));
    // Hierarchical qgZ's node groups are the compiler's idea of a node
    // (ranks-per-node): on a multi-node job with other nodes they are
    // still right, but their exchanges are not the ones the plan was
    // priced for.
    if (root && plan.meshNode > 1 && opt.localWorldSize > 0 && opt.localWorldSize < comm.size() &&
        opt.localWorldSize != plan.meshNode)
      std::fprintf(stderr,
                   "warning: the plan reduces gradients in two levels over nodes of %lld "
                   "ranks (ranks-per-node); this job runs %lld ranks a node, so its "
                   "\"node\" and \"cross\" exchanges do not follow the machines (correct, "
                   "not as priced): compile with ranks-per-node=%lld\n",
                   (long long)plan.meshNode, (long long)opt.localWorldSize,
                   (long long)opt.localWorldSize);
    ex = std::make_unique<Executor>(plan, comm, device);
    ex->setNvmeDir(opt.nvmeDir);
    ex->setNvmeIo(opt.nvmeIo);
    FSDP_RETURN_IF_ERROR(ex->init(opt.seed));
    if (!opt.initFrom.empty()) {
      // Headers only, then each rank its own slices: a rank's host memory
      // stays bounded however large the checkpoint (InitFrom.h). A
      // training checkpoint's parameters come through its shard map.
      if (isTrainingCheckpoint(opt.initFrom)) {
        std::string used;
        FSDP_RETURN_IF_ERROR(initParamsFromCheckpoint(opt.initFrom, plan, *ex, used));
        if (root && !opt.quiet && !opt.json)
          std::printf("parameters from the training checkpoint %s (the optimizer state, "
                      "step and schedule start fresh)\n",
                      used.c_str());
      } else {
        FSDP_RETURN_IF_ERROR(initParamsFrom(opt.initFrom, plan, *ex));
      }
    }
    // The schedule, and the record of it a checkpoint keeps to resume
    // exactly (written from the schedule itself).
    lrSchedule = {opt.schedule,
                  opt.lr,
                  opt.minLr,
                  opt.warmup,
                  opt.steps,
                  opt.decaySteps,
                  opt.decayShape.empty() ? "linear" : opt.decayShape};
    schedule = scheduleRecord(lrSchedule);
    return Status::ok();
  }

  /// --resume: the newest checkpoint's parameters, state, loss scale and
  /// step.
  Status resumeFrom() {
    if (opt.resume.empty())
      return Status::ok();
    std::string path;
    FSDP_RETURN_IF_ERROR(latestCheckpoint(opt.resume, path));
    TrainingPosition pos;
    auto t0 = std::chrono::steady_clock::now();
    FSDP_RETURN_IF_ERROR(loadCheckpoint(path, plan, *ex, comm.rank(), pos, &resumed));
    loadMs =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    FSDP_RETURN_IF_ERROR(ex->restoreLossScaler(pos.lossScale));
    if (pos.step >= opt.steps)
      return FSDP_ERROR("--resume: the checkpoint '", path, "' is at step ", pos.step,
                        ", not before --steps ", opt.steps, ": nothing to run");
    if (root && !opt.quiet && !opt.json) {
      std::printf("resuming from %s (step %lld)\n", path.c_str(), (long long)pos.step);
      if (resumed.resharded && resumed.from != resumed.to)
        std::printf("resharded on load: written for %s, this plan is for %s; rank 0 read "
                    "%s of the checkpoint's %s\n",
                    resumed.from.c_str(), resumed.to.c_str(),
                    human((double)resumed.readBytes).c_str(),
                    human((double)resumed.checkpointBytes).c_str());
      else if (resumed.resharded) // the same mesh and stage: units or dtypes differ
        std::printf("re-laid out on load: written for %s too, with other units or storage "
                    "dtypes; rank 0 read %s of the checkpoint's %s\n",
                    resumed.from.c_str(), human((double)resumed.readBytes).c_str(),
                    human((double)resumed.checkpointBytes).c_str());
      if (!resumed.converted.empty())
        std::printf("converted on load: %s\n", conversionNote(resumed.converted).c_str());
    }
    resumedPath = path;
    resumedStep = pos.step;
    resumedItems = pos.itemsPerStep;
    // The stream's position carries over only for the same data.
    resumedRows = pos.data == opt.data ? pos.rowsConsumed : -1;
    // Another schedule, seed or data source is allowed (fine-tuning on),
    // but then the run is not the one that was interrupted: say so.
    // --steps may grow on resume; it shapes the constant schedule not at all.
    nlohmann::json was = pos.schedule, now = schedule;
    if (opt.schedule == "constant" && was.is_object()) {
      was.erase("steps");
      now.erase("steps");
    }
    if (root && (was != now || pos.seed != opt.seed || pos.data != opt.data))
      std::fprintf(stderr, "fsdp-run: note: the checkpoint was written with another "
                           "schedule, seed or data source (%s); continuing with this "
                           "run's\n",
                   pos.schedule.dump().c_str());
    firstStep = pos.step + 1;
    return Status::ok();
  }

  /// The training data source, and the validation one (--eval-every): its
  /// own source, each evaluation from its first batch. Synthetic
  /// validation samples are held out: the same task drawn with another
  /// seed than training's.
  Status openData() {
    FSDP_RETURN_IF_ERROR(
        makeDataSource(opt.data, plan, comm.rank(), comm.size(), opt.seed, data, opt.lossMask));
    if (opt.gradcheck > 0 || opt.evalEvery <= 0)
      return Status::ok();
    std::string spec = opt.evalData.empty() ? "synthetic" : opt.evalData;
    uint64_t evalSeed = spec == "synthetic" ? opt.seed ^ 0x5a17da7a5eedULL : opt.seed;
    return makeDataSource(spec, plan, comm.rank(), comm.size(), evalSeed, evalSource,
                          opt.evalLossMask);
  }

  /// --dump-dir: the folder and the initial parameters.
  Status openDump() {
    dump = !opt.dumpDir.empty();
    if (!dump)
      return Status::ok();
    if (root)
      FSDP_RETURN_IF_ERROR(makeDir(opt.dumpDir));
    TensorMap init;
    FSDP_RETURN_IF_ERROR(ex->gatherParams(init));
    if (root)
      FSDP_RETURN_IF_ERROR(writeSafeTensors(opt.dumpDir + "/init.safetensors", init));
    return Status::ok();
  }

  void printHeader() const {
    if (root && !opt.quiet && !opt.json)
      std::printf("fsdp-run: %s | model %s | %lld rank(s), stage %lld | %zu "
                  "instructions | arena %s per rank\n",
                  opt.planPath.c_str(), plan.model.c_str(), (long long)plan.worldSize,
                  (long long)plan.stage, plan.program.size(),
                  human((double)plan.arenaBytes).c_str());
    // What runs it: on a GPU which libraries were loaded from where (the
    // CUDA backend opens them at run time, so a figure names its versions).
    if (root && !opt.quiet && !opt.json)
      std::printf("fsdp-run: device %s | comm %s\n", device.describe().c_str(),
                  comm.describe().c_str());
  }

  /// Tracing, step capture, and the fault injection of the failure tests:
  /// FSDP_FAULT_KILL_RANK=r and FSDP_FAULT_KILL_STEP=s make rank r kill
  /// itself at the start of step s.
  Status startLoop() {
    tty = isatty(2) && !opt.json && root;
    ex->setTracing(!opt.trace.empty(), opt.traceSync);
    if (opt.cudaGraphs)
      FSDP_RETURN_IF_ERROR(ex->setStepCapture(true));
    scaling = plan.lossScaling.enabled;
    normed = ex->hasGradNorm();
    items = data->itemsPerStep() * comm.size();
    // A token file goes on at the row of its stream where the checkpoint's
    // run stopped, whatever the global batch (the same batch: the same
    // rows as before, bitwise).
    if (resumedRows >= 0)
      data->resumeAfter(firstStep - 1, resumedRows);
    // Another global batch (a resharded plan whose per-rank batch was not
    // scaled with the world size): say what the continuation reads.
    if (root && resumedItems > 0 && resumedItems != items) {
      if (resumedRows >= 0 && data->consumedAfter(firstStep - 1) == resumedRows)
        std::fprintf(stderr,
                     "fsdp-run: note: the checkpoint's run trained on %lld %s per step, "
                     "this one on %lld: the data goes on at row %lld of the stream, where "
                     "that run stopped\n",
                     (long long)resumedItems, data->unit(), (long long)items,
                     (long long)resumedRows);
      else
        std::fprintf(stderr,
                     "fsdp-run: note: the checkpoint's run trained on %lld %s per step, "
                     "this one on %lld: the continuation reads other batches (keep "
                     "the per-rank batch times the world size)\n",
                     (long long)resumedItems, data->unit(), (long long)items);
    }
    if (const char *r = std::getenv("FSDP_FAULT_KILL_RANK"))
      killRank = std::atoll(r);
    if (const char *k = std::getenv("FSDP_FAULT_KILL_STEP"))
      killStep = std::atoll(k);
    return Status::ok();
  }

  /// The validation loss after `at` steps: the mean over --eval-batches
  /// batches of the loss the plan computes (already the mean over ranks).
  Status validate(int64_t at) {
    auto t0 = std::chrono::steady_clock::now();
    double sum = 0;
    for (int64_t k = 1; k <= opt.evalBatches; ++k) {
      FSDP_RETURN_IF_ERROR(ex->fillInputs(*evalSource, k));
      float l = 0;
      FSDP_RETURN_IF_ERROR(ex->evaluate(l));
      sum += l;
    }
    double loss = sum / (double)opt.evalBatches;
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    evalSteps.push_back(at);
    evalLosses.push_back(loss);
    if (root && opt.json)
      std::printf("%s\n", nlohmann::json({{"eval", true}, {"step", at}, {"val_loss", loss},
                                           {"batches", opt.evalBatches}, {"ms", ms}})
                              .dump()
                              .c_str());
    else if (root && !opt.quiet) {
      if (tty)
        std::fprintf(stderr, "\r\033[K");
      std::printf("eval %5lld/%lld | val loss %.6f | %lld batch(es) | %8.2f ms\n",
                  (long long)at, (long long)opt.steps, loss, (long long)opt.evalBatches, ms);
      std::fflush(stdout);
    }
    return Status::ok();
  }

  /// Step s: its batch, the step itself, the dump's record of it, a
  /// checkpoint where one is due, its report, and a validation where one
  /// is due.
  Status runStep(int64_t s) {
    saveMs = -1;
    if (comm.rank() == killRank && s == killStep)
      std::raise(SIGKILL);
    double lr = scheduledLr(lrSchedule, s);
    FSDP_RETURN_IF_ERROR(ex->fillInputs(*data, s));
    if (dump && root)
      recordBatch(plan, *ex, s, batches);
    int64_t commBefore = ex->commBytes();
    auto t0 = std::chrono::steady_clock::now();
    float loss = 0;
    double scaleUsed = ex->lossScaler().scale;
    FSDP_RETURN_IF_ERROR(ex->step(s, lr, loss));
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    commPerStep = ex->commBytes() - commBefore;
    // Host updates joined in the next step (offload-next-step): the last
    // step's finish here, their failure reported as the step's.
    if (s == opt.steps)
      FSDP_RETURN_IF_ERROR(ex->finishCarried());
    if (!std::isfinite(loss))
      return FSDP_ERROR("the loss is not finite at step ", s, " (", loss,
                        "): lower the learning rate or enable clipping");
    if (dump) {
      // Parameters after every step: the oracle re-runs each update from
      // our own parameters (test/oracle/README.md), so one rounding-level
      // difference is checked where it arises instead of after 20 steps
      // of compounding.
      TensorMap now;
      FSDP_RETURN_IF_ERROR(ex->gatherParams(now));
      // bf16 optimizer state (optimizer-state-dtype=bf16) too: the oracle
      // takes it as each update's state (f32 state it accumulates itself).
      if (std::any_of(plan.states.begin(), plan.states.end(), [&](const State &st) {
            DType d = plan.buffers[st.buffer].dtype;
            return d == DType::BF16 || d == DType::I8; // or 8-bit, decoded
          }))
        FSDP_RETURN_IF_ERROR(ex->gatherMoments(now));
      for (auto &kv : now)
        trajectory["step" + std::to_string(s) + "." + kv.first] = std::move(kv.second);
    }
    if (!opt.ckptDir.empty() &&
        (s == opt.steps || (opt.saveEvery > 0 && s % opt.saveEvery == 0))) {
      TrainingPosition pos{
          s, opt.seed, schedule, opt.data, ex->lossScalerState(), items, data->consumedAfter(s)};
      auto t = std::chrono::steady_clock::now();
      if (opt.asyncSave)
        FSDP_RETURN_IF_ERROR(saver.save(opt.ckptDir, opt.keep, plan, *ex, comm, pos));
      else
        FSDP_RETURN_IF_ERROR(saveCheckpoint(opt.ckptDir, opt.keep, plan, *ex, comm, pos));
      saveMs =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      saveBlockingMs += saveMs;
      ++saves;
    }
    losses.push_back(loss);
    lrs.push_back(lr);
    if (normed)
      norms.push_back(ex->lastGradNorm());
    times.push_back(ms);
    bool skip = scaling && ex->lossScaler().lastSkipped;
    if (scaling)
      scales.push_back(scaleUsed);
    if (skip)
      skipped.push_back(s);
    if (s > firstStep)
      totalMs += ms;
    if (root)
      reportStep(s, loss, lr, ms, scaleUsed, skip);
    if (evalSource && (s % opt.evalEvery == 0 || s == opt.steps))
      FSDP_RETURN_IF_ERROR(validate(s));
    return Status::ok();
  }

  /// Rank 0's line for step s (JSON, or text every --log-every steps) and
  /// the progress bar on a terminal.
  void reportStep(int64_t s, float loss, double lr, double ms, double scaleUsed, bool skip) const {
    bool print = !opt.quiet && (s % opt.logEvery == 0 || s == firstStep || s == opt.steps);
    if (opt.json) {
      nlohmann::json j = {{"step", s},
                          {"loss", loss},
                          {"lr", lr},
                          {"ms", ms},
                          {std::string(data->unit()) + "_per_s", items / (ms / 1000)},
                          {"arena_bytes", plan.arenaBytes},
                          {"comm_bytes", commPerStep}};
      if (saveMs >= 0) { // this step saved a checkpoint: the time it held training
        j["save_ms"] = saveMs;
        if (opt.asyncSave) // of which waiting for the save before to finish
          j["save_wait_ms"] = saver.lastWaitMs();
      }
      if (normed)
        j["grad_norm"] = ex->lastGradNorm();
      if (scaling) {
        j["loss_scale"] = scaleUsed;
        j["skipped"] = skip;
      }
      std::printf("%s\n", j.dump().c_str());
    } else if (print) {
      if (tty)
        std::fprintf(stderr, "\r\033[K");
      char norm[48] = ""; // the global gradient norm, before clipping
      if (normed)
        std::snprintf(norm, sizeof norm, " | norm %.4g", ex->lastGradNorm());
      std::printf("step %5lld/%lld | loss %.6f | lr %.2e%s | %8.2f ms | %9.0f %s/s | mem %s\n",
                  (long long)s, (long long)opt.steps, loss, lr, norm, ms, items / (ms / 1000),
                  data->unit(), human((double)plan.arenaBytes).c_str());
      if (skip)
        std::printf("step %5lld: gradients overflowed at loss scale %g: update "
                    "skipped, scale -> %g\n",
                    (long long)s, scaleUsed, ex->lossScaler().scale);
      std::fflush(stdout);
    }
    if (tty && !opt.quiet) {
      int width = 30, done = (int)(width * s / opt.steps);
      std::fprintf(stderr, "\r[%.*s%*s] %lld/%lld loss %.4f", done,
                   "##############################", width - done, "", (long long)s,
                   (long long)opt.steps, loss);
      if (s == opt.steps)
        std::fprintf(stderr, "\r\033[K");
      std::fflush(stderr);
    }
  }

  /// --trace, the dump folder's final parameters, batches, trajectory,
  /// gradients and log, and --save.
  Status writeOutputs(const MemoryMeasurement &m) {
    if (!opt.trace.empty())
      FSDP_RETURN_IF_ERROR(writeTrace(opt.trace, plan, *ex, comm));
    if (!dump && opt.save.empty())
      return Status::ok();
    TensorMap final;
    FSDP_RETURN_IF_ERROR(ex->gatherParams(final));
    if (root && dump) {
      FSDP_RETURN_IF_ERROR(writeSafeTensors(opt.dumpDir + "/final.safetensors", final));
      FSDP_RETURN_IF_ERROR(writeSafeTensors(opt.dumpDir + "/batches.safetensors", batches));
      FSDP_RETURN_IF_ERROR(
          writeSafeTensors(opt.dumpDir + "/trajectory.safetensors", trajectory));
      TensorMap grads;
      FSDP_RETURN_IF_ERROR(ex->gradOutputs(grads));
      if (!grads.empty())
        FSDP_RETURN_IF_ERROR(writeSafeTensors(opt.dumpDir + "/grads.safetensors", grads));
      nlohmann::json log = {
          {"steps", opt.steps}, {"losses", losses}, {"lr", lrs}, {"step_ms", times},
          {"world_size", plan.worldSize},
          {"memory",
           {{"predicted_peak", plan.memory.peak},
            {"predicted_peak_live", plan.memory.peakLive},
            {"arena_bytes", plan.arenaBytes},
            {"measured_high_water", m.highWater},
            {"measured_peak_live", m.peakLive},
            {"predicted_host_peak", plan.memory.hostPeak},
            {"measured_host_high_water", m.hostHighWater}}},
          {"comm_bytes_per_step", commPerStep}};
      if (normed)
        log["grad_norms"] = norms;
      if (scaling) {
        log["loss_scales"] = scales;
        log["skipped_steps"] = skipped;
      }
      if (evalSource) {
        log["eval_steps"] = evalSteps;
        log["eval_losses"] = evalLosses;
      }
      FSDP_RETURN_IF_ERROR(writeFileAtomic(opt.dumpDir + "/log.json", log.dump(1)));
    }
    if (root && !opt.save.empty())
      FSDP_RETURN_IF_ERROR(
          writeSafeTensors(opt.save, final, {{"format", "pt"}, {"producer", "fsdp-run"}}));
    return Status::ok();
  }

  /// Rank 0's summary: the losses, the mean step time (steps 2..), the
  /// predicted against the measured memory, communication, loss scaling.
  void printSummary(const MemoryMeasurement &m) const {
    int64_t ran = (int64_t)times.size();
    double mean = ran > 1 ? totalMs / (ran - 1) : times[0];
    auto verdict = [](int64_t a, int64_t b) { return a == b ? "MATCH" : "MISMATCH"; };
    if (opt.json) {
      nlohmann::json j = {{"summary", true},
                          {"steps", opt.steps},
                          {"final_loss", losses.back()},
                          {"mean_step_ms", mean},
                          {"predicted_peak", plan.memory.peak},
                          {"predicted_peak_live", plan.memory.peakLive},
                          {"measured_high_water", m.highWater},
                          {"measured_peak_live", m.peakLive},
                          {"comm_bytes_per_step", commPerStep},
                          {"scratch_outside_arena", device.scratchHighWater()},
                          {"device", device.describe()},
                          {"comm", comm.describe()}};
      if (!resumedPath.empty())
        j["resumed"] = {{"path", resumedPath},
                        {"step", resumedStep},
                        {"resharded", resumed.resharded},
                        {"written_for", resumed.from},
                        {"rank0_read_bytes", resumed.readBytes},
                        {"checkpoint_bytes", resumed.checkpointBytes},
                        {"converted", resumed.converted},
                        {"rank0_load_ms", loadMs}};
      if (plan.hostArenaBytes > 0) {
        j["predicted_host_peak"] = plan.memory.hostPeak;
        j["predicted_host_peak_live"] = plan.memory.hostPeakLive;
        j["measured_host_high_water"] = m.hostHighWater;
        j["measured_host_peak_live"] = m.hostPeakLive;
      }
      if (const SwapFile *f = ex->swapFile()) {
        // fsdp-offload's nvme: the file's size and its traffic a step.
        j["nvme_bytes"] = f->size();
        j["nvme_read_bytes_per_step"] = f->bytesRead() / std::max<int64_t>(ran, 1);
        j["nvme_written_bytes_per_step"] = f->bytesWritten() / std::max<int64_t>(ran, 1);
        j["nvme_io"] = f->direct() ? "direct" : "buffered";
        j["nvme_cached_bytes"] = f->cachedBytes(); // the page cache's share
        // The rates the swaps ran at (each transfer's time on its thread).
        j["nvme_read_seconds_per_step"] = f->secondsReading() / std::max<int64_t>(ran, 1);
        j["nvme_write_seconds_per_step"] = f->secondsWriting() / std::max<int64_t>(ran, 1);
        if (!f->directNote().empty())
          j["nvme_io_note"] = f->directNote();
      }
      if (!evalLosses.empty())
        j["final_val_loss"] = evalLosses.back();
      if (saves > 0) {
        j["checkpoints"] = saves;
        j["save_blocking_ms"] = saveBlockingMs;
        j["save_finish_ms"] = finishMs;
        if (opt.asyncSave) {
          j["save_io"] = saver.wroteDirect() ? "direct" : "buffered";
          j["save_pinned"] = saver.pinned(); // the staging image, for the device's copies
        }
      }
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("done: %lld steps | final loss %.6f (first %.6f) | %.2f ms/step "
                "(steps 2..) | %.0f %s/s\n",
                (long long)opt.steps, losses.back(), losses.front(), mean, items / (mean / 1000),
                data->unit());
    if (!evalLosses.empty())
      std::printf("validation: loss %.6f after step %lld (first %.6f after step %lld), "
                  "%lld batch(es) each\n",
                  evalLosses.back(), (long long)evalSteps.back(), evalLosses.front(),
                  (long long)evalSteps.front(), (long long)opt.evalBatches);
    std::printf("memory per rank: predicted peak %lld B (arena), measured "
                "high-water %lld B: %s | predicted peak live %lld B, measured "
                "%lld B: %s\n",
                (long long)plan.memory.peak, (long long)m.highWater,
                verdict(plan.memory.peak, m.highWater), (long long)plan.memory.peakLive,
                (long long)m.peakLive, verdict(plan.memory.peakLive, m.peakLive));
    if (plan.hostArenaBytes > 0)
      std::printf("host memory per rank (offloaded): predicted %lld B, measured "
                  "high-water %lld B: %s | peak live %lld B, measured %lld B: %s\n",
                  (long long)plan.memory.hostPeak, (long long)m.hostHighWater,
                  verdict(plan.memory.hostPeak, m.hostHighWater),
                  (long long)plan.memory.hostPeakLive, (long long)m.hostPeakLive,
                  verdict(plan.memory.hostPeakLive, m.hostPeakLive));
    if (const SwapFile *f = ex->swapFile()) {
      const int64_t cached = f->cachedBytes(); // (a mapping and a mincore: once)
      const bool params = std::any_of(plan.buffers.begin(), plan.buffers.end(), [](const Buffer &b) {
        return b.nvme && b.kind == BufferKind::Param;
      });
      std::printf("optimizer state %son disk (offload-nvme%s): %s swap file per rank in %s, "
                  "%s read and %s written per step, %s%s%s; %s of it in the page cache "
                  "now\n",
                  params ? "and parameters " : "", params ? "-params" : "",
                  human((double)f->size()).c_str(), opt.nvmeDir.c_str(),
                  human((double)f->bytesRead() / std::max<int64_t>(ran, 1)).c_str(),
                  human((double)f->bytesWritten() / std::max<int64_t>(ran, 1)).c_str(),
                  f->direct() ? "direct I/O (O_DIRECT)" : "buffered I/O (page cache)",
                  f->directNote().empty() ? "" : ": ", f->directNote().c_str(),
                  cached < 0 ? "unknown" : human((double)cached).c_str());
      if (f->secondsReading() > 0 && f->secondsWriting() > 0)
        std::printf("the swaps ran at %.2f GB/s reading and %.2f GB/s writing (each transfer's "
                    "time on its thread; --calibrate --nvme-dir measures the disk alone)\n",
                    (double)f->bytesRead() / f->secondsReading() / 1e9,
                    (double)f->bytesWritten() / f->secondsWriting() / 1e9);
    }
    if (int64_t scratch = device.scratchHighWater())
      std::printf("runtime scratch outside the arena (f32 copies of bf16/f16 operands; "
                  "on cuda also the GEMM workspace and staging): %lld B\n",
                  (long long)scratch);
    if (plan.worldSize > 1)
      std::printf("communication: %s sent per rank per step\n", human((double)commPerStep).c_str());
    if (saves > 0) {
      std::string how = "written in the step loop; --async-save writes them in the background";
      if (opt.asyncSave)
        how = std::string("--async-save: snapshots, written ") +
              (saver.wroteDirect() ? "past the page cache (O_DIRECT)" : "through the page cache") +
              "; then " + std::to_string((int)finishMs) + " ms waiting for the last at the end";
      std::printf("checkpoints: %lld saved, %.1f ms holding training in all (%s)\n",
                  (long long)saves, saveBlockingMs, how.c_str());
    }
    if (scaling)
      std::printf("loss scaling: %zu of %zu steps skipped (overflow), scale now %g\n",
                  skipped.size(), times.size(), ex->lossScaler().scale);
  }

  const TrainOptions &opt;
  Communicator &comm;
  Device &device;
  const bool root; ///< rank 0 prints and writes the files

  // loadPlan / resumeFrom
  Plan plan; ///< the executor refers to it: never moved
  std::unique_ptr<Executor> ex;
  nlohmann::json schedule; ///< what a checkpoint records, to resume exactly
  LrSchedule lrSchedule;
  int64_t firstStep = 1;   ///< after the resumed checkpoint's step
  LoadReport resumed;      ///< how --resume loaded it
  std::string resumedPath;
  int64_t resumedStep = -1, resumedItems = 0;
  int64_t resumedRows = -1; ///< the token stream's position (-1: none)
  double loadMs = 0; ///< rank 0's loadCheckpoint
  // openData / openDump / startLoop
  std::unique_ptr<DataSource> data, evalSource;
  bool dump = false;    ///< --dump-dir
  bool tty = false;     ///< rank 0's stderr is a terminal: a progress bar
  bool scaling = false; ///< the plan scales its loss
  int64_t items = 0;    ///< samples or tokens per step, all ranks
  int64_t killRank = -1, killStep = -1;
  // runStep / validate: what the run has measured
  TensorMap batches, trajectory; ///< the dump's batches and parameters per step
  std::vector<double> losses, lrs, times, scales, norms;
  bool normed = false;          ///< the plan returns the gradient norm (clipping, loss scaling)
  std::vector<int64_t> skipped; ///< steps whose updates overflowed
  double totalMs = 0;           ///< steps after the first
  int64_t commPerStep = 0;      ///< the last step's bytes sent
  std::vector<int64_t> evalSteps;
  std::vector<double> evalLosses;
  // checkpoints: the time they held the training thread
  AsyncCheckpointer saver; ///< --async-save
  int64_t saves = 0;
  double saveMs = -1;        ///< this step's save (-1: none)
  double saveBlockingMs = 0; ///< every save's, on the training thread
  double finishMs = 0;       ///< --async-save: the wait for the last one
};

} // namespace

Status train(const TrainOptions &opt, Communicator &comm, Device &device) {
  if (!opt.save.empty())
    FSDP_RETURN_IF_ERROR(checkOutputPath(opt.save, "--save"));
  if (!opt.trace.empty())
    FSDP_RETURN_IF_ERROR(checkOutputPath(opt.trace, "--trace"));
  if (opt.calibrate) {
    if (!opt.planPath.empty())
      return FSDP_ERROR("--calibrate takes no plan (found '", opt.planPath, "')");
    nlohmann::json profile;
    FSDP_RETURN_IF_ERROR(device.calibrate(comm, profile));
    if (!opt.nvmeDir.empty()) // offload-nvme's swap file on that disk
      FSDP_RETURN_IF_ERROR(calibrateSwap(opt.nvmeDir, comm, profile, opt.nvmeIo));
    if (comm.rank() == 0)
      std::printf("%s\n", profile.dump(1).c_str());
    return Status::ok();
  }
  TrainingRun run(opt, comm, device);
  return run.run();
}

} // namespace fsdp
