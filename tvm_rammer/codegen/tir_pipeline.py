"""TVM's TIR lowering, without lowering the persistent kernels a second time.

``tvm.compile`` lowers every PrimFunc of the module with the ``"s_tir"`` TIR pipeline (what its
``tir_pipeline="default"`` names). A persistent kernel is made of rKernel bodies that
``tir_templates.prelower`` has already taken through that pipeline's prefix, one kernel at a time,
and our own glue (the dispatch loop, waits and flat buffer views), written in lowered form. Running
the prefix again over the whole persistent kernel changes nothing in its code but costs seconds to
minutes: ``s_tir.CompactBufferAllocation`` re-derives the region of every local array from every
access under the whole kernel's conditions (29.8 s of SqueezeNet's 34 s ``tvm.compile``; TVM's default
pipeline takes 2.4 s for the model).

:func:`install` registers, in TVM's TIR pipeline registry, a ``"s_tir"`` pipeline that runs TVM's own
one, except that functions carrying :data:`PRELOWERED_ATTR` skip the passes in :data:`SKIPPED`,
which ``prelower`` already ran on every body (:func:`prelowered_passes`);
each of those passes runs on the other functions only. A module with no such function gets
exactly TVM's pipeline. ``tests/test_tir_pipeline.py`` checks that the lowered module is the same
either way.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

from tir_templates.s_tir_passes import s_tir_passes

PRELOWERED_ATTR = "rammer.prelowered"
_NAME = "s_tir"
_MARK = "_rammer_prelowered_aware"

# Passes of TVM's s_tir pipeline that a persistent kernel skips: each ran on every rKernel body in
# tir_templates.prelower, and the glue around the bodies is written flat and simplified already.
# Chosen by comparing the lowered kernels (tests/test_tir_pipeline.py): skipping HoistIfThenElse
# as well changes what CommonSubexprElim later binds, so it stays.
SKIPPED = frozenset({
    "s_tir.CompactBufferAllocation",
    "s_tir.StmtSimplify",
    "tirx.RemoveNoOp",
})


def prelowered_passes(config=None, skipped=SKIPPED) -> list:
    """TVM's s_tir list for a module with prelowered functions: each pass in ``skipped`` runs on
    the other functions only; every other pass runs on the whole module, as in TVM's pipeline."""
    config = tvm.transform.PassContext.current().config if config is None else config
    return [_on_others(p) if p.info.name in skipped else p for p in s_tir_passes(config)]


def is_prelowered(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs and func.attrs.get(PRELOWERED_ATTR, False))


def _on_others(pass_):
    """``pass_`` over the module's functions that are not prelowered; those pass through."""

    @tvm.transform.module_pass(opt_level=0, name=pass_.info.name)
    def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        pre = {gv: f for gv, f in mod.functions_items() if is_prelowered(f)}
        if not pre:
            return pass_(mod)
        rest = {gv: f for gv, f in mod.functions_items() if gv not in pre}
        if not rest:
            return mod
        out = pass_(tvm.IRModule(rest, attrs=mod.attrs, global_infos=mod.global_infos))
        out.update(tvm.IRModule(pre))
        return out

    return _run


def _aware(original):
    """A pipeline factory: ``original``'s pipeline, or for a module with prelowered functions
    :func:`prelowered_passes`."""

    def factory(**kwargs):
        pipeline, finalize_host, finalize_device = original(**kwargs)

        @tvm.transform.module_pass(opt_level=0, name="RammerPrelowerAwareTIRPipeline")
        def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
            if not any(is_prelowered(f) for f in mod.functions.values()):
                return pipeline(mod)
            return tvm.transform.Sequential(prelowered_passes())(mod)

        return _run, finalize_host, finalize_device

    setattr(factory, _MARK, True)
    return factory


def install() -> None:
    """Wrap TVM's ``"s_tir"`` TIR pipeline (idempotent; called when ``tvm_rammer`` is imported)."""
    original = compilation_pipeline.PIPELINE_MAP[_NAME]
    if getattr(original, _MARK, False):
        return
    compilation_pipeline.register_tir_pipeline(_NAME, _aware(original))
