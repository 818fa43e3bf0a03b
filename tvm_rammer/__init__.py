"""tvm-rammer: Rammer (OSDI'20) rTask scheduling and persistent kernels for Apache TVM.

Importing the package registers the ``rammer`` Relax pipeline, the ``rammer/...`` target tags and
the dispatch that makes ``tvm.compile(mod, target=<rammer target>)`` use it.
"""

from .config import RammerConfig
from .checks.emulator import emulate  # CUDA on the CPU (tvm_rammer/checks/emulator/)
from .driver.frontend import compile, import_onnx, lower  # noqa: A004
from .driver.pipeline import install, rammer_pipeline
from .target import is_rammer_target, rammer_target
from .version import __version__

install()

__all__ = ["__version__", "RammerConfig", "emulate", "compile", "import_onnx", "lower", "rammer_pipeline",
           "rammer_target", "is_rammer_target", "install"]
