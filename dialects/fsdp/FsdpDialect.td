//===- FsdpDialect.td - the fsdp training-graph dialect ------*- tablegen -*-===//
//
// The `fsdp` dialect describes one training step of a model: parameters as
// module-level symbols, a model function that computes a scalar loss from a
// batch, and (after the compiler's passes) gradients, optimizer updates and
// collectives. Every tensor is a ranked tensor; compute types are f32, bf16
// and f16, token ids and labels are i32 / i64 tensors.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_DIALECT_TD
#define FSDP_DIALECT_TD

include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/OpBase.td"
include "mlir/IR/CommonTypeConstraints.td"

def Fsdp_Dialect : Dialect {
  let name = "fsdp";
  let cppNamespace = "::mlir::fsdp";
  let summary = "A training-graph dialect for fully sharded data parallelism";
  let description = [{
    A module in this dialect holds:
    - `fsdp.param` symbols: every parameter with its shape, dtype,
      initializer, its unit (the layer an FSDP wrap policy groups by) and
      whether it is trainable;
    - a `func.func` carrying the `fsdp.model` attribute that takes the batch
      and returns a scalar loss, reading parameters with `fsdp.get_param`.

    The compiler's passes add a training step (`fsdp-autodiff`), optimizer
    state and updates (`fsdp-insert-optimizer`), collectives and shards
    (`fsdp-shard`), and finally lower it to a plan for `fsdp-run`.
  }];
  let dependentDialects = ["::mlir::func::FuncDialect"];
  let useDefaultAttributePrinterParser = 1;
}

def Fsdp_MeshAttr : AttrDef<Fsdp_Dialect, "Mesh"> {
  let mnemonic = "mesh";
  let summary = "the device mesh a step is sharded for";
  let description = [{
    `replicas` x `shards` ranks: rank r is replica r / shards and holds
    shard r mod shards. fsdp-shard records it on the module as `fsdp.mesh`
    (a 1-D mesh of N ranks is `#fsdp.mesh<replicas = 1, shards = N>`); a
    collective's `group` ("world", "shard", "replica") names one of its
    groups.

    `reshard = G` (optional; 1 < G < shards, G divides shards): the
    reshard-after-forward group of stage 3 (FSDP2's
    `reshard_after_forward=G`, ZeRO++'s hpZ): G consecutive ranks of one
    replica's shard group, typically one node. Group "reshard" names it;
    rank r is its member (r mod shards) mod G.

    `node = L` (optional; 1 < L < shards, L divides shards): the ranks of
    one node (NVLink) in a shard group, for collectives that run in two
    levels (fsdp-shard's hierarchical qgZ, ZeRO++'s): group "node" is the
    L consecutive ranks of a shard group on this rank's node, group
    "cross" the shards / L ranks of its shard group with the same place
    on their nodes (rank r's place is (r mod shards) mod L, its member
    index in "cross" (r mod shards) / L).

    ```mlir
    module attributes {fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 4>} {}
    module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 8, reshard = 2>} {}
    module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 16, node = 8>} {}
    ```
  }];
  let parameters = (ins "int64_t":$replicas, "int64_t":$shards,
                        DefaultValuedParameter<"int64_t", "0">:$reshard,
                        DefaultValuedParameter<"int64_t", "0">:$node);
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// replicas x shards.
    int64_t getWorldSize() const { return getReplicas() * getShards(); }
    /// Ranks in `group`: "world", "shard", "replica", "reshard" (0
    /// without a reshard group), "node" or "cross" (0 without a node
    /// size); 0 for another name.
    int64_t getGroupSize(::llvm::StringRef group) const {
      return group == "world" ? getWorldSize()
             : group == "shard" ? getShards()
             : group == "replica" ? getReplicas()
             : group == "reshard" ? getReshard()
             : group == "node" ? getNode()
             : group == "cross" ? (getNode() ? getShards() / getNode() : 0) : 0;
    }
  }];
}

class Fsdp_Op<string mnemonic, list<Trait> traits = []>
    : Op<Fsdp_Dialect, mnemonic, traits>;

// Floating-point tensors the runtime computes on (or stores).
def Fsdp_FloatTensor : RankedTensorOf<[F32, BF16, F16]>;
// Optimizer state: a float tensor, or (AdamW's moments with
// state-dtype=8bit) a packed i8 shard of codes and block scales.
def Fsdp_StateTensor : RankedTensorOf<[F32, BF16, F16, I8]>;
// Row statistics kept in f32 whatever the storage dtype (attention's log-sum-exp).
def Fsdp_F32Tensor : RankedTensorOf<[F32]>;
// Token ids and labels.
def Fsdp_IntTensor : RankedTensorOf<[I32, I64]>;
def Fsdp_AnyTensor : RankedTensorOf<[F32, BF16, F16, I32, I64]>;
// ZeRO++'s quantized weights on the wire (fsdp.quantize): int8 values
// and their blocks' f32 scales, as bytes.
def Fsdp_ByteTensor : RankedTensorOf<[I8]>;
// What an all-gather moves: parameters in a float dtype, or quantized.
def Fsdp_GatherTensor : RankedTensorOf<[F32, BF16, F16, I8]>;
// A 0-d float tensor: losses, the learning rate, norms.
def Fsdp_Scalar : 0DTensorOf<[F32]> {
  let builderCall = "::mlir::RankedTensorType::get({}, $_builder.getF32Type())";
}

#endif // FSDP_DIALECT_TD
