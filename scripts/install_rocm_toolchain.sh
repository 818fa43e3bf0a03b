#!/usr/bin/env bash
# The AMDGPU toolchain the ROCm tests need (tests/test_rocm.py, tvm_rammer/rocm/toolchain.py):
# LLVM 22's ld.lld, llc, clang, llvm-readelf, llvm-objdump and ROCm's device bitcode. Found: nothing
# to do. Missing: installed with apt-get when this runs as root on a Debian/Ubuntu machine that
# has the packages (Debian bookworm-security: 1:22.1.8); otherwise the command to run is printed
# and the ROCm tests skip with the same command. Never fails the caller.
set -u
cd "$(dirname "$0")/.."
missing() { python3 -m tvm_rammer.rocm.toolchain >/dev/null 2>&1 && return 1 || return 0; }
missing || exit 0
PACKAGES="lld-22 llvm-22 clang-22 rocm-device-libs"
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing the AMDGPU toolchain: apt-get install -y $PACKAGES" >&2
  apt-get install -y -q $PACKAGES >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $PACKAGES >/dev/null 2>&1; } \
    || echo "apt-get could not install $PACKAGES: the ROCm tests will skip" >&2
fi
missing && python3 -m tvm_rammer.rocm.toolchain >&2
exit 0
