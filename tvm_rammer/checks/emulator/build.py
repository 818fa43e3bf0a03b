"""Build TVM-generated CUDA source into a CPU library and launch its kernels (the emulator's runtime).

:func:`build_module` takes the CUDA source of a device module (a ``str``) and returns an
:class:`EmulatedModule`; ``EmulatedModule.launch(kernel, args, grid, block, ...)`` runs one kernel
launch on the CPU under the execution model of ``include/rammer_emu_runtime.h`` (every CUDA thread a
fiber, one OS thread, deterministic; cooperative launches keep every block live).

Build steps:

1. Source rewriting (line numbers are kept, so the compiler's and the runtime's line numbers are the
   kept source's):
   * ``__shared__`` declarations (``__shared__ alignas(64) uchar pool[1024];``,
     ``extern __shared__ __align__(16) uchar buf_dyn_shmem[];``, ``__shared__ int flag;``) become
     references/pointers into the calling block's shared-memory arena
     (``rammer_emu::shared_static`` / ``shared_dynamic``);
   * inline ``bar.sync`` / ``barrier.sync`` / ``bar.arrive`` asm (named barriers) becomes
     ``rammer_emu::bar_sync`` / ``bar_arrive`` (the runtime owns barriers);
   * :func:`tvm_rammer.checks.emulator.ptx.translate` rewrites the PTX it knows (tensor cores, cp.async)
     and raises :class:`EmulatorError` quoting any other asm statement in a region the build
     compiles (``RAMMER_EMULATE`` is defined: our own helpers take their portable branch);
   * an exported launcher per kernel is appended (``rammer_emu_launch``: the kernel's parameter
     types are unpacked from CUDA's ``void**`` by a C++ template; ``rammer_emu_signature`` gives
     Python one type code per parameter so :meth:`EmulatedModule.launch` checks the arguments).
2. Compilation with the system C++ compiler (``$CXX``, else ``g++``, else ``clang++``):
   ``-std=c++17 -shared -fPIC -fvisibility=hidden -fno-strict-aliasing -w -DRAMMER_EMULATE=1
   -include rammer_emu.h`` plus the optimisation level, the header directory ``include/``.
3. Cache: ``$XDG_CACHE_HOME/tvm-rammer/emulator/<sha256>.so`` (default ``~/.cache``), the key
   being the sha256 of the rewritten source, every file under ``include/``, the flags and the
   compiler's version; the rewritten source is kept beside it (``<sha256>.cu``). Both are written
   to a temporary name and renamed into place, so concurrent processes never see a partial file.
   With g++ the runtime header is precompiled once per (headers, flags, compiler) into
   ``pch/<sha256>/rammer_emu.h.gch`` beside the libraries and found first on the include path
   (:func:`_precompiled_header`): most of a small kernel's compile was parsing that header.

Optimisation level (``opt``, default :data:`DEFAULT_OPT` = ``-O1``), chosen by measurement on this
project's real sources: ``tvm_rammer.checks.emulator.emulate`` of reduced zoo models (``models.REDUCED``;
``branches`` at its full 16-branch size) on the ``rammer/nvidia-h100`` target, g++ 12.2 on a 2-core
machine shared with other jobs (load 8-10, so wall times are inflated about 4x; the compile's own
CPU time for SqueezeNet's source was 4.4 s user at -O0, 5.9 s at -O1). Every run matched
onnxruntime (max relative error <= 4e-7) at both levels.

==================================  =======  ======================  ======================
source (pipeline)                    size     -O0 g++ / run (wall)    -O1 g++ / run (wall)
==================================  =======  ======================  ======================
16-branch demo (rammer, 1 kernel)    16 KB    1.8 s / 0.9 s           1.4 s / 1.0 s
LSTM-TC (rammer, 1 kernel)           140 KB   1.7 s / 0.2 s           3.5 s / 0.3 s
LSTM-TC (TVM default, 18 kernels)    15 KB    1.1 s / 1.5 s           1.9 s / 2.9 s (noise)
AlexNet (rammer, 1 kernel)           673 KB   4.3 s / 1.5 s           7.9 s / 0.8 s
SqueezeNet (rammer, 1 kernel)        2.3 MB   9.9 s / 22 s            23.7 s / 2.8 s
SqueezeNet (TVM default, 27)         2.0 MB   8.3 s / 1.1 s           10.0 s / 0.5 s
NASNet-CIFAR (rammer, 1 kernel)      2.9 MB   17.8 s / 417 s          28.7 s / 300 s (*)
GoogLeNet (rammer, 1 kernel)         6.4 MB   not run                 63.8 s / 0.9 s
GoogLeNet (TVM default, 71 kernels)  5.4 MB   53.5 s / 4.9 s          45.4 s / 1.2 s
AlexNet (TVM default, 12 kernels)    594 KB   9.7 s / 1.0 s           4.8 s / 0.2 s
==================================  =======  ======================  ======================

(*) with the first scheduler (one FIFO of fibers). Blocks taking turns (rammer_emu_runtime.h)
brought NASNet's run to 47 s wall / 12.7 s CPU at -O1 (528 vEUs x 256 threads, 241 M fiber
resumes: about 53 ns each, context switch and barrier bookkeeping included).

-O0 loses on every large persistent kernel: the one function holding every rKernel body gets a
stack frame of 130-165 KB at -O0 (one slot per local of every body; 7 KB at -O1), which each of
the tens of thousands of fibers touches page by page. -O1 costs about a third more compile CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import EmulatorError
from .ptx import find_asm, split_top, translate

__all__ = ["build_module", "EmulatedModule", "EmulatorError", "EmulatorDeadlock", "DEFAULT_OPT",
           "INCLUDE_DIR", "cache_dir", "rewrite_source", "kernel_names"]

INCLUDE_DIR = Path(__file__).with_name("include")
DEFAULT_OPT = "-O1"
_OPTS = ("-O0", "-O1", "-O2", "-O3", "-Os", "-Og")
_BASE_FLAGS = ("-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-w",
               "-pthread", "-DRAMMER_EMULATE=1")
_ORDERS = ("forward", "reverse")
_RC_OK, _RC_DEADLOCK, _RC_ERROR, _RC_UNKNOWN = 0, 1, 2, 3
_REPORT_BYTES = 1 << 18
# one launch at a time in a process: the runtime's signal handlers are process-wide
_LAUNCH_LOCK = threading.Lock()


class EmulatorDeadlock(EmulatorError):
    """A launch could not finish: no thread can continue (barriers that cannot complete), only
    spinning threads remain without progress for a long virtual time, or the wall-clock limit
    passed. ``report``: one dict per group of waiting threads, ``{"block": linear block id,
    "block_idx": (x, y, z), "threads": (first, last) linear thread ids, "what": what they wait on
    and where (barrier id and count, warp collective, grid sync, spin), "line": the line in the
    kept source or None}``."""

    def __init__(self, message: str, report: tuple = ()):
        super().__init__(message)
        self.report = tuple(report)


# ------------------------------------------------------------------------------ source rewriting
_KERNEL = re.compile(r'(?:extern\s+"C"\s+)?__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                     r'([A-Za-z_]\w*)\s*\(')
_SHARED = re.compile(r'(\bextern\s+)?(?:\bstatic\s+)?\b__shared__\b([^;{}]*);')
_ALIGN = re.compile(r'(?:__align__|alignas)\s*\(\s*([^()]*)\s*\)')
_DECLARATOR = re.compile(r'^(?P<type>.*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$')
_BAR = re.compile(r'^\s*(bar|barrier)(?:\.cta)?\.(sync|arrive)(?:\.aligned)?\s+([^,;\s]+)\s*(?:,\s*([^;\s]+))?\s*;?\s*$')


def kernel_names(cuda_source: str) -> tuple:
    """The ``__global__`` functions of ``cuda_source``, in order of first appearance."""
    names = []
    for m in _KERNEL.finditer(cuda_source):
        if m.group(1) not in names:
            names.append(m.group(1))
    return tuple(names)


def _code_only(source: str) -> str:
    """``source`` with comments and the insides of string and character literals blanked (same
    length, newlines kept), so declarations are only found in code."""
    out, i, n = list(source), 0, len(source)
    while i < n:
        ch = source[i]
        if ch in "\"'":
            j = i + 1
            while j < n and source[j] != ch and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + 1
        elif source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


def _line_of(source: str, pos: int) -> int:
    return source.count("\n", 0, pos) + 1


def _rewrite_shared(source: str) -> str:
    code = _code_only(source)
    out, pos, site, depth, scanned = [], 0, 0, 0, 0
    for m in _SHARED.finditer(code):
        decl = m.group(2)
        depth += code.count("{", scanned, m.start()) - code.count("}", scanned, m.start())
        scanned = m.start()
        if "(" in _ALIGN.sub("", decl) or "=" in decl or "," in decl:
            raise EmulatorError(f"cannot rewrite the __shared__ declaration at line "
                                f"{_line_of(source, m.start())} for the emulator (one declarator, "
                                f"no initializer): {m.group(0)!r}")
        if depth == 0:
            raise EmulatorError(f"file-scope __shared__ variable at line {_line_of(source, m.start())} "
                                f"is not supported by the emulator: {m.group(0)!r}")
        aligns = _ALIGN.findall(decl)
        d = _DECLARATOR.match(_ALIGN.sub(" ", decl).strip())
        if d is None or not d.group("type").strip():
            raise EmulatorError(f"cannot read the __shared__ declaration at line "
                                f"{_line_of(source, m.start())}: {m.group(0)!r}")
        ctype, name = " ".join(d.group("type").split()), d.group("name")
        dims = re.findall(r"\[([^\]]*)\]", d.group("dims"))
        align = f"({aligns[-1]})" if aligns else f"alignof({ctype})"
        if m.group(1):  # extern __shared__ T name[];  (dynamic shared memory)
            if len(dims) != 1 or dims[0].strip():
                raise EmulatorError(f"extern __shared__ at line {_line_of(source, m.start())} must "
                                    f"be an unsized array: {m.group(0)!r}")
            text = f"{ctype}* {name} = static_cast<{ctype}*>(::rammer_emu::shared_dynamic());"
        elif not dims:
            text = (f"{ctype}& {name} = *static_cast<{ctype}*>(::rammer_emu::shared_static({site}, "
                    f"sizeof({ctype}), {align}));")
        elif len(dims) == 1:
            text = (f"{ctype}* {name} = static_cast<{ctype}*>(::rammer_emu::shared_static({site}, "
                    f"sizeof({ctype}) * ({dims[0]}), {align}));")
        else:
            inner = "".join(f"[{x}]" for x in dims[1:])
            size = " * ".join(f"({x})" for x in dims)
            text = (f"{ctype} (*{name}){inner} = reinterpret_cast<{ctype} (*){inner}>("
                    f"::rammer_emu::shared_static({site}, sizeof({ctype}) * {size}, {align}));")
        if not m.group(1):
            site += 1
        out.append(source[pos:m.start()])
        out.append(text + "\n" * m.group(0).count("\n"))
        pos = m.end()
    out.append(source[pos:])
    return "".join(out)


def _barrier_call(text: str, line: int):
    """The emulation call for an asm statement that is a named barrier, else None."""
    body = text[text.index("(") + 1:text.rindex(")")]
    sections = split_top(body, ":")
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
    m = _BAR.match(template.replace("\\n", " ").replace("\\t", " "))
    if m is None:
        return None
    operands = []
    for section in sections[1:3]:
        for op in split_top(section, ","):
            op = op.strip()
            if op:
                om = re.match(r'^(?:\[\w+\]\s*)?"[^"]*"\s*\((.*)\)$', op, re.S)
                if om is None:
                    raise EmulatorError(f"cannot read the operand {op!r} of the barrier asm at line "
                                        f"{line}: {text}")
                operands.append(om.group(1).strip())

    def value(token):
        if token is None:
            return None
        om = re.fullmatch(r"%(\d+)", token)
        if om:
            k = int(om.group(1))
            if k >= len(operands):
                raise EmulatorError(f"barrier asm at line {line} names operand %{k}: {text}")
            return f"({operands[k]})"
        return token

    bar_id, count = value(m.group(3)), value(m.group(4))
    func = "bar_sync" if m.group(2) == "sync" else "bar_arrive"
    return f"::rammer_emu::{func}({bar_id}, {count or 0}, {line})"


def _rewrite_barriers(source: str) -> str:
    out, pos = [], 0
    for stmt in find_asm(source):
        if stmt.active is False:
            continue
        call = _barrier_call(stmt.text, stmt.line)
        if call is None:
            continue
        out.append(source[pos:stmt.start])
        out.append(call + "\n" * stmt.text.count("\n"))
        pos = stmt.end
    out.append(source[pos:])
    return "".join(out)


def rewrite_source(cuda_source: str) -> tuple:
    """``(rewritten source, kernel names)``: the C++ the compiler gets (module docstring, step 1)."""
    if not isinstance(cuda_source, str):
        raise TypeError(f"build_module takes the CUDA source as a str, not {type(cuda_source).__name__}")
    kernels = kernel_names(cuda_source)
    if not kernels:
        raise EmulatorError("the CUDA source has no __global__ function (expected "
                            "'extern \"C\" __global__ void NAME(...)')")
    source = _rewrite_barriers(cuda_source)
    source = translate(source)
    source = _rewrite_shared(source)
    cases = "\n".join(f"  RAMMER_EMU_KERNEL_CASE({k})" for k in kernels)
    sigs = "\n".join(f"  RAMMER_EMU_SIGNATURE_CASE({k})" for k in kernels)
    wrapper = (
        "\n// ---- emulator entry points (tvm_rammer/checks/emulator/build.py)\n"
        "RAMMER_EMU_EXPORT int rammer_emu_launch(const char* name, void** args, "
        "const ::rammer_emu::LaunchConfig* cfg, char* report, unsigned long long cap) {\n"
        f"{cases}\n  return ::rammer_emu::RC_UNKNOWN_KERNEL;\n}}\n"
        "RAMMER_EMU_EXPORT const char* rammer_emu_signature(const char* name) {\n"
        f"{sigs}\n  return nullptr;\n}}\n")
    return source + wrapper, kernels


# ------------------------------------------------------------------------------ compilation
def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tvm-rammer/emulator`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tvm-rammer" / "emulator"


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    raise EmulatorError("no C++ compiler found for the emulator: install g++ (or clang++), or set "
                        "$CXX to one")


@lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EmulatorError(f"cannot run the C++ compiler {cxx}: {err}") from None
    return out.stdout.strip() or out.stderr.strip()


def _headers_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(INCLUDE_DIR.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(INCLUDE_DIR)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _normalize_opt(opt) -> str:
    if opt is None:
        return DEFAULT_OPT
    if not isinstance(opt, str):
        raise TypeError(f"opt must be a str such as '-O1', not {type(opt).__name__}")
    text = opt if opt.startswith("-") else f"-O{opt.lstrip('O')}"
    if text not in _OPTS:
        raise ValueError(f"opt={opt!r}: use one of {', '.join(_OPTS)}")
    return text


def _precompiled_header(cxx: str, flags: tuple, folder: Path) -> Path | None:
    """The folder holding ``rammer_emu.h.gch``, g++'s precompiled ``rammer_emu.h`` for ``flags``,
    built on first use and cached under ``folder/pch/<sha256 of the headers, flags, compiler>``;
    the build force-includes ``rammer_emu.h`` by its path in that folder (a one-line header there
    includes the real one, which g++ reads should it ever find the ``.gch`` unusable). None: not
    g++, or the header would not precompile (the build then parses the header itself). Parsing
    and instantiating the runtime header is a large part of a small kernel's g++ time (measured:
    README, "The CPU emulator")."""
    version = _compiler_version(cxx)
    if "Free Software Foundation" not in version or "clang" in version.lower():
        return None
    h = hashlib.sha256()
    for part in (_headers_digest(), " ".join(flags), version):
        h.update(part.encode())
        h.update(b"\0")
    where = folder / "pch" / h.hexdigest()[:32]
    gch = where / "rammer_emu.h.gch"
    if gch.exists() and (where / "rammer_emu.h").exists():
        return where
    try:
        where.mkdir(parents=True, exist_ok=True)
        _write_atomic(where / "rammer_emu.h",
                      f'#include "{INCLUDE_DIR / "rammer_emu.h"}"\n'.encode())
        fd, tmp = tempfile.mkstemp(dir=where, prefix="rammer_emu.h.", suffix=".gch.tmp")
        os.close(fd)
        cmd = [cxx, *[f for f in flags if f != "-shared"], "-I", str(INCLUDE_DIR), "-x", "c++-header",
               str(INCLUDE_DIR / "rammer_emu.h"), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, gch)
    except OSError:
        return None
    return where


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def build_module(cuda_source: str, *, opt: str | None = None,
                 use_pch: bool = True) -> "EmulatedModule":
    """Rewrite, compile (or reuse the cached library) and load ``cuda_source``.

    ``opt``: the compiler's optimisation level (``"-O0"``, ``"-O1"``, ...; default
    :data:`DEFAULT_OPT`); ``use_pch``: with g++, parse the runtime header from a precompiled
    header (:func:`_precompiled_header`; the library is the same either way). Raises EmulatorError on a source the emulator cannot run (unknown inline
    PTX, an unusual ``__shared__`` declaration, no kernel) or a compile failure (the compiler's
    stderr tail, the kept source path and the command to reproduce)."""
    level = _normalize_opt(opt)
    source, kernels = rewrite_source(cuda_source)
    cxx = _compiler()
    flags = (*_BASE_FLAGS, level)
    h = hashlib.sha256()
    for part in (source, _headers_digest(), " ".join(flags), _compiler_version(cxx)):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EmulatorError(f"cannot create the emulator's cache folder {folder} ({err}); set "
                            f"XDG_CACHE_HOME to a writable folder") from None
    lib, src = folder / f"{key}.so", folder / f"{key}.cu"
    seconds = 0.0
    if not lib.exists():
        _write_atomic(src, source.encode())
        start = time.perf_counter()
        pch = _precompiled_header(cxx, flags, folder) if use_pch else None
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{key}.", suffix=".so.tmp")
        os.close(fd)
        forced = str(pch / "rammer_emu.h") if pch else "rammer_emu.h"
        cmd = [cxx, *flags, "-I", str(INCLUDE_DIR), "-include", forced, "-o", tmp, "-x", "c++",
               str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as err:
            os.unlink(tmp)
            raise EmulatorError(f"cannot run the C++ compiler: {err}") from None
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            if os.path.exists(tmp):
                os.unlink(tmp)
            tail = "\n".join(proc.stderr.strip().splitlines()[-40:])
            shown = [c if c != tmp else str(folder / f"{key}.so") for c in cmd]
            raise EmulatorError(
                f"the C++ compiler failed on the emulated CUDA source (exit {proc.returncode}).\n"
                f"kept source: {src}\ncommand: {shlex.join(shown)}\nstderr (tail):\n{tail}")
        os.replace(tmp, lib)
    elif not src.exists():
        _write_atomic(src, source.encode())
    return EmulatedModule(lib, src, kernels, seconds)


# ------------------------------------------------------------------------------ launching
class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("dyn_smem", ctypes.c_uint32), ("cooperative", ctypes.c_int32),
                ("order", ctypes.POINTER(ctypes.c_uint32)), ("wall_limit_s", ctypes.c_double),
                ("stack_bytes", ctypes.c_uint64)]


# signature code -> (numpy kinds accepted, ctypes type, numpy dtype)
_SCALARS = {
    "f": ("fiu", ctypes.c_float, np.float32), "d": ("fiu", ctypes.c_double, np.float64),
    "b": ("biu", ctypes.c_bool, np.bool_),
    "c": ("iub", ctypes.c_int8, np.int8), "C": ("iub", ctypes.c_uint8, np.uint8),
    "s": ("iub", ctypes.c_int16, np.int16), "S": ("iub", ctypes.c_uint16, np.uint16),
    "i": ("iub", ctypes.c_int32, np.int32), "I": ("iub", ctypes.c_uint32, np.uint32),
    "l": ("iub", ctypes.c_int64, np.int64), "L": ("iub", ctypes.c_uint64, np.uint64),
    "h": ("f", ctypes.c_uint16, np.float16),
}


def _dims(value, what: str) -> tuple:
    if isinstance(value, (int, np.integer)):
        value = (int(value),)
    try:
        dims = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise ValueError(f"{what}={value!r}: 1 to 3 positive extents")
    return dims + (1,) * (3 - len(dims))


def _order(order, num_blocks: int):
    if order is None or order == "forward":
        return None
    if order == "reverse":
        perm = np.arange(num_blocks - 1, -1, -1, dtype=np.uint32)
    elif isinstance(order, (int, np.integer)) and not isinstance(order, bool):
        perm = np.random.RandomState(int(order) & 0xFFFFFFFF).permutation(num_blocks).astype(np.uint32)
    else:
        raise ValueError(f"order={order!r}: use 'forward', 'reverse' or an int seed")
    return np.ascontiguousarray(perm)


def _parse_report(text: str) -> tuple:
    rows = []
    for line in text.splitlines():
        m = re.match(r"block=(\d+) \((\d+),(\d+),(\d+)\) threads=(\d+)(?:-(\d+))? what=(.*)$", line)
        if not m:
            continue
        lm = re.search(r" at line (\d+)$", m.group(7))
        first = int(m.group(5))
        rows.append({"block": int(m.group(1)),
                     "block_idx": (int(m.group(2)), int(m.group(3)), int(m.group(4))),
                     "threads": (first, int(m.group(6)) if m.group(6) else first),
                     "what": m.group(7), "line": int(lm.group(1)) if lm else None})
    return tuple(rows)


class EmulatedModule:
    """A built module: ``kernels`` (the ``__global__`` functions' names), ``build_seconds`` (the
    compiler's wall time; 0.0 on a cache hit), ``library_path`` and ``source_path`` (the kept
    rewritten source: line numbers in errors and deadlock reports are its lines), ``signatures``
    (per kernel one type code per parameter: ``p`` pointer, ``i``/``l`` int32/int64, ``f``/``d``
    float/double, ...), ``last_stats`` (the last launch's counters: CUDA threads run, fiber
    resumes, spin yields, scheduling rounds, virtual nanoseconds)."""

    def __init__(self, library: Path, source: Path, kernels: tuple, build_seconds: float):
        self.library_path = str(library)
        self.source_path = str(source)
        self.kernels = tuple(kernels)
        self.build_seconds = float(build_seconds)
        self._lib = ctypes.CDLL(self.library_path)
        self._launch = self._lib.rammer_emu_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.POINTER(_LaunchConfig), ctypes.c_char_p, ctypes.c_ulonglong]
        sig = self._lib.rammer_emu_signature
        sig.restype = ctypes.c_char_p
        sig.argtypes = [ctypes.c_char_p]
        self.signatures = {k: sig(k.encode()).decode() for k in self.kernels}
        self._stats = self._lib.rammer_emu_stats
        self._stats.restype = None
        self._stats.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
        self.last_stats = {}

    def __repr__(self):
        return f"EmulatedModule(kernels={self.kernels}, library={self.library_path!r})"

    def _arguments(self, kernel: str, args: Sequence) -> list:
        signature = self.signatures[kernel]
        if len(args) != len(signature):
            raise TypeError(f"{kernel} takes {len(signature)} arguments, got {len(args)}")
        values = []
        for k, (code, arg) in enumerate(zip(signature, args)):
            if code == "p":
                if arg is None:
                    values.append(ctypes.c_void_p(None))
                elif isinstance(arg, np.ndarray):
                    if not arg.flags.c_contiguous:
                        raise ValueError(f"{kernel}: argument {k} is not C-contiguous")
                    values.append(ctypes.c_void_p(arg.ctypes.data))
                else:
                    raise TypeError(f"{kernel}: argument {k} is a pointer parameter; pass a "
                                    f"C-contiguous numpy array (or None), not {type(arg).__name__}")
                continue
            if code not in _SCALARS:
                raise TypeError(f"{kernel}: parameter {k} has a type the emulator cannot pass "
                                f"(signature {signature!r})")
            kinds, ctype, dtype = _SCALARS[code]
            if isinstance(arg, np.ndarray) and arg.ndim == 0:
                arg = arg[()]
            if isinstance(arg, (bool, int, float)) and not isinstance(arg, np.generic):
                arg = np.asarray(arg)[()]
            if not isinstance(arg, np.generic) or np.dtype(type(arg)).kind not in kinds:
                raise TypeError(f"{kernel}: argument {k} must be a {np.dtype(dtype).name} scalar, got "
                                f"{type(arg).__name__}")
            value = np.asarray(arg).astype(dtype)
            if value.dtype.kind in "iu" and value != arg:
                raise ValueError(f"{kernel}: argument {k} = {arg} does not fit {np.dtype(dtype).name}")
            if code == "h":
                values.append(ctype(int(value.view(np.uint16))))
            else:
                values.append(ctype(value.item()))
        return values

    def launch(self, kernel: str, args: Sequence, grid, block, dyn_smem: int = 0,
               cooperative: bool = False, order="forward", wall_limit_s: float = 600.0, *,
               stack_bytes: int = 256 * 1024) -> None:
        """Run one launch of ``kernel`` (see the module docstring).

        ``args`` in the kernel's parameter order: a C-contiguous numpy array (its data pointer;
        None for a null pointer) for pointer parameters, a numpy scalar (or a Python number that
        fits) for value parameters. ``grid``/``block``: 1 to 3 extents. ``order``: the blocks'
        scheduling order, ``"forward"``, ``"reverse"`` or an int seed of a permutation.
        ``stack_bytes``: each CUDA thread's stack. Raises EmulatorDeadlock (deadlock, livelock,
        wall-clock limit) or EmulatorError (trap, invalid access, bad launch)."""
        if kernel not in self.kernels:
            raise ValueError(f"unknown kernel {kernel!r}; this module has {', '.join(self.kernels)}")
        g, b = _dims(grid, "grid"), _dims(block, "block")
        if b[0] * b[1] * b[2] > 1024:
            raise ValueError(f"block={block!r}: at most 1024 threads per block")
        if int(dyn_smem) < 0:
            raise ValueError(f"dyn_smem={dyn_smem}: must be >= 0")
        if not wall_limit_s > 0:
            raise ValueError(f"wall_limit_s={wall_limit_s}: must be > 0")
        values = self._arguments(kernel, args)
        argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        perm = _order(order, g[0] * g[1] * g[2])
        cfg = _LaunchConfig((ctypes.c_uint32 * 3)(*g), (ctypes.c_uint32 * 3)(*b), int(dyn_smem),
                            int(bool(cooperative)),
                            perm.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)) if perm is not None
                            else None, float(wall_limit_s), int(stack_bytes))
        report = ctypes.create_string_buffer(_REPORT_BYTES)
        stats = (ctypes.c_ulonglong * 5)()
        with _LAUNCH_LOCK:
            rc = self._launch(kernel.encode(), argv, ctypes.byref(cfg), report, _REPORT_BYTES)
            self._stats(stats)
        self.last_stats = dict(zip(("threads", "resumes", "spin_yields", "rounds", "virtual_ns"),
                                   (int(v) for v in stats)))
        text = report.value.decode(errors="replace")
        where = f"(lines refer to {self.source_path})"
        if rc == _RC_DEADLOCK:
            raise EmulatorDeadlock(f"{kernel}: {text}\n{where}", _parse_report(text))
        if rc == _RC_UNKNOWN:
            raise ValueError(f"unknown kernel {kernel!r}")
        if rc != _RC_OK:
            raise EmulatorError(f"{kernel}: {text}\n{where}")
