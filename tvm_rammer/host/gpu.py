"""The local GPU, probed once per call: is there one, which is it, what does it identify as.

The one home of "probe the GPU" (the runner, the benchmarks, the vDevice and the profiler all ask
here). ``DeviceId`` names a device the way profile records are keyed: its name, its architecture
and its driver, since a new driver can change a kernel's time.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import tvm

__all__ = ["DeviceId", "LocalGPU", "local_gpu", "gpu_available"]


@dataclass(frozen=True)
class DeviceId:
    """A GPU as profile records know it: ``name`` (``tvm.cuda(0).device_name``), ``arch``
    ("sm_90") and ``driver`` (the driver version, "unknown" when it cannot be read)."""

    name: str
    arch: str
    driver: str = "unknown"

    @property
    def key(self) -> str:
        return f"{self.name} | {self.arch} | driver {self.driver}"

    @classmethod
    def from_key(cls, key: str) -> "DeviceId":
        name, arch, driver = (part.strip() for part in key.split(" | "))
        return cls(name, arch, driver.removeprefix("driver "))


@dataclass(frozen=True)
class LocalGPU:
    """CUDA device 0 of this process: the TVM device and its identity."""

    dev: object
    id: DeviceId


def _driver_version() -> str:
    if not shutil.which("nvidia-smi"):
        return "unknown"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else "unknown"


def local_gpu() -> LocalGPU | None:
    """CUDA device 0, or None when this TVM has no CUDA runtime or no GPU is visible."""
    try:
        dev = tvm.cuda(0)
        if not dev.exist:
            return None
        major, minor = str(dev.compute_version).split(".")
        name = str(dev.device_name)
    except Exception:  # pylint: disable=broad-except  (no CUDA runtime in this TVM build)
        return None
    return LocalGPU(dev, DeviceId(name, f"sm_{major}{minor}", _driver_version()))


def gpu_available() -> bool:
    """Whether a CUDA device is visible to TVM."""
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # pylint: disable=broad-except  (no CUDA runtime at all)
        return False
