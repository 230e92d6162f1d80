#!/usr/bin/env bash
# Installs every Debian package the project needs. Idempotent: does nothing
# (and needs no network) when everything is already installed. Used by both
# README commands and by .ci/run.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build ccache mold lld-19 git
  llvm-19-dev llvm-19-tools libmlir-19-dev mlir-19-tools   # compiler only
  libgloo-dev libopenblas-dev nlohmann-json3-dev            # runtime
  libgtest-dev                                              # unit tests
  python3 python3-torch                                     # test oracle
  clang-19 libclang-rt-19-dev libomp-19-dev                 # fuzz/ (libFuzzer)
)
if [[ "${FSDP_RUNTIME_ONLY:-0}" == "1" ]]; then
  PKGS=(build-essential cmake ninja-build ccache git libgloo-dev
        libopenblas-dev nlohmann-json3-dev libgtest-dev)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO=sudo; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
