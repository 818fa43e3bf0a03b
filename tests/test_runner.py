"""The GPU runner's CPU-testable parts: error metric, inputs, launch-error translation."""

import numpy as np
import pytest

from tvm_rammer.models import get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import _launch, random_inputs


def test_relative_error_never_passes_nan_or_wrong_shapes():
    ref = np.ones((4,), "float32")
    assert relative_error(ref * (1 + 1e-6), ref) < 1e-5
    assert relative_error(np.full((4,), np.nan, "float32"), ref) == float("inf")
    assert relative_error(np.ones((2, 2), "float32"), ref) == float("inf")


def test_random_inputs_are_seeded_and_shaped():
    model = get_model("two_branch")
    a, b = random_inputs(model, seed=3), random_inputs(model, seed=3)
    (name,) = a
    assert a[name].shape == (64, 128) and np.array_equal(a[name], b[name])
    assert not np.array_equal(a[name], random_inputs(model, seed=4)[name])


class _FailingVM:
    def __init__(self, text):
        self.text = text

    def __getitem__(self, _name):
        def call(*_args):
            raise RuntimeError(self.text)
        return call


def test_a_grid_that_cannot_be_resident_is_a_clear_error():
    vm = _FailingVM("CUDALaunch Error: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE\n grid=(9999,1,1)")
    with pytest.raises(ValueError, match="cooperative launch too large.*veus_per_sm"):
        _launch(vm, [])
    with pytest.raises(RuntimeError, match="something else"):
        _launch(_FailingVM("something else"), [])
