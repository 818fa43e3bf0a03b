// mma.h: TVM's CUDA preamble includes <mma.h> (the nvcuda::wmma C++ API) in every module. The
// emulator runs the tensor-core PTX TVM emits (ldmatrix / mma.sync: rammer_emu_mma.h, translated by
// tvm_rammer/checks/emulator/ptx.py); the wmma API itself is not emulated, so code that uses it fails to
// compile here (nvcuda::wmma has no members) instead of running wrongly.
#pragma once
namespace nvcuda {
namespace wmma {}
}  // namespace nvcuda
