"""ExactPowers (tir_templates/exact_pow.py) and the emulator's fast-math powf (issue 21: the H200 run's
MeanVarianceNormalization came out all NaN).

TVM builds CUDA with ``--use_fast_math``, so ``powf(x, 2)`` runs as ``2^(2 log2 x)``: NaN for any
``x < 0``. The emulator computes the generated ``powf`` the GPU's way (negative control: TVM's own
pipeline on the same model is NaN there, as it would be on the GPU); tvm-rammer's pipeline writes
``x * x`` instead and matches onnxruntime. The small reductions of ``tests/test_gpu.py`` run here
through the emulator on the GPU test's target and config.
"""
import shutil

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, tirx

import tvm_rammer
from tir_templates.exact_pow import MAX_MULTIPLIED, ExactPowers
from tir_templates.serial_run import run_on_cpu
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import onnx_reference, random_inputs

from onnx_builders import SMALL_REDUCTIONS

needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                               reason="the emulator builds kernels with a C++ compiler")
POW = tvm.ir.Op.get("tirx.pow")
# the target of tests/test_gpu.py on the H200 / H100 (sm_90a) and its config
TARGET = {"kind": "cuda", "arch": "sm_90a"}
UNPROFILED = tvm_rammer.RammerConfig(profile=False)
TOLERANCE = 1e-4


def _module(fcompute, dtype="float32", n=8):
    """IRModule with one PrimFunc ``main(x, e) -> y``, ``y[i] = fcompute(x[i], e[i])``."""
    x = te.placeholder((n,), dtype, "x")
    e = te.placeholder((n,), dtype, "e")
    y = te.compute((n,), lambda i: fcompute(x[i], e[i]), "y")
    return tvm.IRModule({"main": te.create_prim_func([x, e, y])})


def _pow_calls(mod) -> int:
    calls = []
    tvm_ffi.structural_walk(mod["main"].body, (tvm.ir.Call, lambda c: calls.append(c.op.same_as(POW))))
    return sum(calls)


# --- the rewrite ----------------------------------------------------------------------------------

def test_a_square_becomes_a_product():
    before = _module(lambda x, _e: tirx.pow(x, tirx.const(2.0, "float32")))
    expected = _module(lambda x, _e: x * x)
    tvm.ir.assert_structural_equal(ExactPowers()(before)["main"], expected["main"])


def test_non_integer_constants_doubles_and_pow_free_modules_are_left_as_they_are():
    for mod in (_module(lambda x, _e: tirx.pow(x, tirx.const(0.75, "float32"))),  # LRN's beta
                _module(lambda x, _e: tirx.pow(x, tirx.const(2.0, "float64")), "float64"),
                _module(lambda x, e: x * e)):
        assert ExactPowers()(mod).same_as(mod)


@pytest.mark.parametrize("exponent", [2.0, 3.0, -2.0, 0.0, 1.0, float(MAX_MULTIPLIED),
                                      float(MAX_MULTIPLIED + 1), 10.0, None])
def test_the_rewrite_computes_numpys_power_on_negative_bases(exponent):
    """Built for llvm (exact pow): the rewritten form keeps pow's values, sign rule included; every
    integer exponent up to MAX_MULTIPLIED leaves no pow call at all. ``None``: the exponent is a
    tensor (integers, odd and even, zero, and non-integers, which give NaN for x < 0 as in numpy)."""
    if exponent is None:
        mod = _module(lambda x, e: tirx.pow(x, e), n=12)
        x = np.array([-1.5, -2.0, -0.5, 0.0, 0.0, 3.0, -3.0, -1.25, 2.0, -2.0, 1.5, -4.0], np.float32)
        e = np.array([2.0, 3.0, 0.0, 0.0, 2.0, -1.0, -1.0, 0.5, 0.5, 5.0, 2.5, 4.0], np.float32)
    else:
        mod = _module(lambda x, _e: tirx.pow(x, tirx.const(exponent, "float32")), n=8)
        x = np.array([-1.5, -2.0, -0.5, 0.5, 1.0, 2.0, -1.0, 0.75], np.float32)
        e = np.zeros(8, np.float32)
    rewritten = ExactPowers()(mod)
    if exponent is not None and abs(exponent) <= MAX_MULTIPLIED:
        assert _pow_calls(rewritten) == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        expect = np.power(x.astype(np.float64), e if exponent is None else exponent)
        out = run_on_cpu(rewritten["main"], [x, e, np.zeros_like(x)])[2]
    np.testing.assert_allclose(out, expect.astype(np.float32), rtol=1e-6, equal_nan=True)


# --- the emulator's fast math ---------------------------------------------------------------------

FAST_MATH = r"""
extern "C" __global__ void powers(const float* __restrict__ x, const float* __restrict__ e,
                                  float* __restrict__ y, float* __restrict__ z) {
  const int i = threadIdx.x;
  y[i] = powf(x[i], e[i]);    // under --use_fast_math: __powf
  z[i] = __powf(x[i], e[i]);
}
"""


@needs_cxx
def test_the_emulators_powf_is_the_gpus_fast_math_powf():
    """2^(y log2 x): NaN for a negative base even with an integer exponent, as nvcc's
    ``lg2.approx``/``ex2.approx`` code for ``powf`` under --use_fast_math gives on the GPU."""
    from tvm_rammer.checks.emulator.build import build_module

    module = build_module(FAST_MATH)
    x = np.array([-3.0, -1.0, 0.0, 0.0, 2.0, 4.0, 0.5, 9.0], np.float32)
    e = np.array([2.0, 3.0, 2.0, 0.0, 3.0, 0.5, -2.0, 1.0], np.float32)
    y, z = np.zeros(8, np.float32), np.zeros(8, np.float32)
    module.launch("powers", [x, e, y, z], grid=1, block=8)
    expect = np.array([np.nan, np.nan, 0.0, np.nan, 8.0, 2.0, 4.0, 9.0], np.float32)
    np.testing.assert_allclose(y, expect, rtol=1e-5, equal_nan=True)
    np.testing.assert_allclose(z, expect, rtol=1e-5, equal_nan=True)


# --- the models of tests/test_gpu.py's small-reduction test, through the emulator ---------------

def _emulated_error(name, pipeline="rammer"):
    from tvm_rammer.checks import emulator

    model = SMALL_REDUCTIONS[name]()
    target = tvm_rammer.rammer_target(TARGET)
    build = emulator.emulation_build(model, target if pipeline == "rammer" else "rammer/nvidia-h100",
                                     UNPROFILED, pipeline=pipeline)
    feeds = random_inputs(model, seed=1)
    result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input if i.name in feeds])
    (ref,) = onnx_reference(model, feeds)
    (out,) = result.outputs
    return relative_error(out, ref), out


@needs_cxx
@pytest.mark.parametrize("name", sorted(SMALL_REDUCTIONS))
def test_small_reductions_match_onnxruntime_in_the_emulator(name):
    """Before ExactPowers, mvn, mvn_axes23, pow_const3 and pow_tensor were all NaN here (and mvn on
    the H200); the reductions without pow matched already."""
    err, _ = _emulated_error(name)
    assert err <= TOLERANCE, f"{name}: relative error {err:.3g}"


@needs_cxx
def test_tvms_own_pipeline_gives_the_nan_the_gpu_gave():
    """Negative control: TVM's default pipeline keeps ``powf(x, 2)``; the emulator computes it as
    the GPU does, so MeanVarianceNormalization is all NaN (the H200's failure, reproduced)."""
    err, out = _emulated_error("mvn", pipeline="default")
    assert err == float("inf") and np.isnan(out).all()
