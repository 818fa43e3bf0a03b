"""Drop the dataflow bindings nothing reads, in time linear in the function's size.

TVM's ``relax.analysis.remove_all_unused`` (and the DeadCodeElimination pass) does the same but takes
minutes on the unrolled RNNs (77 s of DeepSpeech2's 25,000 bindings after SplitMatMulOverConcat, on a
2-core machine). Here every binding's free variables are read once, use counts are kept, and a
worklist removes a binding as soon as its count drops to zero.

What is removed: bindings inside dataflow blocks (pure by construction) whose var is a
``DataflowVar`` that no later binding and not the function's result reads, transitively. Kept
always: bindings outside dataflow blocks, ``match_cast`` bindings (they may define shape variables),
and every non-dataflow var (the block's outputs).
"""
from __future__ import annotations

from tvm import relax

__all__ = ["remove_unused_bindings"]


def remove_unused_bindings(func: relax.Function) -> relax.Function:
    """``func`` without its unused dataflow bindings (see the module docstring), normalized (a
    function built from new blocks gets its struct info)."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return relax.BlockBuilder().normalize(func)
    bindings = [(b_index, k, binding) for b_index, block in enumerate(body.blocks)
                for k, binding in enumerate(block.bindings)]  # (block, index in it, binding)
    uses: dict = {}
    reads = []
    for _, _, binding in bindings:
        free = relax.analysis.free_vars(binding.value)
        reads.append(free)
        for var in free:
            uses[var] = uses.get(var, 0) + 1
    for var in relax.analysis.free_vars(body.body):
        uses[var] = uses.get(var, 0) + 1
    position = {binding.var: n for n, (_, _, binding) in enumerate(bindings)}

    def removable(n):
        b_index, _, binding = bindings[n]
        return (isinstance(body.blocks[b_index], relax.DataflowBlock)
                and isinstance(binding, relax.VarBinding)
                and isinstance(binding.var, relax.DataflowVar)
                and uses.get(binding.var, 0) == 0)

    removed = set()
    todo = [n for n in range(len(bindings)) if removable(n)]
    while todo:
        n = todo.pop()
        if n in removed:
            continue
        removed.add(n)
        for var in reads[n]:
            uses[var] -= 1
            m = position.get(var)
            if m is not None and m not in removed and removable(m):
                todo.append(m)
    kept = [[] for _ in body.blocks]
    for n, (b_index, _, binding) in enumerate(bindings):
        if n not in removed:
            kept[b_index].append(binding)
    blocks = [relax.DataflowBlock(k) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(k)
              for block, k in zip(body.blocks, kept) if k]
    new = relax.Function(func.params, relax.SeqExpr(blocks, body.body), func.ret_ty, func.is_pure,
                         func.attrs, func.span)
    return relax.BlockBuilder().normalize(new)
