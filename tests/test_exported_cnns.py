"""Exported CNNs (BatchNormalization, Dropout, Pad, Clip, LRN, Gemm transB, wide Concat, opsets 7-21):
they import, the inference passes keep their numerics (llvm vs onnxruntime), BatchNorm no longer
splits rPrograms, and each compiles to no more launches than TVM's default pipeline.

The onnx.helper mirrors always run; the torch.onnx exports of the same networks run where torch is
installed (it is not a CI dependency)."""

import functools

import numpy as np
import pytest
import tvm

from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.driver.pipeline import inference_passes

from exported_cnns import OPSETS, REDUCED_CNN, export, mirror, torch_model
from onnx_builders import run_onnxruntime, run_tvm_cpu

NAMES = sorted(REDUCED_CNN)
# one opset per network for the (slower) numerics and schedule checks, so that together they cover
# the old forms (attributes, initializers as inputs, BatchNormalization-7) and the new ones
NUMERICS_OPSET = {"resnet50": 17, "densenet121": 7, "inception_v2": 21, "shufflenet_v2": 11}
SCHEDULE_OPSET = {"resnet50": 7, "densenet121": 11, "inception_v2": 13, "shufflenet_v2": 21}
CONFIG = RammerConfig(profile=False)
TARGET = "rammer/nvidia-h100"


def _feeds(batch=1, size=32, seed=0):
    return {"input": np.random.default_rng(seed).standard_normal(
        (batch, 3, size, size)).astype("float32")}


def _inference(model, **bind):
    return tvm.transform.Sequential(inference_passes())(import_onnx(model, **bind))


def _assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_every_opset_imports_and_loses_batch_norm_and_dropout(name):
    for opset in OPSETS:
        text = _inference(mirror(name, opset), batch=1)["main"].script()
        assert "batch_norm" not in text and "dropout" not in text, (name, opset)


@pytest.mark.parametrize("name", NAMES)
def test_inference_passes_match_onnxruntime(name):
    model = mirror(name, NUMERICS_OPSET[name])
    feeds = _feeds()
    _assert_close(run_tvm_cpu(_inference(model, batch=1), feeds)[0],
                  run_onnxruntime(model, feeds)[0])


def test_initializers_listed_as_inputs_are_weights_not_inputs():
    for model in (mirror("resnet50", 13, initializers_as_inputs=True), mirror("densenet121", 7)):
        assert len(model.graph.input) > 1  # (opset 7 = IR 3, where initializers must be inputs)
        assert len(_inference(model, batch=1)["main"].params) == 1


@functools.lru_cache(maxsize=None)
def _schedule(name, opset, batch):
    """inspect's summary of a mirror whose batch is ``batch`` (an int: static; "N": symbolic,
    bound to 1 at import)."""
    bind = {"batch": 1} if batch == "N" else {}
    return inspect_model(mirror(name, opset, batch=batch), TARGET, CONFIG, **bind)


@pytest.fixture(params=NAMES)
def schedule(request):
    name = request.param
    return name, _schedule(name, SCHEDULE_OPSET[name], "N")


def test_no_more_launches_than_tvm_default(schedule):
    name, summary = schedule
    assert summary["rprograms"] >= 1, name
    assert summary["launches"] <= summary["default_launches"], name


def test_batch_norm_and_dropout_do_not_split_rprograms(schedule):
    name, summary = schedule
    for op in summary["unplaced"]:
        assert "batch_norm" not in op["kernel"] and "dropout" not in op["kernel"], (name, op)
    operators = [op["name"] for program in summary["programs"] for op in program["operators"]]
    assert not [o for o in operators if "batch_norm" in o or "dropout" in o]
    # whatever stays an ordinary kernel says why
    assert all(op["reason"] for op in summary["unplaced"])


def test_symbolic_batch_bound_to_one_schedules_like_the_static_twin():
    def brief(summary):
        return (summary["rprograms"], summary["rtasks"], summary["launches"],
                [[op["name"] for op in p["operators"]] for p in summary["programs"]])

    bound = _schedule("resnet50", SCHEDULE_OPSET["resnet50"], "N")
    static = _schedule("resnet50", SCHEDULE_OPSET["resnet50"], 1)
    assert brief(bound) == brief(static)
    assert bound["rprograms"] >= 1


# --- torch.onnx exports (skipped without torch) ---------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_torch_exports_match_torch_and_schedule_no_worse_than_default(name):
    torch = pytest.importorskip("torch")
    net, shape = torch_model(name)
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    for opset in (7, 13, 21):
        model = export(net, shape, opset)
        assert "BatchNormalization" in {n.op_type for n in model.graph.node}
        _assert_close(run_onnxruntime(model, {"input": x})[0], want)
        _assert_close(run_tvm_cpu(_inference(model, batch=1), {"input": x})[0], want)
    summary = inspect_model(export(net, shape, 13), TARGET, CONFIG, batch=1)
    assert summary["launches"] <= summary["default_launches"]
    assert not [op for op in summary["unplaced"] if "batch_norm" in op["kernel"]]
