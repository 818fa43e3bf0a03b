"""ROCm: persistent kernels built through TVM's ROCm target, checked on the code object.

The same rPrograms, tables and barrier-rTasks as on CUDA, for AMD CDNA GPUs (MI210 gfx90a, MI300X
gfx942). Nothing here needs an AMD GPU; nothing here runs one either (the installed TVM has no
ROCm runtime): what is verified is the code object.

- :mod:`.targets`: the ``rammer/amd-*`` tags and the CDNA vDevice limits;
- :mod:`.toolchain`: LLVM 22's tools and ROCm's device bitcode, found (install command otherwise);
- :mod:`.helpers`: the persistent kernel's device helpers in C (acquire/release at agent scope,
  fenced barrier, software grid barrier, realtime clock), compiled to amdgcn bitcode;
- :mod:`.dialect`: the persistent kernel's AMDGPU dialect (``codegen.dialect``);
- :mod:`.early_exit`: surplus threads skip work but not barriers (no named barriers on CDNA);
- :mod:`.build`: TVM's ROCm build with our bitcode and each kernel's real workgroup size;
- :mod:`.codeobject`, :mod:`.occupancy`, :mod:`.report`: metadata, disassembly and
  memory-ordering checks, vEUs per CU, ``inspect``'s per-rProgram figures.

Importing this package imports nothing heavy (``tvm_rammer.target`` reads :mod:`.targets`).
"""
