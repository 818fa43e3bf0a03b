"""tvm-rammer: Rammer (OSDI'20) holistic rTask scheduling for Apache TVM.

Packages are found, not listed (``find_packages``): a new subpackage is in the wheel without
touching this file. The version is read from ``tvm_rammer/version.py`` (its one source; importing
``tvm_rammer`` here would need TVM at build time). Package data: the shipped profile databases
(``tvm_rammer/profiles/``) and every file under ``tvm_rammer/checks/emulator/include/`` (the CPU
emulator's C++ headers and runtime). ``tests/test_install.py`` builds the wheel, installs it into a
fresh virtual environment and checks that every module and every other file of the packages is
there (a data file added elsewhere fails it until it is listed here).
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (ROOT / "tvm_rammer" / "version.py").read_text(), re.M).group(1)
PACKAGES = ["tvm_rammer", "relay_passes", "tir_templates"]

setup(
    name="tvm-rammer",
    version=VERSION,
    description="Rammer-style persistent kernels (rTasks, vEUs, rPrograms) for Apache TVM",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=[p for name in PACKAGES for p in (name, f"{name}.*")]),
    python_requires=">=3.10",
    install_requires=[
        "apache-tvm==0.27.0.post1",
        # 0.1.15.post2 segfaults in tvm.ir.save_json (and MetaSchedule's JSON database)
        "apache-tvm-ffi==0.1.14.post1",
        "numpy",
        "onnx",
        "tqdm",
    ],
    # "**" needs setuptools >= 62.3 (pyproject.toml's build requirement)
    package_data={"tvm_rammer": ["profiles/*", "checks/emulator/include/**/*"]},
    extras_require={
        # the tutorials run as notebooks in a Jupyter kernel (tests/test_tutorials.py)
        "test": ["pytest", "pytest-xdist", "onnxruntime", "matplotlib", "nbclient", "nbformat", "ipykernel"],
        "bench": ["onnxruntime", "matplotlib"],
        "timeline": ["matplotlib"],  # the PNG of `--timeline` (the Perfetto JSON needs nothing)
        "torch": ["torch", "onnx2torch"],
        # NVRTC, TVM's default CUDA compiler on a GPU host (without it nvcc: `tvm-rammer doctor`)
        "gpu": ["cuda-python"],
    },
    entry_points={"console_scripts": ["tvm-rammer=tvm_rammer.cli:main"]},
)
