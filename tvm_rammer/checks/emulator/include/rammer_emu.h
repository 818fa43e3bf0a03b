// rammer_emu.h: force-included (g++ -include) before TVM-generated CUDA source by
// tvm_rammer/checks/emulator/build.py. Makes the source compile as C++17 and run on the CPU under the
// emulator's execution model (rammer_emu_runtime.h); RAMMER_EMULATE is defined, so helpers of ours
// (tvm_rammer/codegen/cuda_helpers.py) take their portable branch.
#pragma once
#ifndef RAMMER_EMULATE
#define RAMMER_EMULATE 1
#endif
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <type_traits>
#include "rammer_emu_runtime.h"
#include "rammer_emu_cuda.h"
#include "rammer_emu_mma.h"  // tensor-core PTX that tvm_rammer/checks/emulator/ptx.py translates into calls
