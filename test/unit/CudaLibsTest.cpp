//===- CudaLibsTest.cpp - cuBLASLt and NCCL opened on first use -----------===//
//
// runtime/cuda/CudaLibs.h: the backend links neither library; it opens them
// with dlopen. None of this needs a GPU (both libraries load, and answer
// the calls below, on a machine without a driver), so it runs everywhere
// the backend is built. The tests that set FSDP_*_LIBRARY run in a child
// process (a death test, re-executed), since a load happens once per
// process.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaLibs.h"

#include <cublasLt.h>
#include <nccl.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

using namespace fsdp;
using namespace fsdp::cuda;

namespace {

class CudaLibsTest : public ::testing::Test {
protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

/// In a child: the variable set, then `body`; exits 0 if it returned ok,
/// else prints the message and exits 3.
[[noreturn]] void childLoad(const char *var, const char *value, Status (*load)()) {
  setenv(var, value, 1);
  Status st = load();
  if (st.isOk())
    std::exit(0);
  std::fprintf(stderr, "%s\n", st.message().c_str());
  std::exit(3);
}

} // namespace

TEST_F(CudaLibsTest, TheLibrariesTheBackendWasBuiltForLoadAndAnswer) {
  unsetenv("FSDP_CUBLASLT_LIBRARY");
  unsetenv("FSDP_NCCL_LIBRARY");
  Status lt = loadCublasLt();
  ASSERT_TRUE(lt.isOk()) << lt.message();
  Status nc = loadNccl();
  ASSERT_TRUE(nc.isOk()) << nc.message();
  EXPECT_EQ(cublasLtLibraryName(), "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  EXPECT_EQ(ncclLibraryName(), "libnccl.so." + std::to_string(NCCL_MAJOR));
  // The forwarders reach the libraries' own answers (none needs a GPU).
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(pref, nullptr);
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 64, 32, 64), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
  std::string invalid = ncclGetErrorString(ncclInvalidArgument);
  EXPECT_NE(invalid.find("invalid argument"), std::string::npos) << invalid;
  // Loading again returns the first outcome.
  EXPECT_TRUE(loadCublasLt().isOk());
  EXPECT_TRUE(loadNccl().isOk());
}

/// The file named in a description "NAME X.Y.Z (PATH)": its version's
/// major and the path, which must exist and be the library's soname file
/// (or a link to it) as the loader resolved it.
void expectDescription(const std::string &d, const std::string &name, int major,
                       const std::string &file) {
  const std::string head = name + " " + std::to_string(major) + ".";
  ASSERT_EQ(d.rfind(head, 0), 0u) << d;
  size_t open = d.find(" (");
  ASSERT_NE(open, std::string::npos) << d;
  ASSERT_EQ(d.back(), ')') << d;
  std::string version = d.substr(name.size() + 1, open - name.size() - 1);
  EXPECT_EQ(std::count(version.begin(), version.end(), '.'), 2) << d;
  std::string path = d.substr(open + 2, d.size() - open - 3);
  EXPECT_EQ(path.front(), '/') << d;
  EXPECT_EQ(path.substr(path.rfind('/') + 1), file) << d;
  EXPECT_EQ(access(path.c_str(), R_OK), 0) << path;
}

TEST_F(CudaLibsTest, DescriptionsNameTheVersionAndTheFileLoaded) {
  // Before a load there is nothing to describe (a child: this process may
  // have loaded both already).
  EXPECT_EXIT(std::exit(cublasLtDescription().empty() && ncclDescription().empty() ? 0 : 1),
              ::testing::ExitedWithCode(0), "");
  ASSERT_TRUE(loadCublasLt().isOk());
  ASSERT_TRUE(loadNccl().isOk());
  // The version the library reports: the headers' major (the soname's).
  expectDescription(cublasLtDescription(), "cuBLASLt", CUBLAS_VER_MAJOR, cublasLtLibraryName());
  expectDescription(ncclDescription(), "NCCL", NCCL_MAJOR, ncclLibraryName());
}

TEST_F(CudaLibsTest, AMissingFileNamedInTheEnvironmentIsAnErrorNotAFallback) {
  EXPECT_EXIT(childLoad("FSDP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", loadNccl),
              ::testing::ExitedWithCode(3),
              "cannot load NCCL '/nonexistent/libnccl.so.2' \\(.*No such file.*\\).*"
              "FSDP_NCCL_LIBRARY");
  EXPECT_EXIT(childLoad("FSDP_CUBLASLT_LIBRARY", "/nonexistent/libcublasLt.so", loadCublasLt),
              ::testing::ExitedWithCode(3),
              "cannot load cuBLASLt '/nonexistent/libcublasLt.so'.*FSDP_CUBLASLT_LIBRARY");
}

TEST_F(CudaLibsTest, ALibraryWithoutTheFunctionsIsRefusedByName) {
  // glibc's libm (on every machine, the GPU one too) loads but exports no
  // cuBLASLt or NCCL function.
  EXPECT_EXIT(childLoad("FSDP_CUBLASLT_LIBRARY", "libm.so.6", loadCublasLt),
              ::testing::ExitedWithCode(3),
              "cuBLASLt 'libm\\.so\\.6' has no cublasLtCreate.*FSDP_CUBLASLT_LIBRARY");
  EXPECT_EXIT(childLoad("FSDP_NCCL_LIBRARY", "libm.so.6", loadNccl), ::testing::ExitedWithCode(3),
              "NCCL 'libm\\.so\\.6' has no ncclGetUniqueId.*FSDP_NCCL_LIBRARY");
}

TEST_F(CudaLibsTest, AForwarderWithoutItsLibraryReturnsNotInitialized) {
  // The backend calls loadCublasLt first and reports its message; a direct
  // call (a test's) still gets the library's own "not initialized" code.
  EXPECT_EXIT(
      {
        setenv("FSDP_CUBLASLT_LIBRARY", "/nonexistent/libcublasLt.so", 1);
        setenv("FSDP_NCCL_LIBRARY", "/nonexistent/libnccl.so", 1);
        cublasLtHandle_t h = nullptr;
        ncclUniqueId id;
        bool ok =
            cublasLtCreate(&h) == CUBLAS_STATUS_NOT_INITIALIZED &&
            ncclGetUniqueId(&id) == ncclSystemError &&
            std::string(cublasLtGetStatusName(CUBLAS_STATUS_SUCCESS)) == "cuBLASLt is not loaded";
        std::exit(ok ? 4 : 5);
      },
      ::testing::ExitedWithCode(4), "");
}
