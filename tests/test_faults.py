"""Faults: a wait that can never complete ends the kernel with a record the host turns into an
error naming the vEU and the rTask (the run itself is a GPU test in test_gpu.py and an emulator
test in test_emulator.py). The page is memory the module owns, read through TVM's VM."""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_rammer.codegen import faults
from tvm_rammer.codegen import cuda_helpers
from tvm_rammer.config import RammerConfig
from tvm_rammer.codegen.executor import Wait, check, decode_table, manifests
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.codegen.resources import cuda_source
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


def test_every_kernel_takes_the_modules_one_fault_page_constant(injected):
    ((name, func),) = _persistent(injected).items()
    assert func.attrs["rammer.fault_page"]
    assert int(func.attrs["rammer.state_words"]) == func.attrs["rammer.num_veus"] + \
        cuda_helpers.STATE_WORDS
    text = injected["main"].script()
    assert name in text and "call_pure_packed" not in text and "tvm_rammer" not in text
    # the function returning the page returns the very constant main passes to the kernel
    page = injected[faults.PAGE_FUNC].body.body
    assert isinstance(page, tvm.ir.expr.Constant)
    assert (page.value.numpy() == faults.empty_page()).all()
    def args(expr):
        for arg in getattr(expr, "args", None) or getattr(expr, "fields", None) or []:
            yield arg
            yield from args(arg)

    passed = [arg for block in injected["main"].body.blocks for binding in block.bindings
              for arg in args(binding.value) if arg.same_as(page)]
    assert len(passed) == 1


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


def test_a_grid_barrier_timeout_says_the_veus_were_not_resident_not_fault_2():
    """Code 2 (the prologue's software grid barrier, CUDA and ROCm; it records the kernel alone)
    has its own message; a barrier-rTask's code 1 message is the control."""
    grid = faults.message(faults.describe(_words(code=cuda_helpers.FAULT_GRID_TIMEOUT, kernel=1)))
    assert "rammer_rprogram1" in grid and "grid barrier" in grid and "resident" in grid
    assert "fault 2" not in grid and "--veus-per-sm" in grid
    wait = faults.message(faults.describe(_words(code=cuda_helpers.FAULT_WAIT_TIMEOUT, kernel=1)))
    assert "grid barrier" not in wait and "timed out" in wait


def _cpu_vm(mod):
    """A VM on the CPU over ``mod``'s executable with its CUDA module taken out: the VM's
    function pool (and the page's Relax function) need nothing else."""
    ex = tvm.compile(mod, target=rammer_target("nvidia/nvidia-h100"))
    ex.mod.imports[0].clear_imports()
    return relax.VirtualMachine(ex, tvm.cpu())


def test_check_reads_the_page_through_the_vm_raises_once_and_clears_it(injected):
    vm = _cpu_vm(injected)
    faults.check(vm)  # a clean page: nothing to raise
    words = np.array(_words(code=1, kernel=0, veu=2, instruction=1, awaited_veu=0,
                            awaited_step=10 ** 9, reached_step=1), dtype="int32")
    words[-1] = faults.PAGE_MAGIC
    vm[faults.PAGE_FUNC]().copyfrom(words)  # what the kernel writes when a wait gives up
    with pytest.raises(faults.KernelFault, match="vEU 2 waited") as info:
        faults.check(vm)
    assert info.value.record["awaited_step"] == 10 ** 9
    faults.check(vm)  # cleared: nothing to raise any more
    assert faults.read_fault(vm) is None
    assert (vm[faults.PAGE_FUNC]().numpy() == faults.empty_page()).all()


def test_a_module_without_barriers_has_no_page_and_check_passes():
    mod = lower(import_onnx(get_model("branches", n=1, k=16, n_out=8)), TARGET,
                RammerConfig(profile=False))
    if any(f.attrs["rammer.fault_page"] for f in _persistent(mod).values()):
        pytest.skip("this model's rProgram has barriers")
    assert faults.PAGE_FUNC not in [gv.name_hint for gv in mod.get_global_vars()]
    vm = _cpu_vm(mod)
    assert faults.read_fault(vm) is None
    faults.check(vm)
