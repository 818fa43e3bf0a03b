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
  compiles; what compile-time benchmarks do, so that they time the compiler). A directory this
  creates is the user's alone (mode 0700): what is read from it runs on the GPU.
- Size: at most :data:`MAX_BYTES` per kind; past it the least recently used entries go (a hit
  counts as a use).
- Failures: a cache that cannot be read or written (read-only, full, removed) is no error: the
  build compiles as without it. A failed compile is never stored.

One entry is one file ``<key><suffix>``: a header (:data:`MAGIC`, the SHA-256 of the binary) and the
binary, written under a unique temporary name and renamed, so that builds in several processes
(the profiler's build workers) never see one half written; an entry whose binary does not match
its hash (a crash mid-write on a file system that reorders, a disk error) is deleted and compiled
again, never handed to the GPU driver.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass

__all__ = ["ENV", "OFF", "ON", "MAGIC", "MAX_BYTES", "CUDA", "ROCM", "KINDS", "BinaryCache",
           "binary_cache", "cache_root", "digest"]

ENV = "TVM_RAMMER_BINARY_CACHE"
OFF = ("off", "0", "false", "no")
ON = ("", "on", "1", "true", "yes")  # the default place
MAGIC = b"tvm-rammer binary 1\n"
MAX_BYTES = 2 << 30  # per kind: ~400 full-size NASNet-CIFAR fatbins
CUDA = ("cuda", ".bin")  # kinds (directory, suffix): the CUDA callback's binaries,
ROCM = (os.path.join("rocm", "code"), ".co")  # the ROCm back end's code objects
KINDS = (CUDA, ROCM)


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
    if chosen.lower() not in ON:
        return os.path.abspath(os.path.expanduser(chosen))
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
        """The binary stored under ``key``, or None (none, off, unreadable, or not matching its
        hash: then deleted)."""
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        head = len(MAGIC) + 32
        binary = data[head:]
        if not (data.startswith(MAGIC) and binary
                and hashlib.sha256(binary).digest() == data[len(MAGIC):head]):
            _remove(path)  # damaged: compiled again, and stored whole then
            return None
        try:
            os.utime(path)  # used now: the last to be evicted
        except OSError:
            pass
        return binary

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (atomically), then evict the least recently used entries
        beyond ``max_bytes``; a cache that cannot be written is left as it is."""
        if self.directory is None or not data:
            return
        part = None
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, part = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".part", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(data).digest() + bytes(data))
            os.replace(part, self._path(key))
            part = None
        except OSError:
            return
        finally:
            if part is not None:
                _remove(part)
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
        self._sweep_parts()
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            _remove(path)
            total -= size

    def _sweep_parts(self, older_than_s: float = 3600.0) -> None:
        """Remove temporary files a killed process left (none is written for longer than this)."""
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(".part")]
        except OSError:
            return
        now = time.time()
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                if now - os.stat(path).st_mtime > older_than_s:
                    os.remove(path)
            except OSError:
                pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def binary_cache(kind: tuple) -> BinaryCache:
    """The cache of ``kind`` (:data:`CUDA` or :data:`ROCM`: its directory under the root, its
    files' suffix) as the environment sets it now (read at each call: a test or a benchmark may
    turn it off)."""
    root = cache_root()
    directory, suffix = kind
    return BinaryCache(None if root is None else os.path.join(root, directory), suffix)
