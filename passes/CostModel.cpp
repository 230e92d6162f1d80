//===- CostModel.cpp - predicted step time of a planned step --------------===//
//
// Keep in step with tools/fsdp-sim (simulate, comm_cost, flops_of,
// units_of, bytes_of): the two must predict the same step for the same
// plan, and test/lit/e2e/budget.test compares them.
//
//===----------------------------------------------------------------------===//

#include "passes/CostModel.h"
#include "passes/Passes.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include "llvm/ADT/DenseSet.h"

#include <cmath>
#include <deque>
#include <map>
#include <optional>

using namespace mlir;
using namespace mlir::fsdp;
namespace json = llvm::json;

bool mlir::fsdp::loadDeviceProfile(StringRef nameOrPath, DeviceProfile &p,
                                   std::string &error) {
  p = DeviceProfile();
  if (nameOrPath == "h100")
    return true;
  auto buf = llvm::MemoryBuffer::getFile(nameOrPath);
  if (!buf) {
    error = "cannot read device profile '" + nameOrPath.str() +
            "' (expected h100 or a JSON from fsdp-run --calibrate): " +
            buf.getError().message();
    return false;
  }
  llvm::Expected<json::Value> v = json::parse((*buf)->getBuffer());
  if (!v) {
    error = "device profile '" + nameOrPath.str() +
            "' is not JSON: " + llvm::toString(v.takeError());
    return false;
  }
  const json::Object *root = v->getAsObject();
  const json::Object *c = root ? root->getObject("compute") : nullptr;
  if (!c || !c->getNumber("gemm_flops_per_s") ||
      !c->getNumber("mem_bytes_per_s") || !c->getNumber("op_overhead_s")) {
    error = "device profile '" + nameOrPath.str() +
            "' has no compute.{gemm_flops_per_s, mem_bytes_per_s, "
            "op_overhead_s} (write one with fsdp-run --calibrate)";
    return false;
  }
  if (auto n = root->getString("name"))
    p.name = n->str();
  else
    p.name = nameOrPath.str();
  p.cpu = root->getString("kind") == StringRef("cpu");
  p.cores = root->getInteger("cores").value_or(0);
  p.threadsPerRank = root->getInteger("threads_per_rank").value_or(0);
  p.gemmFlopsPerS = *c->getNumber("gemm_flops_per_s");
  p.gemmFlopsPerSBf16 =
      c->getNumber("gemm_flops_per_s_bf16").value_or(p.gemmFlopsPerS);
  p.memBytesPerS = *c->getNumber("mem_bytes_per_s");
  p.opOverheadS = *c->getNumber("op_overhead_s");
  p.hostLinkBytesPerS = c->getNumber("host_link_bytes_per_s").value_or(0.0);
  p.hostMemBytesPerS = c->getNumber("host_mem_bytes_per_s").value_or(0.0);
  if (p.hostLinkBytesPerS < 0 || p.hostMemBytesPerS < 0) {
    error = "device profile '" + nameOrPath.str() +
            "': host_link_bytes_per_s and host_mem_bytes_per_s must be >= 0";
    return false;
  }
  // The drive's fields: a number where given (fsdp-sim's checks too).
  for (const char *key : {"nvme_read_bytes_per_s", "nvme_write_bytes_per_s",
                          "nvme_duplex_read_share", "nvme_duplex_write_share"})
    if (c->get(key) && !c->getNumber(key)) {
      error = "device profile '" + nameOrPath.str() + "': compute." + key + " is not a number";
      return false;
    }
  p.nvmeReadBytesPerS = c->getNumber("nvme_read_bytes_per_s").value_or(p.nvmeReadBytesPerS);
  p.nvmeWriteBytesPerS = c->getNumber("nvme_write_bytes_per_s").value_or(p.nvmeWriteBytesPerS);
  if (p.nvmeReadBytesPerS <= 0 || p.nvmeWriteBytesPerS <= 0) {
    error = "device profile '" + nameOrPath.str() +
            "': nvme_read_bytes_per_s and nvme_write_bytes_per_s must be > 0";
    return false;
  }
  p.nvmeDuplexReadShare = c->getNumber("nvme_duplex_read_share").value_or(p.nvmeDuplexReadShare);
  p.nvmeDuplexWriteShare = c->getNumber("nvme_duplex_write_share").value_or(p.nvmeDuplexWriteShare);
  // (a NaN fails both comparisons: refused too)
  if (!(p.nvmeDuplexReadShare > 0 && p.nvmeDuplexReadShare <= 1) ||
      !(p.nvmeDuplexWriteShare > 0 && p.nvmeDuplexWriteShare <= 1)) {
    error = "device profile '" + nameOrPath.str() +
            "': nvme_duplex_read_share and nvme_duplex_write_share must be in (0, 1] "
            "(the fraction of its rate a swap stream keeps while the other moves data)";
    return false;
  }
  if (p.gemmFlopsPerS <= 0 || p.gemmFlopsPerSBf16 <= 0 || p.memBytesPerS <= 0 ||
      p.opOverheadS < 0) {
    error = "device profile '" + nameOrPath.str() +
            "': rates must be positive and the overhead >= 0";
    return false;
  }
  if (const json::Object *per = c->getObject("seconds_per_unit"))
    for (const auto &kv : *per)
      if (auto s = kv.second.getAsNumber())
        p.secondsPerUnit[kv.first.str()] = *s;
  if (const json::Value *curve = c->get("cache_curve")) {
    const json::Object *o = curve->getAsObject();
    const json::Array *xs = o ? o->getArray("bytes") : nullptr;
    const json::Array *ys = o ? o->getArray("cold_fraction") : nullptr;
    std::optional<double> rate = c->getNumber("gemm_cold_bytes_per_s");
    bool ok = xs && ys && !xs->empty() && xs->size() == ys->size() && rate &&
              std::isfinite(*rate) && *rate > 0;
    for (size_t k = 0; ok && k < xs->size(); ++k) {
      std::optional<double> x = (*xs)[k].getAsNumber(), y = (*ys)[k].getAsNumber();
      ok = x && y && std::isfinite(*x) && *x > 0 && *y >= 0 && *y <= 1 &&
           (k == 0 || *x > p.cacheCurveBytes.back());
      if (ok) {
        p.cacheCurveBytes.push_back(*x);
        p.cacheCurveCold.push_back(*y);
      }
    }
    if (!ok) {
      error = "device profile '" + nameOrPath.str() +
              "': compute.cache_curve must hold 'bytes' (positive, increasing) and "
              "'cold_fraction' (in [0, 1]) of the same length, with "
              "compute.gemm_cold_bytes_per_s > 0";
      return false;
    }
    p.gemmColdBytesPerS = *rate;
  }
  p.ranksPerNode = 0;
  p.alphaS = p.betaSPerByte = 0;
  if (const json::Object *link = root->getObject("link")) {
    p.alphaS = link->getNumber("alpha_s").value_or(0.0);
    p.betaSPerByte = link->getNumber("beta_s_per_byte").value_or(0.0);
    p.ranksPerNode = link->getInteger("ranks_per_node").value_or(0);
    p.glooLink = p.cpu && link->getString("backend").value_or("gloo") == "gloo";
    p.twoLevel = link->getBoolean("two_level").value_or(false);
    p.interGlooLink = p.cpu && link->getString("inter_backend").value_or("") == "gloo";
    if (p.twoLevel && p.ranksPerNode < 1) {
      error = "device profile '" + nameOrPath.str() +
              "': link.two_level needs link.ranks_per_node >= 1";
      return false;
    }
    p.interAlphaS = link->getNumber("inter_alpha_s").value_or(p.alphaS);
    p.interBetaSPerByte =
        link->getNumber("inter_beta_s_per_byte").value_or(p.betaSPerByte);
  }
  return true;
}

namespace {

/// One ring over `n` ranks of one link (alpha, beta): all-reduce
/// 2 (n-1) alpha + 2 (n-1)/n bytes beta, the others half that. Gloo's
/// reduce-scatter over a group whose size is not a power of two is an
/// all-reduce (runtime/comm/GlooComm.cpp); shared memory's and NCCL's have
/// no such case.
double ringSeconds(StringRef op, int64_t n, double bytes, double alpha, double beta, bool gloo) {
  if (n <= 1)
    return 0.0;
  double frac = double(n - 1) / double(n);
  if (op == "all_reduce" || (op == "reduce_scatter" && gloo && (n & (n - 1))))
    return 2.0 * (n - 1) * alpha + 2.0 * frac * bytes * beta;
  return (n - 1) * alpha + frac * bytes * beta;
}

} // namespace

GroupSpan mlir::fsdp::groupSpan(int64_t size, int64_t world, int64_t perNode, bool strided) {
  return groupSpanStrided(size, world, perNode, strided && size > 0 ? world / size : 1);
}

GroupSpan mlir::fsdp::groupSpanStrided(int64_t size, int64_t world, int64_t perNode,
                                       int64_t stride) {
  GroupSpan s;
  if (perNode <= 0 || size <= 1 || world <= 0) {
    s.perNode = std::max<int64_t>(1, size);
    return s;
  }
  // Count the members of each group on each node; every group of the mesh
  // is checked (fsdp-sim's group_span). One group that crosses a node
  // boundary makes them all count as crossing: the others wait for it at
  // the next collective of the whole world.
  // Group g: run g / stride of size x stride consecutive ranks, its
  // members g mod stride + k stride there.
  int64_t groups = std::max<int64_t>(1, world / size);
  stride = std::max<int64_t>(1, stride);
  bool first = true;
  for (int64_t g = 0; g < groups; ++g) {
    std::map<int64_t, int64_t> count; // node -> members
    for (int64_t k = 0; k < size; ++k)
      ++count[(g / stride * size * stride + g % stride + k * stride) / perNode];
    int64_t per = count.begin()->second;
    bool even = llvm::all_of(count, [&](const auto &kv) { return kv.second == per; });
    if (first) {
      s.nodes = (int64_t)count.size(), s.perNode = per, s.uniform = even;
      first = false;
    } else if (!even || per != s.perNode || (int64_t)count.size() != s.nodes) {
      s.uniform = false;
    }
  }
  return s;
}

double mlir::fsdp::collectiveSeconds(StringRef op, int64_t n, int64_t bytes, GroupSpan span,
                                     const DeviceProfile &p) {
  if (n <= 1)
    return 0.0;
  double b = double(bytes);
  if (!span.crosses())
    return ringSeconds(op, n, b, p.alphaS, p.betaSPerByte, p.glooLink);
  if (!p.twoLevel || !span.uniform)
    return ringSeconds(op, n, b, p.interAlphaS, p.interBetaSPerByte,
                       p.twoLevel ? p.interGlooLink : p.glooLink);
  // Two levels, L ranks of the group on each of M nodes: the node's level
  // reduce-scatters (and all-gathers) the whole buffer, the places' level
  // moves 1/L of it between the nodes.
  int64_t L = span.perNode, M = span.nodes;
  double node = 0, inter = 0;
  if (op == "all_reduce") {
    node = ringSeconds("reduce_scatter", L, b, p.alphaS, p.betaSPerByte, p.glooLink) +
           ringSeconds("all_gather", L, b, p.alphaS, p.betaSPerByte, p.glooLink);
    inter =
        ringSeconds("all_reduce", M, b / L, p.interAlphaS, p.interBetaSPerByte, p.interGlooLink);
  } else if (op == "all_to_all") {
    // An exchange reduces nothing on the node: every block bound for
    // another node crosses the network (HybridComm's allToAll).
    node = ringSeconds(op, L, b, p.alphaS, p.betaSPerByte, p.glooLink);
    inter = ringSeconds(op, M, b, p.interAlphaS, p.interBetaSPerByte, p.interGlooLink);
  } else {
    node = ringSeconds(op, L, b, p.alphaS, p.betaSPerByte, p.glooLink);
    inter = ringSeconds(op, M, b / L, p.interAlphaS, p.interBetaSPerByte, p.interGlooLink);
  }
  return node + inter;
}

namespace {

int64_t numel(ArrayRef<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}

/// The name an op's calibrated per-unit cost is kept under: the packed
/// attention ops (fsdp.attention_qkv) run attention's kernels, SwiGLU's
/// silu's.
StringRef costName(StringRef name) {
  if (name == "attention_qkv")
    return "attention";
  if (name == "attention_qkv_grad")
    return "attention_grad";
  if (name == "cross_entropy_fused") // then its gradient: epilogueOps
    return "cross_entropy";
  if (name == "swiglu") // an exp per element, as silu's (the mul is free)
    return "silu";
  if (name == "swiglu_grad")
    return "silu_grad";
  return name;
}

/// A [B, T, C] value of an attention op's queries' shape (q, or for the
/// packed forms y), or null for other ops.
Value attentionQuery(Operation *op) {
  StringRef name = op->getName().stripDialect();
  if (name == "attention" || name == "attention_grad")
    return op->getOperand(0);
  if (name == "attention_qkv")
    return op->getResult(0);
  if (name == "attention_qkv_grad")
    return op->getOperand(1);
  return nullptr;
}

double flopsOf(Operation *op) {
  if (isa<MatmulOp, MatmulBiasOp, MatmulGeluGradOp, MatmulBiasGradOp>(op)) {
    ArrayRef<int64_t> lhs = shapeOf(op->getOperand(0));
    int64_t k = op->hasAttr("transpose_lhs") ? lhs[lhs.size() - 2] : lhs.back();
    return 2.0 * double(numel(shapeOf(op->getResult(0)))) * double(k);
  }
  StringRef name = op->getName().stripDialect();
  if (Value q = attentionQuery(op)) {
    ArrayRef<int64_t> s = shapeOf(q);           // [B, T, C]
    double f = 4.0 * s[0] * s[1] * s[1] * s[2]; // Q K^T and P V
    return f * (costName(name) == "attention_grad" ? 2.5 : 1.0);
  }
  return 0.0;
}

/// The ops fsdp-fuse-epilogues folded into a fused instruction (runtime/cpu
/// runs them one after the other over its result).
SmallVector<StringRef> epilogueOps(Operation *op) {
  SmallVector<StringRef> ops;
  if (auto mb = dyn_cast<MatmulBiasOp>(op)) {
    ops.push_back("bias_add");
    if (mb.getGelu())
      ops.push_back("gelu");
  } else if (auto mg = dyn_cast<MatmulGeluGradOp>(op)) {
    ops.push_back("gelu_grad");
    if (mg.getBiasGrad())
      ops.push_back("sum_to");
  } else if (isa<ResidualLayerNormOp>(op)) {
    ops.append({"add", "layer_norm"});
  } else if (isa<LayerNormGradAccOp>(op)) {
    ops.append({"layer_norm_grad", "add"});
  } else if (isa<ResidualRmsNormOp>(op)) {
    ops.append({"add", "rms_norm"});
  } else if (isa<RmsNormGradAccOp>(op)) {
    ops.append({"rms_norm_grad", "add"});
  } else if (isa<CrossEntropyFusedOp>(op)) {
    ops.push_back("cross_entropy_grad");
  } else if (isa<MatmulBiasGradOp>(op)) {
    ops.push_back("sum_to");
  }
  return ops;
}

double unitsOf(Operation *op, Value firstIn) {
  if (Value q = attentionQuery(op)) {
    ArrayRef<int64_t> s = shapeOf(q);
    return double(s[0]) * s[1] * s[1] * s[2];
  }
  return double(numel(shapeOf(firstIn)));
}

bool isLowPrecision(Value v) {
  Type e = cast<RankedTensorType>(v.getType()).getElementType();
  return e.isBF16() || e.isF16();
}

// [Note: the cache model]
// A GEMM on a CPU runs at its calibrated rate only when its operands are
// in the cache. Measured on this project's 2-core VM (fsdp-run
// --calibrate's cache_samples): a 64 x 256 x 256 GEMM takes 91 us when its
// operands were touched 384 KiB ago and 125 us when 25 MiB ago; the extra
// time is the operand bytes streamed at about 12 GB/s, the same for every
// shape tried. In a training step a layer's weight comes back after the
// whole forward or backward pass, so the model that ignored this predicted
// the MLP's steps 20-30% short (issue 11).
//
// The model: the step's memory traffic as an LRU cache sees it. Every
// instruction but a wait touches its distinct buffers (inputs, then
// outputs), each as the arena blocks it covers (4 KiB, or more so that an
// arena has at most 65536); a block's reuse distance is the bytes of the
// distinct blocks touched since its previous touch (its LRU stack
// distance), over a step that repeats (a first pass over the program sets
// the previous touches). N ranks sharing one host's cache (a CPU profile:
// they run in lockstep) multiply it by N. A GEMM's cold bytes sum, over
// its blocks, the bytes of the block it covers x the profile's measured
// fraction that misses at that distance (linear in log distance between
// the calibrated points); its time is flops / rate + cold bytes / the cold
// rate. Computed with a Fenwick tree over the touches: O(T log T) for T
// block touches. fsdp-sim's gemm_cold_bytes is the twin.

int64_t cacheBlockBytes(const MemoryPlan &plan) {
  int64_t block = 4096, arena = std::max(plan.arenaBytes, plan.hostArenaBytes);
  while (arena / block > 65536)
    block *= 2;
  return block;
}

double coldFraction(const DeviceProfile &p, double d) {
  const std::vector<double> &xs = p.cacheCurveBytes, &ys = p.cacheCurveCold;
  if (d <= xs.front())
    return ys.front();
  for (size_t j = 1; j < xs.size(); ++j)
    if (d <= xs[j]) {
      double w = (std::log(d) - std::log(xs[j - 1])) /
                 (std::log(xs[j]) - std::log(xs[j - 1]));
      return ys[j - 1] + (ys[j] - ys[j - 1]) * w;
    }
  return ys.back();
}

/// Cold bytes of each GEMM of `step` ([Note: the cache model]); empty
/// without a cache model.
llvm::DenseMap<Operation *, double> gemmColdBytes(func::FuncOp step,
                                                  const MemoryPlan &plan,
                                                  const DeviceProfile &p,
                                                  double scale) {
  llvm::DenseMap<Operation *, double> cold;
  // An unplaced plan (the budget search's candidates: liveness only) has
  // no addresses to reuse: its candidates are ranked without the cache
  // model, the chosen plan is predicted with it (simulate=true).
  if (p.cacheCurveBytes.empty() || p.gemmColdBytesPerS <= 0 || !plan.placed)
    return cold;
  const int64_t block = cacheBlockBytes(plan);
  struct Touch {
    Operation *op;
    int64_t key, bytes;
  };
  std::vector<Touch> touches;
  for (Operation &opRef : step.getBody().front()) {
    Operation *op = &opRef;
    // The instructions of the plan (ExportPlan's program), but waits.
    if (isa<func::ReturnOp, SetGradOp, WaitOp>(op) || isStorageAlias(op))
      continue;
    SmallVector<int64_t, 8> bufs;
    auto add = [&](std::optional<int64_t> b) {
      if (b && !llvm::is_contained(bufs, *b))
        bufs.push_back(*b);
    };
    auto ofValue = [&](Value v) -> std::optional<int64_t> {
      auto it = plan.valueBuffer.find(v);
      return it == plan.valueBuffer.end() ? std::nullopt
                                          : std::optional<int64_t>(it->second);
    };
    if (auto [sym, written] = storageWrite(op); written) {
      add(ofValue(written));
      auto it = plan.symbolBuffer.find(sym);
      if (it != plan.symbolBuffer.end())
        add(it->second);
    } else {
      for (Value v : op->getOperands())
        add(ofValue(v));
      for (Value v : op->getResults())
        add(ofValue(v));
    }
    for (int64_t b : bufs) {
      const PlannedBuffer &pb = plan.buffers[b];
      int64_t lo = pb.offset, hi = pb.offset + pb.bytes;
      for (int64_t k = lo / block; k < (hi + block - 1) / block; ++k)
        touches.push_back({op, 2 * k + (pb.host ? 1 : 0),
                           std::min(hi, (k + 1) * block) - std::max(lo, k * block)});
    }
  }
  const size_t n = touches.size();
  std::vector<int64_t> tree(2 * n + 1, 0); // 1 at each block's last touch
  auto update = [&](size_t pos, int64_t v) {
    for (++pos; pos <= 2 * n; pos += pos & -pos)
      tree[pos] += v;
  };
  auto prefix = [&](size_t pos) { // touches at positions < pos
    int64_t r = 0;
    for (; pos > 0; pos -= pos & -pos)
      r += tree[pos];
    return r;
  };
  llvm::DenseMap<int64_t, size_t> last;
  for (size_t pos = 0; pos < 2 * n; ++pos) {
    const Touch &t = touches[pos % n];
    double dist = 0;
    auto it = last.find(t.key);
    if (it != last.end()) {
      dist = double(prefix(pos) - prefix(it->second + 1)) * double(block);
      update(it->second, -1);
    }
    last[t.key] = pos;
    update(pos, 1);
    if (pos >= n && isa<MatmulOp, MatmulBiasOp, MatmulGeluGradOp, MatmulBiasGradOp>(t.op))
      cold[t.op] += double(t.bytes) * coldFraction(p, dist * scale);
  }
  return cold;
}

/// One instruction of the program as the simulation sees it.
struct Item {
  /// Barrier: the step's end, where the host waits for compute, the
  /// collectives and the copies, not the host stream (a plan whose updates
  /// are joined in the next step: see predictStep).
  enum Kind { Compute, Collective, Wait, Host, Copy, Barrier } kind;
  double cost = 0; ///< work at full speed
  bool async = false;
  Value buffer; ///< a wait's operand, an async collective's, host update's or copy's result
  /// A wait the copy stream does instead of compute (fsdp-offload's copy-
  /// stream join of a carried update, on a GPU): queued among the copies.
  bool copyStream = false;
  /// An async host update's swaps (offload-nvme): seconds reading its state
  /// from the drive before it and writing it back after.
  double readS = 0, writeS = 0;
  /// Its reads issued ahead (nvme-read-ahead): once compute has passed
  /// this item; -1: when it is issued.
  int64_t readAt = -1;
  /// A copy of storage on disk to the device (offload-nvme-params): it
  /// starts once its read (readS) is done, on compute (a CPU device, or
  /// not async) or on the copy stream ([Note: parameters on disk]).
  bool readFirst = false;
  /// A collective on the node comm stream ("stream": "node", [Note: node
  /// comm stream] in runtime/core/Device.h): its own queue.
  bool nodeStream = false;
};

/// What costing one instruction reads: the memory plan, the profile, the
/// mesh's groups and whether each spans nodes, and the processor-sharing
/// rates of ranks that share one host's cores.
class StepCosting {
public:
  StepCosting(ModuleOp module, func::FuncOp step, const MemoryPlan &plan, const DeviceProfile &p)
      : plan(plan), p(p) {
    if (MeshAttr mesh = getMesh(module)) {
      world = mesh.getWorldSize();
      replicas = mesh.getReplicas();
      shards = mesh.getShards();
      reshard = mesh.getReshard();
      node = mesh.getNode();
    }
    shardSpan = groupSpan(shards, world, p.ranksPerNode, false);
    // A shard group's nodes (consecutive) and its places across them.
    nodeSpan = groupSpan(node, world, p.ranksPerNode, false);
    crossSpan = groupSpanStrided(node ? shards / node : 0, world, p.ranksPerNode, node);
    reshardSpan = groupSpan(reshard, world, p.ranksPerNode, false);
    replicaSpan = groupSpan(replicas, world, p.ranksPerNode, true);
    worldSpan = groupSpan(world, world, p.ranksPerNode, false);
    share = p.cpu && p.cores > 0;
    cores = double(p.cores);
    threads = double(std::max<int64_t>(1, p.threadsPerRank));
    // A collective's calibrated time was measured with the ranks doing
    // nothing else; a compute op's with one rank alone.
    commWork = rate(false, true);
    compWork = share ? std::min(1.0, cores / threads) : 1.0;
    cold = gemmColdBytes(step, plan, p, share ? double(world) : 1.0);
  }

  /// Ranks sharing one host's cores (a CPU profile) share them by processor
  /// sharing (fsdp-sim's simulate(): the same model, the same arithmetic):
  /// while D = N (p [compute busy] + q [a collective in flight]) threads
  /// want the C cores each runs at min(1, C / D) of its speed alone.
  /// An async host update (fsdp-offload's overlap) runs on threads of
  /// its own as many as compute's.
  /// `comm`: the comm streams with a collective in flight (0, 1 or 2).
  double rate(bool comp, double comm, bool host = false) const {
    if (!share || (!comp && comm == 0 && !host))
      return 1.0;
    return std::min(
        1.0, cores / (double(world) * (threads * comp + commThreads * comm + threads * host)));
  }

  /// A collective over its group, by the alpha-beta model of its link.
  Item collective(Operation *op) const;
  /// A compute instruction (set_param / set_state / set_unit are copies),
  /// an async copy between the arenas (on a GPU: the copy stream's) or an
  /// async host update (the host stream's).
  Item compute(Operation *op) const;

  /// offload-nvme: the drive's duplex shares (DeviceProfile).
  double readShare() const { return p.nvmeDuplexReadShare; }
  double writeShare() const { return p.nvmeDuplexWriteShare; }

private:
  double bytesOf(Value v) const {
    auto it = plan.valueBuffer.find(v);
    return it == plan.valueBuffer.end() ? 0.0
                                        : double(plan.buffers[it->second].bytes);
  }
  /// Bytes an instruction reads and writes, and its first input (which
  /// picks the GEMM rate and the per-unit cost's count).
  double bytesMoved(Operation *op, Value &firstIn) const;

  const MemoryPlan &plan;
  const DeviceProfile &p;
  int64_t world = 1, replicas = 1, shards = 1, reshard = 0, node = 0;
  GroupSpan shardSpan, reshardSpan, replicaSpan, worldSpan, nodeSpan, crossSpan;
  bool share = false;
  double cores = 0, threads = 1, commThreads = 1.0;
  double commWork = 1, compWork = 1;
  llvm::DenseMap<Operation *, double> cold;
};

Item StepCosting::collective(Operation *op) const {
  StringRef group = "world";
  if (auto g = op->getAttrOfType<StringAttr>("group"))
    group = g.getValue();
  int64_t n = group == "shard"     ? shards
              : group == "replica" ? replicas
              : group == "reshard" ? reshard
              : group == "node"    ? node
              : group == "cross"   ? (node ? shards / node : 0)
                                   : world;
  // Shard, reshard and node groups are contiguous ranks, replica groups
  // strided across all, cross groups across their shard group.
  GroupSpan span = group == "shard"     ? shardSpan
                   : group == "reshard" ? reshardSpan
                   : group == "replica" ? replicaSpan
                   : group == "node"    ? nodeSpan
                   : group == "cross"   ? crossSpan
                                        : worldSpan;
  Value whole = isa<AllGatherOp>(op) ? op->getResult(0) : op->getOperand(0);
  double cost =
      collectiveSeconds(op->getName().stripDialect(), n, int64_t(bytesOf(whole)), span, p);
  bool async = op->hasAttr("async");
  Item it{Item::Collective, cost * commWork, async, async ? op->getResult(0) : Value()};
  auto stream = op->getAttrOfType<StringAttr>("stream");
  it.nodeStream = stream && stream.getValue() == "node";
  return it;
}

double StepCosting::bytesMoved(Operation *op, Value &firstIn) const {
  double bytes = 0;
  if (auto [sym, v] = storageWrite(op); v) {
    firstIn = v;
    bytes = bytesOf(v);
    auto it = plan.symbolBuffer.find(sym);
    if (it != plan.symbolBuffer.end())
      bytes += double(plan.buffers[it->second].bytes);
  } else if (auto pack = dyn_cast<PackOp>(op)) {
    // fsdp-sim's pack_bytes: the memory plan places most inputs where
    // the packed buffer wants them (the runtime skips those), so only
    // the others are read and written, and the padding is zeroed.
    firstIn = op->getOperand(0);
    auto bufOf = [&](Value v) -> const PlannedBuffer * {
      auto it = plan.valueBuffer.find(v);
      return it == plan.valueBuffer.end() ? nullptr : &plan.buffers[it->second];
    };
    const PlannedBuffer *o = bufOf(pack.getResult());
    int64_t outBytes = o ? o->bytes : 0;
    int64_t elem = outBytes / std::max<int64_t>(1, numel(shapeOf(pack.getResult())));
    ArrayRef<int64_t> offsets = pack.getOffsets();
    int64_t moved = 0, covered = 0;
    for (auto [k, v] : llvm::enumerate(pack.getInputs())) {
      const PlannedBuffer *b = bufOf(v);
      int64_t n = b ? b->bytes : 0;
      covered += n;
      if (!b || !o || k >= offsets.size() || b->offset != o->offset + offsets[k] * elem)
        moved += 2 * n;
    }
    bytes = double(moved + std::max<int64_t>(0, outBytes - covered));
  } else {
    for (Value v : op->getOperands())
      bytes += bytesOf(v);
    for (Value v : op->getResults())
      bytes += bytesOf(v);
    if (op->getNumOperands())
      firstIn = op->getOperand(0);
  }
  return bytes;
}

Item StepCosting::compute(Operation *op) const {
  Value firstIn;
  double bytes = bytesMoved(op, firstIn);
  double gemm = firstIn && isLowPrecision(firstIn) ? p.gemmFlopsPerSBf16 : p.gemmFlopsPerS;
  // fsdp-offload: a copy between the arenas runs at the host link's
  // speed, the host's update at its memory's (fsdp-sim's compute_cost).
  bool copy = isa<ToHostOp, ToDeviceOp>(op), onHost = op->hasAttr(kOnHostAttrName);
  double mem = onHost && p.hostMemBytesPerS > 0 ? p.hostMemBytesPerS : p.memBytesPerS;
  double gemmS = flopsOf(op) / gemm;
  if (auto it = cold.find(op); it != cold.end())
    gemmS += it->second / p.gemmColdBytesPerS;
  double work = std::max(gemmS, bytes / mem);
  if (copy && p.hostLinkBytesPerS > 0)
    work = bytesOf(op->getResult(0)) / p.hostLinkBytesPerS;
  auto per = p.secondsPerUnit.find(isa<SetParamOp, SetStateOp, SetUnitOp>(op)
                                       ? StringRef("copy")
                                       : costName(op->getName().stripDialect()));
  if (per != p.secondsPerUnit.end() && firstIn)
    work = std::max(work, unitsOf(op, firstIn) * per->second);
  // A fused instruction's folded ops: on a CPU (a profile with per-unit
  // costs) runtime/cpu runs each as a pass over the result; on a GPU they
  // are part of the one kernel (fsdp-sim's compute_cost). A fused layer
  // norm is nothing but its passes there (no GEMM), so its own roofline
  // is not counted on top of them.
  if (!p.secondsPerUnit.empty() &&
      isa<ResidualLayerNormOp, LayerNormGradAccOp, ResidualRmsNormOp, RmsNormGradAccOp>(op))
    work = 0;
  if (!p.secondsPerUnit.empty())
    for (StringRef e : epilogueOps(op)) {
      auto it = p.secondsPerUnit.find(e);
      double perUnit = it == p.secondsPerUnit.end() ? 0.0 : it->second;
      // The pass's tensor: the fused cross-entropy's gradient (its
      // result 0 is the loss), the bias gradient's input dy, else the
      // op's first result.
      Value out = isa<MatmulBiasGradOp>(op) ? op->getOperand(0)
                                            : op->getResult(isa<CrossEntropyFusedOp>(op) ? 1 : 0);
      work += std::max(double(numel(shapeOf(out))) * perUnit, 2 * bytesOf(out) / p.memBytesPerS);
    }
  // fsdp-offload's nvme: the update's state comes from the swap file and
  // goes back (Executor::runHostWithSwaps): the drive's time, not cores'.
  // (A copy of part of a unit on disk reads its staging's blocks.)
  double readS = 0, writeS = 0;
  if (auto it = plan.swaps.find(op); it != plan.swaps.end())
    for (const PlannedSwap &s : it->second) {
      readS += double(plan.buffers[s.staging].bytes) / p.nvmeReadBytesPerS;
      writeS += s.write ? double(plan.buffers[s.file].bytes) / p.nvmeWriteBytesPerS : 0.0;
    }
  double cost = (p.opOverheadS + work) * compWork;
  // fsdp-offload-activations' async copies run on the GPU's copy stream,
  // one at a time beside the collectives (the copy engines); a CPU device
  // copies in place, on compute (CpuDevice::runOn; fsdp-sim's loop does
  // the same). One of storage on disk first waits for its read.
  const bool readFirst = copy && readS > 0;
  if (copy && op->hasAttr("async") && !p.cpu)
    return {Item::Copy, cost, true, op->getResult(0), false, readS, 0.0, -1, readFirst};
  if (readFirst)
    return {Item::Compute, cost, false, Value(), false, readS, 0.0, -1, true};
  // fsdp-offload's async host update: on the host stream, one at a time,
  // its swaps on the swap streams ([Note: swap pipeline]).
  if (onHost && op->hasAttr("async"))
    return {Item::Host, cost, true, op->getResult(0), false, readS, writeS};
  // One joined at once: its reads, it and its writes, one after another.
  return {Item::Compute, cost + readS + writeS};
}

/// The streams, event by event (fsdp-sim's loop): compute runs `prog` in
/// order and stalls at a wait whose collective (or host update, or copy)
/// is in flight or at a blocking collective; the communication stream runs
/// its queue one collective at a time (and the node comm stream its own
/// beside it, at full speed on a GPU: NVLink beside the network), the
/// host stream its updates one at a time, the copy stream its copies one
/// at a time; all slow down by `c.rate` while they overlap (the copy
/// stream exists on a GPU only, where the rate is 1).
StepPrediction simulate(ArrayRef<Item> prog, const StepCosting &c) {
  StepPrediction r;
  struct Queued {
    size_t index;
    double left, start;
  };
  std::deque<Queued> queue, nodeQ, host, copies; // issued and not done
  // offload-nvme's swap streams; the host updates whose reads are queued.
  std::deque<Queued> ins, outs;
  llvm::DenseSet<size_t> reading;
  // Items whose read is issued; compute stalled at a copy whose read is
  // not done (offload-nvme-params).
  std::vector<bool> readIssued(prog.size(), false);
  bool blockedRead = false;
  llvm::DenseSet<Value> inFlight;
  double t = 0, cur = 0, curStart = 0, stallStart = 0;
  // Of compute's stall on a copy, the time that copy sat behind a join on
  // the copy stream waiting for a host update: host exposure, not copy.
  double heldByHostS = 0;
  bool running = false;
  // What compute is blocked on: a wait's buffer, or a blocking collective.
  Value blockedOn;
  std::optional<size_t> blockedSync;
  // A step's end (Item::Barrier) waits for the collectives and copies; the
  // first one starts the step that is reported, the second ends it.
  bool blockedBarrier = false;
  SmallVector<double, 2> barriers;
  size_t i = 0;
  auto passBarrier = [&] {
    blockedBarrier = false;
    ++i;
    barriers.push_back(t);
    if (barriers.size() > 1)
      return; // the host updates left are the next step's
    // (The collectives and copies are done; the host updates running on
    // count whole when they end in the reported step, as the ones that
    // step leaves running are not: one step's worth.)
    r = StepPrediction();
  };
  // Reads ahead (nvme-read-ahead), by the item compute passes first.
  std::vector<std::pair<int64_t, size_t>> ahead;
  for (size_t k = 0; k < prog.size(); ++k)
    if (prog[k].readS > 0 && prog[k].readAt >= 0)
      ahead.push_back({prog[k].readAt, k});
  llvm::stable_sort(ahead, [](auto &a, auto &b) { return a.first < b.first; });
  size_t nextAhead = 0;
  auto issueAhead = [&] {
    for (; nextAhead < ahead.size() && ahead[nextAhead].first < int64_t(i); ++nextAhead) {
      ins.push_back({ahead[nextAhead].second, prog[ahead[nextAhead].second].readS, -1.0});
      reading.insert(ahead[nextAhead].second);
      readIssued[ahead[nextAhead].second] = true;
    }
  };
  for (;;) {
    issueAhead();
    while (!running && !blockedOn && !blockedSync && !blockedBarrier && !blockedRead &&
           i < prog.size()) {
      issueAhead();
      const Item &it = prog[i];
      if (it.kind == Item::Barrier) {
        if (queue.empty() && nodeQ.empty() && copies.empty())
          passBarrier();
        else
          blockedBarrier = true;
      } else if (it.kind == Item::Wait && it.copyStream) {
        // The copies issued after it wait for its buffer; compute goes on.
        if (inFlight.contains(it.buffer))
          copies.push_back({i, 0.0, -1.0});
        ++i;
      } else if (it.kind == Item::Wait) {
        if (inFlight.contains(it.buffer)) {
          blockedOn = it.buffer;
          stallStart = t;
          break;
        }
        ++i;
      } else if (it.kind == Item::Host || it.kind == Item::Copy) {
        (it.kind == Item::Host ? host : copies).push_back({i, it.cost, -1.0});
        if (it.readS > 0 && it.readAt < 0) {
          ins.push_back({i, it.readS, -1.0});
          reading.insert(i);
          readIssued[i] = true;
        }
        inFlight.insert(it.buffer);
        ++i;
      } else if (it.kind == Item::Collective) {
        (it.nodeStream ? nodeQ : queue).push_back({i, it.cost, -1.0});
        if (it.async) {
          inFlight.insert(it.buffer);
          ++i;
        } else {
          blockedSync = i;
          stallStart = t;
          break;
        }
      } else {
        if (it.readFirst) {
          // A copy of storage on disk: its read now, if not ahead, and
          // compute waits for it (the runtime's runCopyWithSwaps).
          if (!readIssued[i]) {
            ins.push_back({i, it.readS, -1.0});
            reading.insert(i);
            readIssued[i] = true;
          }
          if (reading.contains(i)) {
            blockedRead = true;
            stallStart = t;
            break;
          }
        }
        running = true;
        cur = it.cost;
        curStart = t;
      }
    }
    issueAhead();
    // A copy-stream join at the copy stream's front passes once what it
    // waits for is done; until then the copies behind it wait.
    auto isJoin = [&](const Queued &q) { return prog[q.index].kind == Item::Wait; };
    while (!copies.empty() && isJoin(copies.front()) &&
           !inFlight.contains(prog[copies.front().index].buffer))
      copies.pop_front();
    // A host update starts once its read is done, and so does a copy of
    // storage on disk.
    const bool hostReady = !host.empty() && !reading.contains(host.front().index);
    const bool copyReady =
        !copies.empty() && !isJoin(copies.front()) && !reading.contains(copies.front().index);
    for (std::deque<Queued> *q : {&queue, &nodeQ, &host, &copies, &ins, &outs})
      if (!q->empty() && q->front().start < 0 && (q != &host || hostReady) &&
          (q != &copies || copyReady))
        q->front().start = t;
    if ((!running && queue.empty() && nodeQ.empty() && host.empty() && copies.empty() &&
         outs.empty() && ins.empty()) ||
        barriers.size() == 2)
      break;
    double rt = c.rate(running, double(!queue.empty()) + double(!nodeQ.empty()), hostReady);
    // The swap streams share the drive: each at its duplex share while
    // both move data.
    const bool duplex = !ins.empty() && !outs.empty();
    const double ioR = duplex ? c.readShare() : 1.0, ioW = duplex ? c.writeShare() : 1.0;
    double dtC = running ? cur / rt : HUGE_VAL;
    double dtM = !queue.empty() ? queue.front().left / rt : HUGE_VAL;
    double dtN = !nodeQ.empty() ? nodeQ.front().left / rt : HUGE_VAL;
    double dtH = hostReady ? host.front().left / rt : HUGE_VAL;
    double dtY = copyReady ? copies.front().left / rt : HUGE_VAL;
    double dtR = !ins.empty() ? ins.front().left / ioR : HUGE_VAL;
    double dtW = !outs.empty() ? outs.front().left / ioW : HUGE_VAL;
    double dt = std::min({dtC, dtM, dtN, dtH, dtY, dtR, dtW});
    if (blockedOn && !copies.empty() && isJoin(copies.front()) &&
        llvm::any_of(copies, [&](const Queued &q) {
          return !isJoin(q) && prog[q.index].buffer == blockedOn;
        }))
      heldByHostS += dt;
    // The drive is busy while either swap stream moves data.
    if (!ins.empty() || !outs.empty())
      r.swapS += dt;
    if (duplex)
      r.swapDuplexS += dt;
    t += dt;
    if (running) {
      if (dtC <= dt) {
        r.computeS += t - curStart;
        running = false;
        ++i;
      } else {
        cur -= dt * rt;
      }
    }
    auto finishCollective = [&](std::deque<Queued> &stream, double dtS) {
      if (stream.empty())
        return;
      if (dtS <= dt) {
        Queued q = stream.front();
        stream.pop_front();
        const Item &it = prog[q.index];
        r.commS += t - q.start;
        bool unblocks;
        if (it.async) {
          inFlight.erase(it.buffer);
          unblocks = blockedOn && blockedOn == it.buffer;
        } else {
          unblocks = blockedSync && *blockedSync == q.index;
        }
        if (unblocks) {
          r.exposedS += t - stallStart;
          blockedOn = Value();
          blockedSync.reset();
          ++i;
        }
      } else {
        stream.front().left -= dt * rt;
      }
    };
    finishCollective(queue, dtM);
    finishCollective(nodeQ, dtN);
    // The swap-in stream: a read done lets its update start.
    if (!ins.empty()) {
      if (dtR <= dt) {
        const size_t read = ins.front().index;
        reading.erase(read);
        ins.pop_front();
        // Compute waited for a copy's bytes from the drive.
        if (blockedRead && read == i) {
          r.copyExposedS += t - stallStart;
          blockedRead = false;
        }
      } else {
        ins.front().left -= dt * ioR;
      }
    }
    // The host, copy and swap-out streams: async work only, each joined by
    // a wait (an update that writes back: by its write's).
    auto advance = [&](std::deque<Queued> &q, double dtQ, double &busyS, double &waitedS,
                       double speed) {
      if (q.empty() || isJoin(q.front()) || dtQ == HUGE_VAL)
        return;
      if (dtQ > dt) {
        q.front().left -= dt * speed;
        return;
      }
      Queued done = q.front();
      q.pop_front();
      const Item &it = prog[done.index];
      busyS += t - done.start;
      if (&q == &host && it.writeS > 0) {
        outs.push_back({done.index, it.writeS, -1.0});
        return;
      }
      inFlight.erase(it.buffer);
      if (blockedOn && blockedOn == it.buffer) {
        waitedS += t - stallStart - heldByHostS;
        r.hostExposedS += heldByHostS;
        heldByHostS = 0;
        blockedOn = Value();
        ++i;
      }
    };
    advance(host, dtH, r.hostS, r.hostExposedS, rt);
    advance(copies, dtY, r.copyS, r.copyExposedS, rt);
    double writing = 0; // (the drive's time is counted above)
    advance(outs, dtW, writing, r.hostExposedS, ioW);
    if (blockedBarrier && queue.empty() && nodeQ.empty() && copies.empty())
      passBarrier();
  }
  r.stepS = barriers.size() == 2 ? barriers[1] - barriers[0] : t;
  return r;
}

} // namespace

StepPrediction mlir::fsdp::predictStep(ModuleOp module, func::FuncOp step, const MemoryPlan &plan,
                                       const DeviceProfile &p) {
  StepCosting costing(module, step, plan, p);
  // The program as the simulation sees it: the plan's instructions (the
  // storage aliases, set_grad and the return are none).
  SmallVector<Item> prog;
  bool carried = false;
  llvm::DenseMap<Operation *, size_t> itemOf;
  for (Operation &opRef : step.getBody().front()) {
    Operation *op = &opRef;
    if (isa<func::ReturnOp, SetGradOp>(op) || isStorageAlias(op))
      continue;
    itemOf[op] = prog.size();
    if (auto w = dyn_cast<WaitOp>(op); w && w->hasAttr("carried")) {
      // fsdp-offload's next-step join: keyed by the update it joins.
      Operation *u = plan.carried.lookup(op);
      carried = true;
      // (A CPU device copies in place: its copy stream is compute.)
      prog.push_back({Item::Wait, 0, false, u ? u->getResult(0) : Value(),
                      w->hasAttr("copy_stream") && !p.cpu});
    } else if (isa<WaitOp>(op))
      prog.push_back({Item::Wait, 0, false, op->getOperand(0)});
    else if (isa<AllGatherOp, AllToAllOp, ReduceScatterOp, AllReduceOp>(op))
      prog.push_back(costing.collective(op));
    else
      prog.push_back(costing.compute(op));
  }
  // nvme-read-ahead: where each read is issued (an earlier item).
  for (auto [op, from] : plan.swapReadAt)
    if (auto a = itemOf.find(op), f = itemOf.find(from); a != itemOf.end() && f != itemOf.end())
      prog[a->second].readAt = int64_t(f->second);
  if (carried) {
    // Updates joined in the next step: the steady state is the second of
    // two steps (the first joins nothing, as the runtime's first step),
    // from the first step's end to the second's, each end waiting for
    // compute, the collectives and the copies but not the host stream.
    SmallVector<Item> once(prog);
    prog.push_back({Item::Barrier, 0, false, Value()});
    const int64_t second = int64_t(prog.size());
    for (Item &it : once)
      if (it.readAt >= 0)
        it.readAt += second;
    prog.append(once.begin(), once.end());
    prog.push_back({Item::Barrier, 0, false, Value()});
  }
  return simulate(prog, costing);
}

bool mlir::fsdp::parseByteSize(StringRef text, int64_t &bytes) {
  text = text.trim();
  size_t i = 0;
  while (i < text.size() && (isdigit(text[i]) || text[i] == '.'))
    ++i;
  StringRef num = text.take_front(i), unit = text.drop_front(i).trim();
  double v;
  if (num.empty() || num.getAsDouble(v) || !(v > 0))
    return false;
  double mult;
  std::string u = unit.lower();
  if (u.empty() || u == "b")
    mult = 1;
  else if (u == "kib" || u == "k")
    mult = 1024.0;
  else if (u == "mib" || u == "m")
    mult = 1024.0 * 1024;
  else if (u == "gib" || u == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (u == "tib" || u == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "kb")
    mult = 1e3;
  else if (u == "mb")
    mult = 1e6;
  else if (u == "gb")
    mult = 1e9;
  else if (u == "tb")
    mult = 1e12;
  else
    return false;
  double b = v * mult;
  if (!(b >= 1) || b > 9.0e18)
    return false;
  bytes = int64_t(b);
  return true;
}
