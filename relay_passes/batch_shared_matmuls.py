"""BatchSharedWeightMatMuls: GEMVs that share a constant weight and are ready together become one GEMM.

After SplitMatMulOverConcat, the input half ``x_t @ W_x`` of an RNN's first layer reads only the
model's input, so all T steps' GEMVs are ready in the same wave, and each streams the whole W_x
(DeepSpeech2: 300 steps x 5.4 MB). Stacked, ``concat(x_0..x_T-1) @ W_x`` is one GEMM that reads W_x
once (cuDNN runs an RNN's input projection the same way); strided slices hand each step its row
block. The FLOPs are the same, the weight bytes 1/T.

Input: Relax with high-level ops in one dataflow block of ``main`` (run after SplitMatMulOverConcat,
before LegalizeOps). Candidates are bindings ``v = matmul(x, W)`` with ``W`` a 2-D Constant and ``x``
a 2-D dataflow var of static shape. Two or more candidates with the same ``W`` (the same constant,
not merely equal values), dtype and ``out_dtype`` whose ``x`` sit at the same level (the longest
chain of operator bindings from the inputs; Tuple, TupleGetItem and var bindings count zero) form a
batch: ``m = matmul(concat(xs, axis 0), W)`` is emitted once all ``xs`` are bound, and each ``v``
becomes ``strided_slice(m)`` of its rows. When the ``xs`` are, in order, the rows of one tensor
``X`` cut along one axis (``reshape(strided_slice(X, axis, t, t + 1), [1, K])`` for every t, as an
RNN's input steps are cut from the layer before it), the stack is ``reshape(permute_dims(X), [T, K])``
instead of a concat of T slices: the same values, one small kernel instead of a fused function of
2T + 1 operators (DeepSpeech2's took dlight 62 s to schedule). Equal levels make sure nothing waits for a later input
(the batch never serialises parallel work); it adds two levels (concat, matmul) in front of the
slices. The block is re-emitted in a topological order that keeps the original order where it can.
Declines everything else; a main that is not one dataflow block is left alone.

With weights kept apart (``relay_passes.lift_weights``), a weight parameter of ``main`` (past its
``num_input``) or a row block SplitMatMulOverConcat cut from one (``strided_slice`` of it) counts as
a constant W, as its embedded counterpart would.
"""
import heapq
import math

import tvm
from tvm import relax

from .lift_weights import weight_params
from .split_matmul_concat import _is_op, _static_shape
from .unused_bindings import remove_unused_bindings

MATMUL = tvm.ir.Op.get("relax.matmul")
RESHAPE = tvm.ir.Op.get("relax.reshape")
STRIDED_SLICE = tvm.ir.Op.get("relax.strided_slice")
CONSTANT = tvm.ir.expr.Constant
MIN_BATCH = 2


def _static_2d(expr):
    """(rows, cols) of a static 2-D tensor expr, or None."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or len(shape.values) != 2:
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d.value) for d in shape.values)


def _vars_read(expr):
    """The relax Vars an expression reads."""
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found


def _levels(block):
    """Level of every bound var: 1 + the highest level it reads; aliases add nothing."""
    level = {}
    for b in block.bindings:
        reads = [level.get(v, 0) for v in _vars_read(b.value)]
        alias = isinstance(b.value, (relax.Var, relax.Tuple, relax.TupleGetItem))
        level[b.var] = max(reads, default=0) + (0 if alias else 1)
    return level


def _weights(block, params):
    """The weight parameters ``params`` and the vars bound to a ``strided_slice`` of one (the row
    blocks SplitMatMulOverConcat cuts from a weight kept apart)."""
    found = set(params)
    for b in block.bindings:
        if _is_op(b.value, STRIDED_SLICE) and b.value.args[0] in found:
            found.add(b.var)
    return found


def _batches(block, params=()):
    """Lists of binding indices whose matmuls form one batch (see the module docstring);
    ``params``: main's weight parameters (weights kept apart)."""
    level = _levels(block)
    weights = _weights(block, params) if params else set()
    groups = {}
    for i, b in enumerate(block.bindings):
        call = b.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.same_as(MATMUL)):
            continue
        x, w = call.args
        if not isinstance(x, relax.Var) or not (isinstance(w, CONSTANT) or w in weights):
            continue
        if _static_2d(x) is None or _static_2d(w) is None:
            continue
        key = (w, level.get(x, 0), str(x.ty.dtype), str(call.attrs.out_dtype))
        groups.setdefault(key, []).append(i)
    return [idx for idx in groups.values() if len(idx) >= MIN_BATCH]


def _ints(tup):
    """A relax Tuple of integers (IntImm or PrimValue of one) as ints, or None."""
    values = [f if isinstance(f, tvm.tirx.IntImm) else getattr(f, "value", None)
              for f in getattr(tup, "fields", [None])]
    return [int(v.value) for v in values] if all(isinstance(v, tvm.tirx.IntImm) for v in values) else None


def _row_of(x, value_of):
    """(X, axis, t) when ``x`` is ``reshape(strided_slice(X, [axis], [t], [t + 1]), [1, K])`` with K
    the product of X's other dims (through tuple and var aliases), else None."""
    call = value_of.get(x)
    if not _is_op(call, RESHAPE):
        return None
    v = call.args[0]
    while isinstance(value_of.get(v), (relax.Var, relax.TupleGetItem)):
        alias = value_of[v]
        if isinstance(alias, relax.Var):
            v = alias
            continue
        tup = value_of.get(alias.tuple_value, alias.tuple_value)
        if not isinstance(tup, relax.Tuple):
            return None
        v = tup.fields[alias.index]
    cut = value_of.get(v)
    if not _is_op(cut, STRIDED_SLICE) or len(cut.args) != 4 or not isinstance(cut.args[0], relax.Var):
        return None
    source, (axes, begin, end) = cut.args[0], [_ints(a) for a in cut.args[1:]]
    shape = _static_shape(source)
    if shape is None or not axes or len(axes) != 1 or len(begin) != 1 or len(end) != 1:
        return None
    axis = axes[0] % len(shape)
    if not 0 <= begin[0] < shape[axis] or end[0] != begin[0] + 1:
        return None
    if _static_shape(x) != [1, math.prod(shape) // shape[axis]]:
        return None
    return source, axis, begin[0]


def _stack(xs, value_of):
    """``[(var, value), ...]`` binding the [T, K] stack of the 2-D ``xs``: X's rows moved to the
    front and flattened when the xs are X cut along one axis in order (module docstring), else one
    concat along axis 0."""
    rows = [_row_of(x, value_of) for x in xs]
    if all(rows) and all(r[0].same_as(rows[0][0]) and r[1] == rows[0][1] for r in rows) \
            and [r[2] for r in rows] == list(range(len(xs))):
        source, axis = rows[0][0], rows[0][1]
        shape = _static_shape(source)
        if shape[axis] == len(xs):
            out = []
            if axis != 0:
                order = [axis] + [d for d in range(len(shape)) if d != axis]
                value = relax.BlockBuilder().normalize(relax.op.permute_dims(source, order))
                source = relax.DataflowVar("rows_first", value.ty)
                out.append((source, value))
            value = relax.BlockBuilder().normalize(
                relax.op.reshape(source, [len(xs), math.prod(shape) // len(xs)]))
            return out + [(relax.DataflowVar("stacked", value.ty), value)]
    value = relax.BlockBuilder().normalize(relax.op.concat(xs, axis=0))
    return [(relax.DataflowVar("stacked", value.ty), value)]


def _rewrite(block, batches):
    """The block's bindings with every batch stacked, in a topological order."""
    bb = relax.BlockBuilder()
    bindings = list(block.bindings)
    defined_at = {b.var: i for i, b in enumerate(bindings)}
    value_of = {b.var: b.value for b in bindings}
    items = []  # (priority, binding, vars it reads)
    replaced = set()
    for batch in batches:
        calls = [bindings[i].value for i in batch]
        xs = [c.args[0] for c in calls]
        weight = calls[0].args[1]
        rows = [_static_2d(x)[0] for x in xs]
        after = max(defined_at.get(x, -1) for x in xs) + 0.5
        for k, (var, value) in enumerate(_stack(xs, value_of)):
            items.append((after + 0.01 * k, relax.VarBinding(var, value), _vars_read(value)))
        stacked = var
        mm_value = bb.normalize(relax.op.matmul(stacked, weight, out_dtype=calls[0].attrs.out_dtype))
        product = relax.DataflowVar("batched", mm_value.ty)
        items.append((after + 0.1, relax.VarBinding(product, mm_value), _vars_read(mm_value)))
        offset = 0
        for i, n in zip(batch, rows):
            part = bb.normalize(relax.op.strided_slice(product, [0], [offset], [offset + n]))
            items.append((i, relax.VarBinding(bindings[i].var, part), [product]))
            offset += n
            replaced.add(i)
    for i, b in enumerate(bindings):
        if i not in replaced:
            items.append((i, b, _vars_read(b.value)))
    return _topological(items)


def _topological(items):
    """Bindings ordered so every var is bound before it is read, smallest priority first."""
    producer = {item[1].var: k for k, item in enumerate(items)}
    waiting, users = {}, {}
    for k, (_, _, reads) in enumerate(items):
        deps = {producer[v] for v in reads if v in producer and producer[v] != k}
        waiting[k] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [(items[k][0], k) for k in waiting if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(items[k][1])
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (items[u][0], u))
    assert len(order) == len(items), "the batched block has a cycle"
    return order


@tvm.transform.module_pass(opt_level=0, name="BatchSharedWeightMatMuls")
class BatchSharedWeightMatMuls:
    """Stack same-level matmuls of one constant weight into one matmul (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        main = mod["main"]
        body = main.body
        if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1 \
                or not isinstance(body.blocks[0], relax.DataflowBlock):
            return mod
        block = body.blocks[0]
        batches = _batches(block, weight_params(main))
        if not batches:
            return mod
        new_body = relax.SeqExpr([relax.DataflowBlock(_rewrite(block, batches))], body.body)
        new_main = remove_unused_bindings(  # the slices a stack no longer reads
            relax.Function(main.params, new_body, main.ret_ty, main.is_pure, main.attrs))
        bb = relax.BlockBuilder(mod)
        bb.update_func(mod.get_global_var("main"), new_main)
        return relax.transform.Normalize()(bb.get())
