// fp8 is not supported by the CPU emulator
#pragma once
#error "the tvm-rammer CPU emulator does not support fp8 (cuda_fp8.h)"
