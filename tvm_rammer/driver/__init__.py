"""The compile driver: ONNX model in, ``tvm.compile`` executable out (``tvm_rammer.compile``).

In: an ONNX model or Relax module, a target and a ``RammerConfig``. Out: the lowered Relax module
(``lower``) or the executable (``compile``), with the report of what was placed where.

- :mod:`.frontend`: ``compile``, ``lower``, ``import_onnx`` (``onnx_prep``, then TVM's importer);
- :mod:`.pipeline`: the rammer Relax pipeline (``relay_passes``, the back end, TVM's passes) and its
  registration with TVM;
- :mod:`.backend`: the rammer back end: rOperators (``scheduling``), the policy, persistent kernels
  (``codegen``), profiling (``tuning``) and the checks on measured times;
- :mod:`.report`: what a compiled module looks like, as one JSON-able dict;
- :mod:`.launches`: kernel launches per inference of a lowered module;
- :mod:`.timings`: where compile time goes, and the progress line.

Services of later stages reach the back end through registries they fill when imported
(``backend.register_version_checker``: the CPU emulator's check of rKernel versions).
"""
