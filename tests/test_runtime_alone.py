"""A compiled library runs on TVM's runtime alone: it calls no packed function of tvm_rammer.

The Relax VM looks up every packed function a module calls when the VM is created, so a module
that needed ``tvm_rammer`` would fail there in an interpreter that never imported it. These tests
compile in this process, export the library, and create the VM in a fresh interpreter that never
imports tvm_rammer (its ``sys.modules`` is checked). The CUDA module is taken out of the exported
copy, since this machine may have no CUDA runtime to load it: creating the VM needs only its
function pool, and the fault page's Relax function runs on the CPU.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_rammer
from tvm_rammer.codegen import faults
from tvm_rammer.config import RammerConfig
from tvm_rammer.models import REDUCED, get_model

TARGET = "rammer/nvidia-h100"

FRESH = textwrap.dedent("""
    import sys
    import tvm
    from tvm import relax
    vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
    assert "tvm_rammer" not in sys.modules, "the library imported tvm_rammer"
    if len(sys.argv) > 2:
        print(" ".join(str(int(w)) for w in vm[sys.argv[2]]().numpy()))
    print("VM created")
""")


def _export_without_device_module(ex, path) -> None:
    ex.mod.imports[0].clear_imports()  # the host module's CUDA import: no CUDA loader here
    ex.export_library(str(path))


def _fresh(path, *extra):
    return subprocess.run([sys.executable, "-c", FRESH, str(path), *extra], capture_output=True,
                          text=True, timeout=300, cwd=str(path.parent))


@pytest.fixture(scope="module")
def executable():
    """The demo model (barriers: it has a fault page) compiled for a rammer target."""
    model = get_model("branches", **REDUCED["branches"])
    return tvm_rammer.compile(model, target=TARGET, config=RammerConfig(profile=False))


def test_the_executable_names_no_packed_function_of_tvm_rammer(executable):
    text = executable.as_text()
    assert "rammer_rprogram0" in text and f"@{faults.PAGE_FUNC}:" in text
    assert "tvm_rammer" not in text


def test_a_fresh_interpreter_without_tvm_rammer_creates_the_vm_and_reads_the_page(executable,
                                                                                    tmp_path):
    lib = tmp_path / "model.so"
    _export_without_device_module(executable, lib)
    out = _fresh(lib, faults.PAGE_FUNC)
    assert out.returncode == 0, out.stderr[-2000:]
    words, created = out.stdout.strip().splitlines()
    assert created == "VM created"
    assert [int(w) for w in words.split()] == faults.empty_page().tolist()


def test_negative_control_a_module_calling_an_unregistered_packed_function_fails_there(tmp_path):
    """The check above can fail: a module whose main calls a packed function that only some
    Python package registers cannot create its VM in a fresh interpreter."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    name = "tvm_rammer_test.only_registered_here"
    tvm_ffi.register_global_func(name, lambda x: x, override=True)
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        y = bb.emit(relax.call_pure_packed(name, x, ty_args=[relax.TensorType((4,), "float32")]))
        bb.emit_func_output(y)
    ex = tvm.compile(bb.get(), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())  # here, where it is registered, it works
    assert np.array_equal(vm["main"](tvm.runtime.tensor(np.ones(4, "float32"))).numpy(),
                          np.ones(4, "float32"))
    lib = tmp_path / "needs_python.so"
    ex.export_library(str(lib))
    out = _fresh(lib)
    assert out.returncode != 0 and name in out.stderr
