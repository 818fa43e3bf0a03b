"""The optional Python packages tvm-rammer uses, and whether each is installed.

``OPTIONAL`` maps an import name to what it is for and the command that installs it. A package is
"missing" when it cannot be imported: :func:`missing` answers without importing it (``find_spec``,
cheap even for torch), and counts a package that an import hook refuses (as the tests hide them) as
missing too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

__all__ = ["OptionalPackage", "OPTIONAL", "missing", "version_of", "why_missing"]


@dataclass(frozen=True)
class OptionalPackage:
    """``module`` (the import name), ``dist`` (the distribution pip installs), ``used_for`` (what
    works without it, what does not) and ``fix`` (the command that installs it)."""

    module: str
    dist: str
    used_for: str
    fix: str


OPTIONAL = {p.module: p for p in (
    OptionalPackage("onnxruntime", "onnxruntime",
                    "the reference outputs of `run`, `demo` and `bench` (on a GPU)",
                    "pip install onnxruntime   (or the [test] / [bench] extra)"),
    OptionalPackage("matplotlib", "matplotlib",
                    "the PNG of `--timeline` and the `bench` chart (the JSON needs nothing)",
                    "pip install matplotlib   (or the [timeline] extra)"),
    OptionalPackage("torch", "torch", "the PyTorch columns of `bench` (with onnx2torch)",
                    "pip install torch onnx2torch   (or the [torch] extra)"),
    OptionalPackage("onnx2torch", "onnx2torch", "the PyTorch columns of `bench` (with torch)",
                    "pip install onnx2torch   (or the [torch] extra)"),
    OptionalPackage("cuda.bindings", "cuda-bindings",
                    "NVRTC, TVM's default CUDA compiler on a GPU host (without it: nvcc), and "
                    "the `nimble` benchmark",
                    "pip install cuda-python   (or the [gpu] extra)"),
)}


def missing(module: str) -> bool:
    """Whether ``module`` cannot be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or an import hook refusing it
        return True


def version_of(module: str) -> str | None:
    """The installed version of ``module``'s distribution, or None when it is missing."""
    if missing(module):
        return None
    dist = OPTIONAL[module].dist if module in OPTIONAL else module
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def why_missing(module: str) -> str:
    """'' when ``module`` is installed, else "<module> is not installed (<fix>)"."""
    if not missing(module):
        return ""
    fix = OPTIONAL[module].fix if module in OPTIONAL else f"pip install {module}"
    return f"{module} is not installed ({fix.split('   ')[0]})"
