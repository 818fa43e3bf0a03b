"""The profile database: measured rKernel and rProgram times, kept between compilations.

Rammer's profiler (OSDI'20, 3.2) gives the policy 1) each rTask's time on a vEU, 2) its resource
usage and 3) an rProgram's time. Measuring needs the GPU; the database keeps the results so that a
second compilation of the same model measures nothing, and a machine without a GPU can reuse them.

One JSON file::

    {"format": "tvm-rammer-profile-db/1",
     "devices": {DEVICE: {"arch": "sm_90",
                          "kernels": {KEY: {"kernel_us": .., "rtask_us": .., "registers": ..,
                                            "shared_bytes": .., "num_rtasks": .., "threads": ..}},
                          "rprograms": {KEY: {"time_us": ..}}}}}

``DEVICE`` is the CUDA device name (``tvm.cuda(0).device_name``), ``KEY`` of a kernel its structural
hash (``tuning.versions.func_key``), of an rProgram the hash given by the caller.
"""
from __future__ import annotations

import json
import os
from typing import Callable

__all__ = ["ProfileDB", "FORMAT"]

FORMAT = "tvm-rammer-profile-db/1"


class ProfileDB:
    """In-memory profile database backed by one JSON file (``path``; None = memory only)."""

    def __init__(self, path: str | None = None, devices: dict | None = None):
        self.path = path
        self.devices: dict = devices or {}
        self.dirty = False

    @classmethod
    def load(cls, path: str | None) -> "ProfileDB":
        """The database in ``path``; an empty one when the file does not exist yet."""
        if path is None or not os.path.exists(path):
            return cls(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"profile database {path!r} is not readable JSON ({err}); "
                             "delete it or pass another --profile-db") from None
        if data.get("format") != FORMAT:
            raise ValueError(f"profile database {path!r} has format {data.get('format')!r}, "
                             f"expected {FORMAT!r}; delete it or pass another --profile-db")
        return cls(path, data.get("devices", {}))

    def save(self, path: str | None = None) -> None:
        """Write the database (to ``path`` or where it was loaded from), atomically."""
        path = path or self.path
        if path is None:
            raise ValueError("ProfileDB.save needs a path: the database was created in memory")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "devices": self.devices}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        self.dirty = False

    def _device(self, device: str, arch: str | None = None) -> dict:
        entry = self.devices.setdefault(device, {"arch": arch, "kernels": {}, "rprograms": {}})
        if arch and not entry.get("arch"):
            entry["arch"] = arch
        return entry

    def device_for_arch(self, arch: str) -> str | None:
        """A device of the database with this arch (first by name), for compiling without a GPU."""
        base = arch.rstrip("a")
        names = sorted(d for d, e in self.devices.items() if str(e.get("arch") or "").rstrip("a") == base)
        return names[0] if names else None

    def kernel(self, key: str, device: str) -> dict | None:
        """The kernel record for ``key`` measured on ``device``, or None."""
        return self.devices.get(device, {}).get("kernels", {}).get(key)

    def put_kernel(self, key: str, device: str, record: dict, arch: str | None = None) -> None:
        self._device(device, arch)["kernels"][key] = dict(record)
        self.dirty = True

    def rprogram(self, key: str, device: str) -> float | None:
        entry = self.devices.get(device, {}).get("rprograms", {}).get(key)
        return None if entry is None else float(entry["time_us"])

    def put_rprogram(self, key: str, device: str, time_us: float, arch: str | None = None) -> None:
        self._device(device, arch)["rprograms"][key] = {"time_us": float(time_us)}
        self.dirty = True

    def kernel_or_measure(self, key: str, device: str, measure: Callable[[], dict] | None,
                          arch: str | None = None) -> tuple[dict | None, str]:
        """(record, "database") when known; else (``measure()``, "profiled") stored for next time;
        (None, "analytical") when unknown and nothing can measure."""
        record = self.kernel(key, device)
        if record is not None:
            return record, "database"
        if measure is None:
            return None, "analytical"
        record = measure()
        self.put_kernel(key, device, record, arch)
        return record, "profiled"
