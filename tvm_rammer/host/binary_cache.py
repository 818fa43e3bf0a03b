"""Compiled device code kept on disk by content: the same source is compiled once.

A GPU build compiles the module's device source (nvcc or NVRTC for CUDA; LLVM for ROCm) every
time, seconds to a minute for a model (NASNet-CIFAR's persistent kernels: ~27 s of nvcc). Building
the same model again (a second ``tvm.compile``, ``tvm-rammer run`` then ``bench``, the GPU tests)
compiles the same source for the same GPU with the same compiler: a :class:`BinaryCache` keeps what
the first build made under a hash of everything the binary depends on (:func:`digest` of the parts
its caller names: the source, the arch, the compiler and its version, the options), and a second
build reads it instead.

- Where: ``$XDG_CACHE_HOME/tvm-rammer/<kind>/`` (``~/.cache``), or ``$TVM_RAMMER_BINARY_CACHE/<kind>/``
  when that names a directory; ``TVM_RAMMER_BINARY_CACHE=off`` turns caching off (every build
  compiles; what compile-time benchmarks do, so that they time the compiler).
- Size: at most :data:`MAX_BYTES` per kind; past it the least recently used entries go (a hit
  counts as a use).
- Failures: a cache that cannot be read or written (read-only, full, removed) is no error: the
  build compiles as without it. A failed compile is never stored.

One entry is one file ``<key><suffix>``, written whole under a temporary name and renamed, so
builds in several processes (the profiler's build workers) never read a partial binary.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

__all__ = ["ENV", "OFF", "MAX_BYTES", "BinaryCache", "binary_cache", "cache_root", "digest"]

ENV = "TVM_RAMMER_BINARY_CACHE"
OFF = ("off", "0", "false", "no")
MAX_BYTES = 2 << 30  # per kind: ~400 full-size NASNet-CIFAR fatbins


def digest(*parts) -> str:
    """SHA-256 of ``parts`` (each as ``str``, NUL-separated): a cache key."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_root() -> str | None:
    """The directory every kind's cache lives under (None: ``TVM_RAMMER_BINARY_CACHE=off``)."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tvm-rammer")


@dataclass(frozen=True)
class BinaryCache:
    """Binaries by key in ``directory`` (None: off, nothing kept), each ``<key><suffix>``."""

    directory: str | None
    suffix: str = ".bin"
    max_bytes: int = MAX_BYTES

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + self.suffix)

    def get(self, key: str) -> bytes | None:
        """The binary stored under ``key``, or None (none, off, or unreadable)."""
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            os.utime(path)  # used now: the last to be evicted
        except OSError:
            pass
        return data or None

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (atomically), then evict the least recently used entries
        beyond ``max_bytes``; a cache that cannot be written is left as it is."""
        if self.directory is None or not data:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            part = f"{self._path(key)}.{os.getpid()}.part"
            with open(part, "wb") as f:
                f.write(data)
            os.replace(part, self._path(key))
        except OSError:
            return
        self._evict()

    def entries(self) -> list:
        """``(mtime, bytes, path)`` of every entry, oldest first."""
        if self.directory is None:
            return []
        found = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            if not name.endswith(self.suffix):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append((st.st_mtime, st.st_size, path))
        return sorted(found)

    def size(self) -> int:
        """Bytes held."""
        return sum(size for _, size, _ in self.entries())

    def _evict(self) -> None:
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
                total -= size
            except OSError:
                pass


def binary_cache(kind: str, suffix: str = ".bin") -> BinaryCache:
    """The cache of ``kind`` (a relative directory, e.g. ``"cuda"``) as the environment sets it
    now (read at each call: a test or a benchmark may turn it off)."""
    root = cache_root()
    return BinaryCache(None if root is None else os.path.join(root, kind), suffix)
