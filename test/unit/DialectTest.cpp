//===- DialectTest.cpp - building fsdp IR through the C++ API -------------===//
//
// Builds models with OpBuilder (as a front end would), checks that the
// verifiers accept good IR and reject bad IR, that the shape helpers follow
// NumPy, and that the autodiff + optimizer passes run on API-built IR.
//
//===----------------------------------------------------------------------===//

#include "compiler/Pipeline.h"
#include "dialects/fsdp/FsdpOps.h"
#include "dialects/fsdp/Shapes.h"
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"

#include <gtest/gtest.h>

using namespace mlir;
using namespace mlir::fsdp;

namespace {

class DialectTest : public ::testing::Test {
protected:
  DialectTest() {
    ctx.loadDialect<FsdpDialect, func::FuncDialect>();
    // Collect diagnostics instead of printing them.
    handler = std::make_unique<ScopedDiagnosticHandler>(
        &ctx, [this](Diagnostic &d) {
          diagnostics.push_back(d.str());
          return success();
        });
  }

  RankedTensorType f32(ArrayRef<int64_t> shape) {
    return RankedTensorType::get(shape, Float32Type::get(&ctx));
  }

  /// A one-layer regression model: loss = mse(x W^T + b, y).
  OwningOpRef<ModuleOp> buildLinearModel(int64_t in, int64_t out,
                                         int64_t wrongIn = -1) {
    OpBuilder b(&ctx);
    Location loc = b.getUnknownLoc();
    OwningOpRef<ModuleOp> module = ModuleOp::create(loc);
    b.setInsertionPointToEnd(module->getBody());
    b.create<ParamOp>(loc, b.getStringAttr("w"), TypeAttr::get(f32({out, in})),
                      b.getStringAttr("normal"), b.getF64FloatAttr(0.02),
                      b.getStringAttr("layers.0"), UnitAttr());
    b.create<ParamOp>(loc, b.getStringAttr("b"), TypeAttr::get(f32({out})),
                      b.getStringAttr("zeros"), FloatAttr(), StringAttr(),
                      UnitAttr());
    int64_t xin = wrongIn > 0 ? wrongIn : in;
    auto fnTy = b.getFunctionType({f32({4, xin}), f32({4, out})}, {f32({})});
    auto fn = b.create<func::FuncOp>(loc, "model", fnTy);
    fn->setAttr(kModelAttrName, b.getUnitAttr());
    Block *body = fn.addEntryBlock();
    b.setInsertionPointToEnd(body);
    Value w = b.create<GetParamOp>(loc, f32({out, in}), "w");
    Value bias = b.create<GetParamOp>(loc, f32({out}), "b");
    auto mm = b.create<MatmulOp>(loc, f32({4, out}), body->getArgument(0), w);
    mm.setTransposeRhs(true);
    Value h = b.create<BiasAddOp>(loc, f32({4, out}), mm.getResult(), bias);
    Value loss =
        b.create<MseLossOp>(loc, f32({}), h, body->getArgument(1));
    b.create<func::ReturnOp>(loc, loss);
    return module;
  }

  MLIRContext ctx;
  std::unique_ptr<ScopedDiagnosticHandler> handler;
  std::vector<std::string> diagnostics;
};

TEST_F(DialectTest, ApiBuiltModelVerifies) {
  auto module = buildLinearModel(8, 3);
  EXPECT_TRUE(succeeded(verify(*module))) << (diagnostics.empty() ? "" : diagnostics[0]);
}

TEST_F(DialectTest, WrongShapeIsRejectedWithExpectedAndFound) {
  auto module = buildLinearModel(8, 3, /*wrongIn=*/5);
  EXPECT_TRUE(failed(verify(*module)));
  ASSERT_FALSE(diagnostics.empty());
  EXPECT_NE(diagnostics[0].find("expected contracting sizes to agree, found 5 "
                                "(lhs) and 8 (rhs)"),
            std::string::npos)
      << diagnostics[0];
}

TEST_F(DialectTest, AutodiffAndOptimizerRunOnApiBuiltIR) {
  auto module = buildLinearModel(8, 3);
  PassManager pm(&ctx);
  pm.addPass(createFsdpAutodiff());
  FsdpInsertOptimizerOptions opt;
  opt.optimizer = "sgd";
  opt.momentum = 0.9;
  pm.addPass(createFsdpInsertOptimizer(opt));
  ASSERT_TRUE(succeeded(pm.run(*module)));
  auto step = module->lookupSymbol<func::FuncOp>(kTrainStepName);
  ASSERT_TRUE(step);
  int updates = 0, setParams = 0, grads = 0;
  step.walk([&](Operation *op) {
    updates += isa<SgdMomentumUpdateOp>(op);
    setParams += isa<SetParamOp>(op);
    grads += isa<SetGradOp>(op);
  });
  EXPECT_EQ(updates, 2);
  EXPECT_EQ(setParams, 2);
  EXPECT_EQ(grads, 0);
  // lr and step were appended to the batch arguments.
  EXPECT_EQ(step.getNumArguments(), 4u);
  int states = 0;
  for (auto s : module->getOps<StateOp>()) {
    (void)s;
    ++states;
  }
  EXPECT_EQ(states, 2);
  EXPECT_TRUE(succeeded(verify(*module)));
}

TEST_F(DialectTest, PipelineFailsCleanlyWithoutModel) {
  OpBuilder b(&ctx);
  OwningOpRef<ModuleOp> module = ModuleOp::create(b.getUnknownLoc());
  PassManager pm(&ctx);
  buildFsdpPipeline(pm, FsdpPipelineOptions());
  EXPECT_TRUE(failed(pm.run(*module)));
  ASSERT_FALSE(diagnostics.empty());
  EXPECT_NE(diagnostics[0].find("no model function"), std::string::npos);
}

TEST(ShapesTest, BroadcastFollowsNumPy) {
  auto s = broadcastShapes({4, 1, 8}, {3, 1});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(llvm::ArrayRef<int64_t>(*s), llvm::ArrayRef<int64_t>({4, 3, 8}));
  EXPECT_FALSE(broadcastShapes({4, 8}, {3}).has_value());
  EXPECT_TRUE(isBroadcastableTo({8}, {4, 8}));
  EXPECT_FALSE(isBroadcastableTo({4, 8}, {8}));
  EXPECT_EQ(shapeStr({}), "scalar");
  EXPECT_EQ(shapeStr({2, 3}), "2x3");
}

TEST(ShapesTest, MatmulShapesWithTransposes) {
  std::string why;
  auto s = matmulShape({2, 16, 64}, {2, 32, 64}, false, true, why);
  ASSERT_TRUE(s.has_value()) << why;
  EXPECT_EQ(llvm::ArrayRef<int64_t>(*s), llvm::ArrayRef<int64_t>({2, 16, 32}));
  EXPECT_FALSE(matmulShape({4, 8}, {4, 8}, false, false, why).has_value());
  EXPECT_NE(why.find("found 8 (lhs) and 4 (rhs)"), std::string::npos);
  EXPECT_EQ(llvm::ArrayRef<int64_t>(reducedShape({2, 3, 4}, {0, 2})),
            llvm::ArrayRef<int64_t>({3}));
  EXPECT_EQ(llvm::ArrayRef<int64_t>(keptShape({2, 3, 4}, {1})),
            llvm::ArrayRef<int64_t>({2, 1, 4}));
}

} // namespace

// The backward pass's gathers (backwardGathers, shared by fsdp-schedule
// and the memory-budget search) are judged the same before and after
// fsdp-schedule moves the gathers, with two micro-batches (the second's
// forward gathers prefetched into the first's backward) and whole-unit
// recomputation.
TEST_F(DialectTest, BackwardGathersAreTheSameBeforeAndAfterScheduling) {
  const char *src = R"mlir(
fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @w3 : tensor<8x8xf32> init("normal", 0.02) unit "layers.2"
func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %w3 = fsdp.get_param @w3 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %g = fsdp.matmul %h, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %o = fsdp.matmul %g, %w3 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %l = fsdp.mse_loss %o, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
)mlir";
  OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(src, &ctx);
  ASSERT_TRUE(module) << (diagnostics.empty() ? "" : diagnostics[0]);
  PassManager pm(&ctx);
  pm.addPass(createFsdpAutodiff());
  FsdpGradAccumOptions accum;
  accum.microBatches = 2;
  pm.addPass(createFsdpGradAccum(accum));
  FsdpInsertOptimizerOptions opt;
  opt.optimizer = "adamw";
  pm.addPass(createFsdpInsertOptimizer(opt));
  FsdpRecomputeOptions recompute;
  recompute.policy = "unit";
  pm.addPass(createFsdpRecompute(recompute));
  FsdpShardOptions shard;
  shard.worldSize = 2;
  shard.stage = 3;
  pm.addPass(createFsdpShard(shard));
  ASSERT_TRUE(succeeded(pm.run(*module))) << (diagnostics.empty() ? "" : diagnostics[0]);

  // Each parameter gather's direction, in the gathers' order (which
  // fsdp-schedule keeps), and whether it lies after a fsdp.microbatch it
  // is not read behind.
  auto directions = [&](Block &body) {
    llvm::SmallPtrSet<Operation *, 16> backward = backwardGathers(body, stepLossOps(body));
    std::vector<bool> out;
    for (Operation &op : body)
      if (gatheredUnitRead(&op))
        out.push_back(backward.contains(&op));
    return out;
  };
  Block &body = module->lookupSymbol<func::FuncOp>(kTrainStepName).getBody().front();
  EXPECT_EQ(stepLossOps(body).size(), 2u);
  std::vector<bool> before = directions(body);
  // Forward: 3 gathers a micro-batch; backward: at least one a
  // micro-batch.
  int64_t forward = llvm::count(before, false);
  EXPECT_EQ(forward, 6);
  EXPECT_GE(int64_t(before.size()) - forward, 2);

  // The gathers issued before the second micro-batch starts.
  auto gathersBeforeSecond = [&]() -> int64_t {
    int64_t n = 0;
    for (Operation &op : body) {
      if (auto mb = dyn_cast<MicrobatchOp>(op); mb && mb.getIndex() == 1)
        return n;
      n += bool(gatheredUnitRead(&op));
    }
    return -1;
  };
  int64_t unmoved = gathersBeforeSecond();
  ASSERT_GT(unmoved, 0);

  PassManager sched(&ctx);
  FsdpScheduleOptions s;
  s.prefetchDepth = 2;
  sched.addPass(createFsdpSchedule(s));
  ASSERT_TRUE(succeeded(sched.run(*module))) << (diagnostics.empty() ? "" : diagnostics[0]);
  EXPECT_EQ(directions(body), before);
  // The case the rule is for: forward gathers of the second micro-batch
  // issued before it starts (prefetched into the first's backward).
  EXPECT_GT(gathersBeforeSecond(), unmoved)
      << "no forward gather of the second micro-batch was prefetched into the first";
}
