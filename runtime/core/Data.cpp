//===- Data.cpp - batches for the plan's input bindings -------------------===//

#include "runtime/core/Data.h"

#include "runtime/core/Init.h"
#include "runtime/core/SafeTensors.h"

#include <cstring>
#include <fstream>
#include <sstream>

namespace fsdp {

namespace {

constexpr int32_t kTokenMagic = 20240520; // llm.c's data files
constexpr int32_t kTokenVersion = 1;

const Binding *findRole(const Plan &plan, const char *role) {
  const Binding *found = nullptr;
  for (const Binding &b : plan.inputs)
    if (b.role == role) {
      if (found)
        return nullptr; // ambiguous: handled by the caller's message
      found = &b;
    }
  return found;
}

bool isIntBuffer(const Buffer &b) {
  return b.dtype == DType::I32 || b.dtype == DType::I64;
}

void storeInt(const Buffer &b, uint8_t *p, int64_t i, int64_t v) {
  if (b.dtype == DType::I32)
    reinterpret_cast<int32_t *>(p)[i] = (int32_t)v;
  else
    reinterpret_cast<int64_t *>(p)[i] = v;
}

/// The FSDP2 tutorial task: x ~ N(0, 1), target 1 when sum(x) > 0.
class SyntheticRegression final : public DataSource {
public:
  SyntheticRegression(const Plan &plan, const Binding &x, const Binding &y,
                      int64_t rank, uint64_t seed)
      : plan(plan), x(x), y(y), rank(rank), seed(seed) {}
  Status fill(int64_t step, uint8_t *(*addr)(void *, int64_t), void *ctx) override {
    const Buffer &bx = plan.buffers[x.buffer];
    int64_t rows = bx.shape[0], cols = bx.numel() / rows;
    float *xs = reinterpret_cast<float *>(addr(ctx, x.buffer));
    float *ys = reinterpret_cast<float *>(addr(ctx, y.buffer));
    uint64_t key = mix64(seed ^ mix64(0x5eedULL + (uint64_t)step));
    for (int64_t i = 0; i < rows; ++i) {
      int64_t g = rank * rows + i; // global row
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) {
        double v = standardNormal(key, (uint64_t)(g * cols + c));
        xs[i * cols + c] = (float)v;
        sum += (float)v;
      }
      ys[i] = sum > 0 ? 1.0f : 0.0f;
    }
    return Status::ok();
  }
  const char *unit() const override { return "samples"; }
  int64_t itemsPerStep() const override {
    return plan.buffers[x.buffer].shape[0];
  }

private:
  const Plan &plan;
  Binding x, y;
  int64_t rank;
  uint64_t seed;
};

/// Token sequences with a learnable rule: t[j+1] = (5 t[j] + 3) mod V from
/// a random start, so a model can drive the loss towards zero.
class SyntheticTokens final : public DataSource {
public:
  SyntheticTokens(const Plan &plan, const Binding &x, const Binding &y,
                  int64_t rank, uint64_t seed)
      : plan(plan), x(x), y(y), rank(rank), seed(seed) {}
  Status fill(int64_t step, uint8_t *(*addr)(void *, int64_t), void *ctx) override {
    const Buffer &bx = plan.buffers[x.buffer], &by = plan.buffers[y.buffer];
    int64_t rows = bx.shape[0], T = bx.numel() / rows;
    int64_t V = std::min(x.range, y.range);
    uint8_t *xs = addr(ctx, x.buffer), *ys = addr(ctx, y.buffer);
    uint64_t key = mix64(seed ^ mix64(0x70cULL + (uint64_t)step));
    for (int64_t i = 0; i < rows; ++i) {
      int64_t g = rank * rows + i;
      int64_t t = (int64_t)(uniform01(key, (uint64_t)g) * V) % V;
      for (int64_t j = 0; j < T; ++j) {
        int64_t next = (5 * t + 3) % V;
        storeInt(bx, xs, i * T + j, t);
        storeInt(by, ys, i * T + j, next);
        t = next;
      }
    }
    return Status::ok();
  }
  const char *unit() const override { return "tokens"; }
  int64_t itemsPerStep() const override { return plan.buffers[x.buffer].numel(); }

private:
  const Plan &plan;
  Binding x, y;
  int64_t rank;
  uint64_t seed;
};

/// llm.c token files: windows of T+1 tokens; the global batch of step k
/// takes world x B consecutive windows, advancing every step, wrapping
/// around at the end of the file.
class TokenFile final : public DataSource {
public:
  TokenFile(const Plan &plan, const Binding &x, const Binding &y, int64_t rank, int64_t world,
            std::vector<uint16_t> tokens, std::vector<uint16_t> mask, int64_t ignore)
      : plan(plan), x(x), y(y), rank(rank), world(world), tokens(std::move(tokens)),
        mask(std::move(mask)), ignore(ignore) {}
  Status fill(int64_t step, uint8_t *(*addr)(void *, int64_t), void *ctx) override {
    const Buffer &bx = plan.buffers[x.buffer], &by = plan.buffers[y.buffer];
    int64_t rows = bx.shape[0], T = bx.numel() / rows;
    int64_t windows = ((int64_t)tokens.size() - 1) / T;
    uint8_t *xs = addr(ctx, x.buffer), *ys = addr(ctx, y.buffer);
    // Row `origin + (step - originStep - 1) x world x rows + rank x rows +
    // i` of the stream, modulo its windows (in 128 bits: no overflow).
    __int128 first = (__int128)originRows + (__int128)(step - originStep - 1) * world * rows +
                     (__int128)rank * rows;
    for (int64_t i = 0; i < rows; ++i) {
      int64_t w = (int64_t)((first + i) % windows);
      if (w < 0)
        w += windows;
      int64_t start = w * T;
      for (int64_t j = 0; j < T; ++j) {
        int64_t a = tokens[start + j], b = tokens[start + j + 1];
        bool masked = !mask.empty() && mask[start + j + 1] == 0;
        if (a >= x.range || (b >= y.range && !masked))
          return FSDP_ERROR("token ", std::max(a, b), " at position ",
                            start + j, " of the data file is outside the "
                            "model's vocabulary of ", std::min(x.range, y.range));
        storeInt(bx, xs, i * T + j, a);
        storeInt(by, ys, i * T + j, masked ? ignore : b);
      }
    }
    return Status::ok();
  }
  const char *unit() const override { return "tokens"; }
  int64_t itemsPerStep() const override { return plan.buffers[x.buffer].numel(); }
  int64_t consumedAfter(int64_t step) const override {
    return originRows + (step - originStep) * world * plan.buffers[x.buffer].shape[0];
  }
  void resumeAfter(int64_t step, int64_t consumed) override {
    originStep = step;
    originRows = consumed;
  }

private:
  const Plan &plan;
  Binding x, y;
  int64_t rank, world;
  int64_t originStep = 0, originRows = 0; ///< resumeAfter
  std::vector<uint16_t> tokens;
  std::vector<uint16_t> mask; ///< empty, or one entry a token: 0 = not a target
  int64_t ignore;             ///< the label written for a masked target
};

/// Sizes the sources divide by and write: a batch of at least one row,
/// every dimension positive, whole buffers inside their byte size.
Status checkDataBuffers(const Buffer &bx, const Buffer &by) {
  for (const auto *p : {&bx, &by}) {
    int64_t numel = 1;
    for (int64_t d : p->shape) {
      if (d <= 0)
        return FSDP_ERROR("input and target need a positive size in every "
                          "dimension, found ", d, " in buffer ", p->name);
      if (__builtin_mul_overflow(numel, d, &numel))
        return FSDP_ERROR("buffer ", p->name, ": element count overflows");
    }
    int64_t need;
    if (__builtin_mul_overflow(numel, dtypeSize(p->dtype), &need) || need > p->bytes)
      return FSDP_ERROR("buffer ", p->name, ": ", numel, " elements of ",
                        dtypeName(p->dtype), " do not fit its ", p->bytes, " bytes");
  }
  return Status::ok();
}

} // namespace

Status parseTokenFile(const std::string &name, const std::string &bytes,
                      std::vector<uint16_t> &tokens) {
  constexpr size_t kHeader = 256 * sizeof(int32_t);
  if (bytes.size() < kHeader)
    return FSDP_ERROR(name, ": too short for a token file header (", bytes.size(),
                      " of 1024 bytes)");
  auto word = [&](int i) { // little-endian int32 whatever the host
    uint32_t v = 0;
    for (int b = 3; b >= 0; --b)
      v = (v << 8) | (uint8_t)bytes[4 * i + b];
    return (int32_t)v;
  };
  if (word(0) != kTokenMagic)
    return FSDP_ERROR(name, ": bad magic ", word(0), " (expected ", kTokenMagic,
                      ": an llm.c token file)");
  if (word(1) != kTokenVersion)
    return FSDP_ERROR(name, ": unsupported token file version ", word(1),
                      " (expected ", kTokenVersion, ": uint16 tokens)");
  int64_t n = word(2);
  if (n < 0)
    return FSDP_ERROR(name, ": header token count ", n, " is negative");
  // Checked against the size before anything is allocated, as llm.c does.
  uint64_t expect = kHeader + 2 * (uint64_t)n;
  if (bytes.size() < expect)
    return FSDP_ERROR(name, ": truncated: the header announces ", n, " tokens (",
                      expect, " bytes), the file has ", bytes.size(), " bytes");
  if (bytes.size() > expect)
    return FSDP_ERROR(name, ": ", bytes.size() - expect, " bytes after the ", n,
                      " tokens the header announces (expected a file of ",
                      expect, " bytes)");
  tokens.resize((size_t)n);
  for (int64_t i = 0; i < n; ++i)
    tokens[i] = (uint16_t)((uint8_t)bytes[kHeader + 2 * i] |
                           ((uint8_t)bytes[kHeader + 2 * i + 1] << 8));
  return Status::ok();
}

Status readTokenFile(const std::string &path, std::vector<uint16_t> &tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return FSDP_ERROR("cannot open data file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return FSDP_ERROR("cannot read data file '", path, "'");
  return parseTokenFile(path, ss.str(), tokens);
}

Status writeTokenFile(const std::string &path,
                      const std::vector<uint16_t> &tokens) {
  if (tokens.size() > (size_t)INT32_MAX)
    return FSDP_ERROR(path, ": ", tokens.size(), " tokens do not fit a token "
                      "file (at most ", INT32_MAX, ")");
  int32_t header[256] = {};
  header[0] = kTokenMagic;
  header[1] = kTokenVersion;
  header[2] = (int32_t)tokens.size();
  std::string bytes(reinterpret_cast<const char *>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char *>(tokens.data()), tokens.size() * 2);
  return writeFileAtomic(path, bytes);
}

Status planIgnoreIndex(const Plan &plan, bool &found, int64_t &index) {
  found = false;
  for (const Instruction &inst : plan.program) {
    if (inst.op.rfind("cross_entropy", 0) != 0)
      continue;
    auto it = inst.attrs.find("ignore_index");
    if (it == inst.attrs.end() || !it->is_number_integer())
      continue;
    int64_t v = it->get<int64_t>();
    if (found && v != index)
      return FSDP_ERROR("the plan's cross-entropies disagree on ignore_index (", index, " and ", v,
                        "): --loss-mask cannot say which to write");
    found = true;
    index = v;
  }
  return Status::ok();
}

Status makeDataSource(const std::string &spec, const Plan &plan, int64_t rank, int64_t world,
                      uint64_t seed, std::unique_ptr<DataSource> &out,
                      const std::string &lossMask) {
  const Binding *x = findRole(plan, "input"), *y = findRole(plan, "target");
  if (!x || !y)
    return FSDP_ERROR("the plan needs exactly one input and one target binding "
                      "for fsdp-run's data sources");
  const Buffer &bx = plan.buffers[x->buffer], &by = plan.buffers[y->buffer];
  if (bx.shape.empty() || by.shape.empty() || bx.shape[0] != by.shape[0])
    return FSDP_ERROR("input and target must share a leading batch dimension, "
                      "found shapes of ", bx.shape.size(), " and ",
                      by.shape.size(), " dimensions");
  FSDP_RETURN_IF_ERROR(checkDataBuffers(bx, by));
  bool tokens = isIntBuffer(bx) && isIntBuffer(by) && bx.shape == by.shape &&
                bx.shape.size() == 2;
  if (tokens && (x->range < 1 || y->range < 1))
    return FSDP_ERROR("token inputs need a vocabulary: the bindings ", x->name,
                      " and ", y->name, " have range ", x->range, " and ",
                      y->range, " (expected >= 1)");
  if (spec == "synthetic" && !lossMask.empty())
    return FSDP_ERROR("--loss-mask marks positions of a token file: it needs --data FILE");
  if (spec == "synthetic") {
    if (tokens) {
      out = std::make_unique<SyntheticTokens>(plan, *x, *y, rank, seed);
      return Status::ok();
    }
    if (bx.dtype == DType::F32 && by.dtype == DType::F32 &&
        by.numel() == by.shape[0]) {
      out = std::make_unique<SyntheticRegression>(plan, *x, *y, rank, seed);
      return Status::ok();
    }
    return FSDP_ERROR("synthetic data needs float inputs [B, ...] with a "
                      "float target [B, 1], or token ids [B, T] with targets "
                      "[B, T]; use --data FILE for other models");
  }
  if (!tokens)
    return FSDP_ERROR("a token file feeds models whose input and target are "
                      "integer [B, T] tensors");
  std::vector<uint16_t> toks, mask;
  FSDP_RETURN_IF_ERROR(readTokenFile(spec, toks));
  if (!lossMask.empty()) {
    FSDP_RETURN_IF_ERROR(readTokenFile(lossMask, mask));
    if (mask.size() != toks.size())
      return FSDP_ERROR("--loss-mask ", lossMask, " has ", mask.size(), " entries; the data file ",
                        spec, " has ", toks.size(), " tokens (expected one entry a token)");
  }
  return makeTokenDataSource(spec, std::move(toks), plan, rank, world, out, std::move(mask));
}

Status makeTokenDataSource(const std::string &name, std::vector<uint16_t> toks, const Plan &plan,
                           int64_t rank, int64_t world, std::unique_ptr<DataSource> &out,
                           std::vector<uint16_t> mask) {
  const Binding *x = findRole(plan, "input"), *y = findRole(plan, "target");
  if (!x || !y)
    return FSDP_ERROR("the plan needs exactly one input and one target binding "
                      "for fsdp-run's data sources");
  const Buffer &bx = plan.buffers[x->buffer], &by = plan.buffers[y->buffer];
  FSDP_RETURN_IF_ERROR(checkDataBuffers(bx, by));
  if (!(isIntBuffer(bx) && isIntBuffer(by) && bx.shape == by.shape &&
        bx.shape.size() == 2))
    return FSDP_ERROR("a token file feeds models whose input and target are "
                      "integer [B, T] tensors");
  if (x->range < 1 || y->range < 1)
    return FSDP_ERROR("token inputs need a vocabulary: the bindings ", x->name,
                      " and ", y->name, " have range ", x->range, " and ",
                      y->range, " (expected >= 1)");
  if (rank < 0 || world < 1 || rank >= world)
    return FSDP_ERROR("rank ", rank, " is outside a world of ", world);
  int64_t T = bx.shape[1];
  if ((int64_t)toks.size() < T + 1)
    return FSDP_ERROR(name, ": ", toks.size(), " tokens are fewer than one "
                      "window of ", T + 1);
  bool hasIgnore = false;
  int64_t ignore = 0;
  FSDP_RETURN_IF_ERROR(planIgnoreIndex(plan, hasIgnore, ignore));
  if (!mask.empty() && !hasIgnore)
    return FSDP_ERROR("--loss-mask needs a plan whose cross_entropy has ignore_index (the label "
                      "it writes for a masked position); this plan's has none");
  if (!mask.empty() && mask.size() != toks.size())
    return FSDP_ERROR(name, ": the loss mask has ", mask.size(), " entries for ", toks.size(),
                      " tokens");
  out = std::make_unique<TokenFile>(plan, *x, *y, rank, world, std::move(toks), std::move(mask),
                                    ignore);
  return Status::ok();
}

} // namespace fsdp
