"""Faults: a wait that can never complete ends the kernel with a record the host turns into an
error naming the vEU and the rTask (the run itself is a GPU test in test_gpu.py)."""
import ctypes

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_rammer import faults
from tvm_rammer.codegen import cuda_helpers
from tvm_rammer.config import RammerConfig
from tvm_rammer.executor import Wait, check, decode_table, manifests
from tvm_rammer.frontend import import_onnx, lower
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.resources import cuda_source
from tvm_rammer.target import rammer_target

TARGET = "rammer/nvidia-h100"
INJECT = RammerConfig(profile=False, wait_timeout_ms=250.0,
                      extra={faults.INJECT_KEY: True})


@pytest.fixture(scope="module")
def injected():
    return lower(import_onnx(get_model("branches", **REDUCED["branches"])), TARGET, INJECT)


def _persistent(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
            and "rammer.num_veus" in f.attrs}


def test_the_injected_barrier_waits_for_a_step_nobody_publishes(injected):
    (manifest,) = manifests(injected)
    broken = np.array(manifest["table"])
    clean_mod = lower(import_onnx(get_model("branches", **REDUCED["branches"])), TARGET,
                      RammerConfig(profile=False))
    (clean,) = manifests(clean_mod)
    clean = np.array(clean["table"])
    assert (faults.inject_test_fault(clean, manifest["num_veus"], RammerConfig()) == clean).all()
    assert (faults.inject_test_fault(clean, manifest["num_veus"], INJECT) == broken).all()
    assert (broken != clean).sum() == 1
    waits = [item for items in decode_table(broken, manifest["num_veus"]) for item in items
             if isinstance(item, Wait)]
    assert any(step == 10 ** 9 for w in waits for _, step in w.pairs)
    manifest["table"] = broken.tolist()
    problems = check(manifest, trials=2)
    assert problems and problems[0].startswith("deadlock:")


def test_the_kernel_takes_the_fault_page_from_the_packed_function(injected):
    ((name, func),) = _persistent(injected).items()
    assert func.attrs["rammer.fault_page"]
    assert int(func.attrs["rammer.state_words"]) == func.attrs["rammer.num_veus"] + \
        cuda_helpers.STATE_WORDS
    text = injected["main"].script()
    assert f'"{faults.FAULT_PAGE_FUNC}"' in text and name in text


@pytest.mark.nvcc
def test_the_fault_logic_is_in_the_generated_cuda_and_nvcc_compiles_it(injected):
    from tir_templates.cuda_resources import compile_cuda_resources

    ((name, func),) = _persistent(injected).items()
    source = cuda_source(func.with_attr("global_symbol", name), rammer_target("nvidia/nvidia-h100"))
    assert "%globaltimer" in source and "__trap" not in source
    assert "atomicCAS(state + num_veus, 0, 1)" in source  # the first vEU to give up records
    assert "st.release.sys.global" in source and "__threadfence_system" in source
    assert "rammer_stopped" in source  # every vEU stops after a fault
    assert "250000000" in source       # wait_timeout_ms=250 -> ns
    assert compile_cuda_resources(source, "sm_90a")  # nvcc -Xptxas -v: a real sm_90a cubin


def test_a_kernel_without_barriers_has_no_fault_page():
    mod = lower(import_onnx(get_model("branches", n=1, k=16, n_out=8)), TARGET,
                RammerConfig(profile=False))
    for func in _persistent(mod).values():
        if not func.attrs["rammer.fault_page"]:
            assert "rammer_fault_page" not in func.script()


def _words(**fields):
    keys = ("code", "kernel", "veu", "instruction", "awaited_veu", "awaited_step",
            "reached_step", "entry", "rtask_id")
    words = [0] * faults.PAGE_WORDS
    for i, k in enumerate(keys):
        words[i] = fields.get(k, 0)
    return words


def test_the_message_names_the_kernel_the_veu_and_the_rtask():
    record = faults.describe(_words(code=1, kernel=3, veu=5, instruction=7, awaited_veu=1,
                                    awaited_step=4, reached_step=2, entry=2, rtask_id=12))
    text = faults.message(record, 250.0)
    for part in ("rammer_rprogram3", "vEU 5", "instruction 7", "rTask 12 of dispatch entry 2",
                 "vEU 1 to reach step 4", "reached 2", "more than 250 ms", "still usable"):
        assert part in text
    assert faults.describe(_words()) is None


class _FakePage:
    def __init__(self, words):
        self.words = list(words)

    def words_now(self):
        return list(self.words)

    def clear(self):
        self.words = [0] * len(self.words)


def test_check_raises_once_and_clears_the_page(monkeypatch):
    page = _FakePage(_words(code=1, kernel=0, veu=2, instruction=1, awaited_veu=0,
                            awaited_step=10 ** 9, reached_step=1))
    monkeypatch.setitem(faults._PAGES, 0, page)
    with pytest.raises(faults.KernelFault, match="vEU 2 waited") as info:
        faults.check()
    assert info.value.record["awaited_step"] == 10 ** 9
    faults.check()  # cleared: nothing to raise any more
    assert faults.read_fault(0) is None


def test_the_page_view_is_a_tvm_tensor_over_the_same_memory():
    """The DLPack view the packed function hands to Relax (on the GPU: the mapped host page)."""
    raw = (ctypes.c_int32 * (faults.PAGE_WORDS + 16))()
    address = (ctypes.addressof(raw) + 63) // 64 * 64  # TVM wants 64-byte aligned data
    words = (ctypes.c_int32 * faults.PAGE_WORDS).from_address(address)
    tensor = tvm.runtime.from_dlpack(faults._View(address, faults.PAGE_WORDS, 1, 0))  # CPU
    assert tensor.shape == (faults.PAGE_WORDS,) and str(tensor.dtype) == "int32"
    words[3] = 42
    assert tensor.numpy()[3] == 42


def test_the_packed_function_is_registered_on_import():
    import tvm_ffi

    assert tvm_ffi.get_global_func(faults.FAULT_PAGE_FUNC) is not None
    assert isinstance(faults.fault_page_call(relax.const(np.zeros(4, "int32"))), relax.Call)
