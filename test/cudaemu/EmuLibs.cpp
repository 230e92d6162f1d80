//===- EmuLibs.cpp - the emulator's cuBLASLt and NCCL are linked in --------===//
//
// runtime/cuda/CudaLibs.cpp opens the real libraries with dlopen; the
// emulator links its CPU implementations of the same functions
// (EmuCublasLt.cpp, EmuNccl.cpp) instead, so there is nothing to load.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaLibs.h"

namespace fsdp::cuda {

Status loadCublasLt() { return Status::ok(); }
Status loadNccl() { return Status::ok(); }
std::string cublasLtLibraryName() { return "the emulator's cuBLASLt (EmuCublasLt.cpp)"; }
std::string ncclLibraryName() { return "the emulator's NCCL (EmuNccl.cpp)"; }
std::string cublasLtDescription() { return "cuBLASLt emulated (EmuCublasLt.cpp)"; }
std::string ncclDescription() { return "NCCL emulated (EmuNccl.cpp)"; }

} // namespace fsdp::cuda
