"""GEMVEpilogueFusion and its rKernel: an LSTM step is one operator, and results do not change.

The graph rewrite is checked as a Before/Expected pair on a two-step cell and numerically (the
rewritten Relax module built for llvm against onnxruntime on the reduced RNN zoo models and random
LSTM stacks). The fused cell's schedule is checked on CPU by running its scheduled TIR with every
thread loop made serial (what each block computes, not how the GPU's threads share it) against the
unscheduled function, and by the rTask shape it lowers to.
"""
import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import from_onnx

from relay_passes.batch_shared_matmuls import BatchSharedWeightMatMuls
from relay_passes.dataflow_graph import CALL_TIR
from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.gemv_epilogue import (EPILOGUE_ATTR, GEMVEpilogueFusion, interleave_columns,
                                        is_plain_matmul)
from relay_passes.split_matmul_concat import SplitMatMulOverConcat
from relay_passes.split_tail_fusion import SplitTailFusion
from relay_passes.split_to_slices import SplitToSlices
from tir_templates.default_schedule import scheduled_by
from tir_templates.gemv_epilogue import GEMVEpilogue, cell_tiling
from tir_templates.prelower import prelower
from tvm_rammer.models import REDUCED, get_model

from conftest_tir import serial_threads
from onnx_builders import random_inputs, run_onnxruntime, run_tvm_cpu

H, K, X = 8, 8, 8  # the smallest cell that tiles: 4 units x 8 reduction threads x 4 gates
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a", "max_num_threads": 256})


def tensor(*shape):
    return relax.TensorType(list(shape), "float32")


W_H = np.arange(K * 4 * H, dtype="float32").reshape(K, 4 * H) / 10
W_X = np.ones((X, 4 * H), dtype="float32")


def two_steps(w_h=None, delay=0):
    """Two steps of a cell: mx = x_t @ W_x, gates = mx + h @ W_h, c' = f * c, h' = o + c'
    (f, o two of the four slices); legalized and grouped as the pipeline does. ``w_h``: the
    recurrent weight of each step (one shared constant by default); ``delay``: step 2 reads
    ``x1 @ A`` ``delay`` times over instead of x1 (an input produced later)."""
    w_h = w_h or [relax.const(W_H)] * 2
    wx = relax.const(W_X)
    a = relax.const(np.eye(X, dtype="float32") * 0.5)
    bb = relax.BlockBuilder()
    h0, c0 = relax.Var("h0", tensor(1, K)), relax.Var("c0", tensor(1, H))
    x0, x1 = relax.Var("x0", tensor(1, X)), relax.Var("x1", tensor(1, X))
    op = relax.op
    with bb.function("main", [h0, c0, x0, x1]):
        with bb.dataflow():
            late = x1
            for _ in range(delay):
                late = bb.emit(op.matmul(late, a))
            h, c = h0, c0
            for x, w in zip((x0, late), w_h):
                mx = bb.emit(op.matmul(x, wx))
                gates = bb.emit(op.add(mx, bb.emit(op.matmul(h, w))))
                f = bb.emit(op.strided_slice(gates, [1], [0], [H]))
                o = bb.emit(op.strided_slice(gates, [1], [3 * H], [4 * H]))
                c = bb.emit(op.multiply(f, c))
                h = bb.emit(op.add(o, c))
            out = bb.emit_output(relax.Tuple([h, c]))
        bb.emit_func_output(out)
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), SplitTailFusion(),
           BranchPreservingFusion()]
    return tvm.transform.Sequential(seq)(bb.get())


def deinterleave(hidden=H):
    """out[0, p*H + j] = x[0, j*4 + p]: the gates back in W_h's column order."""
    shape = (tirx.IntImm("int64", 1), tirx.IntImm("int64", 4 * hidden))
    x = te.placeholder(shape, "float32", name="x")
    out = te.compute(shape, lambda i, c: x[i, (c % hidden) * 4 + c // hidden],
                     name="T_deinterleave")
    return te.create_prim_func([x, out]).without_attr("global_symbol").with_attr("op_pattern", 2)


def two_steps_expected(before):
    """Each step: one call of the fused cell (recurrent GEMV on the interleaved W_h, the
    de-interleave, the tail's two groups with their common add and slice once) and its two
    outputs taken from the tuple; the input halves stay as they were."""
    gv = before.get_global_var
    kept = {g: f for g, f in before.functions_items()
            if g.name_hint not in ("main",) and not g.name_hint.startswith("fused_")}
    bb = relax.BlockBuilder(tvm.IRModule(kept))
    deint = bb.add_func(deinterleave(), "deinterleave")
    h, weight = relax.Var("h", tensor(1, K)), relax.Var("weight", tensor(K, 4 * H))
    mx, c = relax.Var("param_1", tensor(1, 4 * H)), relax.Var("param_2", tensor(1, H))

    def call(name, args, out):
        callee = name if isinstance(name, tvm.ir.GlobalVar) else gv(name)
        return bb.emit(relax.call_tir(callee, relax.Tuple(args), out_ty=out))

    with bb.function("fused_gemv_epilogue_matmul", [h, weight, mx, c], private=True,
                     attrs={"Primitive": True, EPILOGUE_ATTR: 4}):
        with bb.dataflow():
            gates = call(deint, [call("matmul", [h, weight], tensor(1, 4 * H))], tensor(1, 4 * H))
            pre = call("add", [mx, gates], tensor(1, 4 * H))
            c1 = call("multiply", [call("strided_slice", [pre], tensor(1, H)), c], tensor(1, H))
            h1 = call("add1", [call("strided_slice1", [pre], tensor(1, H)), c1], tensor(1, H))
            out = bb.emit_output(relax.Tuple([c1, h1]))
        cell = bb.emit_func_output(out)
    w_h = relax.const(interleave_columns(W_H, 4))
    wx = before["main"].body.blocks[0].bindings[0].value.args[1].fields[1]  # the W_x constant
    h0, c0 = relax.Var("h0", tensor(1, K)), relax.Var("c0", tensor(1, H))
    x0, x1 = relax.Var("x0", tensor(1, X)), relax.Var("x1", tensor(1, X))
    with bb.function("main", [h0, c0, x0, x1]):
        with bb.dataflow():
            hs, cs = h0, c0
            for x in (x0, x1):
                m = call("matmul", [x, wx], tensor(1, 4 * H))
                both = bb.emit(relax.Call(cell, [hs, w_h, m, cs]))
                cs, hs = bb.emit(relax.TupleGetItem(both, 0)), bb.emit(relax.TupleGetItem(both, 1))
            out = bb.emit_output(relax.Tuple([hs, cs]))
        bb.emit_func_output(out)
    return bb.get()


def test_two_steps_become_one_fused_cell_each():
    before = two_steps()
    tvm.ir.assert_structural_equal(GEMVEpilogueFusion()(before), two_steps_expected(before))


def test_the_gemv_whose_input_comes_last_joins_the_cell():
    """Step 1: both inputs are parameters, and the recurrent W_h (applied again to h1) wins the
    tie; step 2: x1 @ A @ A @ A comes after h1, so the input half joins (as in Seq2Seq's
    decoder, whose layers run in series)."""
    late = two_steps(delay=3)  # x1 @ A @ A @ A: level 2, h1's is 1
    after = GEMVEpilogueFusion()(late)
    cells = [b.value for b in after["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)
             and b.value.op.name_hint.startswith("fused_gemv_epilogue")]
    weights = [c.args[1].value.numpy() for c in cells]
    assert len(weights) == 2
    np.testing.assert_array_equal(weights[0], interleave_columns(W_H, 4))
    np.testing.assert_array_equal(weights[1], interleave_columns(W_X, 4))
    feeds = {n: np.random.default_rng(k).standard_normal(s).astype("float32")
             for k, (n, s) in enumerate([("h0", (1, K)), ("c0", (1, H)), ("x0", (1, X)),
                                         ("x1", (1, X))])}
    want = run_tvm_cpu(relax.transform.FuseTIR()(late), feeds)
    got = run_tvm_cpu(relax.transform.FuseTIR()(after), feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5)


def test_interleaved_weight_and_deinterleave_are_inverse():
    w = np.random.default_rng(0).standard_normal((3, 12)).astype("float32")
    wi = interleave_columns(w, 4)  # H = 3
    assert all(np.array_equal(wi[:, j * 4 + p], w[:, p * 3 + j]) for j in range(3) for p in range(4))
    h = np.random.default_rng(1).standard_normal((1, 3)).astype("float32")
    lib = tvm.compile(tvm.IRModule({"main": deinterleave(2).with_attr("global_symbol", "main")}),
                      target="llvm")
    x = np.arange(8, dtype="float32").reshape(1, 8)
    out = tvm.runtime.tensor(np.zeros((1, 8), "float32"))
    lib["main"](tvm.runtime.tensor(interleave_columns(x, 4)), out)
    np.testing.assert_array_equal(out.numpy(), x)
    np.testing.assert_allclose((h @ wi).reshape(1, 3, 4).transpose(0, 2, 1).reshape(1, 12), h @ w,
                               rtol=1e-6)


def lstm_stack(seed):
    """Random unrolled LSTM stacks (sizes, layers and steps vary with the seed)."""
    hidden = (4, 8, 12, 16)[seed]
    return get_model("lstm_tc", seq_len=3 + seed, input_size=3 + 2 * seed, hidden=hidden,
                     layers=1 + seed % 3, seed=seed)


MODELS = {
    "lstm_tc": lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]),
    "seq2seq": lambda: get_model("seq2seq", **REDUCED["seq2seq"]),
    "deepspeech2": lambda: get_model("deepspeech2", **REDUCED["deepspeech2"]),
    **{f"lstm_stack_{s}": (lambda s=s: lstm_stack(s)) for s in range(4)},
}


def rewritten(model, fuse=True):
    """The rammer graph rewrites up to FuseTIR, with or without GEMVEpilogueFusion."""
    seq = [SplitToSlices(), SplitMatMulOverConcat(), BatchSharedWeightMatMuls(),
           relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant(), SplitTailFusion(), BranchPreservingFusion(),
           *([GEMVEpilogueFusion()] if fuse else []), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(seq)(from_onnx(model, keep_params_in_input=False))


def fused_cells(mod):
    return [f for gv, f in mod.functions_items() if gv.name_hint.startswith("fused_gemv_epilogue")]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rewritten_module_built_for_llvm_matches_onnxruntime(name):
    model = MODELS[name]()
    feeds = random_inputs(model, seed=2)
    mod = rewritten(model)
    assert fused_cells(mod), "every one of these models has recurrent GEMVs"
    for got, want in zip(run_tvm_cpu(mod, feeds), run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_each_lstm_step_after_the_first_is_one_operator():
    """lstm_tc (3 layers x 5 steps): every cell but the model's first (layer 0, step 0: its
    x-half is the batched GEMM's slice and h = 0, so it has no GEMV) is one fused operator. In
    the wavefront a layer's h_{t-1} and the layer below's h_t are ready together, so the
    recurrent GEMV joins its cell; at step 0 (h = 0) the input half is the only GEMV and joins."""
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    before, after = rewritten(model, fuse=False), rewritten(model)
    steps, layers = REDUCED["lstm_tc"]["seq_len"], REDUCED["lstm_tc"]["layers"]

    def callees(mod):
        names = []
        for b in mod["main"].body.blocks[0].bindings:
            op = getattr(b.value, "op", None)
            if isinstance(b.value, relax.Call) and op is not None and op.same_as(CALL_TIR):
                names.append(b.value.args[0].name_hint)
        return names

    def count(names, prefix):
        return sum(1 for n in names if n.startswith(prefix))

    was, now = callees(before), callees(after)
    assert count(now, "fused_gemv_epilogue") == layers * steps - 1
    assert count(was, "matmul") - count(now, "matmul") == layers * (steps - 1)
    assert count(was, "fused_matmul_add") - count(now, "fused_matmul_add") == layers - 1


def scheduled_cells(model):
    mod = rewritten(model)
    found = []
    for func in fused_cells(mod):
        with TARGET:
            sch = GEMVEpilogue().apply(func, TARGET)
        found.append((func, sch.mod["main"].with_attr("tirx.is_scheduled", True)))
    return found


def run_cpu(func, seed=0):
    """Run a PrimFunc on random inputs on the CPU; its outputs (the last params, [1, H])."""
    rng = np.random.default_rng(seed)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target="llvm")
    shapes = [[int(d) for d in p.ty.shape] for p in func.params]
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in shapes]
    lib["main"](*args)
    return [a.numpy() for a in args]


@pytest.mark.parametrize("name", ["lstm_tc", "seq2seq", "lstm_stack_0", "lstm_stack_2", "lstm_stack_3"])
def test_scheduled_cell_computes_what_the_fused_function_does(name):
    for func, scheduled in scheduled_cells(MODELS[name]()):
        want = run_cpu(func)
        got = run_cpu(serial_threads(scheduled))
        n_out = len(func.params) - 4  # h, weight, the input half, c ... then the outputs
        for g, w in zip(got[-n_out:], want[-n_out:]):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_scheduled_cell_is_one_kernel_of_four_units_per_rtask():
    """Hidden 16, four gates: 16 / 4 = 4 rTasks of 16 x 16 threads (a GEMV column per
    threadIdx.x, the reduction over threadIdx.y), shared memory for the 16 gate values."""
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])  # hidden 16
    for _, scheduled in scheduled_cells(model):
        lowered = prelower(scheduled, TARGET, name="cell")
        assert lowered.grid == (4, 1, 1) and lowered.block == (16, 16, 1)
        assert lowered.has_sync and lowered.shared_bytes > 0


def test_the_rule_leaves_other_functions_to_dlight():
    """A GEMV with a bias epilogue (no de-interleave) is not the rule's: dlight's rules apply."""
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    mod = rewritten(model)
    others = [f for gv, f in mod.functions_items()
              if isinstance(f, tirx.PrimFunc) and "gemv_epilogue" not in gv.name_hint]
    assert any(name.startswith("fused_matmul_add") for name in (
        gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)))
    for f in others:
        assert GEMVEpilogue().apply(f, TARGET) is None


def test_pipeline_schedules_the_cells_with_the_rule():
    """In the rammer pipeline the fused cells carry the rule's name (``inspect`` reports it as
    their version); nothing else does."""
    from tvm_rammer.driver import pipeline
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx

    target = tvm.target.Target("rammer/nvidia-h100")
    mod = import_onnx(get_model("lstm_tc", **REDUCED["lstm_tc"]))
    passes = pipeline.rammer_passes(target, RammerConfig(profile=False))
    names = [p.info.name for p in passes]
    with target:
        for p in passes[:names.index("WithTarget(RammerBackend)")]:
            mod = p(mod)
    by = {gv.name_hint: scheduled_by(f) for gv, f in mod.functions_items()
          if isinstance(f, tirx.PrimFunc)}
    assert {n for n, b in by.items() if b} == {n for n in by if n.startswith("fused_gemv_epilogue")}
    assert set(by.values()) == {None, "gemv_epilogue"}


def test_only_a_plain_row_times_matrix_is_a_gemv():
    """is_plain_matmul: the legalized [1, K] x [K, N] matmul; not a batch of rows, not a
    matmul with its bias fused in, not a row times a transposed matrix."""
    def legalized(a_shape, b_shape, bias=False):
        bb = relax.BlockBuilder()
        a, b = relax.Var("a", tensor(*a_shape)), relax.Var("b", tensor(*b_shape))
        with bb.function("main", [a, b]):
            with bb.dataflow():
                out = relax.op.matmul(a, b)
                if bias:
                    out = relax.op.add(bb.emit(out), relax.const(np.ones(4, "float32")))
                out = bb.emit_output(out)
            bb.emit_func_output(out)
        mod = relax.transform.LegalizeOps()(bb.get())
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(
            relax.transform.AnnotateTIROpPattern()(mod)))
        return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]

    assert [is_plain_matmul(f) for f in legalized((1, 3), (3, 4))] == [True]
    assert not any(is_plain_matmul(f) for f in legalized((2, 3), (3, 4)))
    assert not any(is_plain_matmul(f) for f in legalized((1, 3), (2, 3, 4)))  # batched weight
    assert not any(is_plain_matmul(f) for f in legalized((1, 3), (3, 4), bias=True))
    a, b = te.placeholder((1, 3), name="a"), te.placeholder((4, 3), name="b")
    k = te.reduce_axis((0, 3), name="k")
    transposed = te.compute((1, 4), lambda i, j: te.sum(a[i, k] * b[j, k], axis=k), name="matmul")
    assert not is_plain_matmul(te.create_prim_func([a, b, transposed]))


def test_cell_tiling_takes_whole_warps_within_the_cap():
    """Four gates: 4 units (16 columns) x 16 reduction threads for H = K = 256; fewer reduction
    threads for a short K; fewer units when 4 does not divide H; None when no power-of-two split
    of K makes whole warps (H = K = 6: 12 or 8 or 4 columns times 1 or 2 threads)."""
    assert cell_tiling(256, 4, 256, 256) == (4, 16)
    assert cell_tiling(256, 4, 256, 128) == (4, 8)
    assert cell_tiling(16, 4, 4, 256) == (4, 4)
    assert cell_tiling(6, 4, 8, 256) == (3, 8)  # 12 columns x 8 threads: three warps
    assert cell_tiling(6, 4, 6, 256) is None
    assert cell_tiling(128, 2, 64, 256) == (8, 16)  # two parts (a GRU's r, z): 8 units
    for hidden, parts, k in [(256, 4, 256), (64, 4, 48), (10, 2, 24), (3, 8, 32)]:
        tiling = cell_tiling(hidden, parts, k, 256)
        if tiling is not None:
            units, threads = tiling
            assert hidden % units == 0 and k % threads == 0
            assert (parts * units * threads) % 32 == 0 and parts * units * threads <= 256


def test_a_cell_that_does_not_tile_stays_two_operators_in_one_rprogram():
    """Hidden 6: no whole-warp tiling, so no fusion; the model is still one rProgram (fusing
    would have left the cells ordinary kernels between rPrograms)."""
    from tvm_rammer.views.inspection import inspect_model

    model = get_model("lstm_tc", seq_len=4, input_size=5, hidden=6, layers=2)
    assert not fused_cells(rewritten(model))
    summary = inspect_model(model, tvm.target.Target("rammer/nvidia-h100"))
    assert summary["rprograms"] == 1 and summary["launches"] == 1 and not summary["unplaced"]
