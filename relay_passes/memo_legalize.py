"""MemoLegalizeOps: TVM's LegalizeOps, legalizing each distinct operator signature once.

An unrolled RNN repeats the same few operators thousands of times: DeepSpeech2's main has 35,713
calls after the graph rewrites, of a few hundred distinct (operator, attributes, argument types)
signatures. ``relax.transform.LegalizeOps`` runs the operator's legalization for every call (a TE
compute, ``create_prim_func``, then the block builder's structural de-duplication of the new
PrimFunc): 17 s of DeepSpeech2's compile.

Input: Relax with high-level operators. This pass runs ``relax.transform.LegalizeOps`` with a
``customize_legalize_map`` that wraps each operator's own ``FLegalize``: the first call of a
signature is legalized by it; when the result is a plain ``call_tir`` of exactly the call's tensor
arguments in their order, later calls of the same signature become a ``call_tir`` of the same PrimFunc on their
arguments, without building it again. A signature is the operator, its attributes, the type of
every tensor argument, every other argument (shapes, indices) as it is, the identity of every
constant argument, and the call's result type. Output: what LegalizeOps outputs (the same
PrimFuncs, de-duplicated as LegalizeOps de-duplicates them).
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _is_tensor(arg) -> bool:
    return isinstance(arg, (relax.Var, tvm.ir.expr.Constant)) and isinstance(
        getattr(arg, "ty", None), relax.TensorType)


class _Memo:
    """The wrapped ``FLegalize`` of one operator, with the signatures it has legalized."""

    def __init__(self, legalize):
        self.legalize = legalize
        self.seen = {}  # structural hash -> [(signature, gvar, arg positions, attrs, ty_args)]

    @staticmethod
    def signature(call):
        parts = [call.op, call.attrs, call.ty]
        for arg in call.args:
            if isinstance(arg, tvm.ir.expr.Constant):
                parts.append(tvm_ffi.convert(["constant", arg.__hash__()]))
            elif _is_tensor(arg):
                parts.append(arg.ty)
            else:
                parts.append(arg)
        return tvm_ffi.convert(parts)

    def __call__(self, bb, call):
        sig = self.signature(call)
        key = tvm_ffi.structural_hash(sig)
        for other, gvar, positions, attrs, ty_args in self.seen.get(key, ()):
            if tvm_ffi.structural_equal(sig, other):
                args = relax.Tuple([call.args[j] for j in positions])
                return relax.Call(CALL_TIR, [gvar, args], attrs, ty_args)
        result = self.legalize(bb, call)
        reusable = self._reusable(call, result)
        if reusable is not None:
            self.seen.setdefault(key, []).append((sig, *reusable))
        return result

    @staticmethod
    def _reusable(call, result):
        """(gvar, positions of the call's tensor arguments, attrs, ty_args) when ``result`` is a
        call_tir of a GlobalVar on exactly ``call``'s tensor arguments in their order, else None."""
        if not (isinstance(result, relax.Call) and result.op.same_as(CALL_TIR)
                and len(result.args) == 2 and isinstance(result.args[0], tvm.ir.GlobalVar)
                and isinstance(result.args[1], relax.Tuple)):
            return None
        positions = [j for j, arg in enumerate(call.args) if _is_tensor(arg)]
        fields = result.args[1].fields
        if len(fields) != len(positions) or not all(
                f.same_as(call.args[j]) for f, j in zip(fields, positions)):
            return None  # not the call's tensors in their order: nothing to reuse safely
        return result.args[0], positions, result.attrs, result.ty_args


def _op_names(mod: tvm.IRModule) -> set:
    names = set()

    def visit(call):
        if isinstance(call.op, tvm.ir.Op):
            names.add(call.op.name)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func.body, (relax.Call, visit))
    return names


@tvm.transform.module_pass(opt_level=0, name="MemoLegalizeOps")
class MemoLegalizeOps:
    """``relax.transform.LegalizeOps`` with every operator's legalization memoised per signature."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        custom = {}
        for name in _op_names(mod):
            legalize = tvm.ir.Op.get(name).get_attr("FLegalize")
            if legalize is not None:
                custom[name] = _Memo(legalize)
        return relax.transform.LegalizeOps(customize_legalize_map=custom)(mod)
