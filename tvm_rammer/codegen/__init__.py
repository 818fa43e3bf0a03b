"""The persistent kernel: an rProgram in, one PrimFunc with its constant table out.

In: an rProgram (``abstractions``) whose rTasks carry their rKernels (prelowered TIR), the tensor
plan of its operators. Out: the persistent-kernel PrimFunc (grid = vEUs, the table of per-vEU
instruction lists and barrier waits), which ``driver.pipeline`` hands to ``tvm.compile``.

- :mod:`.persistent`: the kernel and its table (``encode_program``, ``build_persistent_func``);
- :mod:`.tensors`: the arenas the operators' tensors live in;
- :mod:`.dialect`, :mod:`.cuda_helpers`: the device helpers (grid barrier, waits), per target kind;
- :mod:`.rkernel_functions`, :mod:`.tir_pipeline`: rKernel bodies as device functions, TVM's TIR
  pipeline wrapped for prelowered kernels;
- :mod:`.faults`: the kernel's fault page, read on the host as errors naming vEU and rTask;
- :mod:`.executor`: the table's reference executor (its semantics, checked without a GPU);
- :mod:`.resources`: the compiled kernel's registers and shared memory, for its occupancy.
"""
