"""tvm-rammer: Rammer (OSDI'20) rTask scheduling and persistent kernels for Apache TVM.

Importing the package registers the ``rammer`` Relax pipeline, the ``rammer/...`` target tags and
the dispatch that makes ``tvm.compile(mod, target=<rammer target>)`` use it.

Under TVM's runtime alone (``TVM_USE_RUNTIME_LIB=1``, or a TVM without its compiler library, as on
a host that only runs libraries built elsewhere) nothing of the compiler side is imported: only
``tvm_rammer.runtime`` (load, run, check and time a library), ``tvm_rammer.models`` and
``tvm_rammer.lease.manifest`` work there, and the compiler's names raise ImportError saying so.
"""

import os as _os

from .version import __version__

_COMPILER_NAMES = ("RammerConfig", "emulate", "compile", "import_onnx", "lower", "rammer_pipeline",
                   "rammer_target", "is_rammer_target", "install")


def _runtime_only() -> str | None:
    """Why TVM's compiler is unavailable (TVM_USE_RUNTIME_LIB=1, a TVM without libtvm_compiler,
    or no TVM at all), or None when it is there."""
    if _os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        return "TVM_USE_RUNTIME_LIB=1 loads TVM's runtime library only"
    try:
        import tvm
    except ImportError as err:
        return f"TVM cannot be imported ({err})"
    if getattr(tvm, "_RUNTIME_ONLY", False):
        return "this TVM has no loadable compiler library (libtvm_compiler)"
    return None


_RUNTIME_ONLY = _runtime_only()

if _RUNTIME_ONLY is None:
    from .config import RammerConfig
    from .checks.emulator import emulate  # CUDA on the CPU (tvm_rammer/checks/emulator/)
    from .driver.frontend import compile, import_onnx, lower  # noqa: A004
    from .driver.pipeline import install, rammer_pipeline
    from .target import is_rammer_target, rammer_target

    install()

__all__ = ["__version__", *_COMPILER_NAMES] if _RUNTIME_ONLY is None else ["__version__"]


def __getattr__(name: str):
    """Only reached for names not set above: the compiler's, under TVM's runtime alone."""
    if name in _COMPILER_NAMES:
        raise ImportError(f"tvm_rammer.{name} needs TVM's compiler, which is not loaded here "
                          f"({_RUNTIME_ONLY}): run it where TVM's compiler is installed, without "
                          f"TVM_USE_RUNTIME_LIB=1; here tvm_rammer.runtime runs a built library")
    raise AttributeError(f"module 'tvm_rammer' has no attribute {name!r}")
