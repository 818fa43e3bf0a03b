"""Shared pytest set-up: GPU tests skip cleanly without a CUDA device, nvcc tests without nvcc."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from tvm_rammer.gpu import gpu_available  # noqa: E402  (after the path set-up above)

GPU = gpu_available()
NVCC = shutil.which("nvcc") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc to build sm_90a cubins")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not NVCC:
            item.add_marker(skip_nvcc)
