"""Kernel launches per inference, counted from the lowered program."""

import tvm
from tvm import relax

from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.views.inspection import lower_default
from tvm_rammer.driver.launches import (count_cuda_graph_launches, count_launches,
                                        kernels_in_primfunc)
from tvm_rammer.models import get_model

from onnx_builders import parallel_branches


def test_default_pipeline_launches_one_kernel_per_fused_operator():
    mod = import_onnx(parallel_branches(6, join="concat", hidden=64))
    lowered = lower_default(mod, "nvidia/nvidia-h100")
    kernels = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert all(kernels_in_primfunc(f) == 1 for f in kernels)
    # 6 GEMV branches share one PrimFunc but are launched 6 times: calls count, not functions
    assert count_launches(lowered) >= 7 > len(kernels)


def test_cuda_graph_replays_count_the_kernels_they_capture():
    mod = import_onnx(get_model("branches", n=4, k=32, n_out=16))
    target = tvm.target.Target("nvidia/nvidia-h100")
    plain = count_launches(lower_default(mod, target))
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        with target:
            graph_mod = relax.get_default_pipeline(target)(mod)
    counted = count_cuda_graph_launches(graph_mod)
    assert counted["launches"] == plain
    assert counted["graph_replays"] >= 1 or counted["kernels_outside_graphs"] == plain
