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
