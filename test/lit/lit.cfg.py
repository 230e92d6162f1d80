# lit configuration for the fsdp compiler and runtime tests.
import os

import lit.formats
from lit.llvm import llvm_config

config.name = "FSDP"
config.test_format = lit.formats.ShTest(not llvm_config.use_lit_shell)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.fsdp_obj_root, "test", "lit")
config.excludes = ["Inputs", "CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py"]

llvm_config.use_default_substitutions()
llvm_config.with_environment("PATH", config.fsdp_tools_dir, append_path=True)
llvm_config.with_environment("PATH", config.llvm_tools_dir, append_path=True)
config.substitutions.append(("%fsdp_src", config.fsdp_src_root))
config.substitutions.append(("%fsdp_bin", config.fsdp_tools_dir))
# The PyTorch oracle needs Debian's python (torch 1.13), not pyenv's.
config.substitutions.append(("%torch_python", "/usr/bin/python3"))

# A CUDA GPU with a working driver: the --device cuda tests run (else lit
# reports them UNSUPPORTED, a visible skip).
import shutil
import subprocess
if shutil.which("nvidia-smi"):
    try:
        if subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0:
            config.available_features.add("cuda-gpu")
    except (OSError, subprocess.SubprocessError):
        pass

# The binaries were built with the CUDA backend (a CUDA toolkit was there).
if os.path.exists(os.path.join(config.fsdp_tools_dir, "CudaLibsTest")):
    config.available_features.add("cuda-backend")

# Without a GPU, the CUDA backend's end-to-end tests run on the CPU
# emulation of CUDA (test/cudaemu/README.md: fsdp-run-emu, the backend's
# own code on fibers); %fsdp_run_cuda is the binary either way.
if "cuda-gpu" in config.available_features:
    config.substitutions.append(("%fsdp_run_cuda", "fsdp-run"))
elif os.path.exists(os.path.join(config.fsdp_tools_dir, "fsdp-run-emu")):
    config.available_features.add("cuda-emu")
    config.substitutions.append(("%fsdp_run_cuda", "fsdp-run-emu"))

# scripts/coretype-sweep.sh reruns the suite per OpenBLAS kernel; tests that
# run none of our kernels (the PyTorch importer's structure checks) say
# `UNSUPPORTED: coretype-sweep` and run once.
if os.environ.get("FSDP_CORETYPE_SWEEP") == "1":
    config.available_features.add("coretype-sweep")

# A private mount namespace where /dev/shm can be replaced by a tiny tmpfs
# (root with CAP_SYS_ADMIN, util-linux unshare): shm-fallback.test checks
# what fsdp-run does when shared memory cannot be had (else UNSUPPORTED).
if shutil.which("unshare"):
    try:
        if subprocess.run(["unshare", "--mount", "sh", "-c",
                           "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                          capture_output=True, timeout=30).returncode == 0:
            config.available_features.add("mount-ns")
    except (OSError, subprocess.SubprocessError):
        pass
