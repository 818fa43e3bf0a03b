"""Static shapes at import: --input-shape / --batch / shapes= bind symbolic dims; a model left
symbolic warns, names its inputs and the flags, and gets TVM's default pipeline (never worse)."""

import logging

import numpy as np
import onnx
import pytest
from tvm import relax

import tvm_rammer
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import get_model
from tvm_rammer.onnx_prep.shapes import (bind_shapes, parse_shape, parse_shape_flag, unbound_inputs,
                                unbound_params)

from onnx_builders import dynamic_batch, run_onnxruntime, run_tvm_cpu

CONFIG = RammerConfig(profile=False)
TARGET = "rammer/nvidia-h100"


def _symbolic(model, name="N"):
    """``model`` with its inputs' and outputs' leading dim made the symbolic ``name``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in [*out.graph.input, *out.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = name
    return out


def _dims(value):
    return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]


def test_parse_shape_forms_and_errors():
    assert parse_shape("1x3x224x224") == (1, 3, 224, 224)
    assert parse_shape("2,8") == (2, 8)
    assert parse_shape_flag("input.1=1x3x8x8") == ("input.1", (1, 3, 8, 8))
    for bad in ("", "1x0", "ax3", "1x-2"):
        with pytest.raises(ValueError, match="positive integers"):
            parse_shape(bad)
    with pytest.raises(ValueError, match="NAME=DIMS"):
        parse_shape_flag("1x3x8x8")


def test_batch_binds_every_symbolic_leading_dim_and_its_other_uses():
    model = bind_shapes(dynamic_batch(hidden=8), batch=3)
    assert _dims(model.graph.input[0]) == [3, 8]
    assert _dims(model.graph.output[0]) == [3, 8]  # the same named dim "N"
    assert unbound_inputs(model) == {}
    assert unbound_inputs(dynamic_batch(hidden=8)) == {"x": ["N", 8]}


def test_input_shape_binds_by_name_and_checks_against_the_model():
    model = dynamic_batch(hidden=8)
    assert _dims(bind_shapes(model, {"x": (2, 8)}).graph.input[0]) == [2, 8]
    with pytest.raises(ValueError, match=r"no input 'y'; its inputs are 'x'"):
        bind_shapes(model, {"y": (1, 8)})
    with pytest.raises(ValueError, match="rank 2"):
        bind_shapes(model, {"x": (1, 8, 1)})
    with pytest.raises(ValueError, match="static size 8 on axis 1"):
        bind_shapes(model, {"x": (1, 9)})
    with pytest.raises(ValueError, match="batch size must be an integer >= 1"):
        bind_shapes(model, batch=0)
    with pytest.raises(ValueError, match="integer >= 1"):
        bind_shapes(model, {"x": (0, 8)})


def test_one_named_dim_cannot_get_two_sizes():
    model = dynamic_batch(hidden=8)
    second = onnx.helper.make_tensor_value_info("x2", onnx.TensorProto.FLOAT, ["N", 8])
    model.graph.input.append(second)
    with pytest.raises(ValueError, match="'N' is bound to both 1 and 2"):
        bind_shapes(model, {"x": (1, 8), "x2": (2, 8)})


def test_bound_model_computes_what_onnxruntime_computes():
    model = dynamic_batch(hidden=16)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    got = run_tvm_cpu(import_onnx(model, shapes={"x": (4, 16)}), {"x": x})[0]
    np.testing.assert_allclose(got, run_onnxruntime(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_symbolic_batch_with_batch_1_gets_the_static_twins_rprograms():
    static = get_model("branches", n=4, k=32, n_out=32)

    def brief(summary):
        return (summary["rprograms"], summary["rtasks"], summary["launches"],
                [[op["name"] for op in p["operators"]] for p in summary["programs"]])

    twin = inspect_model(static, TARGET, CONFIG)
    assert twin["rprograms"] == 1
    assert brief(inspect_model(_symbolic(static), TARGET, CONFIG, batch=1)) == brief(twin)
    assert brief(inspect_model(_symbolic(static), TARGET, CONFIG,
                               shapes={"input": (1, 32)})) == brief(twin)


def test_unbound_symbolic_input_warns_and_gets_the_default_pipeline(caplog):
    model = _symbolic(get_model("branches", n=4, k=32, n_out=32))
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        summary = inspect_model(model, TARGET, CONFIG)
    assert summary["rprograms"] == 0
    assert summary["launches"] == summary["default_launches"]
    text = caplog.text
    assert "'input' is Nx32" in text and "--batch 1" in text
    assert "--input-shape input=1x32" in text and "shapes={'input': (1, 32)}" in text


def test_compile_binds_shapes_and_refuses_them_for_a_relax_module():
    model = _symbolic(get_model("branches", n=2, k=16, n_out=16))
    mod = import_onnx(model, batch=1)
    assert "rammer.unbound_inputs" not in (mod.attrs or {})
    assert "rammer.unbound_inputs" in (import_onnx(model).attrs or {})
    with pytest.raises(ValueError, match="already fixed"):
        tvm_rammer.compile(mod, batch=1)
    with pytest.raises(ValueError, match="no input 'nope'"):
        tvm_rammer.compile(model, shapes={"nope": (1, 16)})


def test_shapes_bound_after_import_are_seen_as_static():
    mod = import_onnx(_symbolic(get_model("branches", n=2, k=16, n_out=16)))
    assert unbound_params(mod) == {"input": ["N", 16]}  # the ONNX name, recorded at import
    bound = relax.transform.BindSymbolicVars({"N": 1})(mod)
    assert unbound_params(bound) == {}


def test_batch_that_contradicts_a_static_batch_is_refused():
    static = get_model("branches", n=2, k=16, n_out=16)
    assert bind_shapes(static, batch=1).graph.input[0] == static.graph.input[0]  # agrees: no-op
    with pytest.raises(ValueError, match="no symbolic leading dim to bind"):
        bind_shapes(static, batch=8)
