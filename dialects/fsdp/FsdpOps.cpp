//===- FsdpOps.cpp - verifiers of the fsdp dialect ------------------------===//
//
// Every verifier names what it expected and what it found, so a user sees
// e.g. "expected contracting sizes to agree, found 64 (lhs) and 32 (rhs)" at
// the op's file:line:col.
//
//===----------------------------------------------------------------------===//

#include "dialects/fsdp/FsdpOps.h"
#include "dialects/fsdp/Shapes.h"
#include "runtime/core/ShapeRules.h"

#include "mlir/IR/BuiltinOps.h"

#include "llvm/ADT/STLExtras.h"

#include <cmath>

using namespace mlir;
using namespace mlir::fsdp;

/// `: type(q) [, type(k)]` of attention ops: the key/value type is printed
/// only when it differs from the query type (grouped-query attention), so
/// multi-head attention keeps its one-type form.
static ParseResult parseAttentionTypes(OpAsmParser &parser, Type &qType,
                                       Type &kType) {
  if (parser.parseType(qType))
    return failure();
  if (succeeded(parser.parseOptionalComma()))
    return parser.parseType(kType);
  kType = qType;
  return success();
}

static void printAttentionTypes(OpAsmPrinter &printer, Operation *, Type qType,
                                Type kType) {
  printer << qType;
  if (kType != qType)
    printer << ", " << kType;
}

/// attention_grad's types: those of attention, and its `lse` operand's,
/// f32 [B, heads, T] from q's [B, T, C] (not written).
static ParseResult parseAttentionGradTypes(OpAsmParser &parser, Type &qType,
                                           Type &kType, IntegerAttr heads,
                                           Type &lseType) {
  if (parseAttentionTypes(parser, qType, kType))
    return failure();
  auto q = dyn_cast<RankedTensorType>(qType);
  if (!q || q.getRank() != 3)
    return parser.emitError(parser.getCurrentLocation())
           << "expected q of rank 3 [batch, seq, width], found " << qType;
  lseType = RankedTensorType::get({q.getDimSize(0), heads.getInt(), q.getDimSize(1)},
                                  Float32Type::get(parser.getContext()));
  return success();
}

static void printAttentionGradTypes(OpAsmPrinter &printer, Operation *op,
                                    Type qType, Type kType, IntegerAttr,
                                    Type) {
  printAttentionTypes(printer, op, qType, kType);
}

/// The layer norm gradients' d_gamma / d_beta type: gamma's, unless
/// `-> type` follows (f32 for a narrow gamma; the verifier checks it).
static ParseResult parseParamGradTypes(OpAsmParser &parser, Type gamma, Type &dGamma,
                                       Type &dBeta) {
  dGamma = gamma;
  if (succeeded(parser.parseOptionalArrow()) && parser.parseType(dGamma))
    return failure();
  dBeta = dGamma;
  return success();
}

static void printParamGradTypes(OpAsmPrinter &printer, Operation *, Type gamma, Type dGamma,
                                Type) {
  if (dGamma != gamma)
    printer << "-> " << dGamma; // the printer has put a space before the directive
}

/// An update's state type (adamw_update's and LAMB's moments,
/// sgd_momentum_update's buffer): the parameter's, unless `state type` follows (bf16 state of
/// f32 parameters; the verifier checks it).
static ParseResult parseStateType(OpAsmParser &parser, Type &state, Type param) {
  state = param;
  if (succeeded(parser.parseOptionalKeyword("state")) && parser.parseType(state))
    return failure();
  return success();
}

static void printStateType(OpAsmPrinter &printer, Operation *, Type state, Type param) {
  if (state != param)
    printer << "state " << state; // the printer has put a space before the directive
}

/// An update's gradient type: the parameter's, unless `grad type` follows
/// (the f32 gradient of bf16 parameters, master-dtype=bf16; the verifier
/// checks it).
static ParseResult parseGradType(OpAsmParser &parser, Type &grad, Type param) {
  grad = param;
  if (succeeded(parser.parseOptionalKeyword("grad")) && parser.parseType(grad))
    return failure();
  return success();
}

static void printGradType(OpAsmPrinter &printer, Operation *, Type grad, Type param) {
  if (grad != param)
    printer << "grad " << grad; // the printer has put a space before the directive
}

#define GET_OP_CLASSES
#include "dialects/fsdp/FsdpOps.cpp.inc"

static RankedTensorType rt(Value v) {
  return cast<RankedTensorType>(v.getType());
}

static std::string typeStr(Type t) {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << "'" << t << "'";
  return s;
}

/// Checks that `got` has shape `want` and element type `elem`.
static LogicalResult expectType(Operation *op, StringRef what,
                                RankedTensorType got, ArrayRef<int64_t> want,
                                Type elem) {
  if (got.getShape() != want || got.getElementType() != elem)
    return op->emitOpError() << "expected " << what << " of type "
                             << typeStr(RankedTensorType::get(want, elem))
                             << ", found " << typeStr(got);
  return success();
}

//===----------------------------------------------------------------------===//
// Module-level state
//===----------------------------------------------------------------------===//

LogicalResult ParamOp::verify() {
  StringRef init = getInit();
  if (!llvm::is_contained({"normal", "uniform", "zeros", "ones"}, init))
    return emitOpError() << "expected init to be one of normal, uniform, "
                            "zeros, ones; found \""
                         << init << "\"";
  bool needsScale = init == "normal" || init == "uniform";
  if (needsScale && !getScale())
    return emitOpError() << "expected a scale for init \"" << init
                         << "\" (e.g. init(\"" << init << "\", 0.02))";
  if (!needsScale && getScale())
    return emitOpError() << "init \"" << init << "\" takes no scale";
  if (getScale() && getScale()->convertToDouble() < 0)
    return emitOpError() << "expected a non-negative scale, found "
                         << getScale()->convertToDouble();
  if (getUnit() && getUnit()->empty())
    return emitOpError() << "expected a non-empty unit name";
  return success();
}

LogicalResult StateOp::verify() {
  Operation *sym =
      SymbolTable::lookupNearestSymbolFrom(*this, getParamAttr());
  // The state's dtype: the parameter's, or bf16 beside an f32 parameter
  // (fsdp-insert-optimizer's state-dtype=bf16).
  // Or 8-bit or 4-bit moments (state-dtype=8bit|4bit): the packed i8
  // codes and block scales of an f32 shadow, for a block that is a power
  // of two in [32, 4096].
  auto packs = [](RankedTensorType s, RankedTensorType t) {
    if (!s.getElementType().isF32() || !t.getElementType().isInteger(8) || t.getRank() != 1)
      return false;
    for (int64_t block = 32; block <= 4096; block *= 2)
      for (int64_t bits : {8, 4})
        if (::fsdp::shapes::packedStateBytes(s.getNumElements(), block, bits) == t.getNumElements())
          return true;
    return false;
  };
  auto fits = [&](Type shadow) {
    auto s = cast<RankedTensorType>(shadow), t = getTensorType();
    return s == t ||
           (s.getShape() == t.getShape() && s.getElementType().isF32() &&
            t.getElementType().isBF16()) ||
           packs(s, t);
  };
  // A bf16 unit (fsdp-mixed-precision's master-dtype=bf16) steps in f32:
  // its state is that of an f32 unit.
  auto fitsUnit = [&](Type shadow) {
    auto s = cast<RankedTensorType>(shadow);
    return fits(s) ||
           (s.getElementType().isBF16() && fits(s.clone(Float32Type::get(getContext()))));
  };
  if (auto unit = dyn_cast_or_null<UnitOp>(sym)) {
    // Whole (DDP) or one shard (ZeRO-1/2/3) of the unit.
    if (!fitsUnit(unit.getType()) && !fitsUnit(unit.getShardType()))
      return emitOpError() << "expected the unit's type " << unit.getType()
                           << " or its shard type " << unit.getShardType()
                           << ", found " << getType();
    return success();
  }
  auto param = dyn_cast_or_null<ParamOp>(sym);
  if (!param)
    return emitOpError() << "shadows " << getParamAttr()
                         << ", which is not an fsdp.param or fsdp.unit";
  if (!fits(param.getType()))
    return emitOpError()
           << "expected type " << param.getType()
           << " of the parameter it shadows (or its shape in bf16, or 8-bit moments of it), found "
           << getType();
  return success();
}

/// Shared by the symbol accessors: the symbol must be an op of kind OpT whose
/// type is `type`.
template <typename OpT>
static LogicalResult verifySymbolAccess(Operation *op, FlatSymbolRefAttr name,
                                        Type type,
                                        SymbolTableCollection &symbolTable,
                                        StringRef kind, bool needTrainable) {
  Operation *sym = symbolTable.lookupNearestSymbolFrom(op, name);
  if (!sym)
    return op->emitOpError() << "refers to undefined " << kind << " " << name;
  auto target = dyn_cast<OpT>(sym);
  if (!target)
    return op->emitOpError() << "expected " << name << " to be an "
                             << OpT::getOperationName() << ", found "
                             << sym->getName();
  if (target.getType() != type)
    return op->emitOpError() << "expected type " << target.getType() << " of "
                             << name << ", found " << type;
  if constexpr (std::is_same_v<OpT, ParamOp>) {
    if (needTrainable && target.getFrozen())
      return op->emitOpError() << name << " is frozen and has no gradient";
  }
  return success();
}

LogicalResult GetParamOp::verifySymbolUses(SymbolTableCollection &st) {
  return verifySymbolAccess<ParamOp>(*this, getNameAttr(), getType(), st,
                                     "parameter", false);
}
LogicalResult SetParamOp::verifySymbolUses(SymbolTableCollection &st) {
  return verifySymbolAccess<ParamOp>(*this, getNameAttr(),
                                     getValue().getType(), st, "parameter",
                                     false);
}
LogicalResult SetGradOp::verifySymbolUses(SymbolTableCollection &st) {
  return verifySymbolAccess<ParamOp>(*this, getNameAttr(),
                                     getValue().getType(), st, "parameter",
                                     true);
}
LogicalResult GetStateOp::verifySymbolUses(SymbolTableCollection &st) {
  return verifySymbolAccess<StateOp>(*this, getNameAttr(), getType(), st,
                                     "optimizer state", false);
}
LogicalResult SetStateOp::verifySymbolUses(SymbolTableCollection &st) {
  return verifySymbolAccess<StateOp>(*this, getNameAttr(),
                                     getValue().getType(), st,
                                     "optimizer state", false);
}

//===----------------------------------------------------------------------===//
// Compute ops
//===----------------------------------------------------------------------===//

static LogicalResult verifyBinary(Operation *op) {
  auto a = rt(op->getOperand(0)), b = rt(op->getOperand(1));
  auto r = rt(op->getResult(0));
  if (a.getElementType() != b.getElementType())
    return op->emitOpError() << "expected operands of one element type, found "
                             << a.getElementType() << " and "
                             << b.getElementType();
  auto shape = broadcastShapes(a.getShape(), b.getShape());
  if (!shape)
    return op->emitOpError() << "operand shapes " << shapeStr(a.getShape())
                             << " and " << shapeStr(b.getShape())
                             << " do not broadcast";
  return expectType(op, "result", r, *shape, a.getElementType());
}

LogicalResult DropoutOp::verify() {
  double p = getP().convertToDouble();
  if (!(p >= 0.0 && p < 1.0))
    return emitOpError() << "p = " << p << " must be in [0, 1)";
  // I64Attr reads back unsigned: compare as signed.
  int64_t id = (int64_t)getId(), micro = (int64_t)getMicro(),
          count = (int64_t)getMicroCount();
  if (id < 0)
    return emitOpError() << "id = " << id << " must be >= 0";
  if (count < 1 || micro < 0 || micro >= count)
    return emitOpError() << "micro = " << micro << " must be in [0, micro_count = "
                         << count << ")";
  return success();
}

LogicalResult AddOp::verify() { return verifyBinary(*this); }
LogicalResult SubOp::verify() { return verifyBinary(*this); }
LogicalResult MulOp::verify() { return verifyBinary(*this); }
LogicalResult DivOp::verify() { return verifyBinary(*this); }

LogicalResult BiasAddOp::verify() {
  auto x = rt(getInput());
  if (x.getRank() < 1)
    return emitOpError() << "expected an input of rank >= 1, found a scalar";
  return expectType(*this, "bias", rt(getBias()), {x.getShape().back()},
                    x.getElementType());
}

static LogicalResult verifyGeluForm(Operation *op, llvm::StringRef form) {
  if (form != "tanh" && form != "none")
    return op->emitOpError() << "expected approximate = \"tanh\" or \"none\", found \""
                             << form << "\"";
  return success();
}
LogicalResult GeluOp::verify() { return verifyGeluForm(*this, getApproximate()); }
LogicalResult GeluGradOp::verify() { return verifyGeluForm(*this, getApproximate()); }

/// The element type a matmul's product may have on operands of element
/// type `in`, given the result `r` found: `in`, or f32 for bf16 / f16
/// operands (the f32 accumulation written unrounded: fsdp-fuse-epilogues
/// folds a cast of the product to f32 into it).
static Type productType(Type in, RankedTensorType r) {
  Type out = r.getElementType();
  return out.isF32() && (in.isBF16() || in.isF16()) ? out : in;
}

LogicalResult MatmulOp::verify() {
  auto a = rt(getLhs()), b = rt(getRhs());
  if (a.getElementType() != b.getElementType())
    return emitOpError() << "expected operands of one element type, found "
                         << a.getElementType() << " and " << b.getElementType();
  std::string why;
  auto shape = matmulShape(a.getShape(), b.getShape(), getTransposeLhs(),
                           getTransposeRhs(), why);
  if (!shape)
    return emitOpError() << why;
  if (failed(expectType(*this, "result", rt(getResult()), *shape,
                        productType(a.getElementType(), rt(getResult())))))
    return failure();
  if (Value acc = getAcc()) {
    if (a.getRank() != 2)
      return emitOpError() << "accumulates (acc) only rank-2 products, found rank " << a.getRank();
    if (rt(acc) != rt(getResult()))
      return emitOpError() << "expected acc of the result's type " << getResult().getType()
                           << ", found " << acc.getType();
  }
  return success();
}

/// Shared by the fused matmuls: rank-2 operands of one element type, and
/// the product's [M, N] shape in `shape`.
static LogicalResult verifyFusedMatmul(Operation *op, RankedTensorType a,
                                       RankedTensorType b, bool ta, bool tb,
                                       SmallVectorImpl<int64_t> &shape) {
  if (a.getRank() != 2 || b.getRank() != 2)
    return op->emitOpError() << "expected rank-2 operands, found ranks "
                             << a.getRank() << " and " << b.getRank();
  if (a.getElementType() != b.getElementType())
    return op->emitOpError() << "expected operands of one element type, found "
                             << a.getElementType() << " and " << b.getElementType();
  std::string why;
  auto s = matmulShape(a.getShape(), b.getShape(), ta, tb, why);
  if (!s)
    return op->emitOpError() << why;
  shape.assign(s->begin(), s->end());
  return success();
}

LogicalResult MatmulBiasOp::verify() {
  auto a = rt(getLhs()), b = rt(getRhs());
  SmallVector<int64_t> shape;
  if (failed(verifyFusedMatmul(*this, a, b, getTransposeLhs(), getTransposeRhs(), shape)))
    return failure();
  Type et = a.getElementType();
  if (failed(expectType(*this, "bias", rt(getBias()), {shape[1]}, et)) ||
      failed(expectType(*this, "result", rt(getResult()), shape, et)))
    return failure();
  if (getPre()) {
    if (!getGelu())
      return emitOpError() << "has a pre-activation result without gelu";
    return expectType(*this, "pre", rt(getPre()), shape, et);
  }
  return success();
}

LogicalResult MatmulGeluGradOp::verify() {
  auto a = rt(getLhs()), b = rt(getRhs());
  SmallVector<int64_t> shape;
  if (failed(verifyFusedMatmul(*this, a, b, getTransposeLhs(), getTransposeRhs(), shape)))
    return failure();
  Type et = a.getElementType();
  if (failed(expectType(*this, "pre", rt(getPre()), shape, et)) ||
      failed(expectType(*this, "result", rt(getResult()), shape, et)))
    return failure();
  // The bias gradient: the operands' type, or f32 (productType: a
  // parameter gradient widened by fsdp-fuse-epilogues).
  if (getBiasGrad())
    return expectType(*this, "bias_grad", rt(getBiasGrad()), {shape[1]},
                      productType(et, rt(getBiasGrad())));
  return success();
}

LogicalResult MatmulBiasGradOp::verify() {
  if (!getTransposeLhs() || getTransposeRhs())
    return emitOpError() << "expected transpose_lhs and not transpose_rhs (the weight "
                            "gradient lhs^T rhs)";
  auto a = rt(getLhs()), b = rt(getRhs());
  SmallVector<int64_t> shape;
  if (failed(verifyFusedMatmul(*this, a, b, true, false, shape)))
    return failure();
  // Both results of one type: the operands', or f32 (productType).
  Type et = productType(a.getElementType(), rt(getResult()));
  if (failed(expectType(*this, "result", rt(getResult()), shape, et)) ||
      failed(expectType(*this, "bias_grad", rt(getBiasGrad()), {shape[0]}, et)))
    return failure();
  OperandRange acc = getAcc();
  if (acc.empty())
    return success();
  if (acc.size() != 2)
    return emitOpError() << "expected two accumulators (acc: the weight gradient's and the bias "
                            "gradient's) or none, found "
                         << acc.size();
  auto check = [&](Value a, Value r, StringRef what) -> LogicalResult {
    if (a.getType() == r.getType())
      return success();
    return emitOpError() << "expected the " << what << " gradient's accumulator of type "
                         << r.getType() << ", found " << a.getType();
  };
  return failure(failed(check(acc[0], getResult(), "weight")) ||
                 failed(check(acc[1], getBiasGrad(), "bias")));
}

/// Shared by the layer norms: x of rank >= 1, gamma (and beta) [C], a
/// positive epsilon.
static LogicalResult verifyLayerNorm(Operation *op, RankedTensorType x, Value gamma,
                                     Value beta, double epsilon) {
  if (x.getRank() < 1)
    return op->emitOpError() << "expected an input of rank >= 1, found a scalar";
  SmallVector<int64_t> c{x.getShape().back()};
  if (failed(expectType(op, "gamma", rt(gamma), c, x.getElementType())) ||
      (beta && failed(expectType(op, "beta", rt(beta), c, x.getElementType()))))
    return failure();
  if (epsilon <= 0)
    return op->emitOpError() << "expected a positive epsilon";
  return success();
}

LogicalResult LayerNormOp::verify() {
  return verifyLayerNorm(*this, rt(getInput()), getGamma(), getBeta(),
                         getEpsilon().convertToDouble());
}

LogicalResult ResidualLayerNormOp::verify() {
  return verifyLayerNorm(*this, rt(getLhs()), getGamma(), getBeta(),
                         getEpsilon().convertToDouble());
}

/// d_gamma / d_beta of the layer norm gradients: gamma's type, or f32 for
/// a bf16 / f16 gamma (productType: the f32 sums unrounded).
static LogicalResult verifyParamGrads(Operation *op, Value gamma, Value dGamma, Value dBeta) {
  auto g = rt(gamma);
  if (failed(expectType(op, "d_gamma", rt(dGamma), g.getShape(),
                        productType(g.getElementType(), rt(dGamma)))))
    return failure();
  return expectType(op, "d_beta", rt(dBeta), g.getShape(), rt(dGamma).getElementType());
}

LogicalResult LayerNormGradOp::verify() {
  if (failed(verifyLayerNorm(*this, rt(getInput()), getGamma(), Value(),
                             getEpsilon().convertToDouble())))
    return failure();
  return verifyParamGrads(*this, getGamma(), getDGamma(), getDBeta());
}

LogicalResult LayerNormGradAccOp::verify() {
  if (failed(verifyLayerNorm(*this, rt(getInput()), getGamma(), Value(),
                             getEpsilon().convertToDouble())))
    return failure();
  return verifyParamGrads(*this, getGamma(), getDGamma(), getDBeta());
}

/// Shared by attention and attention_grad: q is [B, T, heads*D]; k and v
/// (one type, by the op's traits) are [B, T, kvHeads*D] with kvHeads
/// dividing heads.
static LogicalResult verifyAttention(Operation *op, RankedTensorType q,
                                     RankedTensorType k, int64_t heads,
                                     std::optional<int64_t> kvHeads) {
  if (q.getRank() != 3)
    return op->emitOpError() << "expected q, k, v of rank 3 [batch, seq, "
                                "width], found rank "
                             << q.getRank();
  if (heads <= 0 || q.getShape()[2] % heads != 0)
    return op->emitOpError() << "expected heads to divide the width "
                             << q.getShape()[2] << ", found heads = " << heads;
  int64_t kv = kvHeads.value_or(heads);
  if (kv <= 0 || heads % kv != 0)
    return op->emitOpError() << "expected kv_heads to divide heads = " << heads
                             << ", found kv_heads = " << kv;
  int64_t d = q.getShape()[2] / heads;
  return expectType(op, "k and v", k,
                    {q.getShape()[0], q.getShape()[1], kv * d},
                    q.getElementType());
}

/// The log-sum-exp of attention with query type `q`: f32 [B, heads, T].
static LogicalResult expectLse(Operation *op, RankedTensorType q,
                               int64_t heads, Value lse) {
  return expectType(op, "lse", rt(lse),
                    {q.getShape()[0], heads, q.getShape()[1]},
                    Float32Type::get(op->getContext()));
}

LogicalResult AttentionOp::verify() {
  if (failed(verifyAttention(*this, rt(getQ()), rt(getK()), getHeads(),
                             getKvHeads())))
    return failure();
  return getLse() ? expectLse(*this, rt(getQ()), getHeads(), getLse())
                  : success();
}

LogicalResult AttentionGradOp::verify() {
  if (failed(verifyAttention(*this, rt(getQ()), rt(getK()), getHeads(),
                             getKvHeads())))
    return failure();
  return expectLse(*this, rt(getQ()), getHeads(), getLse());
}

/// attention_qkv(_grad): `qkv` [B, T, C + 2 G D] against y [B, T, C] of
/// its element type (C = heads * D), as attention's q, k, v would be.
static LogicalResult verifyPackedAttention(Operation *op, RankedTensorType qkv,
                                           RankedTensorType y, int64_t heads,
                                           std::optional<int64_t> kvHeads) {
  if (qkv.getRank() != 3 || y.getRank() != 3)
    return op->emitOpError() << "expected qkv and y of rank 3 [batch, seq, width], found "
                             << typeStr(qkv) << " and " << typeStr(y);
  if (failed(verifyAttention(op, y, y, heads, std::nullopt)))
    return failure();
  int64_t kv = kvHeads.value_or(heads);
  if (kv <= 0 || heads % kv != 0)
    return op->emitOpError() << "expected kv_heads to divide heads = " << heads
                             << ", found kv_heads = " << kv;
  int64_t c = y.getShape()[2], d = c / heads;
  return expectType(op, "qkv (q, k and v side by side)", qkv,
                    {y.getShape()[0], y.getShape()[1], c + 2 * kv * d}, y.getElementType());
}

LogicalResult AttentionQkvOp::verify() {
  RankedTensorType y = rt(getResult());
  if (failed(verifyPackedAttention(*this, rt(getQkv()), y, getHeads(), getKvHeads())))
    return failure();
  return getLse() ? expectLse(*this, y, getHeads(), getLse()) : success();
}

LogicalResult AttentionQkvGradOp::verify() {
  RankedTensorType y = rt(getY());
  if (failed(verifyPackedAttention(*this, rt(getQkv()), y, getHeads(), getKvHeads())))
    return failure();
  return expectLse(*this, y, getHeads(), getLse());
}

/// Shared by rms_norm and rms_norm_grad.
static LogicalResult verifyRmsNorm(Operation *op, RankedTensorType x,
                                   RankedTensorType w, double epsilon) {
  if (x.getRank() < 1)
    return op->emitOpError() << "expected an input of rank >= 1, found a scalar";
  if (failed(expectType(op, "weight", w, {x.getShape().back()},
                        x.getElementType())))
    return failure();
  if (!(epsilon > 0) || !std::isfinite(epsilon))
    return op->emitOpError() << "expected a positive, finite epsilon, found "
                             << epsilon;
  return success();
}

LogicalResult RmsNormOp::verify() {
  return verifyRmsNorm(*this, rt(getInput()), rt(getWeight()),
                       getEpsilon().convertToDouble());
}

LogicalResult RmsNormGradOp::verify() {
  return verifyRmsNorm(*this, rt(getInput()), rt(getWeight()),
                       getEpsilon().convertToDouble());
}

LogicalResult ResidualRmsNormOp::verify() {
  return verifyRmsNorm(*this, rt(getLhs()), rt(getWeight()), getEpsilon().convertToDouble());
}

LogicalResult RmsNormGradAccOp::verify() {
  return verifyRmsNorm(*this, rt(getInput()), rt(getWeight()), getEpsilon().convertToDouble());
}

/// Shared by rope and rope_grad: [B, T, heads*D] with D even, theta > 1
/// (theta <= 1 would not decrease the frequencies with i).
static LogicalResult verifyRope(Operation *op, RankedTensorType x,
                                int64_t heads, double theta) {
  if (x.getRank() != 3)
    return op->emitOpError() << "expected an input of rank 3 [batch, seq, "
                                "heads*head_dim], found "
                             << typeStr(x);
  int64_t c = x.getShape()[2];
  if (heads <= 0 || c % heads != 0 || (c / heads) % 2 != 0)
    return op->emitOpError() << "expected heads to divide the width " << c
                             << " into heads of even size, found heads = "
                             << heads;
  if (!(theta > 1) || !std::isfinite(theta))
    return op->emitOpError() << "expected a finite theta > 1, found " << theta;
  return success();
}

LogicalResult RopeOp::verify() {
  return verifyRope(*this, rt(getInput()), getHeads(),
                    getTheta().convertToDouble());
}

LogicalResult RopeGradOp::verify() {
  return verifyRope(*this, rt(getGrad()), getHeads(),
                    getTheta().convertToDouble());
}

LogicalResult EmbeddingOp::verify() {
  auto t = rt(getTable()), ids = rt(getIds());
  if (t.getRank() != 2)
    return emitOpError() << "expected a table of rank 2 [vocab, width], found "
                         << shapeStr(t.getShape());
  SmallVector<int64_t> shape(ids.getShape());
  shape.push_back(t.getShape()[1]);
  return expectType(*this, "result", rt(getResult()), shape,
                    t.getElementType());
}

LogicalResult ReshapeOp::verify() {
  auto a = rt(getInput()), r = rt(getResult());
  if (a.getElementType() != r.getElementType())
    return emitOpError() << "expected the element type to be kept, found "
                         << a.getElementType() << " -> " << r.getElementType();
  if (a.getNumElements() != r.getNumElements())
    return emitOpError() << "expected the element count to be kept, found "
                         << a.getNumElements() << " -> " << r.getNumElements();
  return success();
}

LogicalResult MicrobatchOp::verify() {
  auto a = rt(getInput()), r = rt(getResult());
  if (a.getElementType() != r.getElementType())
    return emitOpError() << "expected the element type to be kept, found "
                         << a.getElementType() << " -> " << r.getElementType();
  if (a.getRank() < 1 || a.getRank() != r.getRank() ||
      a.getShape().drop_front() != r.getShape().drop_front())
    return emitOpError() << "expected the shapes to differ in dimension 0 "
                            "only, found "
                         << a << " -> " << r;
  int64_t rows = r.getShape()[0];
  if (a.getShape()[0] % rows != 0)
    return emitOpError() << "expected the input's " << a.getShape()[0]
                         << " rows to hold a whole number of micro-batches of "
                         << rows;
  if (getIndex() < 0 || getIndex() >= a.getShape()[0] / rows)
    return emitOpError() << "micro-batch index " << getIndex()
                         << " is out of range: the input holds "
                         << a.getShape()[0] / rows;
  return success();
}

LogicalResult TransposeOp::verify() {
  auto a = rt(getInput());
  ArrayRef<int64_t> perm = getPerm();
  if ((int64_t)perm.size() != a.getRank())
    return emitOpError() << "expected a permutation of " << a.getRank()
                         << " dimensions, found " << perm.size();
  SmallVector<int64_t> shape;
  SmallVector<bool> seen(perm.size(), false);
  for (int64_t p : perm) {
    if (p < 0 || p >= a.getRank() || seen[p])
      return emitOpError() << "expected perm to be a permutation of [0, "
                           << a.getRank() << ")";
    seen[p] = true;
    shape.push_back(a.getShape()[p]);
  }
  return expectType(*this, "result", rt(getResult()), shape,
                    a.getElementType());
}

/// Checks dim/offset of slice-like ops: `small` is a window of `big`.
static LogicalResult verifyWindow(Operation *op, RankedTensorType big,
                                  RankedTensorType small, int64_t dim,
                                  int64_t offset) {
  if (dim < 0 || dim >= big.getRank())
    return op->emitOpError() << "expected dim in [0, " << big.getRank()
                             << "), found " << dim;
  SmallVector<int64_t> want(big.getShape());
  if (small.getRank() != big.getRank())
    return op->emitOpError() << "expected the sliced tensor to keep rank "
                             << big.getRank() << ", found " << small.getRank();
  want[dim] = small.getShape()[dim];
  if (failed(expectType(op, "slice", small, want, big.getElementType())))
    return failure();
  // offset + size could overflow (offset = 2^63 - 1): compare with the room.
  int64_t size = small.getShape()[dim], extent = big.getShape()[dim];
  if (offset < 0 || size > extent || offset > extent - size)
    return op->emitOpError() << "slice of size " << size << " at offset " << offset
                             << " is out of bounds of size " << extent;
  return success();
}

LogicalResult SliceOp::verify() {
  return verifyWindow(*this, rt(getInput()), rt(getResult()), getDim(),
                      getOffset());
}

LogicalResult SliceGradOp::verify() {
  return verifyWindow(*this, rt(getResult()), rt(getGrad()), getDim(),
                      getOffset());
}

LogicalResult ConcatOp::verify() {
  if (getInputs().empty())
    return emitOpError() << "expected at least one input";
  auto first = rt(getInputs()[0]);
  int64_t dim = getDim();
  if (dim < 0 || dim >= first.getRank())
    return emitOpError() << "expected dim in [0, " << first.getRank()
                         << "), found " << dim;
  SmallVector<int64_t> shape(first.getShape());
  shape[dim] = 0;
  for (Value v : getInputs()) {
    auto t = rt(v);
    SmallVector<int64_t> want(first.getShape());
    want[dim] = t.getRank() == first.getRank() ? t.getShape()[dim] : 0;
    if (failed(expectType(*this, "input", t, want, first.getElementType())))
      return failure();
    shape[dim] += t.getShape()[dim];
  }
  return expectType(*this, "result", rt(getResult()), shape,
                    first.getElementType());
}

static LogicalResult verifyReduce(Operation *op, ArrayRef<int64_t> dims) {
  auto a = rt(op->getOperand(0));
  SmallVector<bool> seen(a.getRank(), false);
  for (int64_t d : dims) {
    if (d < 0 || d >= a.getRank() || seen[d])
      return op->emitOpError() << "expected distinct dims in [0, "
                               << a.getRank() << "), found " << d;
    seen[d] = true;
  }
  return expectType(op, "result", rt(op->getResult(0)),
                    reducedShape(a.getShape(), dims), a.getElementType());
}

LogicalResult ReduceSumOp::verify() { return verifyReduce(*this, getDims()); }
LogicalResult ReduceMeanOp::verify() { return verifyReduce(*this, getDims()); }

LogicalResult BroadcastOp::verify() {
  auto a = rt(getInput()), r = rt(getResult());
  if (a.getElementType() != r.getElementType() ||
      !isBroadcastableTo(a.getShape(), r.getShape()))
    return emitOpError() << "cannot broadcast " << typeStr(a) << " to "
                         << typeStr(r);
  return success();
}

LogicalResult SumToOp::verify() {
  auto a = rt(getInput()), r = rt(getResult());
  // The input's type, or f32 for a bf16 / f16 input (productType: the f32
  // sum unrounded).
  if (productType(a.getElementType(), r) != r.getElementType())
    return emitOpError() << "expected a result of element type " << a.getElementType()
                         << " (or f32 for a bf16 / f16 input), found " << r.getElementType();
  if (!isBroadcastableTo(r.getShape(), a.getShape()))
    return emitOpError() << "expected the result " << typeStr(r)
                         << " to broadcast to the input " << typeStr(a);
  return success();
}

LogicalResult CastOp::verify() {
  auto a = rt(getInput()), r = rt(getResult());
  if (a.getShape() != r.getShape())
    return emitOpError() << "expected the shape to be kept, found "
                         << shapeStr(a.getShape()) << " -> "
                         << shapeStr(r.getShape());
  if (getStochastic()) {
    if (!a.getElementType().isF32() || !r.getElementType().isBF16())
      return emitOpError() << "stochastic rounding converts f32 to bf16, found "
                           << a.getElementType() << " -> " << r.getElementType();
    if (!getKey() || (int64_t)*getKey() < 0)
      return emitOpError() << "stochastic rounding needs `key`, an integer >= 0";
  } else if (getKey() || getSharded()) {
    return emitOpError() << "`key` and `sharded` are the stochastic rounding's; this cast "
                            "rounds to nearest";
  }
  return success();
}

/// `classes = K` on a cross-entropy: the first K of the logits' V columns
/// are the classes (the rest padding), so 1 <= K <= V.
/// `classes` within the logits' last dimension and `label_smoothing` in
/// [0, 1] (PyTorch's range), on cross_entropy and its gradients.
static LogicalResult verifyClasses(Operation *op, RankedTensorType logits,
                                   std::optional<uint64_t> classes,
                                   std::optional<APFloat> smoothing) {
  int64_t v = logits.getShape().back();
  if (classes && ((int64_t)*classes < 1 || (int64_t)*classes > v))
    return op->emitOpError() << "classes = " << (int64_t)*classes
                             << " must lie in [1, " << v
                             << "] (the logits' last dimension)";
  if (smoothing) {
    double e = smoothing->convertToDouble();
    if (!(e >= 0.0 && e <= 1.0))
      return op->emitOpError() << "label_smoothing = " << e << " must lie in [0, 1]";
  }
  return success();
}

/// A normalizer only with ignore_index (it divides by the kept count).
static LogicalResult verifyIgnore(Operation *op, std::optional<uint64_t> ignore, Value normalizer) {
  if (normalizer && !ignore)
    return op->emitOpError() << "has a normalizer but no ignore_index (without one the loss is "
                                "the mean over all positions)";
  return success();
}

LogicalResult CountLabelsOp::verify() {
  if (auto d = getDivisor(); d && (int64_t)*d < 1)
    return emitOpError() << "divisor = " << (int64_t)*d << " must be >= 1";
  return success();
}

/// LAMB's layout rules (fsdp.lamb_norms / fsdp.lamb_update): segments rise
/// strictly from 0; the norms hold two sums per segment, in f32; a whole
/// operand (no stride) covers every segment; the weight decay's prefix
/// ends at a segment boundary, so a parameter decays (and adapts) whole.
static LogicalResult verifyLamb(Operation *op, ArrayRef<int64_t> seg, Value param, Value norms,
                                std::optional<uint64_t> decay, std::optional<uint64_t> stride) {
  auto err = [&]() { return op->emitOpError(); };
  std::string list;
  llvm::raw_string_ostream os(list);
  os << '[';
  llvm::interleaveComma(seg, os);
  os << ']';
  if (seg.size() < 2 || seg.front() != 0)
    return err() << "segments must start at 0 and name at least one parameter, found " << list;
  for (size_t i = 1; i < seg.size(); ++i)
    if (seg[i] <= seg[i - 1])
      return err() << "segments must rise strictly, found " << list;
  if (!rt(param).getElementType().isF32())
    return err() << "expected f32 parameters (the master copy), found " << param.getType();
  int64_t k = (int64_t)seg.size() - 1, n = rt(param).getNumElements();
  auto nt = rt(norms);
  if (!nt.getElementType().isF32() || nt.getRank() != 1 || nt.getShape()[0] != 2 * k)
    return err() << "expected norms of type tensor<" << 2 * k << "xf32> (two sums for each of the "
                 << k << " segments), found " << nt;
  if ((!stride || *stride == 0) && seg.back() > n)
    return err() << "segments end at " << seg.back() << " past the operand's " << n
                 << " elements (no shard_stride: the operand is the whole unit)";
  if (stride && *stride != 0 && (int64_t)*stride != n)
    return err() << "shard_stride = " << (int64_t)*stride << " must be 0 or the operand's " << n
                 << " elements";
  if (decay && (int64_t)*decay < seg.back() && !llvm::is_contained(seg, (int64_t)*decay))
    return err() << "decay_numel = " << (int64_t)*decay
                 << " falls inside a segment: a parameter decays whole";
  return success();
}

/// An update's state (`what`: "moments", "buffer") against its parameter:
/// the same shape, the parameter's dtype or bf16 beside f32 parameters
/// (state-dtype=bf16); `stochastic` rounds into bf16 and needs a key.
/// The dtype an update computes in: the parameter's, or f32 for bf16
/// parameters with an f32 gradient (master-dtype=bf16: widened, updated in
/// f32, rounded back once). Checks the gradient against the parameter, and
/// `stochastic_param` (the parameters' rounding) against both.
static FailureOr<Type> verifyUpdateDtype(Operation *op, Value param, Value grad,
                                         bool stochasticParam, std::optional<int64_t> key) {
  RankedTensorType p = rt(param), g = rt(grad);
  if (p.getShape() != g.getShape())
    return op->emitOpError() << "gradient " << typeStr(g) << " must have the parameter's shape "
                             << typeStr(p);
  Type pe = p.getElementType(), ge = g.getElementType();
  const bool widened = pe.isBF16() && ge.isF32();
  if (ge != pe && !widened)
    return op->emitOpError() << "gradient of " << typeStr(ge) << " for parameters of "
                             << typeStr(pe)
                             << ": expected the parameter's dtype, or f32 for bf16 parameters";
  if (stochasticParam && !widened)
    return op->emitOpError() << "stochastic_param rounds the f32 step's parameters to bf16: "
                                "expected bf16 parameters with an f32 gradient, found "
                             << typeStr(pe) << " parameters with a " << typeStr(ge) << " gradient";
  if (stochasticParam && !key)
    return op->emitOpError() << "stochastic_param needs a key (its draws' stream)";
  if (key && *key < 0)
    return op->emitOpError() << "key must be >= 0, found " << *key;
  return widened ? ge : pe;
}

static LogicalResult verifyStateDtype(Operation *op, Value param, Value state, StringRef what,
                                      bool stochastic, std::optional<int64_t> key, Type work = {}) {
  RankedTensorType p = rt(param), m = rt(state);
  if (p.getShape() != m.getShape())
    return op->emitOpError() << what << " " << typeStr(m) << " must have the parameter's shape "
                             << typeStr(p);
  // pe: the dtype the step computes in (the parameter's, or f32 for bf16
  // parameters updated in f32)
  Type pe = work ? work : p.getElementType(), me = m.getElementType();
  if (me != pe && !(pe.isF32() && me.isBF16()))
    return op->emitOpError() << what << " of " << typeStr(me) << " for parameters of "
                             << typeStr(pe)
                             << ": expected the parameter's dtype, or bf16 for f32 parameters";
  if (stochastic && !(pe.isF32() && me.isBF16()))
    return op->emitOpError() << "stochastic rounds f32 " << what << " to bf16: expected bf16 "
                             << what << " of f32 parameters, found " << typeStr(me) << " of "
                             << typeStr(pe);
  if (stochastic && !key)
    return op->emitOpError() << "stochastic needs a key (its draws' stream)";
  if (key && *key < 0)
    return op->emitOpError() << "key must be >= 0, found " << *key;
  return success();
}

/// 8-bit state (`state_block`, state-dtype=8bit: AdamW's moments, SGD's
/// momentum buffer, `what`): an f32 step, a block that is a power of two
/// in [32, 4096], and the state a packed i8 vector of the parameter's
/// codes and block scales.
static LogicalResult verifyState8bit(Operation *op, Value param, Value state, StringRef what,
                                     std::optional<int64_t> block, bool stochastic,
                                     bool stochasticParam, std::optional<int64_t> key, Type work,
                                     std::optional<int64_t> bitsAttr = std::nullopt) {
  RankedTensorType p = rt(param), m = rt(state);
  if (bitsAttr && *bitsAttr != 4)
    return op->emitOpError() << "state_bits must be 4 (absent: 8-bit codes), found " << *bitsAttr;
  const int64_t bits = bitsAttr ? 4 : 8;
  const char *are = what == "buffer" ? " is" : " are";
  if (!block)
    return op->emitOpError() << "i8 " << what << are << " 8-bit block codes: expected state_block";
  if (*block < 32 || *block > 4096 || (*block & (*block - 1)))
    return op->emitOpError() << "state_block must be a power of two in [32, 4096], found "
                             << *block;
  if (!work.isF32() || !m.getElementType().isInteger(8))
    return op->emitOpError() << "state_block keeps the " << what << " of an f32 step in i8, found "
                             << typeStr(m.getElementType()) << " " << what << " of "
                             << typeStr(p.getElementType()) << " parameters";
  int64_t want = ::fsdp::shapes::packedStateBytes(p.getNumElements(), *block, bits);
  if (m.getRank() != 1 || m.getNumElements() != want)
    return op->emitOpError() << bits << "-bit " << what << " of " << p.getNumElements()
                             << " elements in blocks of " << *block << are << " " << want
                             << " bytes (tensor<" << want << "xi8>), found " << typeStr(m);
  if (stochastic || (key && !stochasticParam))
    return op->emitOpError() << bits << "-bit " << what << are
                             << " rounded to the nearest code: stochastic and "
                                "key (but for stochastic_param's bf16 parameters) do not apply";
  return success();
}

LogicalResult AdamwUpdateOp::verify() {
  FailureOr<Type> work =
      verifyUpdateDtype(*this, getParam(), getGrad(), getStochasticParam(), getKey());
  if (failed(work))
    return failure();
  if (getStateBlock() || getStateBits() || rt(getExpAvg()).getElementType().isInteger(8))
    return verifyState8bit(*this, getParam(), getExpAvg(), "moments", getStateBlock(),
                           getStochastic(), getStochasticParam(), getKey(), *work, getStateBits());
  return verifyStateDtype(*this, getParam(), getExpAvg(), "moments", getStochastic(), getKey(),
                          *work);
}

LogicalResult SgdMomentumUpdateOp::verify() {
  FailureOr<Type> work =
      verifyUpdateDtype(*this, getParam(), getGrad(), getStochasticParam(), getKey());
  if (failed(work))
    return failure();
  if (getStateBlock() || rt(getBuffer()).getElementType().isInteger(8))
    return verifyState8bit(*this, getParam(), getBuffer(), "buffer", getStateBlock(),
                           getStochastic(), getStochasticParam(), getKey(), *work);
  return verifyStateDtype(*this, getParam(), getBuffer(), "buffer", getStochastic(), getKey(),
                          *work);
}

LogicalResult SgdUpdateOp::verify() {
  return verifyUpdateDtype(*this, getParam(), getGrad(), getStochasticParam(), getKey());
}

LogicalResult LambNormsOp::verify() {
  if (failed(verifyLamb(*this, getSegments(), getParam(), getResult(), getDecayNumel(),
                        getShardStride())))
    return failure();
  Type f32 = rt(getParam()).getElementType();
  if (getStateBlock() || rt(getExpAvg()).getElementType().isInteger(8))
    return verifyState8bit(*this, getParam(), getExpAvg(), "moments", getStateBlock(),
                           /*stochastic=*/false, /*stochasticParam=*/false, std::nullopt, f32);
  return verifyStateDtype(*this, getParam(), getExpAvg(), "moments", /*stochastic=*/false,
                          std::nullopt);
}

LogicalResult LambUpdateOp::verify() {
  if (failed(verifyLamb(*this, getSegments(), getParam(), getNorms(), getDecayNumel(),
                        getShardStride())))
    return failure();
  Type f32 = rt(getParam()).getElementType();
  if (getStateBlock() || rt(getExpAvg()).getElementType().isInteger(8))
    return verifyState8bit(*this, getParam(), getExpAvg(), "moments", getStateBlock(),
                           getStochastic(), /*stochasticParam=*/false, getKey(), f32);
  return verifyStateDtype(*this, getParam(), getExpAvg(), "moments", getStochastic(), getKey());
}

LogicalResult CrossEntropyOp::verify() {
  auto l = rt(getLogits()), y = rt(getLabels());
  if (l.getRank() < 2)
    return emitOpError() << "expected logits of rank >= 2 [..., classes], "
                            "found "
                         << shapeStr(l.getShape());
  if (y.getShape() != l.getShape().drop_back())
    return emitOpError() << "expected labels of shape "
                         << shapeStr(l.getShape().drop_back())
                         << " (the logits without the class dimension), found "
                         << shapeStr(y.getShape());
  // Logits of any float type (Fsdp_FloatTensor): bf16 / f16 (mixed
  // precision) are widened by the kernels, the loss computed in f32 as
  // autocast's float32 cross-entropy computes it from logits.float(),
  // without an f32 copy of them.
  if (failed(verifyIgnore(*this, getIgnoreIndex(), getNormalizer())))
    return failure();
  return verifyClasses(*this, l, getClasses(), getLabelSmoothing());
}

/// cross_entropy_grad and cross_entropy_fused: logits [..., classes],
/// labels of their leading shape, `classes` within the last dimension.
template <typename OpT> static LogicalResult verifyCrossEntropyGrad(OpT op) {
  auto l = rt(op.getLogits()), y = rt(op.getLabels());
  if (l.getRank() < 2 || y.getShape() != l.getShape().drop_back())
    return op.emitOpError() << "expected logits [..., classes] and labels of "
                               "their leading shape, found "
                            << shapeStr(l.getShape()) << " and "
                            << shapeStr(y.getShape());
  if (failed(verifyIgnore(op, op.getIgnoreIndex(), op.getNormalizer())))
    return failure();
  return verifyClasses(op, l, op.getClasses(), op.getLabelSmoothing());
}

LogicalResult CrossEntropyGradOp::verify() { return verifyCrossEntropyGrad(*this); }

LogicalResult CrossEntropyFusedOp::verify() { return verifyCrossEntropyGrad(*this); }

static LogicalResult verifyPairLoss(Operation *op) {
  auto a = rt(op->getOperand(0)), b = rt(op->getOperand(1));
  if (a != b)
    return op->emitOpError() << "expected input and target of one type, found "
                             << typeStr(a) << " and " << typeStr(b);
  if (!a.getElementType().isF32())
    return op->emitOpError() << "expected f32 operands, found "
                             << a.getElementType();
  return success();
}

LogicalResult MseLossOp::verify() { return verifyPairLoss(*this); }
LogicalResult BceWithLogitsOp::verify() { return verifyPairLoss(*this); }

LogicalResult EmbeddingGradOp::verify() {
  auto ids = rt(getIds()), g = rt(getGrad()), r = rt(getResult());
  if (r.getRank() != 2)
    return emitOpError() << "expected a result of rank 2 [vocab, width]";
  SmallVector<int64_t> want(ids.getShape());
  want.push_back(r.getShape()[1]);
  if (failed(expectType(*this, "grad", g, want, g.getElementType())))
    return failure();
  // The gradient's type, or f32 for a bf16 / f16 gradient (productType:
  // the f32 sums unrounded).
  if (productType(g.getElementType(), r) != r.getElementType())
    return emitOpError() << "expected a result of element type " << g.getElementType()
                         << " (or f32 for a bf16 / f16 gradient), found " << r.getElementType();
  return success();
}

//===----------------------------------------------------------------------===//
// Sharding ops
//===----------------------------------------------------------------------===//

/// The ranks in `group` ("world" for every rank, "shard" / "replica" for
/// an axis of the mesh `fsdp.mesh` = #fsdp.mesh<replicas, shards>) as
/// recorded by fsdp-shard on the module; 0 when unknown (no mesh yet).
static int64_t groupSizeOf(Operation *op, StringRef group) {
  MeshAttr mesh = getMesh(op);
  return mesh ? mesh.getGroupSize(group) : 0;
}

/// A collective's `group` attribute names one of the mesh's groups.
static LogicalResult verifyGroup(Operation *op) {
  auto g = op->getAttrOfType<StringAttr>("group");
  if (g &&
      !llvm::is_contained({"world", "shard", "replica", "reshard", "node", "cross"}, g.getValue()))
    return op->emitOpError() << "expected group = \"world\", \"shard\", "
                                "\"replica\", \"reshard\", \"node\" or \"cross\", found \""
                             << g.getValue() << "\"";
  // A reshard group exists only where the mesh records one, and the node
  // and cross groups where it records a node size.
  if (g && g.getValue() == "reshard")
    if (MeshAttr mesh = getMesh(op); mesh && !mesh.getReshard())
      return op->emitOpError() << "group \"reshard\" needs a mesh with a "
                                  "reshard group (#fsdp.mesh<..., reshard = G>)";
  if (g && (g.getValue() == "node" || g.getValue() == "cross"))
    if (MeshAttr mesh = getMesh(op); mesh && !mesh.getNode())
      return op->emitOpError() << "group \"" << g.getValue()
                               << "\" needs a mesh with a node size (#fsdp.mesh<..., node = L>)";
  return success();
}

static StringRef groupOf(Operation *op) {
  auto g = op->getAttrOfType<StringAttr>("group");
  // A shard view cuts the unit into the shard group's shards.
  return g ? g.getValue() : isa<ShardViewOp>(op) ? "shard" : "world";
}

static LogicalResult expectFlat(Operation *op, StringRef what,
                                RankedTensorType t) {
  if (t.getRank() != 1)
    return op->emitOpError() << "expected a flat (rank-1) " << what
                             << ", found " << typeStr(t);
  return success();
}

LogicalResult UnitOp::verify() {
  auto full = cast<RankedTensorType>(getType());
  auto shard = cast<RankedTensorType>(getShardType());
  if (failed(expectFlat(*this, "unit type", full)) ||
      failed(expectFlat(*this, "shard type", shard)))
    return failure();
  if (shard.getNumElements() <= 0 ||
      full.getNumElements() % shard.getNumElements() != 0)
    return emitOpError() << "expected the shard size to divide the padded "
                            "size, found "
                         << shard.getNumElements() << " and "
                         << full.getNumElements();
  if (int64_t world = groupSizeOf(*this, "shard"))
    if (shard.getNumElements() * world != full.getNumElements())
      return emitOpError() << "expected padded size = shard count (" << world
                           << ") x shard size, found " << full.getNumElements()
                           << " and " << shard.getNumElements();
  if (getNumel() > full.getNumElements() || getNumel() <= 0)
    return emitOpError() << "numel " << getNumel()
                         << " does not fit the padded size "
                         << full.getNumElements();
  return success();
}

LogicalResult GetUnitOp::verifySymbolUses(SymbolTableCollection &st) {
  auto unit = st.lookupNearestSymbolFrom<UnitOp>(*this, getNameAttr());
  if (!unit)
    return emitOpError() << "refers to undefined unit " << getNameAttr();
  if (unit.getStorageType() != getType())
    return emitOpError() << "expected the unit's storage type "
                         << unit.getStorageType() << ", found " << getType();
  return success();
}

LogicalResult SetUnitOp::verifySymbolUses(SymbolTableCollection &st) {
  auto unit = st.lookupNearestSymbolFrom<UnitOp>(*this, getNameAttr());
  if (!unit)
    return emitOpError() << "refers to undefined unit " << getNameAttr();
  if (unit.getStorageType() != getValue().getType())
    return emitOpError() << "expected the unit's storage type "
                         << unit.getStorageType() << ", found "
                         << getValue().getType();
  return success();
}

LogicalResult ViewOp::verify() {
  auto in = rt(getInput()), r = rt(getResult());
  if (failed(expectFlat(*this, "input", in)))
    return failure();
  if (in.getElementType() != r.getElementType())
    return emitOpError() << "expected the element type to be kept";
  if (getOffset() < 0 ||
      getOffset() + r.getNumElements() > in.getNumElements())
    return emitOpError() << "view [" << getOffset() << ", "
                         << getOffset() + r.getNumElements()
                         << ") is out of bounds of " << in.getNumElements();
  return success();
}

/// Shared by shard_view, all_gather and reduce_scatter: `big` holds one
/// shard of `small` per rank of the op's group.
static LogicalResult verifyShardPair(Operation *op, RankedTensorType big,
                                     RankedTensorType small) {
  if (failed(verifyGroup(op)) || failed(expectFlat(op, "whole buffer", big)) ||
      failed(expectFlat(op, "shard", small)))
    return failure();
  if (big.getElementType() != small.getElementType())
    return op->emitOpError() << "expected one element type, found "
                             << big.getElementType() << " and "
                             << small.getElementType();
  int64_t world = groupSizeOf(op, groupOf(op));
  if (small.getNumElements() <= 0 ||
      big.getNumElements() % small.getNumElements() != 0 ||
      (world && big.getNumElements() != world * small.getNumElements()))
    return op->emitOpError()
           << "expected the whole buffer to hold "
           << (world ? std::to_string(world) : std::string("group-size"))
           << " shards of " << small.getNumElements() << ", found "
           << big.getNumElements() << " elements";
  return success();
}

LogicalResult ShardViewOp::verify() {
  return verifyShardPair(*this, rt(getInput()), rt(getResult()));
}
LogicalResult AllGatherOp::verify() {
  return verifyShardPair(*this, rt(getResult()), rt(getInput()));
}

/// fsdp.quantize / fsdp.dequantize: `block` values a scale, and the
/// quantized shard's bytes (ShapeRules.h: quantizedBytes). Sizes up to
/// 2^40 elements, so that the byte count cannot overflow.
static LogicalResult verifyQuantized(Operation *op, int64_t block, int64_t values, int64_t parts,
                                     RankedTensorType bytes) {
  if (block <= 0)
    return op->emitOpError() << "expected block > 0, found " << block;
  if (values <= 0 || values > (int64_t(1) << 40))
    return op->emitOpError() << "expected 1 to 2^40 values a part, found " << values;
  if (parts > (int64_t(1) << 20))
    return op->emitOpError() << "expected at most 2^20 parts, found " << parts;
  int64_t want = ::fsdp::shapes::quantizedBytes(values, block) * parts;
  if (bytes.getNumElements() != want)
    return op->emitOpError()
           << "expected " << want << " bytes for " << parts << " x " << values
           << " values in blocks of " << block
           << " (int8 values padded to 4 bytes, then an f32 scale a block), found "
           << bytes.getNumElements();
  return success();
}

LogicalResult QuantizeOp::verify() {
  auto in = rt(getInput()), out = rt(getResult());
  if (failed(expectFlat(*this, "input", in)) || failed(expectFlat(*this, "result", out)))
    return failure();
  int64_t parts = getParts() ? (int64_t)*getParts() : 1;
  if (parts <= 0 || in.getNumElements() % parts != 0)
    return emitOpError() << "expected the input's " << in.getNumElements()
                         << " values to split into parts = " << parts;
  if (getChunks()) {
    int64_t chunks = (int64_t)*getChunks();
    if (!getParts() || chunks < parts || chunks % parts != 0 || in.getNumElements() % chunks != 0)
      return emitOpError() << "expected chunks = " << chunks
                           << " to be a multiple of parts = " << parts
                           << " (given) dividing the input's " << in.getNumElements() << " values";
  }
  return verifyQuantized(*this, (int64_t)getBlock(), in.getNumElements() / parts, parts, out);
}

static LogicalResult verifyReduceKind(Operation *op, StringRef reduce);

LogicalResult DequantizeOp::verify() {
  auto in = rt(getInput()), out = rt(getResult());
  if (failed(expectFlat(*this, "input", in)) || failed(expectFlat(*this, "result", out)))
    return failure();
  int64_t parts = (int64_t)getParts();
  // reduce: the parts summed into one part's values (qgZ); otherwise
  // concatenated (qwZ's gathered shards).
  if (getReduce()) {
    if (failed(verifyReduceKind(*this, *getReduce())))
      return failure();
    if (parts <= 0)
      return emitOpError() << "expected parts > 0, found " << parts;
    return verifyQuantized(*this, (int64_t)getBlock(), out.getNumElements(), parts, in);
  }
  if (parts <= 0 || out.getNumElements() % parts != 0)
    return emitOpError() << "expected the result's " << out.getNumElements()
                         << " values to split into parts = " << parts;
  return verifyQuantized(*this, (int64_t)getBlock(), out.getNumElements() / parts, parts, in);
}

LogicalResult AllToAllOp::verify() {
  auto t = rt(getInput());
  if (failed(verifyGroup(*this)) || failed(expectFlat(*this, "input", t)))
    return failure();
  int64_t world = groupSizeOf(*this, groupOf(*this));
  if (t.getNumElements() <= 0 || (world && t.getNumElements() % world != 0))
    return emitOpError() << "expected " << (world ? std::to_string(world) : "group-size")
                         << " equal parts, found " << t.getNumElements() << " elements";
  return success();
}

static LogicalResult verifyReduceKind(Operation *op, StringRef reduce) {
  if (reduce != "sum" && reduce != "mean")
    return op->emitOpError() << "expected reduce = \"sum\" or \"mean\", found \""
                             << reduce << "\"";
  return success();
}

LogicalResult ReduceScatterOp::verify() {
  if (failed(verifyReduceKind(*this, getReduce())))
    return failure();
  return verifyShardPair(*this, rt(getInput()), rt(getResult()));
}

LogicalResult AllReduceOp::verify() {
  if (failed(verifyGroup(*this)))
    return failure();
  return verifyReduceKind(*this, getReduce());
}

LogicalResult PackOp::verify() {
  auto r = rt(getResult());
  if (failed(expectFlat(*this, "result", r)))
    return failure();
  ArrayRef<int64_t> offsets = getOffsets();
  if (offsets.size() != getInputs().size())
    return emitOpError() << "expected one offset per input, found "
                         << offsets.size() << " for " << getInputs().size();
  SmallVector<std::pair<int64_t, int64_t>> ranges;
  for (auto [v, off] : llvm::zip(getInputs(), offsets)) {
    auto t = rt(v);
    if (t.getElementType() != r.getElementType())
      return emitOpError() << "expected inputs of element type "
                           << r.getElementType();
    if (off < 0 || off + t.getNumElements() > r.getNumElements())
      return emitOpError() << "input range [" << off << ", "
                           << off + t.getNumElements()
                           << ") is out of bounds of " << r.getNumElements();
    ranges.push_back({off, off + t.getNumElements()});
  }
  llvm::sort(ranges);
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      return emitOpError() << "input ranges overlap at element "
                           << ranges[i].first;
  return success();
}

LogicalResult WaitOp::verify() {
  Operation *def = getInput().getDefiningOp();
  if ((*this)->hasAttr("carried")) {
    // fsdp-offload's next-step join: the previous step's update of a unit.
    if (!isa_and_nonnull<GetUnitOp>(def))
      return emitOpError() << "carried: expected a read of the unit whose previous-step "
                              "host update it joins (fsdp.get_unit)";
    return success();
  }
  if (!def || !def->hasAttr("async") ||
      !isa<AllGatherOp, AllToAllOp, ReduceScatterOp, AllReduceOp, ToHostOp, ToDeviceOp,
           AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambUpdateOp>(def))
    return emitOpError() << "expected the result of an async collective, copy or host update";
  return success();
}
