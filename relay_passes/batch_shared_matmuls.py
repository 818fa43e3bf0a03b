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
becomes ``strided_slice(m)`` of its rows. Equal levels make sure nothing waits for a later input
(the batch never serialises parallel work); it adds two levels (concat, matmul) in front of the
slices. The block is re-emitted in a topological order that keeps the original order where it can.
Declines everything else; a main that is not one dataflow block is left alone.
"""
import heapq

import tvm
from tvm import relax

MATMUL = tvm.ir.Op.get("relax.matmul")
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


def _batches(block):
    """Lists of binding indices whose matmuls form one batch (see the module docstring)."""
    level = _levels(block)
    groups = {}
    for i, b in enumerate(block.bindings):
        call = b.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.same_as(MATMUL)):
            continue
        x, w = call.args
        if not isinstance(x, relax.Var) or not isinstance(w, CONSTANT):
            continue
        if _static_2d(x) is None or _static_2d(w) is None:
            continue
        key = (w, level.get(x, 0), str(x.ty.dtype), str(call.attrs.out_dtype))
        groups.setdefault(key, []).append(i)
    return [idx for idx in groups.values() if len(idx) >= MIN_BATCH]


def _rewrite(block, batches):
    """The block's bindings with every batch stacked, in a topological order."""
    bb = relax.BlockBuilder()
    bindings = list(block.bindings)
    defined_at = {b.var: i for i, b in enumerate(bindings)}
    items = []  # (priority, binding, vars it reads)
    replaced = set()
    for batch in batches:
        calls = [bindings[i].value for i in batch]
        xs = [c.args[0] for c in calls]
        weight = calls[0].args[1]
        rows = [_static_2d(x)[0] for x in xs]
        stacked = relax.DataflowVar("stacked", bb.normalize(relax.op.concat(xs, axis=0)).ty)
        mm_value = bb.normalize(relax.op.matmul(stacked, weight, out_dtype=calls[0].attrs.out_dtype))
        product = relax.DataflowVar("batched", mm_value.ty)
        after = max(defined_at.get(x, -1) for x in xs) + 0.5
        items.append((after, relax.VarBinding(stacked, bb.normalize(relax.op.concat(xs, axis=0))), xs))
        items.append((after + 0.1, relax.VarBinding(product, mm_value), [stacked]))
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
        batches = _batches(block)
        if not batches:
            return mod
        new_body = relax.SeqExpr([relax.DataflowBlock(_rewrite(block, batches))], body.body)
        new_main = relax.Function(main.params, new_body, main.ret_ty, main.is_pure, main.attrs)
        bb = relax.BlockBuilder(mod)
        bb.update_func(mod.get_global_var("main"), new_main)
        return relax.transform.Normalize()(bb.get())
