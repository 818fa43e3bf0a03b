"""Shared pytest set-up: GPU tests skip cleanly without a CUDA device, nvcc tests without nvcc."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Hermetic profile cache: a compile in a test reads and writes a cache of this session only, never
# the user's (whose records would change which kernels a test sees).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tvm_rammer_test_cache_")
os.environ.pop("TVM_RAMMER_BINARY_CACHE", None)  # the caches are the session's, under it


from tvm_rammer.host.gpu import gpu_available  # noqa: E402  (after the path set-up above)

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
