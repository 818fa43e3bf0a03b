"""ONNX in, ready for TVM's importer: symbolic dimensions bound, shape computations folded.

In: an ``onnx.ModelProto`` (and ``shapes=`` / ``batch=``). Out: an ONNX model with static input
shapes whose shape subgraphs are constants (what ``driver.frontend.import_onnx`` turns into a Relax
module for ``relay_passes``).

- :mod:`.shapes`: bind symbolic input dimensions (``--input-shape``, ``--batch``); the inputs left
  symbolic;
- :mod:`.onnx_fold`: fold Shape/Gather/Concat... chains into constants once shapes are static.

Imports nothing else of tvm_rammer.
"""
