"""What this machine can do with tvm-rammer, and the fixes for what it cannot.

- :mod:`.gpu`: the local GPU, probed once per call (is there one, which, what it identifies as);
- :mod:`.packages`: the optional Python packages (onnxruntime, matplotlib, torch, cuda-python):
  installed or not, and the ``pip install`` that adds each.
- :mod:`.cuda_compile`: how TVM compiles CUDA here (NVRTC or nvcc), and the fallback to nvcc that
  importing tvm_rammer installs in TVM's ``tvm_callback_cuda_compile`` when NVRTC is not usable.
- :mod:`.binary_cache`: compiled device code kept by content (the CUDA callback's binaries, the
  ROCm code objects), so that a source built before is not compiled again.
- :mod:`.cross`: CUDA libraries cross-compiled: written here without a GPU with their CUDA compiled
  for the target's arch (``cross.export(ex, path, target)``), so the GPU host compiles nothing.
- :mod:`.preflight`: what a command needs, checked before it starts (a missing requirement is an
  error naming the fix; a missing optional package a warning saying what is skipped).
- :mod:`.doctor`: ``tvm-rammer doctor``, every check on one screen (``--json`` too).

Nothing here imports the CLI, the pipeline or the benchmarks.
"""

__all__ = ["gpu", "packages", "cuda_compile", "binary_cache", "cross", "preflight", "doctor"]
