"""``tvm-rammer doctor``: what this machine can do with tvm-rammer, and how to fix what it cannot.

:func:`diagnose` runs every check and returns them as :class:`Check` rows (``name``, ``status``,
``detail``, ``fix``); :func:`format_report` prints them on one screen, ``--json`` prints
:func:`to_json`. A status is ``ok``, ``missing`` (an optional package or tool: what it is for is in
the detail, the fix says how to add it), ``mismatch`` (the GPU is not the default target's arch)
or ``none`` (no GPU: compiling and inspecting still work). Checks, in order: tvm-rammer itself, TVM
(version, CUDA runtime loaded or not), the CUDA compiler a build would use (``host.cuda_compile``),
nvcc, the GPU (name, arch, driver; which ``rammer/...`` tag matches it), the optional packages
(``host.packages``), a C++ compiler (the CPU emulator builds with one), the ROCm toolchain (AMD
targets), the profile cache and the shipped profile databases.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

from . import cuda_compile, packages

__all__ = ["Check", "diagnose", "format_report", "to_json", "register"]

GPU_COMMANDS = "`run`, `bench` (timing) and `tune`"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` is "ok", "missing", "mismatch" or "none"."""

    name: str
    status: str
    detail: str
    fix: str = ""


def _tvm_check() -> Check:
    import tvm

    where = os.path.dirname(os.path.abspath(tvm.__file__))
    try:
        use_cuda = str(tvm.support.libinfo().get("USE_CUDA", "?"))
    except Exception:  # (libinfo is optional in some builds)
        use_cuda = "?"
    if cuda_compile.tvm_builds_cuda():
        runtime = "CUDA runtime loaded: builds compile their CUDA"
    else:
        runtime = "no CUDA runtime loaded (no NVIDIA driver): builds keep CUDA source only"
    return Check("TVM", "ok", f"{tvm.__version__} (USE_CUDA={use_cuda}) at {where}; {runtime}")


def _compiler_check() -> Check:
    choice = cuda_compile.compiler_choice()
    if choice.compiler is None:
        return Check("CUDA compiler", "missing", "none: " + choice.why.split(":")[0],
                     "pip install cuda-python (NVRTC), or put the CUDA toolkit's nvcc on PATH")
    when = "" if cuda_compile.tvm_builds_cuda() else " (on a GPU host; nothing is compiled here)"
    if choice.compiler == "nvcc" and not os.environ.get(cuda_compile.ENV):
        return Check("CUDA compiler", "ok", f"nvcc, since {choice.why}{when}",
                     "optional: pip install cuda-python for NVRTC, TVM's default")
    return Check("CUDA compiler", "ok", f"{choice.compiler}: {choice.why}{when}")


def _nvcc_arches(path: str) -> list:
    try:
        out = subprocess.run([path, "--list-gpu-arch"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"compute_(\d+)", out)


def _nvcc_check(arch: str) -> Check:
    path, version = cuda_compile.nvcc_status()
    if path is None:
        return Check("nvcc", "missing",
                     "not on PATH: needed where NVRTC is not, by the sm_90a cubin tests and "
                     "`scripts/gpu_check.sh`",
                     "install the CUDA toolkit (12.x or newer) and put its bin/ on PATH")
    arches = _nvcc_arches(path)
    wanted = arch.removeprefix("sm_").rstrip("af")
    if arches and wanted not in arches:
        return Check("nvcc", "mismatch", f"{version} at {path}: cannot build {arch} "
                     f"(builds compute_{arches[0]}..{arches[-1]})", "a newer CUDA toolkit")
    return Check("nvcc", "ok", f"{version} at {path}" + (f"; builds {arch}" if arches else ""))


def _matching_tag(arch: str, name: str) -> str | None:
    from ..target import TAGS, resolve_target, same_arch, target_arch

    by_name = [tag for tag in TAGS if tag.split("-")[-1] in name.lower().replace(" ", "")]
    same = [tag for tag in TAGS if same_arch(target_arch(resolve_target(tag)), arch)]
    found = [tag for tag in by_name if tag in same] or same
    return found[0] if found else None


def _nvidia_smi_gpus() -> list:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def _gpu_check(default_target: str) -> tuple:
    """(the GPU check, the arch the nvcc check should look for)."""
    from .gpu import local_gpu
    from ..target import resolve_target, same_arch, target_arch

    default_arch = target_arch(resolve_target(default_target))
    local = local_gpu()
    if local is None:
        seen = _nvidia_smi_gpus()
        if seen:
            return Check("GPU", "missing", f"nvidia-smi lists {', '.join(seen)} but TVM sees no "
                         "CUDA device", "a TVM build with CUDA (USE_CUDA=ON) matching the driver; "
                         "check LD_LIBRARY_PATH holds libcuda.so"), default_arch
        return Check("GPU", "none", f"none visible: compile, inspect, demo and the tests work "
                     f"without one; {GPU_COMMANDS} need an NVIDIA GPU"), default_arch
    ident = local.id
    tag = _matching_tag(ident.arch, ident.name)
    detail = f"{ident.name}, {ident.arch}, driver {ident.driver}"
    if same_arch(default_arch, ident.arch):
        return Check("GPU", "ok", f"{detail}; the default target {default_target} "
                     f"({default_arch}) matches" + (f"; its own tag: {tag}" if tag else "")), \
            ident.arch
    fix = (f"--target {tag}" if tag else
           f"--target '{{\"kind\": \"cuda\", \"arch\": \"{ident.arch}\"}}'")
    return Check("GPU", "mismatch", f"{detail}; the default target {default_target} is "
                 f"{default_arch}", fix), ident.arch


def _package_check(module: str) -> Check:
    info = packages.OPTIONAL[module]
    version = packages.version_of(module)
    label = "cuda-python" if module == "cuda.bindings" else module
    if version is None:
        return Check(label, "missing", f"not installed: {info.used_for}", info.fix)
    return Check(label, "ok", version)


def _cxx_check() -> Check:
    for name in ("g++", "clang++", "c++"):
        path = shutil.which(name)
        if path:
            try:
                out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                     timeout=30, check=False).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            first = out.splitlines()[0] if out else "unknown version"
            return Check("C++ compiler", "ok", f"{first} at {path}")
    return Check("C++ compiler", "missing",
                 "none of g++, clang++, c++ on PATH: the CPU emulator (`--emulate`) needs one",
                 "apt-get install g++  (or your platform's C++17 compiler)")


def _rocm_check() -> Check:
    from ..rocm.toolchain import INSTALL_COMMAND, locate

    found = locate()
    if isinstance(found, str):
        return Check("ROCm toolchain", "missing", "only for --target rammer/amd-*: " +
                     found.split(";")[0], INSTALL_COMMAND)
    return Check("ROCm toolchain", "ok", f"ld.lld {found.ld_lld}, clang {found.clang}, device "
                 f"bitcode in {found.rocm_path} (AMD code objects build; nothing runs on an AMD "
                 f"GPU through this TVM)")


def _size(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


def _cache_checks() -> list:
    from ..tuning.profile_db import SHIPPED_DIR, default_cache_path

    path = default_cache_path()
    if os.path.exists(path):
        cache = Check("profile cache", "ok", f"{path} ({_size(path) / 1e6:.2f} MB)")
    else:
        cache = Check("profile cache", "ok", f"{path} (empty: created by the first profiled "
                      "compile on a GPU; XDG_CACHE_HOME moves it)")
    shipped = sorted(p.name for p in SHIPPED_DIR.glob("*.json")) if SHIPPED_DIR.is_dir() else []
    ship = Check("shipped profiles", "ok" if shipped else "none",
                 f"{', '.join(shipped)} in {SHIPPED_DIR}" if shipped else
                 f"none in {SHIPPED_DIR}: without a GPU, operators keep TVM's dlight schedule")
    return [cache, ship, _binary_cache_check()]


def _binary_cache_check() -> Check:
    from .binary_cache import ENV, KINDS, binary_cache, cache_root

    root = cache_root()
    if root is None:
        return Check("binary cache", "none", f"{ENV}=off: every GPU build runs the device compiler")
    held = sum(binary_cache(kind).size() for kind in KINDS)
    kinds = ",".join(directory for directory, _ in KINDS)
    return Check("binary cache", "ok", f"{root}/{{{kinds}}} ({held / 1e6:.2f} MB): a source "
                 f"built before is not compiled again ({ENV}=off: never; {ENV}=<dir>: elsewhere)")


def diagnose(default_target: str = "rammer/nvidia-h100") -> list:
    """Every check of this machine, in report order (a list of :class:`Check`)."""
    from ..version import __version__

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checks = [Check("tvm-rammer", "ok", f"{__version__} at {here} (Python "
                    f"{platform.python_version()} at {sys.executable})"),
              _tvm_check(), _compiler_check()]
    gpu, arch = _gpu_check(default_target)
    checks += [_nvcc_check(arch), gpu]
    checks += [_package_check(m) for m in ("cuda.bindings", "onnxruntime", "matplotlib", "torch")]
    checks += [_cxx_check(), _rocm_check(), *_cache_checks()]
    return checks


_MARK = {"ok": "ok", "missing": "--", "mismatch": "!!", "none": "--"}


def format_report(checks: list) -> str:
    """One line per check (``fix:`` under the ones that have one), then a one-line summary."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{_MARK.get(c.status, '??')}] {c.name.ljust(width)}  {c.detail}")
        if c.fix:
            lines.append(f"     {' ' * width}  fix: {c.fix}")
    lines.append(summary(checks))
    return "\n".join(lines)


def summary(checks: list) -> str:
    """What this machine can do, in one line."""
    by = {c.name: c for c in checks}
    can = ["compile", "inspect"]
    gpu = by.get("GPU")
    if gpu is not None and gpu.status in ("ok", "mismatch") and \
            by["CUDA compiler"].status == "ok":
        can += ["run", "bench", "tune"]
    if by.get("C++ compiler") is not None and by["C++ compiler"].status == "ok":
        can.append("emulate on the CPU")
    return "this machine can: " + ", ".join(can)


def to_json(checks: list) -> str:
    """The checks as one JSON object: ``{"checks": [...], "summary": "..."}``."""
    return json.dumps({"checks": [asdict(c) for c in checks], "summary": summary(checks)},
                      indent=1)


def register(sub, default_target: str) -> None:
    """Add the ``doctor`` subcommand to the ``tvm-rammer`` parser."""
    p = sub.add_parser("doctor", help="what this machine can do with tvm-rammer, and the fixes")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--target", default=default_target,
                   help="the target whose arch the GPU is checked against (default: %(default)s)")

    def run(args) -> int:
        checks = diagnose(args.target)
        print(to_json(checks) if args.json else format_report(checks))
        return 0

    p.set_defaults(func=run)
