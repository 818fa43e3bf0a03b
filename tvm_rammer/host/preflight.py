"""What a command needs, checked before it starts, never after a long compile.

:func:`check` takes the command's name and its parsed arguments. A missing requirement raises
ValueError naming the fix (the CLI prints it and exits 2); a missing optional package returns a
warning saying what the command skips, and the command then skips it:

- ``compile``, ``run``, ``demo``, ``bench``, ``tune``, ``generate``, ``fuzz --gpu`` where TVM
  compiles CUDA (a GPU host): a CUDA compiler (NVRTC or nvcc, ``host.cuda_compile``), else an error;
- ``fuzz --gpu``: onnxruntime (the comparison is the point), else an error;
- ``--emulate``: a C++ compiler, else an error;
- ``bench`` on a GPU: onnxruntime (every system's outputs are checked against it before they are
  timed), else an error; without torch / onnx2torch, a warning that its PyTorch columns are skipped;
  without matplotlib, a warning that its chart is skipped;
- ``run``, ``demo`` on a GPU without onnxruntime: a warning that the outputs are checked against
  TVM's default pipeline instead (``runner.run_model``);
- ``run --timeline`` / ``inspect --timeline`` without matplotlib: a warning that only ``OUT.json``
  is written, no PNG.
"""

from __future__ import annotations

import shutil

from . import cuda_compile, packages

__all__ = ["check", "BUILDS_CUDA"]

BUILDS_CUDA = ("compile", "run", "demo", "bench", "tune", "generate")
# bench's PyTorch systems run by default (benchmarks.systems.TORCH_SYSTEMS; not imported here: the
# host checks import nothing of the pipeline or the benchmarks)
DEFAULT_TORCH_SYSTEMS = ("torch-eager", "torch-cudagraph")


def _gpu() -> bool:
    from .gpu import gpu_available  # pylint: disable=import-outside-toplevel

    return gpu_available()


def check(command: str, args) -> list:
    """Warnings for ``command`` (strings); ValueError when something it needs is missing."""
    warnings = []
    gpu_fuzz = command == "fuzz" and getattr(args, "gpu", False)
    if (command in BUILDS_CUDA or gpu_fuzz) and cuda_compile.tvm_builds_cuda() and \
            cuda_compile.compiler_choice().compiler is None:
        raise ValueError(f"`{command}` builds CUDA on this GPU host, but there is "
                         f"{cuda_compile.NO_COMPILER}")
    if getattr(args, "emulate", False) and not any(
            shutil.which(c) for c in ("g++", "clang++", "c++")):
        raise ValueError("--emulate builds the kernels with a C++ compiler and none of g++, "
                         "clang++, c++ is on PATH: install one (apt-get install g++)")
    if getattr(args, "timeline", None) and packages.missing("matplotlib"):
        warnings.append("matplotlib is not installed: --timeline writes the JSON (Perfetto) only, "
                        "no PNG (pip install matplotlib)")
    if command in ("run", "demo") and packages.missing("onnxruntime") and \
            (command == "run" or _gpu()):
        warnings.append("onnxruntime is not installed: outputs are checked against TVM's default "
                        "pipeline instead of onnxruntime (pip install onnxruntime)")
    if gpu_fuzz and packages.missing("onnxruntime"):
        raise ValueError("`fuzz --gpu` compares every graph's outputs with onnxruntime, and "
                         "onnxruntime is not installed: pip install onnxruntime (or the [test] "
                         "extra), or fuzz without --gpu")
    if command == "bench":
        warnings += _bench(args)
    return warnings


def _bench(args) -> list:
    chosen = [s for s in args.systems.split(",") if s] or list(DEFAULT_TORCH_SYSTEMS)
    gpu = _gpu()
    if gpu and packages.missing("onnxruntime"):
        raise ValueError("`bench` checks every system's outputs against onnxruntime before timing "
                         "them, and onnxruntime is not installed: pip install onnxruntime (or the "
                         "[bench] extra)")
    warnings = []
    torch = [s for s in chosen if s.startswith("torch-")]
    why = packages.why_missing("torch") or packages.why_missing("onnx2torch")
    if torch and why:
        warnings.append(f"{why}: the {', '.join(torch)} columns are skipped")
    if gpu and not args.no_chart and packages.missing("matplotlib"):
        warnings.append("matplotlib is not installed: no chart is drawn (pip install matplotlib)")
    return warnings
