"""The analytical cost model's bytes: the regions an operator accesses, and the weights it reads
from the L2 cache (a weight an earlier operator already read, when the re-read weights fit)."""
import numpy as np
import pytest
from tvm import relax, te, tirx

from relay_passes.dataflow_graph import DataflowGraph
from tvm_rammer.scheduling.cost_model import CostModelConfig, rtask_time_us
from tvm_rammer.scheduling.rkernels import flops_and_bytes, param_bytes, resident_inputs


def prim(*tensors):
    return te.create_prim_func(list(tensors))


def test_a_slice_reads_its_row_not_its_input():
    """strided_slice of row 3 of a [100, 1024] tensor: 4 KiB read, 4 KiB written (not 400 KiB)."""
    x = te.placeholder((100, 1024), name="x")
    row = te.compute((1, 1024), lambda i, j: x[3 + i, j], name="row")
    assert param_bytes(prim(x, row)) == [4096, 4096]


def test_the_gates_a_cell_reads_are_counted_not_the_whole_vector():
    """c' = sigmoid(f) * c + sigmoid(i) * tanh(g) reads three of the four gates of [1, 4H]."""
    hidden = 8
    gates, c = te.placeholder((1, 4 * hidden), name="gates"), te.placeholder((1, hidden), name="c")

    def cell(i, j):
        sig = te.sigmoid
        return sig(gates[i, hidden + j]) * c[i, j] + sig(gates[i, j]) * te.tanh(gates[i, 2 * hidden + j])

    out = te.compute((1, hidden), cell, name="c1")
    # the gate reads' bounding box spans i..g (three gates); c and c' whole
    assert param_bytes(prim(gates, c, out)) == [3 * hidden * 4, hidden * 4, hidden * 4]


def test_whole_tensors_where_every_element_is_read():
    a = te.placeholder((16, 32), name="a")
    b = te.placeholder((32, 8), name="b")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((16, 8), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    func = prim(a, b, c)
    assert param_bytes(func) == [16 * 32 * 4, 32 * 8 * 4, 16 * 8 * 4]
    assert flops_and_bytes(func) == (2 * 16 * 8 * 32, float((16 * 32 + 32 * 8 + 16 * 8) * 4))


def test_a_gather_reads_the_rows_it_indexes_not_its_table():
    """A gather through an index tensor: the read region of x depends on data; each of the 4
    iterations reads one element of x, so 4 elements (not the 64 of x), the index and the output
    whole."""
    x = te.placeholder((64,), name="x")
    idx = te.placeholder((4,), "int32", name="idx")
    out = te.compute((4,), lambda i: x[idx[i]], name="out")
    assert param_bytes(prim(x, idx, out)) == [4 * 4, 4 * 4, 4 * 4]


def _take(rows, cols, tokens):
    """Relax ``take(table[rows, cols], ids[1, tokens], axis=0)`` as LegalizeOps writes it (the
    PrimFunc ONNX's Gather becomes)."""
    bb = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType([rows, cols], "float32"))
    ids = relax.Var("ids", relax.TensorType([1, tokens], "int64"))
    with bb.function("main", [table, ids]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.take(table, ids, axis=0)))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return func


def test_take_of_one_token_reads_one_row_of_the_embedding():
    """GPT-2's token embedding: one row of a 50257 x 768 fp32 table per token. By hand: 768 x 4 =
    3,072 bytes of the table per token (not 50257 x 768 x 4 = 154.4 MB), 8 bytes of the int64 id
    per token, 3,072 bytes of output per token; three tokens read three rows."""
    assert param_bytes(_take(50257, 768, 1)) == [3072, 8, 3072]
    assert param_bytes(_take(50257, 768, 3)) == [3 * 3072, 3 * 8, 3 * 3072]
    # the sum the analytical model charges (flops_and_bytes): 6,152 bytes, not 154 MB
    assert flops_and_bytes(_take(50257, 768, 1))[1] == 3072 + 8 + 3072


def test_indirect_reads_are_capped_at_the_table():
    """More iterations than the table has rows (16 tokens of a 4-row table): the whole table,
    never more (4 x 8 x 4 = 128 bytes, not 16 x 8 x 4)."""
    assert param_bytes(_take(4, 8, 16)) == [4 * 8 * 4, 16 * 8, 16 * 8 * 4]


def test_a_window_at_a_data_dependent_start_counts_its_width():
    """A block reading ``x[idx[i]:idx[i] + 16]`` per iteration (4 iterations): 4 x 16 floats of
    x (256 bytes), not one element per iteration as a gather's row index would be."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def window(x: T.Buffer((1024,), "float32"), idx: T.Buffer((4,), "int32"),
               out: T.Buffer((4, 16), "float32")):
        for i in range(4):
            with T.sblock("w"):
                vi = T.axis.spatial(4, i)
                T.reads(x[idx[vi]:idx[vi] + 16], idx[vi])
                T.writes(out[vi, 0:16])
                for k in range(16):
                    out[vi, k] = x[idx[vi] + k]

    assert param_bytes(window) == [4 * 16 * 4, 4 * 4, 4 * 16 * 4]


def test_a_direct_read_is_unchanged_by_the_indirect_rule():
    """Control: the same shapes read through an affine index (row 3, a slice) cost the bounding box,
    and a whole-table read the whole table, as before."""
    x = te.placeholder((50257, 768), name="x")
    row = te.compute((1, 768), lambda i, j: x[3 + i, j], name="row")
    assert param_bytes(prim(x, row)) == [3072, 3072]
    total = te.compute((50257, 768), lambda i, j: x[i, j] * 2.0, name="twice")
    assert param_bytes(prim(x, total)) == [50257 * 768 * 4, 50257 * 768 * 4]


def test_l2_bytes_take_the_l2_bandwidth():
    cost = CostModelConfig(mem_bw_gbps=3000.0, l2_bw_gbps=6000.0)
    dram = rtask_time_us(0, 3e9, 132, 1, cost)
    assert dram == pytest.approx(1000.0 + 0.5)
    assert rtask_time_us(0, 3e9, 132, 1, cost, l2_bytes=3e9) == pytest.approx(500.0 + 0.5)
    assert rtask_time_us(0, 3e9, 132, 1, cost, l2_bytes=1.5e9) == pytest.approx(750.0 + 0.5)
    with pytest.raises(ValueError, match="l2_bytes must be between 0 and bytes"):
        rtask_time_us(0, 1e3, 1, 1, cost, l2_bytes=2e3)
    with pytest.raises(ValueError, match="CostModelConfig.l2_bw_gbps must be > 0"):
        CostModelConfig(l2_bw_gbps=0)


def gemv_chain(steps, hidden=8, shared=True):
    """h_{t+1} = tanh(h_t @ W): one weight read at every step (``shared``) or one per step."""
    bb = relax.BlockBuilder()
    h0 = relax.Var("h0", relax.TensorType([1, hidden], "float32"))
    rng = np.random.default_rng(0)
    weights = [relax.const(rng.standard_normal((hidden, hidden)).astype("float32"))]
    with bb.function("main", [h0]):
        with bb.dataflow():
            h = h0
            for t in range(steps):
                w = weights[0] if shared else relax.const(
                    rng.standard_normal((hidden, hidden)).astype("float32"))
                h = bb.emit(relax.op.tanh(bb.emit(relax.op.matmul(h, w))))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    return DataflowGraph.from_function(mod["main"], mod)


def matmul_nodes(graph):
    return [n.index for n in graph.nodes if n.kind == "call_tir" and n.gvar.name_hint == "matmul"]


def test_a_weight_read_again_comes_from_l2():
    """The first GEMV reads W from DRAM; the later ones from L2 (its weight is parameter 1)."""
    graph = gemv_chain(4)
    first, *later = matmul_nodes(graph)
    resident = resident_inputs(graph, 50 * 2 ** 20)
    assert first not in resident
    assert all(resident[i] == (1,) for i in later)
    assert set(resident) == set(later)


def test_weights_read_once_or_too_big_for_l2_come_from_dram():
    assert resident_inputs(gemv_chain(4, shared=False), 50 * 2 ** 20) == {}
    assert resident_inputs(gemv_chain(4, hidden=64), 64 * 64 * 4 - 1) == {}
    assert len(resident_inputs(gemv_chain(4, hidden=64), 64 * 64 * 4)) == 3


def test_the_l2_figure_can_be_set_per_compilation():
    """RammerConfig(l2_bw_gbps=...) (a measured figure, or several to compare) reaches the cost
    model; None keeps the model's own."""
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.scheduling.rkernels import cost_config
    from tvm_rammer.abstractions.vdevice import VDevice

    vdevice = VDevice.for_arch("sm_90a")
    assert cost_config(RammerConfig(), vdevice).l2_bw_gbps == CostModelConfig().l2_bw_gbps
    assert cost_config(RammerConfig(l2_bw_gbps=7000), vdevice).l2_bw_gbps == 7000.0
    with pytest.raises(ValueError, match="l2_bw_gbps=0 must be positive"):
        RammerConfig(l2_bw_gbps=0)
