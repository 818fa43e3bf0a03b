"""The checkers: whether what the compiler emits is right, without a GPU and with one.

In: ONNX models (the zoo, random DAGs, the ONNX node tests) and compiled modules. Out: verdicts
(errors against onnxruntime or the reference executor), faults named, reports.

- :mod:`.emulator`: the generated CUDA run on the CPU (``tvm_rammer.emulate``), also the check of
  every rKernel version (``RammerConfig(emulate_versions=True)``, registered with the back end);
- :mod:`.fuzz`: random ONNX DAGs through the whole pipeline, checked by ``codegen.executor``;
- :mod:`.node_suite`: the ONNX backend node tests through both pipelines;
- :mod:`.stress`: the GPU stress run (reliability at scale);
- :mod:`.workers`: small compile jobs in worker subprocesses, each with a time limit.
"""
