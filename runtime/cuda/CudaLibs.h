//===- CudaLibs.h - cuBLASLt and NCCL, opened when first needed -*- C++ -*-===//
//
// The CUDA backend does not link cuBLASLt or NCCL: CudaLibs.cpp defines
// the few functions of theirs it calls, each forwarding to the library
// opened with dlopen on first use (the CUDA runtime is linked statically,
// CudaDevice.h). So
//   - a binary built with the CUDA backend starts, and runs --device cpu,
//     on a machine without those libraries;
//   - a CPU run does not pay for loading them: libcublasLt.so.13 alone
//     costs about 0.19 s per process (relocating its ~500 MB), which every
//     rank of every fsdp-run paid before, GPU or not.
// The library file is the soname the headers were built for
// (libcublasLt.so.<CUBLAS_VER_MAJOR>, libnccl.so.<NCCL_MAJOR>), looked up
// the usual way (LD_LIBRARY_PATH, the binary's run path, ld.so.cache), then
// in the toolkit's library directory known at build time. The environment
// variables FSDP_CUBLASLT_LIBRARY and FSDP_NCCL_LIBRARY name another file
// (a newer NCCL, say); a file named there that does not load is an error,
// never a fallback.
//
// The CUDA emulator (test/cudaemu) links its own CPU implementations of
// these functions instead of CudaLibs.cpp, and its loaders succeed.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDALIBS_H
#define FSDP_RUNTIME_CUDA_CUDALIBS_H

#include "runtime/core/Status.h"

#include <string>

namespace fsdp::cuda {

/// Opens cuBLASLt and resolves every function the backend calls; an error
/// names the file, what dlopen/dlsym said and how to point at another.
/// Idempotent: later calls return the first result.
Status loadCublasLt();

/// The same for NCCL.
Status loadNccl();

/// The file loadCublasLt / loadNccl opens (or opened): the override from
/// the environment, else the soname.
std::string cublasLtLibraryName();
std::string ncclLibraryName();

/// What was loaded, for the run's header: "cuBLASLt 13.1.0 (/path/to/
/// libcublasLt.so.13)", its version as the library reports it and the file
/// the loader resolved; "" while the library is not loaded. The same for
/// NCCL.
std::string cublasLtDescription();
std::string ncclDescription();

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDALIBS_H
