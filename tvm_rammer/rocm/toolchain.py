"""The LLVM 22 tools and ROCm device libraries the AMDGPU build needs, found (never installed) here.

TVM's bundled LLVM (22) generates AMDGPU code in-process; the rest is outside tools of the same
major version:

* ``ld.lld-22`` links TVM's relocatable object into an HSA code object (``tvm.support.rocm``);
* ``clang-22`` compiles the persistent kernel's device helpers (C) to amdgcn bitcode
  (:mod:`tvm_rammer.rocm.helpers`), ``llc-22`` recompiles a module whose kernels need other
  attributes than TVM sets (:mod:`tvm_rammer.rocm.build`), ``llvm-readelf-22`` /
  ``llvm-objdump-22`` read the code object's metadata and disassembly
  (:mod:`tvm_rammer.rocm.codeobject`);
* ROCm's device bitcode (``ocml`` and friends, Debian ``rocm-device-libs``) for kernels that call
  math functions: :func:`rocm_path` finds it (``ROCM_PATH``, ``/opt/rocm``, Debian's
  ``/usr/lib/x86_64-linux-gnu``) and ``tvm_rammer.rocm.build`` hands TVM its directory.

:func:`find_toolchain` returns a :class:`Toolchain` or raises :class:`ToolchainMissing`, whose
message names the missing pieces and :data:`INSTALL_COMMAND`. ``scripts/test.sh`` installs them
when it can (root and apt), ``tests/test_rocm.py`` skips with that command when they are absent.
Tools are looked up on ``PATH`` (versioned names first) and in ``/usr/lib/llvm-22/bin``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import lru_cache

LLVM_MAJOR = 22
PACKAGES = (f"lld-{LLVM_MAJOR}", f"llvm-{LLVM_MAJOR}", f"clang-{LLVM_MAJOR}", "rocm-device-libs")
INSTALL_COMMAND = "apt-get update && apt-get install -y " + " ".join(PACKAGES)
# where Debian's rocm-device-libs puts amdgcn/bitcode (ROCM_PATH for TVM's bitcode lookup)
DEBIAN_ROCM_PATH = "/usr/lib/x86_64-linux-gnu"
_TOOLS = {"ld_lld": "ld.lld", "clang": "clang", "llc": "llc", "llvm_as": "llvm-as",
          "readelf": "llvm-readelf", "objdump": "llvm-objdump"}


class ToolchainMissing(RuntimeError):
    """Some tool or the device bitcode is missing; the message says what and how to install it."""


@dataclass(frozen=True)
class Toolchain:
    """Absolute paths of the tools, and the ROCm root holding ``amdgcn/bitcode`` (None: absent,
    kernels that call no ocml function still build)."""

    ld_lld: str
    clang: str
    llc: str
    llvm_as: str
    readelf: str
    objdump: str
    rocm_path: str | None


def _which(name: str, path: str | None) -> str | None:
    for candidate in (f"{name}-{LLVM_MAJOR}", name):
        found = shutil.which(candidate, path=path) or (path is None and shutil.which(
            candidate, path=f"/usr/lib/llvm-{LLVM_MAJOR}/bin"))
        if found and (candidate != name or _major_ok(found)):
            return found
    return None


def _major_ok(path: str) -> bool:
    """An unversioned tool is used only when it is LLVM 22's (a symlink into llvm-22)."""
    return f"llvm-{LLVM_MAJOR}" in os.path.realpath(path)


def rocm_path() -> str | None:
    """The ROCm root with ``amdgcn/bitcode``: ``ROCM_PATH`` if set and holding it, else
    ``/opt/rocm``, else Debian's location; None when none has the bitcode."""
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm", DEBIAN_ROCM_PATH):
        if root and os.path.isfile(os.path.join(root, "amdgcn", "bitcode", "ocml.bc")):
            return root
    return None


def locate(path: str | None = None) -> Toolchain | str:
    """The toolchain on ``path`` (None: ``PATH`` and ``/usr/lib/llvm-22/bin``), or the message
    saying what is missing and how to install it."""
    found = {field: _which(tool, path) for field, tool in _TOOLS.items()}
    missing = [f"{_TOOLS[f]}-{LLVM_MAJOR}" for f, path in found.items() if path is None]
    root = rocm_path()
    if root is None:
        missing.append("ROCm device bitcode (amdgcn/bitcode/ocml.bc)")
    if missing:
        return (f"the AMDGPU build needs {', '.join(missing)}; install with: {INSTALL_COMMAND} "
                "(or set ROCM_PATH to a ROCm installation)")
    return Toolchain(rocm_path=root, **found)


@lru_cache(maxsize=1)
def _find() -> Toolchain | str:
    return locate()


def find_toolchain() -> Toolchain:
    """The tools and ROCm path, or :class:`ToolchainMissing` naming what to install."""
    found = _find()
    if isinstance(found, str):
        raise ToolchainMissing(found)
    return found


def missing_reason() -> str | None:
    """Why the AMDGPU build cannot run here (with the install command), or None when it can."""
    found = _find()
    return found if isinstance(found, str) else None


if __name__ == "__main__":  # scripts/install_rocm_toolchain.sh: exit status 0 = found
    import sys

    REASON = missing_reason()
    print(REASON or f"AMDGPU toolchain found: {find_toolchain()}")
    sys.exit(1 if REASON else 0)
