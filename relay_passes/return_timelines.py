"""ReturnTimelines: make ``main`` return the timeline buffers of instrumented persistent kernels.

Input: a Relax module after the rProgram rewrite (``RammerGroupRPrograms``), where some call_tirs
call a PrimFunc carrying the attribute ``attr`` (an instrumented persistent kernel, whose LAST
output is its per-run timeline buffer). Output: the same module whose ``main`` returns
``(its old return value, (timeline buffer of each such call, in execution order))`` and whose
attribute ``rammer.timeline_kernels`` lists the callee names in that order. A module without such
calls is returned unchanged.

The buffers are call_tir outputs, so every run of the module gets its own (concurrent runs stay
apart). Must run after the rewrite and before the dataflow lowering passes.
"""
from __future__ import annotations

import json

import tvm
from tvm import relax, tirx

__all__ = ["ReturnTimelines", "TIMELINE_KERNELS_ATTR"]

TIMELINE_KERNELS_ATTR = "rammer.timeline_kernels"


def _instrumented_callee(mod: tvm.IRModule, value, attr: str):
    """The callee's name when ``value`` is a call_tir (or call_tir_inplace: an rProgram writing a
    KV cache in place) of a PrimFunc with ``attr``, else None."""
    if not (isinstance(value, relax.Call) and value.op in (
            tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_inplace"))):
        return None
    gvar = value.args[0]
    func = mod[gvar] if isinstance(gvar, tvm.ir.GlobalVar) else None
    if isinstance(func, tirx.PrimFunc) and func.attrs is not None and attr in func.attrs:
        return gvar.name_hint
    return None


@tvm.transform.module_pass(opt_level=0, name="ReturnTimelines")
class ReturnTimelines:
    """Return the last output of every call_tir to a PrimFunc with attribute ``attr`` from ``main``.

    Parameters
    ----------
    attr: the PrimFunc attribute that marks an instrumented kernel (default
        ``"rammer.timeline_words"``, set by ``tvm_rammer.codegen.persistent``).
    """

    def __init__(self, attr: str = "rammer.timeline_words"):
        self.attr = attr

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        main = mod["main"]
        if not isinstance(main.body, relax.SeqExpr):
            return mod
        blocks, timelines, names = [], [], []
        for block in main.body.blocks:
            bindings = []
            for binding in block.bindings:
                bindings.append(binding)
                name = (_instrumented_callee(mod, binding.value, self.attr)
                        if isinstance(binding, relax.VarBinding) else None)
                if name is None:
                    continue
                outputs = binding.var.ty
                if not isinstance(outputs, relax.TupleType):
                    continue  # an instrumented kernel has at least its step state and timeline
                buffer = relax.Var(f"{name}_timeline", outputs.fields[-1])
                bindings.append(relax.VarBinding(
                    buffer, relax.TupleGetItem(binding.var, len(outputs.fields) - 1)))
                timelines.append(buffer)
                names.append(name)
            kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
            blocks.append(kind(bindings))
        if not timelines:
            return mod
        body = relax.SeqExpr(blocks, relax.Tuple([main.body.body, relax.Tuple(timelines)]))
        ret_ty = tvm.ir.TupleType([main.body.body.ty, tvm.ir.TupleType([t.ty for t in timelines])])
        new_main = relax.Function(main.params, body, ret_ty, is_pure=main.is_pure, attrs=main.attrs)
        updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        updated[mod.get_global_var("main")] = relax.BlockBuilder().normalize(new_main)
        return updated.with_attr(TIMELINE_KERNELS_ATTR, json.dumps(names))
