"""NormGEMVFusion: a decode step's row norm becomes the prologue of each GEMV that reads it.

In a decode step (``M = 1``) a LayerNorm is a dependent step of its own: one small operator (one
row of ``d_model`` values, one rTask) with a barrier before the GEMV after it. A norm cannot be
fused into its producer (it needs the whole row, which many rTasks produce), but it can be fused
into its consumers: the row is tiny, so every rTask of the GEMV recomputes the row's statistics
itself and normalises the row into shared memory before its share of the GEMV
(``tir_templates.norm_gemv``). The norm's step and its barrier leave the critical path.

Which norms. A *norm node* is a call_tir, or a call of a Primitive function of call_tirs (a fused
group: ``layer_norm`` and the ``astype`` ToMixedPrecision leaves after it; an RMSNorm as
exporters write it, ``x * (1 / sqrt(mean(x^2) + eps)) * weight``, which the fusion makes one
group), with one output ``[1, ..., 1, K]`` and one input ``x`` of that shape that is not a weight
(the others are weights of K values or one: gain and shift, epsilon; never a matrix, so a square
GEMV with its bias and ReLU is no norm); exactly one of its PrimFuncs reduces, only over the last
axis (``layer_norm``'s sums, RMSNorm's ``mean``), and is no matmul; the others are at most
injective. A *GEMV node* is a call_tir of a
matmul ``[1, ..., 1, K] x [K, N]`` with a weight ``W`` (one reduction block, the weight's columns
contiguous), or a group of one followed by call_tirs of at most broadcast pattern (bias add,
casts; what FuseOps puts after a matmul). A norm node is fused when its output is not an output
of ``main`` and every reader is a GEMV node reading it as the matmul's row (so nothing needs the
norm's own result): each GEMV node becomes one Primitive function holding the norm's calls then
the GEMV's, and the norm's binding goes. Several readers (Llama's q, k, v; gate and up) each
recompute the norm.

The prologue also takes the elementwise nodes that lead to the norm's row (at most
:data:`MAX_PROLOGUE`: one row in, one row out, at most broadcast pattern, per-element parameters
only): HF's RMSNorm reads ``hidden_states.to(float32)``, a cast the grouping leaves a call_tir of
its own (its output is read twice in the norm's group) while the residual add reads the float16
stream uncast. Each fused function then takes the float16 row and casts it as it reads it. A
prologue node whose output is also read by anything else (or returned) stays for that reader, and
the fused functions still recompute it (K values, re-read from L2 as the norm re-reads its row):
the norm's GEMVs do not wait for its step either way. A residual add (two activations) is no
prologue node.

What is emitted. The fused function calls a copy of the matmul PrimFunc whose reduction block is
annotated ``rammer.norm_gemv`` (FuseTIR keeps block annotations, not function attributes): the
schedule rule ``tir_templates.norm_gemv.NormGEMV`` recognises the fused PrimFunc by it.

In: an IRModule after BranchPreservingFusion (``main`` one dataflow block). Out: the same module
with each fusable norm and its GEMVs rewritten as above; unchanged when none qualifies. Must run
before FuseTIR.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from tir_templates.norm_gemv import norm_gemv_shape

from .branch_fusion import BROADCAST, INJECTIVE, callee_pattern
from .dataflow_graph import CALL_TIR, DataflowGraph
from .lift_weights import weight_params

__all__ = ["NormGEMVFusion", "NORM_GEMV_ANNOTATION", "row_matmul_shape", "is_row_norm"]

NORM_GEMV_ANNOTATION = "rammer.norm_gemv"
MAX_ROW_BYTES = 16 * 1024  # the normalised row each rTask keeps in shared memory


@tvm.transform.module_pass(opt_level=0, name="NormGEMVFusion")
class NormGEMVFusion:
    """Fuse each decode-step row norm into the GEMVs that read it (see the module docstring).
    ``max_row_bytes``: the largest normalised row (K x its dtype's bytes) fused; every rTask
    keeps it in shared memory (16 KB: Llama-70B's d_model 8192 in float16)."""

    def __init__(self, max_row_bytes: int = MAX_ROW_BYTES, max_threads: int = 256):
        self.max_row_bytes, self.max_threads = max_row_bytes, max_threads

    def transform_module(self, mod, ctx):
        """Find the fusable norms of main and emit one fused function per GEMV reader."""
        graph = DataflowGraph.of_main(mod)
        if graph is None:  # no main, or control flow in it: nothing to fuse
            return mod
        fusions = find_fusions(graph, self.max_row_bytes, self.max_threads)
        if not fusions:
            return mod
        return _emit(mod, graph, fusions)


# --- recognising the operators ----------------------------------------------------------------

def _static(shape):
    return shape is not None and all(isinstance(d, int) for d in shape)


def _buffer_shape(buf):
    dims = getattr(buf.ty, "shape", None)
    if dims is None:
        return None
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def _blocks(func):
    found = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, found.append)])
    return [b for b in found if b.iter_vars]  # the root block has none


def row_matmul_shape(func) -> tuple | None:
    """``(K, N)`` for a PrimFunc ``(A, B, C)`` of one reduction block ``C[.., j] += A[.., k] *
    B[k, j]`` (casts allowed) with ``A [1, .., 1, K]``, ``B [K, N]``, ``C [1, .., 1, N]``; else
    None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return None
    bufs = list(func.params)  # a PrimFunc's parameters are its buffers
    a, b, c = (_buffer_shape(x) for x in bufs)
    if None in (a, b, c) or len(b) != 2 or len(a) != len(c) or any(d != 1 for d in a[:-1] + c[:-1]):
        return None
    k, n = b
    if a[-1] != k or c[-1] != n:
        return None
    blocks = _blocks(func)
    if len(blocks) != 1:
        return None
    block = blocks[0]
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    if kinds.count(2) != 1 or len(block.reads) != 2 or len(block.writes) != 1:
        return None
    if not (block.reads[0].source.same_as(bufs[0]) and block.reads[1].source.same_as(bufs[1])
            and block.writes[0].source.same_as(bufs[2])):
        return None
    (r,) = (iv.var for iv in block.iter_vars if int(iv.iter_type) == 2)
    # A's last index and B's first are the reduction var, B's last is C's last
    a_idx = [rg.min for rg in block.reads[0].region]
    b_idx = [rg.min for rg in block.reads[1].region]
    c_idx = [rg.min for rg in block.writes[0].region]
    if not (a_idx[-1].same_as(r) and b_idx[0].same_as(r) and b_idx[1].same_as(c_idx[-1])):
        return None
    return k, n


def is_row_norm(func, k: int) -> bool:
    """A PrimFunc whose reduction blocks each reduce ``k`` values of the last axis (a row norm's
    sums: LayerNorm's mean and variance, RMSNorm's mean square)."""
    blocks = _blocks(func)
    reductions = [b for b in blocks if any(int(iv.iter_type) == 2 for iv in b.iter_vars)]
    if not reductions:
        return False
    for block in reductions:
        red = [iv for iv in block.iter_vars if int(iv.iter_type) == 2]
        if len(red) != 1 or not isinstance(red[0].dom.extent, tirx.IntImm) \
                or int(red[0].dom.extent) != k:
            return False
    return True


def _callee_calls(graph, node):
    """[(callee GlobalVar, binding)] of a call_tir node or of the members of a group; None for
    anything else (a binding of a group that is not a call_tir)."""
    if node.kind == "call_tir":
        return [(node.gvar, None)]
    op = getattr(node.value, "op", None)
    if not isinstance(op, tvm.ir.GlobalVar) or op not in graph.mod.functions:
        return None
    func = graph.mod[op]
    if not (isinstance(func, relax.Function) and func.attrs is not None
            and bool(func.attrs.get("Primitive", False))):
        return None
    calls = []
    for blk in func.body.blocks:
        for b in blk.bindings:
            if not (isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR)):
                return None
            calls.append((b.value.args[0], b))
    return calls


def _is_weight(tensor, weights):
    return tensor.is_constant or (tensor.producer is None and tensor.expr in weights)


class _Gemv:
    """A GEMV node: its matmul callee and the tensor it reads as the matmul's row."""

    def __init__(self, node, matmul, row, k, n, itemsize=4):
        self.node, self.matmul, self.row, self.k, self.n = node, matmul, row, k, n
        self.itemsize = itemsize  # the weight's


def _gemv(graph, node, weights):
    """The _Gemv of a call_tir of a row matmul with a weight, or of a group whose first call is one
    and whose other calls are at most broadcast (bias add, casts); else None."""
    calls = _callee_calls(graph, node)
    if not calls or len(node.outputs) != 1:
        return None
    gvar, first = calls[0]
    shape = row_matmul_shape(graph.mod[gvar]) if gvar in graph.mod.functions else None
    if shape is None:
        return None
    if any(callee_pattern(graph.mod, g) > BROADCAST for g, _ in calls[1:]):
        return None
    if node.kind == "call_tir":
        row, weight = node.inputs[0], node.inputs[1]
    else:
        callee = graph.mod[node.value.op]
        outer = {p: graph.tensor_of_expr(a) for p, a in zip(callee.params, node.value.args)}
        a, w = first.value.args[1].fields
        if a not in outer or w not in outer:
            return None
        row, weight = outer[a], outer[w]
        # the row is read by the matmul only
        for _, b in calls[1:]:
            if any(x.same_as(a) for x in b.value.args[1].fields):
                return None
    if not _is_weight(weight, weights):
        return None
    return _Gemv(node, gvar, row, *shape, itemsize=np.dtype(weight.dtype).itemsize)


def _norm(graph, node, weights):
    """K when ``node`` is a norm node (module docstring), else None."""
    calls = _callee_calls(graph, node)
    if not calls or len(node.outputs) != 1:
        return None
    shape = node.outputs[0].shape
    if not _static(shape) or not shape or any(d != 1 for d in shape[:-1]):
        return None  # a scalar has no row (the ONNX node suite's Clip, NLLLoss)
    k = shape[-1]
    activations = [t for t in node.inputs if not _is_weight(t, weights)]
    if len(activations) != 1 or activations[0].shape != shape:
        return None
    # the other inputs are per-element parameters of the row (gain, shift: K values or one), never
    # a matrix: a square GEMV [1, K] x [K, K] (+ bias, ReLU) would pass the rest, and each rTask
    # of its reader would recompute the whole GEMV (AlexNet's classifier)
    if any(not _static(t.shape) or int(np.prod(t.shape)) not in (1, k) for t in node.inputs
           if t != activations[0]):
        return None
    reducing = [g for g, _ in calls if callee_pattern(graph.mod, g) > INJECTIVE]
    if len(reducing) != 1 or reducing[0] not in graph.mod.functions \
            or not is_row_norm(graph.mod[reducing[0]], k) \
            or row_matmul_shape(graph.mod[reducing[0]]) is not None:
        return None
    return k


MAX_PROLOGUE = 4  # elementwise nodes taken into the prologue before a norm (HF's upcast is one)


def _elementwise(graph, node, weights, shape):
    """The activation TensorRef of ``node`` when it is an elementwise step of one row: a call_tir or
    group of at most broadcast pattern (a cast, an affine map) with one output and one activation
    input, both of ``shape`` (the norm's row; the dtypes may differ), the other inputs per-element
    parameters (K values or one); else None."""
    calls = _callee_calls(graph, node)
    if not calls or len(node.outputs) != 1 or node.outputs[0].shape != shape:
        return None
    if any(callee_pattern(graph.mod, g) > BROADCAST for g, _ in calls):
        return None
    activations = [t for t in node.inputs if not _is_weight(t, weights)]
    if len(activations) != 1 or activations[0].shape != shape:
        return None
    if any(not _static(t.shape) or int(np.prod(t.shape)) not in (1, shape[-1]) for t in node.inputs
           if t != activations[0]):
        return None
    return activations[0]


def _prologue(graph, norm, weights):
    """Indices of the elementwise nodes (:func:`_elementwise`) that lead to ``norm``'s row, first
    first, at most :data:`MAX_PROLOGUE`: Llama's RMSNorm reads ``hidden_states.to(float32)``,
    a cast of the residual stream that the residual add reads uncast, so the cast is a node of
    its own before the norm. Every fused function recomputes them (a re-read of the K values
    the norm reads anyway), so the norm's GEMVs no longer wait for them; a node whose output is
    read by anything else as well stays for that reader (:func:`_dropped`)."""
    shape = norm.outputs[0].shape
    (row,) = [t for t in norm.inputs if not _is_weight(t, weights)]
    chain = []
    while row.producer is not None and len(chain) < MAX_PROLOGUE:
        node = graph.nodes[row.producer]
        if node.kind == "alias":
            break
        row = _elementwise(graph, node, weights, shape)
        if row is None:
            break
        chain.insert(0, node.index)
    return chain


def _dropped(graph, fusions) -> set:
    """The node indices the fused functions replace: every fused norm, and each prologue node
    whose every reader is replaced too and whose output is not an output of ``main``."""
    dropped = {f.norm for f in fusions}
    for index in sorted({i for f in fusions for i in f.prologue}, reverse=True):
        node = graph.nodes[index]
        if not graph.is_graph_output(node.outputs[0]) \
                and all(c in dropped for c in graph.consumers(node.outputs[0])):
            dropped.add(index)
    return dropped


@dataclass(frozen=True)
class Fusion:
    """One norm to fuse: its node index, its readers (``_Gemv`` s) and the indices of the
    elementwise nodes before it taken into the prologue (:func:`_prologue`, first first)."""

    norm: int
    gemvs: tuple
    prologue: tuple = ()


def find_fusions(graph, max_row_bytes: int = None, max_threads: int = 256) -> list:
    """[:class:`Fusion`] for every norm to fuse into its readers, in binding order
    (a normalised row of at most ``max_row_bytes``; default :data:`MAX_ROW_BYTES`), each reader
    one the NormGEMV rule lays out in rTasks of at most ``max_threads`` threads
    (``norm_gemv_shape``): a fused function it cannot schedule would go to dlight's generic rules,
    which make two kernels with the row's statistics in a global buffer (a fuzz graph's
    ``x - max(x)`` into a 48 x 48 GEMV at 64 threads: the emulator cannot run that host code)."""
    max_row_bytes = MAX_ROW_BYTES if max_row_bytes is None else max_row_bytes
    weights = frozenset(weight_params(graph.func))
    fusions = []
    for node in graph.nodes:
        if node.kind == "alias":
            continue
        k = _norm(graph, node, weights)
        if k is None or graph.is_graph_output(node.outputs[0]) \
                or k * np.dtype(node.outputs[0].dtype).itemsize > max_row_bytes:
            continue
        readers = graph.consumers(node.outputs[0])
        gemvs = [_gemv(graph, graph.nodes[r], weights) for r in sorted(readers)]
        if not readers or any(g is None or g.row != node.outputs[0] or g.k != k for g in gemvs):
            continue
        # the norm's output read only as each GEMV's row (not also as a bias or residual)
        if any(sum(t == node.outputs[0] for t in g.node.inputs) != 1 for g in gemvs):
            continue
        if any(norm_gemv_shape(g.n, k, g.itemsize, max_threads) is None for g in gemvs):
            continue
        fusions.append(Fusion(node.index, tuple(gemvs), tuple(_prologue(graph, node, weights))))
    return fusions


# --- emission ---------------------------------------------------------------------------------

def annotated_matmul(func):
    """``func`` (a row matmul) with its reduction block annotated :data:`NORM_GEMV_ANNOTATION`."""
    sch = s_tir.Schedule(func)
    (block,) = [b for b in sch.get_child_blocks(sch.get_sblock("root"))]
    sch.annotate(block, NORM_GEMV_ANNOTATION, 1)
    return sch.mod["main"]


def _group_body(graph, node, args, bb, replace=None, output=False):
    """Emit ``node``'s calls inside the dataflow block being built; ``args``: its inputs' vars
    (in the order of the call's arguments); ``replace``: callee -> callee to call instead;
    ``output``: its result is the block's output. Returns the var of its output."""
    replace = replace or {}
    if node.kind == "call_tir":
        gvar = replace.get(node.gvar, node.gvar)
        call = relax.call_tir(gvar, relax.Tuple(args), out_ty=node.var.ty)
        return bb.emit_output(call) if output else bb.emit(call, node.name)
    callee = graph.mod[node.value.op]
    inner = dict(zip(callee.params, args))
    for blk in callee.body.blocks:
        for b in blk.bindings:
            value = b.value
            call_args = [inner[a] if isinstance(a, relax.Var) else a for a in value.args[1].fields]
            gvar = replace.get(value.args[0], value.args[0])
            call = relax.call_tir(gvar, relax.Tuple(call_args), out_ty=b.var.ty)
            last = output and b.var.same_as(callee.body.body)
            inner[b.var] = bb.emit_output(call) if last else bb.emit(call, str(b.var.name))
    return inner[callee.body.body]


def _args_of(node):
    """The Relax expressions a node passes (a call_tir's tuple fields, a group call's args)."""
    if node.kind == "call_tir":
        return list(node.value.args[1].fields)
    return list(node.value.args)


def _emit(mod, graph, fusions):
    bb = relax.BlockBuilder(mod)
    annotated = {}
    replace = {}
    for fusion in fusions:
        chain = [graph.nodes[i] for i in (*fusion.prologue, fusion.norm)]
        for gemv in fusion.gemvs:
            if gemv.matmul.name_hint not in annotated:
                annotated[gemv.matmul.name_hint] = bb.add_func(
                    annotated_matmul(graph.mod[gemv.matmul]), f"{gemv.matmul.name_hint}_norm_gemv")
            ext, params = [], []

            def param(expr):
                for e, p in zip(ext, params):
                    if e.same_as(expr):
                        return p
                ext.append(expr)
                params.append(relax.Var(f"p{len(params)}", expr.ty))
                return params[-1]

            # the prologue's and the norm's arguments: the previous node's output is the inner var
            chain_args = [[None if any(a.same_as(m.var) for m in chain[:c]) else param(a)
                           for a in _args_of(node)] for c, node in enumerate(chain)]
            other = [None if a.same_as(chain[-1].var) else param(a) for a in _args_of(gemv.node)]
            callee = gemv.node.gvar if gemv.node.kind == "call_tir" else gemv.node.value.op
            name = f"fused_norm_{callee.name_hint}"[:64]
            with bb.function(name, params, private=True, attrs={"Primitive": True}):
                with bb.dataflow():
                    inner = {}
                    for node, args in zip(chain, chain_args):
                        args = [inner[a] if v is None else v
                                for a, v in zip(_args_of(node), args)]
                        inner[node.var] = _group_body(graph, node, args, bb)
                    row = inner[chain[-1].var]
                    args = [row if v is None else v for v in other]
                    out = _group_body(graph, gemv.node, args, bb,
                                      {gemv.matmul: annotated[gemv.matmul.name_hint]}, output=True)
                gvar = bb.emit_func_output(out)
            replace[gemv.node.index] = relax.Call(gvar, ext)
    dropped = _dropped(graph, fusions)
    bindings = []
    for i, b in enumerate(graph.block.bindings):
        if i in dropped:
            continue
        bindings.append(relax.VarBinding(b.var, replace[i]) if i in replace else b)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    new_main = relax.BlockBuilder().normalize(
        relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    bb.update_func(mod.get_global_var("main"), new_main)
    out = bb.finalize()
    still_called = set()
    relax.analysis.post_order_visit(new_main, lambda e: still_called.add(e)
                                    if isinstance(e, tvm.ir.GlobalVar) else None)
    for fusion in fusions:
        for node in (*(graph.nodes[i] for i in (*fusion.prologue, fusion.norm)),
                     *(g.node for g in fusion.gemvs)):
            if node.kind != "call_tir" and node.value.op not in still_called:
                out = tvm.IRModule({gv: f for gv, f in out.functions_items()
                                    if not gv.same_as(node.value.op)}, attrs=out.attrs)
    return out
