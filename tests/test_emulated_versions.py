"""rKernel versions validated on the CPU emulator (issue 23 item 4; ``tvm_rammer.checks.emulator.versions``,
``RammerConfig.emulate_versions``, ``tvm-rammer inspect --emulate``).

Reduced AlexNet: every version of every placeable operator is checked against TVM's default kernel on
the emulator, fp32 and fp16, none left unchecked. Negative controls: the spatial template's write-back
as it was before its fix (rebuilt here as ``test_version_sweep`` does) is reported invalid with its
error, and a compile drops it from the operator's candidates; a version that stores past the end of
its output is invalid; a pipeline version that is wrong leaves the operator TVM's default kernel.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import tirx

from conftest_tir import single_op_module
from test_spatial_template import pool, unscheduled
from test_version_sweep import write_back_under_thread_loop
from tir_templates.default_schedule import schedule_like_default
from tir_templates.templates import Template, schedule_spatial
from tvm_rammer.config import RammerConfig
from tvm_rammer.checks.emulator.versions import check_versions
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.target import plain_target, resolve_target
from tvm_rammer.tuning import versions as versions_module
from tvm_rammer.tuning.measure import KERNEL_TOLERANCE, KernelJob
from tvm_rammer.tuning.versions import func_key

TARGET = "rammer/nvidia-h100"
GEMM_OPERATORS = ("conv2d", "matmul")


def _job(label, func, reference, num_outputs=1):
    return KernelJob(key=func_key(func), label=label, func=func, reference=reference,
                     reference_key=func_key(reference), num_outputs=num_outputs,
                     operator=label.split(":")[0])


def _pool_jobs(shape=(1, 12, 14, 14)):
    func = unscheduled(pool, shape)
    reference = schedule_like_default(func, plain_target(resolve_target(TARGET)))
    return func, reference


def test_the_pre_fix_spatial_write_back_is_invalid_and_the_fixed_one_valid():
    func, reference = _pool_jobs()
    broken = write_back_under_thread_loop(func, 128, 4)
    fixed = schedule_spatial(func, 128, 4)
    stats = {}
    records = check_versions([_job("pool:broken", broken, reference),
                              _job("pool:fixed", fixed, reference)],
                             resolve_target(TARGET), stats=stats)
    bad, good = records
    assert bad["valid"] is False
    assert bad["max_rel_err"] is None or bad["max_rel_err"] > 100 * KERNEL_TOLERANCE
    assert "differs from TVM's default kernel on the emulator" in bad["reason"] \
        or "past the end" in bad["reason"]
    assert good == {"valid": True, "max_rel_err": good["max_rel_err"], "reason": None}
    assert good["max_rel_err"] <= KERNEL_TOLERANCE
    # both versions and their shared reference: one module, one g++ build
    assert stats["kernels"] == 3 and stats["gxx_builds"] == 1


def test_no_cpp_compiler_is_one_clear_error(monkeypatch):
    from tvm_rammer.checks.emulator import build

    func, reference = _pool_jobs()
    monkeypatch.setattr(build.shutil, "which", lambda _name: None)
    with pytest.raises(ValueError, match="emulate_versions.*no C\\+\\+ compiler found"):
        check_versions([_job("pool:x", func, reference)], resolve_target(TARGET))


def _store_one_further(func):
    """``func`` with every store of its output one element further along the last axis: the
    last output's store lands past the end of the buffer."""
    import tvm_ffi

    out = str(func.params[-1].name)

    def rewrite(node):
        if isinstance(node, tirx.BufferStore) and str(node.buffer.name) == out:
            return tirx.BufferStore(node.buffer, node.value,
                                    [*node.indices[:-1], node.indices[-1] + 1])
        return node

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.BufferStore, rewrite)]))


def test_a_version_that_stores_past_the_end_of_its_output_is_invalid():
    func, reference = _pool_jobs((1, 12, 16, 16))
    shifted = _store_one_further(schedule_spatial(func, 128, 1))
    (record,) = check_versions([_job("pool:shifted", shifted, reference)], resolve_target(TARGET))
    assert record == {"valid": False, "max_rel_err": None,
                      "reason": record["reason"]}
    assert "wrote past the end of parameter" in record["reason"], record


def test_a_version_that_never_writes_its_output_is_invalid():
    """Outputs are pre-filled with NaN for the version (tuning.measure's convention): a schedule
    whose grid covers only half the output leaves NaN and is invalid."""
    func, reference = _pool_jobs((1, 12, 16, 16))
    sch = tvm.s_tir.Schedule(func)
    block = sch.get_sblock("pool_max")
    fused = sch.fuse(*sch.get_loops(block)[:4])
    bx, tx = sch.split(fused, factors=[None, 64])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    half = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    (record,) = check_versions([_job("pool:whole", half, reference)], resolve_target(TARGET))
    assert record["valid"] is True  # the control: the full schedule is right
    skipping = _skip_odd_blocks(half)
    (record,) = check_versions([_job("pool:half", skipping, reference)], resolve_target(TARGET))
    assert record["valid"] is False and "relative error inf" in record["reason"]


def _skip_odd_blocks(func):
    """``func`` with its body run only in even thread blocks (the odd blocks' outputs unwritten)."""
    import tvm_ffi

    def rewrite(node):
        binding = node.thread_binding
        if binding is not None and binding.thread_tag == "blockIdx.x":
            even = tirx.EQ(tirx.floormod(node.loop_var, node.min + 2), node.min)  # min is 0
            return tirx.For(node.loop_var, node.min, node.extent, node.kind,
                            tirx.IfThenElse(even, node.body, None), binding, node.annotations)
        return node

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, rewrite)]))


def _operators(summary):
    return [op for program in summary["programs"] for op in program["operators"]]


def _alexnet(precision):
    model = get_model("alexnet", **REDUCED["alexnet"])
    config = RammerConfig(emulate_versions=True, profile=False, precision=precision,
                          check_unmeasured=False)  # keep the rProgram whose versions are checked
    return inspect_model(model, TARGET, config)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_every_version_of_reduced_alexnet_is_checked_on_the_emulator(precision):
    summary = _alexnet(precision)
    ops = _operators(summary)
    gemms = [op for op in ops if any(k in op["name"] for k in GEMM_OPERATORS)]
    assert len(gemms) >= 8, [op["name"] for op in ops]  # 5 convolutions, 3 matmuls
    assert not summary["unplaced"] or all("emulator" not in u["reason"] for u in summary["unplaced"])
    for op in ops:
        checked = op["versions_checked"]
        names = [c["version"] for c in checked]
        assert "dlight" in names and len(names) == len(set(names)), op
        # every version checked, none left unchecked, all valid (after the spatial fix)
        assert all(c["valid"] is True for c in checked), (op["name"], checked)
        assert all(0.0 <= c["max_rel_err"] <= (KERNEL_TOLERANCE if precision == "float32" else 1e-2)
                   for c in checked), checked
        assert op["dropped"] == []
    for op in gemms:  # the templates were made and checked too, not only dlight's versions
        assert any(c["source"] == "template" for c in op["versions_checked"]), op
    if precision == "float16":  # the tensor-core versions of the convolutions
        assert any(c["version"].startswith("mma_") for op in gemms for c in op["versions_checked"])


def _with_broken_spatial(monkeypatch, threads=128, per=4):
    """kernel_versions' templates with the pre-fix spatial write-back in place of the fixed
    ``spatial_t{threads}x{per}`` (the same grid and block, so it is not deduplicated away)."""
    original = versions_module.template_schedules

    def templates(func, target=None):
        found = [t for t in original(func, target) if t.name != f"spatial_t{threads}x{per}"]
        try:
            broken = write_back_under_thread_loop(func, threads, per)
        except Exception:  # pylint: disable=broad-except  (not a pooling operator)
            return found
        return [Template(f"broken_spatial_t{threads}x{per}", broken)] + found

    monkeypatch.setattr(versions_module, "template_schedules", templates)


def test_a_compile_drops_a_version_that_is_wrong_on_the_emulator(monkeypatch):
    _with_broken_spatial(monkeypatch)
    mod = single_op_module(pool, (1, 12, 14, 14))
    # one small pool alone is no rProgram the unmeasured check would build: keep it one
    summary = inspect_model(mod, TARGET, RammerConfig(emulate_versions=True, profile=False,
                                                      check_unmeasured=False))
    (op,) = _operators(summary)
    checked = {c["version"]: c for c in op["versions_checked"]}
    bad = checked["broken_spatial_t128x4"]
    assert bad["valid"] is False and bad["reason"]
    assert all(c["valid"] is True for name, c in checked.items() if name != "broken_spatial_t128x4")
    assert [d["version"] for d in op["dropped"]] == ["broken_spatial_t128x4"]
    assert op["dropped"][0]["reason"].startswith("emulator: ")
    # without emulate_versions nothing is checked (the default path costs nothing)
    plain = inspect_model(mod, TARGET, RammerConfig(profile=False, check_unmeasured=False))
    assert all("versions_checked" not in o for o in _operators(plain))


def test_a_wrong_pipeline_version_leaves_the_operator_tvms_default_kernel(monkeypatch):
    from tvm_rammer.driver import backend

    original = backend.kernel_versions

    def broken_dlight(name, target, *, scheduled=None, **kw):
        found = original(name, target, scheduled=scheduled, **kw)
        from tvm_rammer.tuning.versions import KernelVersion
        from tir_templates.prelower import prelower

        out = []
        for v in found:
            if v.name == "dlight":
                func = write_back_under_thread_loop(kw["unscheduled"], 128, 4)
                v = KernelVersion("dlight", v.source, func, prelower(func, target, name=name))
            out.append(v)
        return out

    monkeypatch.setattr(backend, "kernel_versions", broken_dlight)
    summary = inspect_model(single_op_module(pool, (1, 12, 14, 14)), TARGET,
                            RammerConfig(emulate_versions=True, profile=False,
                                         check_unmeasured=False))  # only the emulator decides
    assert summary["rprograms"] == 0
    (left,) = summary["unplaced"]
    assert "not valid on the emulator" in left["reason"] and "TVM's default kernel" in left["reason"]


@pytest.mark.slow
def test_cli_inspect_emulate_json_lists_versions_checked(tmp_path):
    model = tmp_path / "two_branch.onnx"
    from tvm_rammer.models import get_model as build
    import onnx

    onnx.save(build("two_branch", **REDUCED["two_branch"]), str(model))
    proc = subprocess.run([sys.executable, "-m", "tvm_rammer.cli", "inspect", str(model),
                           "--emulate", "--json"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    ops = _operators(summary)
    assert ops and all(op["versions_checked"] for op in ops)
    assert all(c["valid"] is True and isinstance(c["max_rel_err"], float)
               for op in ops for c in op["versions_checked"])
    assert np.isfinite([c["max_rel_err"] for op in ops for c in op["versions_checked"]]).all()


def test_a_function_the_emulator_cannot_build_costs_its_own_record_only(monkeypatch):
    """A joint build whose error names one function is tried again without it (one more build,
    not one per function); that version is 'not checkable' (valid None, the error), never valid."""
    from tvm_rammer.checks.emulator import versions as emulated

    func, reference = _pool_jobs((1, 12, 16, 16))
    real = emulated._build
    sizes = []

    def failing(funcs, target, opt):
        sizes.append(len(funcs))
        if "rammer_emu_v1" in funcs:
            raise ValueError("the emulator cannot read the host function rammer_emu_v1: "
                             "unsupported host statement AllocBuffer")
        return real(funcs, target, opt)

    monkeypatch.setattr(emulated, "_build", failing)
    stats = {}
    good, bad = check_versions([_job("pool:a", schedule_spatial(func, 128, 1), reference),
                                _job("pool:b", schedule_spatial(func, 64, 1), reference)],
                               resolve_target(TARGET), stats=stats)
    assert sizes == [3, 2] and stats["gxx_builds"] == 2
    assert good["valid"] is True
    assert bad["valid"] is None and "AllocBuffer" in bad["reason"]
