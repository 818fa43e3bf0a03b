"""``inspect``'s whole-inference prediction (``predicted_us``) and ``bench``'s floor (``floor_us``).

``predicted_us`` is every rProgram's prediction plus every ordinary kernel's launch and analytical
time (``views.prediction``); ``floor_us`` is ``benchmarks.floor``'s, handed in by the CLI. Small
models, nothing measured (``profile=False``): a 2-convolution graph whose rProgram the unmeasured
check drops (the negative control: its operators are then priced as ordinary kernels) and the zoo's
reduced ``two_branch`` through the CLI.
"""
import json

import numpy as np
import pytest
from tvm import relax

from tvm_rammer.cli import _bench_floor, main
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.report import format_schedule
from tvm_rammer.models import REDUCED, get_model, save_model
from tvm_rammer.scheduling import rkernels
from tvm_rammer.target import resolve_target
from tvm_rammer.views.inspection import inspect_model

TARGET = "rammer/nvidia-h100"


def two_convs():
    """conv 11x11/4 (AlexNet's first, 12 channels) + ReLU, then conv 3x3 + ReLU: an rProgram the
    unmeasured check estimates slower than TVM's default kernels (it falls back)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 3, 67, 67], "float32"))
    rng = np.random.default_rng(0)
    with bb.function("main", [x]):
        with bb.dataflow():
            w1 = relax.const(rng.standard_normal((12, 3, 11, 11)).astype("float32"))
            w2 = relax.const(rng.standard_normal((12, 12, 3, 3)).astype("float32"))
            h = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, w1, strides=4, padding=2))))
            h = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(h, w2, padding=1))))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def kept_and_dropped():
    """The two-convolution graph inspected with the rProgram kept (check off) and dropped."""
    mod = two_convs()
    kept = inspect_model(mod, TARGET, RammerConfig(profile=False, check_unmeasured=False),
                         floor_of=_bench_floor)
    dropped = inspect_model(mod, TARGET, RammerConfig(profile=False), floor_of=_bench_floor)
    return kept, dropped


def test_prediction_is_the_rprograms_plus_the_ordinary_kernels(kept_and_dropped):
    kept, dropped = kept_and_dropped
    for summary in (kept, dropped):
        parts = summary["prediction"]
        assert isinstance(summary["predicted_us"], float) and summary["predicted_us"] > 0
        assert summary["predicted_us"] == pytest.approx(parts["rprograms_us"] + parts["ordinary_us"])
        assert parts["unpriced"] == []
        assert parts["ordinary_us"] == pytest.approx(
            sum(k["calls"] * k["us_per_call"] for k in parts["ordinary_kernels"]))
    # kept: one rProgram, its report's prediction, nothing outside it
    assert kept["rprograms"] == 1 and kept["launches"] == 1
    assert kept["prediction"]["rprograms_us"] == pytest.approx(kept["programs"][0]["predicted_us"])
    assert kept["prediction"]["ordinary_kernels"] == []


def test_a_dropped_rprogram_is_priced_as_its_ordinary_kernels(kept_and_dropped):
    """Negative control: the unmeasured check drops the rProgram; predicted_us is then its two
    operators as ordinary kernels, each one launch (launch_us) plus its analytical time, and not
    the dropped rProgram's prediction."""
    kept, dropped = kept_and_dropped
    assert dropped["rprograms"] == 0 and len(dropped["fallbacks"]) == 1
    assert dropped["prediction"]["rprograms_us"] == 0.0
    kernels = dropped["prediction"]["ordinary_kernels"]
    assert sum(k["calls"] for k in kernels) == dropped["launches"] == 2
    launch = rkernels.cost_config(RammerConfig(), rkernels.vdevice_for(
        resolve_target(TARGET), RammerConfig())).launch_us
    assert all(k["us_per_call"] > launch for k in kernels)  # a launch and some time each
    assert dropped["predicted_us"] != pytest.approx(kept["predicted_us"])
    assert dropped["predicted_us"] == pytest.approx(dropped["prediction"]["ordinary_us"])


def test_floor_is_benchs_floor_and_below_the_prediction(kept_and_dropped):
    """floor_us is benchmarks.floor's (the largest of its three bounds, the target's nominal
    peaks); the cost model's peaks are below the nominal ones and every kernel pays a launch, so
    nothing here may be predicted below it."""
    from tvm_rammer.benchmarks import floor

    kept, dropped = kept_and_dropped
    expected = floor.floor(floor.op_costs(two_convs()), floor.nominal_peaks(resolve_target(TARGET)))
    for summary in (kept, dropped):
        assert summary["floor_us"] == pytest.approx(expected["floor_us"])
        bounds = summary["floor"]
        assert summary["floor_us"] == pytest.approx(max(
            bounds["compute_us"], bounds["memory_us"], bounds["critical_path_us"]))
        assert 0 < summary["floor_us"] <= summary["predicted_us"]


def test_a_floor_that_fails_is_said_and_inspect_goes_on():
    def broken(mod, target):
        raise RuntimeError("no floor here")

    summary = inspect_model(get_model("two_branch", **REDUCED["two_branch"]), TARGET,
                            RammerConfig(profile=False), floor_of=broken)
    assert summary["floor_us"] is None and "no floor here" in summary["floor"]["error"]
    assert summary["predicted_us"] > 0
    assert "floor: not computed (RuntimeError: no floor here)" in format_schedule(summary)


def test_cli_inspect_prints_both_in_json_and_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "two_branch.onnx")
    save_model(get_model("two_branch", **REDUCED["two_branch"]), path)
    assert main(["inspect", path, "--no-profile", "--json", "--brief"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert isinstance(summary["predicted_us"], float) and isinstance(summary["floor_us"], float)
    assert 0 < summary["floor_us"] <= summary["predicted_us"]
    assert summary["floor"]["peaks"].startswith("nominal")
    assert main(["inspect", path, "--no-profile"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("predicted inference:")]
    assert len(lines) == 1
    assert f"{summary['predicted_us']:.1f} us" in lines[0]
    assert f"floor {summary['floor_us']:.1f} us" in lines[0]


def test_an_rprogram_is_found_by_its_function_name_not_its_reports():
    """The module may name an rProgram's function otherwise than its report's ``kernel`` (GPT-2
    small's rammer_rprogram11 is the module's rammer_rprogram111): it is still an rProgram at its
    report's prediction, not priced as an ordinary kernel."""
    from tvm_rammer.driver.report import REPORT_ATTR
    from tvm_rammer.views.inspection import inspect_lowered
    from tvm_rammer.views.prediction import predict_inference

    config = RammerConfig(profile=False)
    summary, lowered = inspect_lowered(get_model("two_branch", **REDUCED["two_branch"]), TARGET,
                                       config)
    (report,) = summary["programs"]
    gv = lowered.get_global_var(report["kernel"])
    renamed = dict(report, kernel="rammer_rprogram_elsewhere")
    lowered[gv] = lowered[gv].with_attr(REPORT_ATTR, json.dumps(renamed))
    found = predict_inference(lowered, TARGET, config)
    assert found["rprograms_us"] == pytest.approx(report["predicted_us"])
    assert found["ordinary_kernels"] == [] and found["predicted_us"] == summary["predicted_us"]


def test_an_external_call_is_unpriced_under_its_own_name():
    """A library call (call_dps_packed of an ExternFunc) cannot be priced: listed in ``unpriced``
    by its symbol and counted as one launch."""
    from tvm_rammer.views.prediction import predict_inference

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_dps_packed(
                "my_library.op", [x], relax.TensorType([4], "float32")))
        bb.emit_func_output(out)
    config = RammerConfig(profile=False)
    found = predict_inference(bb.get(), TARGET, config)
    launch = rkernels.cost_config(config, rkernels.vdevice_for(
        resolve_target(TARGET), config)).launch_us
    assert found["unpriced"] == ["my_library.op"]
    assert found["ordinary_kernels"] == [{"kernel": "my_library.op", "calls": 1,
                                          "us_per_call": launch}]
    assert found["predicted_us"] == pytest.approx(launch)
