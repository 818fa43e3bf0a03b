"""LiftWeightTransforms: what ``main`` computes from its weights alone goes to ``transform_params``.

TVM's ``LiftTransformParams`` pattern, written for tvm-rammer's pipeline. A model imported with
its weights as parameters (``from_onnx(..., keep_params_in_input=True)``: ``main(inputs...,
weights...)`` with the function attribute ``num_input``) still gets every weight rewrite of the
pipeline (batch norm folded into the conv's weights, W cut into row blocks, columns interleaved,
reshapes of biases): the rewrites emit them as operators on the weight parameters instead of numpy
values. This pass then takes every binding of ``main`` that reads weights (and constants) only,
and no input, out of ``main`` into a function ``transform_params``, called once after loading:

    w = transform_params(*raw_weights)     # a tuple: the weights main reads, transformed
    out = main(*inputs, *w)

In: an IRModule whose ``main`` has ``num_input`` (its parameters past that count are weights; after
an earlier run of this pass, the transformed weights). Run where FoldConstant runs in the embedded
mode (before grouping: what FoldConstant would fold there is what this pass lifts, so ``main`` keeps
the same operators), and again after a rewrite that emits weight operators later
(GEMVEpilogueFusion's column interleave): a second run appends to the existing ``transform_params``
(its outputs feed the newly lifted bindings), so there is always one transform of the raw weights.
Bindings in a dataflow block are lifted when pure, free of symbolic shape variables and reading at
least one weight; match_casts and other blocks stay. Out: ``main(inputs..., transformed...)`` with
``num_input`` kept, and ``transform_params(raw...)`` (public) returning the tuple of transformed
weights in order: the raw weights main reads unchanged first (raw order), then the lifted values
(binding order). Without ``num_input``, or when nothing reads weights only and no transform exists
yet, the module is returned unchanged (main then takes the raw weights as they are).
"""
from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["LiftWeightTransforms", "TRANSFORM_NAME", "WeightsAsInputs", "lift_weight_transforms",
           "substitute", "weight_params"]

TRANSFORM_NAME = "transform_params"


def weight_params(func) -> list:
    """The parameters of ``func`` past its ``num_input`` attribute (its weights); [] without it."""
    attrs = func.attrs
    if attrs is None or "num_input" not in attrs:
        return []
    return list(func.params[int(attrs["num_input"]):])


@tvm.transform.module_pass(opt_level=0, name="WeightsAsInputs")
class WeightsAsInputs:
    """With the weights embedded (``RammerConfig(weights="embedded")``, the default), every
    parameter of ``main`` is an input: its ``num_input`` attribute, which a Relax module made
    elsewhere may carry (``from_onnx(keep_params_in_input=True)``, TVM's exported-program import),
    is dropped, so that no weight rewrite treats the parameters past it as weights while nothing
    lifts what they emit (it would run on every inference). In: any IRModule; out: the same, with
    ``main`` as before and no ``num_input``. Runs first in the rammer pipeline's graph passes."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(gv.name_hint == "main" for gv in mod.get_global_vars()):
            return mod
        main = mod["main"]
        if main.attrs is None or "num_input" not in main.attrs:
            return mod
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs, global_infos=mod.global_infos)
        out["main"] = main.without_attr("num_input")
        return out


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Replace vars by expressions (in binding values only)."""

    def __init__(self, remap):
        super().__init__()
        self.remap = remap

    def visit_var_(self, var):
        return self.remap.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.remap.get(var, var)


def substitute(expr, values: dict):
    """``expr`` with each var of ``values`` replaced by its expression."""
    return _Substitute(values).visit_expr(expr)


def _liftable(value, lifted) -> bool:
    """Whether a binding value reads only lifted vars/weights (at least one) and constants."""
    if relax.analysis.contains_impure_call(value) or relax.analysis.free_symbolic_vars(value):
        return False
    reads = relax.analysis.free_vars(value)
    return bool(reads) and all(v in lifted for v in reads)


def _transform_parts(mod):
    """(raw params, bindings, output exprs) of an existing transform, or None."""
    names = [gv.name_hint for gv in mod.get_global_vars()]
    if TRANSFORM_NAME not in names:
        return None
    func = mod[TRANSFORM_NAME]
    bindings = [b for blk in func.body.blocks for b in blk.bindings]
    out = func.body.body
    value = {b.var: b.value for b in bindings}.get(out)
    if isinstance(value, relax.Tuple):
        bindings = [b for b in bindings if not b.var.same_as(out)]
        fields = list(value.fields)
    else:
        fields = [relax.TupleGetItem(out, i) for i in range(len(out.ty.fields))]
    return list(func.params), bindings, fields


def lift_weight_transforms(mod: tvm.IRModule) -> tvm.IRModule:
    """The module with main's weight-only bindings in ``transform_params`` (module docstring)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod
    main = mod["main"]
    weights = weight_params(main)
    if not weights or not isinstance(main.body, relax.SeqExpr):
        return mod
    existing = _transform_parts(mod)
    lifted = set(weights)
    moved, kept_blocks = [], []
    for block in main.body.blocks:
        kept = []
        for b in block.bindings:
            if isinstance(block, relax.DataflowBlock) and isinstance(b, relax.VarBinding) \
                    and _liftable(b.value, lifted):
                lifted.add(b.var)
                moved.append(b)
            else:
                kept.append(b)
        kept_blocks.append((block, kept))
    if not moved and existing is None:
        return mod
    # what main still reads of the weights and lifted values, in definition order
    still_read = set()
    for _, kept in kept_blocks:
        for b in kept:
            still_read.update(relax.analysis.free_vars(b.value))
    still_read.update(relax.analysis.free_vars(main.body.body))
    order = weights + [b.var for b in moved]
    needed = [v for v in order if v in still_read]

    # the transform: the raw weights in, the needed values out
    if existing is None:
        raw = [relax.Var(str(p.name), p.ty) for p in weights]
        first, fields = [], raw
    else:
        raw, first, fields = existing
    remap = {}
    bb = relax.BlockBuilder()
    with bb.function(TRANSFORM_NAME, raw, attrs={"global_symbol": TRANSFORM_NAME}):
        with bb.dataflow():
            for b in first:  # the earlier transform's bindings, as they were
                remap[b.var] = bb.emit(_Substitute(remap).visit_expr(b.value), str(b.var.name))
            if len(weights) != len(fields):
                raise ValueError(f"{TRANSFORM_NAME} returns {len(fields)} weights but main takes "
                                 f"{len(weights)}: a pass between two weight lifts changed main's "
                                 f"weight parameters")
            for w, field in zip(weights, fields):  # main's weights = the earlier outputs
                remap[w] = _Substitute(dict(remap)).visit_expr(field)
            for b in moved:
                remap[b.var] = bb.emit(_Substitute(remap).visit_expr(b.value), str(b.var.name))
            out = bb.emit_output(relax.Tuple([remap[v] for v in needed]))
        bb.emit_func_output(out)
    transform = bb.get()[TRANSFORM_NAME]

    # main: the inputs, then one parameter per needed value
    num_input = int(main.attrs["num_input"])
    params = {v: relax.Var(str(v.name), v.ty) for v in needed}
    sub = _Substitute(params)
    blocks = []
    for block, kept in kept_blocks:
        new = [relax.VarBinding(b.var, sub.visit_expr(b.value)) if isinstance(b, relax.VarBinding)
               else relax.MatchCast(b.var, sub.visit_expr(b.value), b.ty) for b in kept]
        if new:
            blocks.append(relax.DataflowBlock(new) if isinstance(block, relax.DataflowBlock)
                          else relax.BindingBlock(new))
    new_main = relax.Function([*main.params[:num_input], *params.values()],
                              relax.SeqExpr(blocks, sub.visit_expr(main.body.body)), main.ret_ty,
                              main.is_pure, main.attrs)
    if "params" in main.attrs:  # the frontend's raw arrays: they travel apart
        new_main = new_main.without_attr("params")
    out_mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    out_mod[mod.get_global_var("main")] = relax.BlockBuilder().normalize(new_main)
    if existing is None:
        out_mod[TRANSFORM_NAME] = transform
    else:
        out_mod[mod.get_global_var(TRANSFORM_NAME)] = transform
    return out_mod


@tvm.transform.module_pass(opt_level=0, name="LiftWeightTransforms")
class LiftWeightTransforms:
    """Move main's weight-only bindings into ``transform_params`` (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return lift_weight_transforms(mod)
