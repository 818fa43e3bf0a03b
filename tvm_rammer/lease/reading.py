"""The profile database a lease's compile without a GPU reads (``lease.kernels``' recording
compile, ``lease.rprograms``' rProgram compile): :func:`source_device` finds the database and
device whose records it reads for an arch (the profiler's rule), :class:`Overlay` serves them with
what the compile itself writes kept in memory (nothing reaches the database)."""
from __future__ import annotations

from ..host.gpu import DeviceId

__all__ = ["Overlay", "source_device"]


class Overlay:
    """The profile database a compile without a GPU reads: ``base``'s records of ``base_device`` (or
    nothing), a placeholder record for every key in ``timed`` (timed by an earlier lease: not asked
    again), and in memory what the compile writes (operator records; nothing reaches ``base``)."""

    def __init__(self, base, base_device: DeviceId | None, timed=()):
        self.base, self.base_device, self.timed = base, base_device, set(timed)
        self.path = None
        self._mem: dict = {}

    def get(self, kind: str, key: str, device):
        if (kind, key) in self._mem:
            return self._mem[(kind, key)]
        if kind == "kernel" and key in self.timed:
            return {"kernel_us": None, "valid": None, "error": None, "timed_by_lease": True}
        if self.base is None or self.base_device is None:
            return None
        return self.base.get(kind, key, self.base_device)

    def put_many(self, items) -> None:
        for kind, key, _, record in items:
            self._mem[(kind, key)] = dict(record)

    def flush(self) -> None:
        pass

    def device_for(self, arch: str, name: str | None = None):
        return self.base_device


def source_device(db, arch: str):
    """(database, device) whose records a compile without a GPU reads for ``arch``: ``db``'s device
    of that arch, else the first shipped database that has one (``Profiler``'s rule)."""
    from ..tuning.profile_db import shipped_profile_dbs

    for candidate in ([db] if db is not None else []) + shipped_profile_dbs():
        found = candidate.device_for(arch)
        if found is not None:
            return candidate, found
    return None, None
