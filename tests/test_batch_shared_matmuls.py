"""BatchSharedWeightMatMuls: same-wave GEMVs of one constant weight become one GEMM."""
import numpy as np
import tvm
from tvm import relax

from relay_passes.batch_shared_matmuls import BatchSharedWeightMatMuls


def tensor(*shape):
    return relax.TensorType(list(shape), "float32")


W = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")


def before(chained=False):
    """y_k = relu(x_k) @ W for three inputs; with `chained`, the third input is y_0 instead."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{k}", tensor(1, 4)) for k in range(3)]
    w = relax.const(W)
    with bb.function("main", xs):
        with bb.dataflow():
            r0 = bb.emit(relax.op.nn.relu(xs[0]))
            y0 = bb.emit(relax.op.matmul(r0, w))
            r1 = bb.emit(relax.op.nn.relu(xs[1]))
            y1 = bb.emit(relax.op.matmul(r1, w))
            r2 = bb.emit(relax.op.nn.relu(bb.emit(relax.op.strided_slice(y0, [1], [0], [4]))
                                          if chained else xs[2]))
            y2 = bb.emit(relax.op.matmul(r2, w))
            out = bb.emit_output(relax.Tuple([y0, y1, y2]))
        bb.emit_func_output(out)
    return bb.get(), w


def test_three_gemvs_of_one_weight_become_one_gemm_and_slices():
    mod, w = before()
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{k}", tensor(1, 4)) for k in range(3)]
    with bb.function("main", xs):
        with bb.dataflow():
            r0 = bb.emit(relax.op.nn.relu(xs[0]))
            r1 = bb.emit(relax.op.nn.relu(xs[1]))
            r2 = bb.emit(relax.op.nn.relu(xs[2]))
            stacked = bb.emit(relax.op.concat([r0, r1, r2], axis=0))
            batched = bb.emit(relax.op.matmul(stacked, w))
            ys = [bb.emit(relax.op.strided_slice(batched, [0], [k], [k + 1])) for k in range(3)]
            out = bb.emit_output(relax.Tuple(ys))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(BatchSharedWeightMatMuls()(mod), bb.get())


def test_a_gemv_whose_input_comes_later_stays_out_of_the_batch():
    mod, _ = before(chained=True)
    text = BatchSharedWeightMatMuls()(mod)["main"].script()
    assert text.count("R.matmul") == 2 and text.count("R.concat") == 1


def test_nothing_to_batch_leaves_the_module_alone():
    mod, _ = before(chained=True)
    single = BatchSharedWeightMatMuls()(BatchSharedWeightMatMuls()(mod))
    once = BatchSharedWeightMatMuls()(mod)
    tvm.ir.assert_structural_equal(single, once)
    bb = relax.BlockBuilder()
    x = relax.Var("x", tensor(1, 4))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.const(W)))
        bb.emit_func_output(out)
    plain = bb.get()
    assert BatchSharedWeightMatMuls()(plain).same_as(plain)


def test_batched_module_computes_the_same():
    mod, _ = before()
    xs = [np.random.default_rng(k).standard_normal((1, 4)).astype("float32") for k in range(3)]

    def run(m):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(x) for x in xs])]

    for got, want in zip(run(BatchSharedWeightMatMuls()(mod)), run(mod)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def rows_cut_from_one_tensor(order=(0, 1, 2)):
    """y_t = reshape(x[:, :, t], [1, 8]) @ W2 for the time steps t of x[1, 2, 4, 3], in ``order``
    (through SplitToSlices-style Tuple / TupleGetItem aliases, as an exported RNN's inputs are)."""
    w = relax.const(np.random.default_rng(1).standard_normal((8, 5)).astype("float32"))
    bb = relax.BlockBuilder()
    x = relax.Var("x", tensor(1, 2, 4, 3))
    with bb.function("main", [x]):
        with bb.dataflow():
            act = bb.emit(relax.op.nn.relu(x))
            cuts = bb.emit(relax.Tuple([bb.emit(relax.op.strided_slice(act, [3], [t], [t + 1]))
                                        for t in range(3)]))
            steps = [bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(cuts, t)), [1, 8]))
                     for t in order]
            out = bb.emit_output(relax.Tuple([bb.emit(relax.op.matmul(s, w)) for s in steps]))
        bb.emit_func_output(out)
    return bb.get()


def test_rows_cut_in_order_from_one_tensor_are_stacked_by_a_transpose_not_a_concat():
    """DeepSpeech2's first layer: the steps' inputs are one activation cut along time, so the stack
    is that activation with time moved first (the cuts go); computed the same."""
    mod = rows_cut_from_one_tensor()
    text = BatchSharedWeightMatMuls()(mod)["main"].script()
    assert "R.concat" not in text and "R.shape([1, 8])" not in text  # the cuts and their reshapes went
    assert text.count("R.strided_slice(batched") == text.count("R.strided_slice") == 3
    assert text.count("R.permute_dims") == 1 and text.count("R.matmul") == 1
    shuffled = BatchSharedWeightMatMuls()(rows_cut_from_one_tensor(order=(1, 0, 2)))["main"].script()
    assert "R.concat" in shuffled and "R.permute_dims" not in shuffled  # out of order: a concat
    x = np.random.default_rng(2).standard_normal((1, 2, 4, 3)).astype("float32")

    def run(m):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        return [o.numpy() for o in vm["main"](tvm.runtime.tensor(x))]

    for got, want in zip(run(BatchSharedWeightMatMuls()(mod)), run(mod)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
