"""How TVM compiles CUDA on this machine, and the fallback to nvcc when NVRTC is not usable.

TVM compiles a module's CUDA source when its CUDA runtime is loaded (a host with the NVIDIA
driver), through the packed function ``tvm_callback_cuda_compile`` (``tvm/support/nvcc.py``): NVRTC
by default, which needs the ``cuda-python`` package (``cuda.bindings.nvrtc``), or nvcc when
``TVM_CUDA_COMPILE_MODE=nvcc``. Without cuda-python every GPU build would fail deep inside TVM.

The choice (:func:`compiler_choice`):

1. ``TVM_CUDA_COMPILE_MODE`` set: the user's choice, TVM's behaviour unchanged;
2. NVRTC usable (cuda.bindings imports and ``nvrtcVersion`` answers): NVRTC, TVM's default;
3. else nvcc on ``PATH``: nvcc (a fatbin, as TVM's nvcc mode builds);
4. else none: a build fails at once with the fix (``pip install cuda-python`` or the CUDA toolkit).

:func:`install` registers :func:`compile_callback` as ``tvm_callback_cuda_compile`` (TVM's own
registry, override; idempotent), which applies the choice and delegates the compile to TVM's
``tvm.support.nvcc``. Importing tvm_rammer installs it (``pipeline.install``). Why the callback and
not setting ``TVM_CUDA_COMPILE_MODE`` for the user: the callback is TVM's hook for exactly this
choice, it works for the Python API as well as the CLI, it leaves the process environment alone,
and it changes nothing where TVM's default works (it only replaces a certain failure). It applies
to every CUDA build of the process, TVM's default pipeline included (``run`` and ``bench`` build
that as the baseline).

The callback also keeps what it compiles (``host.binary_cache``, kind ``cuda``): a source compiled
on this host before for the same arch, with the same compiler and options (:func:`cache_key`), is
read back instead of compiled again, whichever compiler the choice names (TVM's default
pipeline's builds too). ``TVM_RAMMER_BINARY_CACHE=off`` compiles every time.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from .binary_cache import CUDA, binary_cache, digest

__all__ = ["CompilerChoice", "compiler_choice", "nvrtc_status", "nvcc_status",
           "tvm_builds_cuda", "compile_callback", "install", "NO_COMPILER", "nvcc_keeps_log",
           "tvm_nvcc_command", "nvcc_with_log", "cache_key"]

CALLBACK = "tvm_callback_cuda_compile"
ENV = "TVM_CUDA_COMPILE_MODE"
NO_COMPILER = ("no CUDA compiler: NVRTC needs cuda-python (`pip install cuda-python`, or the [gpu] "
               "extra) and nvcc is not on PATH (install the CUDA toolkit); `tvm-rammer doctor` "
               "shows what this machine has")


@dataclass(frozen=True)
class CompilerChoice:
    """``compiler``: "nvrtc", "nvcc" or None (none usable); ``why``: how it was chosen."""

    compiler: str | None
    why: str


@functools.cache
def nvrtc_status() -> tuple:
    """``(usable, detail)``: whether NVRTC can compile (cuda.bindings.nvrtc imports and reports its
    version), with its version or the reason it cannot. Probed once per process."""
    try:
        from cuda.bindings import nvrtc
    except ModuleNotFoundError:
        return False, "cuda-python is not installed"
    except Exception as err:  # the library failing to load  # pylint: disable=broad-except
        return False, f"cuda-python does not import ({type(err).__name__}: {err})"
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # libnvrtc.so not found  # pylint: disable=broad-except
        return False, f"cuda-python is installed but NVRTC does not load ({exc})"
    if int(err) != 0:
        return False, f"nvrtcVersion failed ({err})"
    return True, f"NVRTC {major}.{minor}"


@functools.cache
def nvcc_status() -> tuple:
    """``(path or None, version or reason)`` of the nvcc on PATH (the one TVM calls)."""
    path = shutil.which("nvcc")
    if path is None:
        return None, "nvcc is not on PATH"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return path, f"`nvcc --version` failed ({err})"
    found = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return path, (found.group(2) if found else "unknown version")


def tvm_builds_cuda() -> bool:
    """Whether TVM's CUDA runtime is loaded here (a host with the NVIDIA driver): only then does a
    build compile the CUDA source (without it TVM keeps the source and compiles nothing)."""
    import tvm  # noqa: F401  (loads TVM's libraries, the CUDA runtime among them when it can)
    import tvm_ffi

    return tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None


def compiler_choice() -> CompilerChoice:
    """The CUDA compiler a build uses here (see the module docstring for the order)."""
    mode = os.environ.get(ENV)
    if mode:
        return CompilerChoice(mode.lower(), f"{ENV}={mode}")
    usable, detail = nvrtc_status()
    if usable:
        return CompilerChoice("nvrtc", f"TVM's default ({detail})")
    path, version = nvcc_status()
    if path:
        return CompilerChoice("nvcc", f"NVRTC is not usable ({detail}); nvcc {version} at {path}")
    return CompilerChoice(None, NO_COMPILER)


# the other environment variables that change a binary: TVM's compile's (tvm/support/nvcc.py; CUDA_PATH
# finds NVRTC's headers) and nvcc's own: part of a cache key
_OPTION_ENVS = ("TVM_CUDA_PTXAS_REG_LEVEL", "TVM_CUDA_PTXAS_EXTRA_OPTS", "TVM_CUDA_NVCC_NO_FAST_MATH",
                "TVM_CUDA_NVRTC_EXTRA_OPTS", "CUDA_PATH", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS",
                "NVCC_CCBIN")


def compile_callback(code, *args):
    """``tvm_callback_cuda_compile``: TVM's own callback under the choice above, nvcc when only
    nvcc works, a RuntimeError naming the fix when nothing does. Returns the binary TVM loads.

    A source this host compiled before for the same arch, compiler and options is read from the
    binary cache (``host.binary_cache``, kind ``cuda``: :func:`cache_key`) instead of compiled
    again; what the compiler makes is stored there."""
    from tvm.support import nvcc

    choice = compiler_choice()
    by_tvm = bool(os.environ.get(ENV)) or choice.compiler == "nvrtc"
    if not by_tvm and choice.compiler != "nvcc":
        raise RuntimeError(f"cannot compile CUDA: {NO_COMPILER}")
    key = cache_key(str(code), choice.compiler, args)
    cache = binary_cache(CUDA)
    cached = cache.get(key) if key is not None else None
    if cached is not None:
        return bytearray(cached)
    if by_tvm:
        binary = nvcc.tvm_callback_cuda_compile(code, *args)
    else:
        binary = nvcc.compile_cuda(code, target_format="fatbin", compiler="nvcc")
    if key is not None and binary:
        cache.put(key, bytes(binary))
    return binary


def cache_key(code: str, compiler: str | None, args=()) -> str | None:
    """The binary cache's key of ``code`` compiled here now: a hash of the source, the compiler
    (nvcc's path and version, or NVRTC's version), the arch TVM compiles for (the current
    target's, as ``tvm.support.nvcc`` reads it), TVM's version and the environment variables
    that change the binary (TVM's and nvcc's, ``_OPTION_ENVS``). None (not cached) where the user
    asked to see into the build (``TVM_KERNEL_DUMP``, ``TVM_KERNEL_DEBUG=1``,
    ``cuda.kernels_output_dir``), where the source links NVSHMEM, or where the compiler or the arch
    is not usable (TVM's compile then says why)."""
    import tvm
    from tvm.support import nvcc

    if compiler not in ("nvcc", "nvrtc") or _writes_files() or "nvshmem" in code:
        return None
    target = tvm.target.Target.current(allow_none=True)
    arch = getattr(target, "arch", None) if target is not None else None
    if not (isinstance(arch, str) and arch.startswith("sm_")):
        try:
            arch = nvcc.get_target_compute_version(target)
        except Exception:  # pylint: disable=broad-except  (no arch known: compiled, not cached)
            return None
    identity = nvcc_status() if compiler == "nvcc" else (*nvrtc_status(), _package("cuda-bindings"))
    if not identity[0]:
        return None  # the compiler is not usable: TVM's compile says why
    return digest("cuda-2", tvm.__version__, _tvm_compile_source(), compiler, *identity, arch,
                  *(f"{e}={os.environ.get(e)}" for e in _OPTION_ENVS), *map(str, args), code)


def _package(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _tvm_compile_source() -> str:
    """A hash of TVM's ``tvm/support/nvcc.py`` (its flags and NVRTC's preamble: a TVM built from
    source can change them under the same version)."""
    from tvm.support import nvcc

    try:
        with open(nvcc.__file__, "rb") as f:
            return digest(f.read())
    except OSError:
        return "unreadable"


def _writes_files() -> bool:
    """Whether a CUDA build here is one the user asked to see into: kernel dumps (files, and
    ``-lineinfo``) or a debug build (``-g -G``), as TVM tests them (tvm/support/nvcc.py)."""
    if os.environ.get("TVM_KERNEL_DUMP") is not None or os.environ.get("TVM_KERNEL_DEBUG") == "1":
        return True
    import tvm

    return "cuda.kernels_output_dir" in (tvm.transform.PassContext.current().config or {})


def nvcc_keeps_log() -> bool:
    """Whether :func:`nvcc_with_log` compiles exactly as this process's CUDA builds do: nvcc is
    the compiler (:func:`compiler_choice`) and no TVM option changes its command (the
    environment's, nor the pass context's ``cuda.kernels_output_dir``, where a TVM build
    registers that option)."""
    return compiler_choice().compiler == "nvcc" and not _writes_files()


def tvm_nvcc_command(source_path: str, output_path: str, target) -> list:
    """The nvcc command TVM's nvcc mode runs on a module's CUDA source (``tvm.support.nvcc``'s
    ``_compile_cuda_nvcc`` with ``target_format="fatbin"``, for ``target``'s arch): the same
    flags, ptxas's ``-v`` among them (tests/test_host.py compares it with TVM's own)."""
    from tvm.support import nvcc

    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    suffix = arch[3:] if arch.startswith("sm_") else "".join(nvcc.get_target_compute_version(target).split("."))
    return ["nvcc", "--fatbin", "-O3", "-gencode", f"arch=compute_{suffix},code=sm_{suffix}",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr", "--expt-extended-lambda",
            *([] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]),
            f"--ptxas-options={','.join(nvcc._ptxas_option_flags())}",  # pylint: disable=protected-access
            "-o", output_path, source_path]


def nvcc_with_log(code: str, target) -> tuple:
    """``(fatbin, nvcc's output)`` of CUDA ``code`` compiled by :func:`tvm_nvcc_command`: the
    binary TVM's nvcc mode makes and ptxas's ``-v`` lines for each kernel (registers, shared
    memory, spills: ``tir_templates.cuda_resources.parse_ptxas_functions``), from one nvcc run
    instead of one for the module and another for its resources. RuntimeError with nvcc's output
    when it fails."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rammer_nvcc_") as work:
        src, out = os.path.join(work, "tvm_kernels.cu"), os.path.join(work, "tvm_kernels.fatbin")
        with open(src, "w", encoding="utf-8") as f:
            f.write(code)
        cmd = tvm_nvcc_command(src, out, target)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{log}\nreproduce with: {' '.join(cmd)}")
        with open(out, "rb") as f:
            binary = bytearray(f.read())
    if not binary:
        raise RuntimeError("nvcc made an empty binary")
    return binary, log


def install() -> None:
    """Register :func:`compile_callback` as TVM's ``tvm_callback_cuda_compile`` (idempotent).

    ``tvm.support.nvcc`` is imported first, so that TVM's own registration (done when that module
    is imported) never replaces this one later."""
    import tvm_ffi
    import tvm.support.nvcc  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    tvm_ffi.register_global_func(CALLBACK, compile_callback, override=True)
