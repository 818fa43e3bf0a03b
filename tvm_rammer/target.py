"""Rammer targets: CUDA targets carrying the key "rammer".

A rammer target is an ordinary TVM CUDA target whose ``keys`` start with ``"rammer"``;
``tvm.compile(mod, target=T)`` then runs the rammer pipeline (see :mod:`tvm_rammer.driver.pipeline`).
Tags ``rammer/<tag>`` are registered for the common NVIDIA data-centre GPUs.
"""

from __future__ import annotations

import contextlib
import os
import sys

import tvm

from .rocm.targets import AMD_TAGS, rocm_arch

RAMMER_KEY = "rammer"
TAGS = {
    "rammer/nvidia-h100": "nvidia/nvidia-h100",
    "rammer/nvidia-h200": {"kind": "cuda", "arch": "sm_90a", "max_shared_memory_per_block": 49152,
                           "max_threads_per_block": 1024, "thread_warp_size": 32,
                           "registers_per_block": 65536},
    "rammer/nvidia-a100": {"kind": "cuda", "arch": "sm_80", "max_shared_memory_per_block": 49152,
                           "max_threads_per_block": 1024, "thread_warp_size": 32,
                           "registers_per_block": 65536},
    "rammer/nvidia-a10g": "nvidia/nvidia-a10g",
    "rammer/nvidia-v100": "nvidia/nvidia-v100",
    **AMD_TAGS,  # rammer/amd-mi210, rammer/amd-mi300x (tvm_rammer.rocm)
}
KINDS = ("cuda", "rocm")


def rammer_target(target="nvidia/nvidia-h100") -> tvm.target.Target:
    """Make any CUDA or ROCm target (a Target, tag, or config dict) a rammer target."""
    base = target if isinstance(target, tvm.target.Target) else _parse(target)
    if base.kind.name not in KINDS:
        raise ValueError(
            f"rammer targets must be CUDA or ROCm targets, got kind {base.kind.name!r} ({base}); "
            "pass e.g. 'nvidia/nvidia-h100', {'kind': 'cuda', 'arch': 'sm_90a'} or "
            "'rammer/amd-mi300x'")
    if is_rammer_target(base):
        return base
    config = dict(base.export())
    config.pop("tag", None)
    config["keys"] = [RAMMER_KEY, *[k for k in config.get("keys", ()) if k != RAMMER_KEY]]
    return tvm.target.Target(config)


def is_rammer_target(target) -> bool:
    """Whether ``target`` asks for the rammer pipeline."""
    return target is not None and RAMMER_KEY in tuple(target.keys)


def resolve_target(target) -> tvm.target.Target:
    """Accept a tag (``rammer/...`` or any CUDA tag), a Target or a dict; return a rammer target."""
    return rammer_target(target)


_LIST_OPTIONS = ("keys", "libs", "mattr")


def cli_target_dict(text: str) -> dict | None:
    """The config dict of a target in the CLI form of older TVM releases (``"cuda -arch=sm_80"``,
    ``"cuda -arch=sm_90a -max_threads_per_block=1024"``), which TVM 0.27 no longer parses; None
    when ``text`` is not in that form. Integers become ints, list options (-keys, -libs, -mattr)
    lists."""
    parts = text.split()
    if len(parts) < 2 or parts[0].startswith(("-", "{")) or "/" in parts[0]:
        return None
    config = {"kind": parts[0]}
    for part in parts[1:]:
        if not part.startswith("-") or "=" not in part:
            return None
        key, _, value = part.lstrip("-").partition("=")
        if key in _LIST_OPTIONS:
            config[key] = [v for v in value.split(",") if v]
        elif value.lstrip("-").isdigit():
            config[key] = int(value)
        elif value.lower() in ("true", "false"):
            config[key] = value.lower() == "true"
        else:
            config[key] = value
    return config


def _parse(target) -> tvm.target.Target:
    spec = (cli_target_dict(target) or target) if isinstance(target, str) else target
    try:
        return tvm.target.Target(spec)
    except Exception as err:  # TVM raises several error types for a bad target string
        raise ValueError(
            f"cannot parse target {target!r}: {str(err).splitlines()[0].split('. ')[0]}; write a "
            "tag ('rammer/nvidia-h100', 'nvidia/nvidia-a100'), a dict / JSON string "
            "('{\"kind\": \"cuda\", \"arch\": \"sm_80\"}') or 'cuda -arch=sm_80'") from None


def register_tags() -> None:
    """Register the ``rammer/...`` tags in TVM's tag registry (idempotent)."""
    known = tvm.target.list_tags() or {}
    for name, base in TAGS.items():
        if name in known:
            continue
        rocm = isinstance(base, dict) and base.get("kind") == "rocm"
        with _quiet_rocm_parser() if rocm else contextlib.nullcontext():
            config = dict(rammer_target(base).export())
            config.pop("tag", None)
            config["keys"] = list(config["keys"])
            tvm.target.register_tag(name, config)


@contextlib.contextmanager
def _quiet_rocm_parser():
    """Standard error (fd 2) closed to TVM's C++ log while the AMD tags are registered at import:
    without a ROCm device, TVM's rocm target parser warns "Unable to detect ROCm version,
    assuming >= 3.5" for every rocm Target made, even one naming its mcpu (the version only
    matters below ROCm 3.5), which printed six lines before every command on every machine. A
    rocm target a user makes later still warns, as TVM does."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def target_arch(target: tvm.target.Target) -> str:
    """The CUDA architecture a target compiles for, as nvcc spells it ("sm_90a", "sm_80").

    The one place that reads it: a CUDA target without an ``arch`` attribute is refused, since TVM
    would otherwise fall back to sm_50 (older than anything tvm-rammer supports). A ROCm target's
    arch is its ``mcpu`` ("gfx942")."""
    if target.kind.name == "rocm":
        return rocm_arch(target)
    arch = target.attrs.get("arch", None)
    if not arch:
        raise ValueError(f"target {target} names no CUDA arch; add one, e.g. "
                         "{'kind': 'cuda', 'arch': 'sm_90a'}, or use a tag like 'rammer/nvidia-h100'")
    return str(arch)


def same_arch(a: str, b: str) -> bool:
    """Whether two arch names are the same compute capability ("sm_90a" and "sm_90" are)."""
    return a.rstrip("af") == b.rstrip("af")


def target_spec(target: tvm.target.Target) -> dict:
    """``target`` as plain data that ``tvm.target.Target(spec)`` builds again (in another process,
    or changed): its export without the tag, its keys a list."""
    spec = dict(target.export())
    spec.pop("tag", None)
    spec["keys"] = list(spec.get("keys", ()))
    return spec


def plain_target(target) -> tvm.target.Target:
    """The same target without the rammer key: TVM's default pipeline applies to it."""
    spec = target_spec(resolve_target(target))
    spec["keys"] = [k for k in spec["keys"] if k != RAMMER_KEY]
    return tvm.target.Target(spec)


def capped_target(target: tvm.target.Target, threads: int) -> tvm.target.Target:
    """``target`` with at most ``threads`` threads per block (what dlight may use)."""
    spec = target_spec(target)
    spec["max_num_threads"] = min(int(spec.get("max_num_threads", 1024)), threads)
    spec["max_threads_per_block"] = min(int(spec.get("max_threads_per_block", 1024)), threads)
    return tvm.target.Target(spec)


def rkernel_target(target: tvm.target.Target, config) -> tvm.target.Target:
    """The target dlight schedules under: threads per block capped at ``max_rtask_threads``."""
    return capped_target(target, config.max_rtask_threads)
