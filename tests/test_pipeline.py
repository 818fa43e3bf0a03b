"""The rammer pipeline end to end on the CPU: schedules, launches, CUDA that nvcc accepts."""

import logging

import pytest
import tvm
from tvm import relax

import tvm_rammer
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.driver.launches import count_launches
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.report import rprogram_reports
from tvm_rammer.codegen.resources import cuda_source

from onnx_builders import mixed_relax_module, parallel_branches, random_dag, two_branch

TARGET = "rammer/nvidia-h100"


def persistent_kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and "rammer.report" in (f.attrs or {})}


@pytest.mark.parametrize("join", ["sum", "add_chain", "concat"])
def test_sixteen_gemv_branches_become_one_launch(join):
    summary = inspect_model(get_model("branches", n=16, join=join), TARGET)
    assert summary["rprograms"] == 1
    assert summary["launches"] == 1
    assert summary["default_launches"] >= 16
    assert summary["rtasks"][0] >= 16 * 16  # 16 GEMV operators of 16 rTasks each at least


def test_identical_operators_share_one_kernel_body():
    summary = inspect_model(get_model("branches", n=16), TARGET)
    (program,) = summary["programs"]
    assert len(program["operators"]) >= 17
    assert program["kernel_bodies"] <= 3  # the 16 GEMV+ReLU share one body, weights in the blob


def test_unrolled_lstm_is_one_rprogram_not_one_per_step():
    def inspect(steps):
        return inspect_model(get_model("lstm_tc", seq_len=steps, input_size=64, layers=2, hidden=64),
                             TARGET)

    summary, longer = inspect(4), inspect(8)
    assert summary["unplaced"] == []  # splits became slices: nothing cuts the rProgram
    assert summary["launches"] < summary["default_launches"] // 10

    def bodies(s):
        return sum(p["kernel_bodies"] for p in s["programs"])

    # the steps share their cells' kernel bodies: four more steps add only their input slices
    assert bodies(longer) - bodies(summary) == 4


def test_tvm_compile_dispatches_on_the_rammer_target():
    mod = import_onnx(two_branch())
    rammer = tvm.target.Target(TARGET)
    with rammer:
        lowered = relax.get_default_pipeline(rammer)(mod)
    assert len(persistent_kernels(lowered)) == 1
    plain = tvm.target.Target("nvidia/nvidia-h100")
    with plain:
        default = relax.get_default_pipeline(plain)(mod)
    assert not persistent_kernels(default)
    assert count_launches(default) > count_launches(lowered)


def test_relax_pipeline_name_and_tvm_compile_build():
    mod = import_onnx(parallel_branches(4, join="sum", hidden=64))
    ex = tvm.compile(mod, target=tvm.target.Target("nvidia/nvidia-h100"), relax_pipeline="rammer")
    assert ex is not None
    ex2 = tvm.compile(mod, target=TARGET)
    assert ex2 is not None


def test_schedule_report_covers_every_operator_once():
    model = random_dag(3, num_ops=16)
    lowered = lower(import_onnx(model), TARGET)
    reports = rprogram_reports(lowered)
    assert reports, "at least one rProgram"
    for report in reports:
        assert report["rtasks"] == sum(op["rtasks"] for op in report["operators"])
        assert report["num_veus"] >= 1 and report["veu_threads"] % 32 == 0


def test_unplaceable_operators_stay_ordinary_kernels(caplog):
    mod = mixed_relax_module()
    with caplog.at_level(logging.INFO, logger="tvm_rammer"):
        with tvm_rammer.rammer_target(TARGET):
            from tvm_rammer.driver.pipeline import rammer_passes
            from tvm_rammer.config import RammerConfig

            passes = rammer_passes(tvm.target.Target(TARGET), RammerConfig())
            lowered = tvm.transform.Sequential(passes)(mod)
    assert "stays an ordinary kernel" in caplog.text
    text = lowered["main"].script()
    assert "my_ext" in text  # the extern call survives between rPrograms
    from tvm_rammer.driver.report import unplaced_operators

    reasons = " ".join(op["reason"] for op in unplaced_operators(lowered))
    assert "tir_vars" in reasons and "call_dps_packed" in reasons


def test_bad_targets_and_models_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="must be CUDA or ROCm targets"):
        tvm_rammer.rammer_target("llvm")
    with pytest.raises(ValueError, match="cannot parse target"):
        tvm_rammer.rammer_target("no-such-target-xyz")
    with pytest.raises(ValueError, match="does not exist"):
        tvm_rammer.compile(str(tmp_path / "missing.onnx"))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="not a readable ONNX model|invalid ONNX model"):
        tvm_rammer.compile(str(bad))
    with pytest.raises(TypeError, match="expected an onnx.ModelProto"):
        tvm_rammer.compile(42)
    with pytest.raises(TypeError, match="config must be a RammerConfig"):
        tvm_rammer.compile(two_branch(), config={"veus_per_sm": 2})
    with pytest.raises(ValueError, match="selection='best'"):
        tvm_rammer.RammerConfig(selection="best")


MODELS = {
    "gemv": lambda: parallel_branches(4, join="sum", hidden=128),
    "matmul": lambda: two_branch(),
    "conv_pool_concat_softmax": lambda: random_dag(5, num_ops=14),
    "random_dag_7": lambda: random_dag(7, num_ops=14),
    "nasbench_cell": lambda: get_model("nasbench_cell", seed=1, channels=16, image_size=8),
    "lstm_arena": lambda: get_model("lstm_tc", seq_len=3, input_size=32, layers=2, hidden=32),
}


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(MODELS))
def test_persistent_kernels_compile_with_nvcc_for_sm90a(name):
    from tir_templates.cuda_resources import compile_cuda_resources

    lowered = lower(import_onnx(MODELS[name]()), TARGET)
    kernels = persistent_kernels(lowered)
    assert kernels
    target = tvm_rammer.rammer_target(TARGET)
    for kname, func in kernels.items():
        usage = compile_cuda_resources(cuda_source(func.with_attr("global_symbol", kname), target),
                                       "sm_90a")
        assert 0 < usage["registers"] <= 255
        assert usage["spills"] < 1024  # a few spilled bytes cost speed, not correctness
        assert usage["shared_bytes"] <= 48 * 1024


def test_main_with_control_flow_keeps_ordinary_kernels():
    from tvm.script import relax as R

    @tvm.script.ir_module
    class WithIf:
        @R.function
        def main(x: R.Tensor((4,), "float32"), c: R.Tensor((), "bool")) -> R.Tensor((4,), "float32"):
            if c:
                y = R.add(x, x)
            else:
                y = R.multiply(x, x)
            return y

    lowered = lower(WithIf, TARGET)
    from tvm_rammer.driver.report import unplaced_operators

    assert not persistent_kernels(lowered)
    assert unplaced_operators(lowered)[0]["name"] == "main"
    assert count_launches(lowered) >= 1


def test_barriers_are_bounded_and_the_launch_cooperative():
    lowered = lower(import_onnx(get_model("branches", n=4)), TARGET)
    ((name, func),) = persistent_kernels(lowered).items()
    assert "tirx.use_cooperative_launch" in list(func.attrs["tirx.kernel_launch_params"])
    source = cuda_source(func.with_attr("global_symbol", name), tvm_rammer.rammer_target(TARGET))
    # per-run step state is zeroed before any wait: a software grid barrier on the fault page, not
    # cooperative groups, whose headers cost nvcc most of a second per build
    assert "rammer_grid_sync(" in source and "atom.acq_rel.gpu.global.add" in source
    assert "cooperative_groups" not in source and "cuda/barrier" not in source
    # a stuck wait gives up after a time (globaltimer), records the fault and every vEU stops:
    # no __trap, which would poison the CUDA context
    assert "%globaltimer" in source and "timeout_ns" in source and "__trap" not in source
    assert "rammer_stopped" in source and "st.release.sys.global" in source
    assert "ld.acquire.gpu" in source and "st.release.gpu" in source
    assert "__launch_bounds__(" in source and ", " in source.split("__launch_bounds__(")[1][:12]


def test_a_lowering_with_more_launches_than_tvms_default_is_replaced_by_the_default():
    """The guard behind 'never more launches than TVM's default pipeline': given a lowering that
    launches more kernels (here: every operator unfused), the default lowering is kept, with why."""
    from tir_templates.default_schedule import default_schedule_pass
    from tvm.relax.backend.cuda import pipeline as cuda_backend

    from tvm_rammer.driver.pipeline import _fewer_launches
    from tvm_rammer.driver.report import unplaced_operators

    mod = import_onnx(random_dag(5, num_ops=14))
    plain = tvm.target.Target("nvidia/nvidia-h100")
    with plain:
        unfused = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            default_schedule_pass(), *cuda_backend.dataflow_lower_passes(plain),
            *cuda_backend.finalize_passes(plain)])(mod)
    kept = _fewer_launches(mod, unfused, tvm.target.Target(TARGET))
    assert count_launches(kept) < count_launches(unfused)
    (why,) = unplaced_operators(kept)
    assert why["name"] == "main" and "TVM's default pipeline is kept" in why["reason"]
    rammer = lower(mod, TARGET)
    assert _fewer_launches(mod, rammer, tvm.target.Target(TARGET)) is rammer


def test_the_default_is_fused_only_when_its_operators_alone_do_not_decide(monkeypatch):
    """_fewer_launches: a lowering with no more launches than the default's matmul/conv operators is
    kept without running FuseOps on the default; one with more goes on to the fused bound (the
    negative control)."""
    from tvm_rammer.driver import pipeline

    mod = import_onnx(random_dag(5, num_ops=14))
    rammer = lower(mod, TARGET)
    fused = []
    real = tvm.transform.Sequential

    def sequential(passes, *args, **kwargs):
        fused.extend(p.info.name for p in passes if p.info.name == "FuseOps")
        return real(passes, *args, **kwargs)

    counted = pipeline.count_launches
    monkeypatch.setattr(pipeline.tvm.transform, "Sequential", sequential)
    ours = iter([1])  # ours: as few launches as can be; then every count is real
    monkeypatch.setattr(pipeline, "count_launches", lambda m: next(ours, None) or counted(m))
    assert pipeline._fewer_launches(mod, rammer, tvm.target.Target(TARGET)) is rammer
    assert fused == []
    ours = iter([10 ** 6])
    kept = pipeline._fewer_launches(mod, rammer, tvm.target.Target(TARGET))
    assert fused == ["FuseOps"] and kept is not rammer  # fused, finished: TVM's is kept
    assert "TVM's default pipeline is kept" in kept.attrs[pipeline.UNPLACED_ATTR]


def test_matmuls_nobody_reads_are_not_counted_as_default_launches():
    """FuseOps and FuseTIR drop calls whose results nobody reads; FoldConstant removes them first,
    but a pass context may disable it: the bound before FuseOps must leave them out too."""
    from tvm.script import relax as R

    from tvm_rammer.driver.pipeline import default_anchors_at_least, default_stages
    from tvm_rammer.target import plain_target, rammer_target

    @tvm.script.ir_module
    class Dead:  # pylint: disable=too-few-public-methods
        @R.function
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                _ = R.matmul(x, w)
                unread = R.matmul(x, x)
                _ = R.add(unread, x)
                y = R.matmul(w, w)
                R.output(y)
            return y

    plain = plain_target(rammer_target(TARGET))
    with tvm.transform.PassContext(opt_level=3, disabled_pass=["FoldConstant"]), plain:
        before_fusion = tvm.transform.Sequential(default_stages(plain)[0])(Dead)
        default = relax.get_default_pipeline(plain)(Dead)
    assert default_anchors_at_least(before_fusion) == count_launches(default) == 1


@pytest.mark.parametrize("model", [lambda: random_dag(5, num_ops=14),
                                   lambda: get_model("randwire", **REDUCED["randwire"]),
                                   lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]),
                                   lambda: get_model("nasnet_cifar", **REDUCED["nasnet_cifar"]),
                                   lambda: get_model("deepspeech2", **REDUCED["deepspeech2"]),
                                   lambda: get_model("googlenet", **REDUCED["googlenet"])])
def test_the_default_launch_lower_bounds_never_exceed_the_default_launches(model):
    """_fewer_launches skips building TVM's default lowering when ours launches at most this bound;
    it must never be more than what the default lowering launches."""
    from tvm_rammer.driver.pipeline import (default_anchors_at_least, default_launches_at_least,
                                     default_stages)
    from tvm_rammer.target import plain_target, rammer_target

    mod = import_onnx(model())
    plain = plain_target(rammer_target(TARGET))
    to_fusion, fusion, _ = default_stages(plain)
    with plain:
        default = relax.get_default_pipeline(plain)(mod)
        before_fusion = tvm.transform.Sequential(to_fusion)(mod)
        fused = tvm.transform.Sequential(fusion)(before_fusion)
    bound = default_launches_at_least(fused)
    assert 0 < bound <= count_launches(default)
    anchors = default_anchors_at_least(before_fusion)  # the cheaper bound, before FuseOps
    assert 0 < anchors <= bound
