"""Running a compiled model on the local GPU, checked against onnxruntime, timed against TVM.

In: an ONNX model, a target and a ``RammerConfig``. Out: outputs, their error against the reference
(onnxruntime, else TVM's default pipeline), latencies, and the measured timeline of the persistent
kernels. Also the reference helpers every checker uses (seeded inputs, onnxruntime's outputs).

- :mod:`.runner`: ``tvm-rammer run`` / ``demo`` (the emulator, for a host without a GPU, is handed
  in by the caller: ``checks`` comes after this stage);
- :mod:`.generate`: ``tvm-rammer generate``, greedy decoding with a decode-step model, the caches
  kept on the device between steps, every step's logits checked against onnxruntime (the
  emulator's step handed in by the caller, as for ``demo``).
"""
