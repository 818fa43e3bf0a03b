"""tvm-rammer: Rammer (OSDI'20) holistic rTask scheduling for Apache TVM."""
from setuptools import setup

setup(
    name="tvm-rammer",
    version="0.1.0",
    description="Rammer-style persistent-kernel compilation (rTasks, vEUs, rPrograms) for Apache TVM",
    packages=["tvm_rammer", "tvm_rammer.codegen", "tvm_rammer.models", "tvm_rammer.benchmarks",
              "tvm_rammer.tuning", "relay_passes", "tir_templates"],
    python_requires=">=3.10",
    install_requires=[
        "apache-tvm==0.27.0.post1",
        # 0.1.15.post2 segfaults in tvm.ir.save_json (and MetaSchedule's JSON database)
        "apache-tvm-ffi==0.1.14.post1",
        "numpy",
        "onnx",
        "tqdm",
    ],
    package_data={"tvm_rammer": ["profiles/*.json"]},
    extras_require={
        # the tutorials run as notebooks in a Jupyter kernel (tests/test_tutorials.py)
        "test": ["pytest", "onnxruntime", "matplotlib", "nbclient", "nbformat", "ipykernel"],
        "bench": ["onnxruntime", "matplotlib"],
        "timeline": ["matplotlib"],  # the PNG of `--timeline` (the Perfetto JSON needs nothing)
        "torch": ["torch", "onnx2torch"],
    },
    entry_points={"console_scripts": ["tvm-rammer=tvm_rammer.cli:main"]},
)
