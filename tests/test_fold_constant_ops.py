"""FoldConstantOps: layout and elementwise ops on constants become constants (numpy), chains too;
everything else is left for FoldConstant. Before/Expected, and numerics of a folded model."""

import numpy as np
import pytest
import tvm
from tvm import relax

from relay_passes.fold_constant_ops import FoldConstantOps, fold


def _module(build):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def test_bias_reshape_and_weight_scaling_chains_fold_to_constants():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype("float32")
    b = rng.standard_normal(3).astype("float32")
    scale = rng.standard_normal(3).astype("float32")

    def before(bb, x):
        wt = bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))            # [3, 4]
        s = bb.emit(relax.op.reshape(relax.const(scale), (3, 1)))
        ws = bb.emit(relax.op.multiply(wt, s))                                  # chain: folded inputs
        br = bb.emit(relax.op.expand_dims(relax.const(b), [0]))                 # [1, 3]
        y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(ws, [1, 0])))
        return relax.op.add(y, br)

    def expected(bb, x):
        folded_w = np.ascontiguousarray((w.T * scale.reshape(3, 1)).T)
        y = bb.emit(relax.op.matmul(x, relax.const(folded_w)))
        return relax.op.add(y, relax.const(b.reshape(1, 3)))

    tvm.ir.assert_structural_equal(FoldConstantOps()(_module(before)), _module(expected))


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide"])
def test_binary_ops_broadcast_like_relax(op):
    a = np.arange(6, dtype="float32").reshape(2, 3) + 1
    c = np.array([2.0, 3.0, 5.0], dtype="float32")
    call = getattr(relax.op, op)(relax.const(a), relax.const(c))
    value = fold(call, relax.BlockBuilder().normalize(call).ty)
    assert value.dtype == np.float32 and value.shape == (2, 3)
    np.testing.assert_array_equal(value, getattr(np, op)(a, c))


def test_calls_with_a_variable_or_mixed_dtypes_are_left_alone():
    def build(bb, x):
        half = bb.emit(relax.op.astype(relax.const(np.ones((2, 4), "float32")), "float16"))
        mixed = bb.emit(relax.op.add(x, relax.const(np.ones((2, 4), "float32"))))  # x: a variable
        return relax.op.add(mixed, relax.op.astype(half, "float32"))

    out = FoldConstantOps()(_module(build))
    text = out.script()
    assert "R.add(x" in text                        # not folded: x is no constant
    assert "R.astype" not in text                    # astype of a constant (and of that) folded
    ops = [b.value.op.name for b in out["main"].body.blocks[0].bindings
           if isinstance(b.value, relax.Call)]
    assert ops == ["relax.add", "relax.add"]


def test_a_folded_model_computes_what_the_unfolded_one_does():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3)).astype("float32")
    b = rng.standard_normal(3).astype("float32")

    def build(bb, x):
        ws = bb.emit(relax.op.multiply(relax.op.permute_dims(relax.const(w.T.copy()), [1, 0]),
                                       relax.const(np.float32(0.5))))
        y = bb.emit(relax.op.matmul(x, ws))
        return relax.op.add(y, relax.op.reshape(relax.const(b), (1, 3)))

    mod = _module(build)
    x = rng.standard_normal((2, 4)).astype("float32")
    results = []
    for m in (mod, FoldConstantOps()(mod)):
        ex = tvm.compile(m, target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)
    np.testing.assert_allclose(results[0], x @ (w * 0.5) + b, rtol=1e-5)


@pytest.mark.parametrize("name", ["alexnet", "randwire"])
def test_the_faster_default_pipeline_builds_tvms_kernels_and_launches(name):
    """pipeline.default_passes (the launch-count fallback): TVM's default CUDA pipeline with the
    numpy pre-fold and memoised legalization: the same kernels called the same number of times."""
    import tvm_ffi

    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.launches import count_launches
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.driver.pipeline import default_passes
    from tvm_rammer.target import plain_target, rammer_target

    mod = import_onnx(get_model(name, **REDUCED[name]))
    target = plain_target(rammer_target("rammer/nvidia-h100"))
    with target:
        theirs = relax.get_default_pipeline(target)(mod)
        ours = tvm.transform.Sequential(default_passes(target))(mod)
    assert count_launches(ours) == count_launches(theirs)

    def kernels_called(m):
        called = []

        def visit(call):  # after the VM lowering a kernel call is a call of its GlobalVar
            gv = call.op if isinstance(call.op, tvm.ir.GlobalVar) else None
            if gv is not None and isinstance(m[gv], tvm.tirx.PrimFunc):
                called.append(tvm_ffi.structural_hash(m[gv].without_attr("global_symbol")))
        tvm_ffi.structural_walk(m["main"].body, (relax.Call, visit))
        return sorted(called)

    assert kernels_called(theirs) and kernels_called(ours) == kernels_called(theirs)
