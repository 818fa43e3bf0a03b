"""TVM's TIR lowering, without lowering the persistent kernels a second time.

``tvm.compile`` lowers every PrimFunc of the module with the ``"s_tir"`` TIR pipeline (what its
``tir_pipeline="default"`` names). A persistent kernel is made of rKernel bodies that
``tir_templates.prelower`` has already taken through that pipeline's prefix, one kernel at a time,
and our own glue (the dispatch loop, waits and flat buffer views), written in lowered form. Running
the whole pipeline again over the persistent kernel costs seconds to minutes and buys nothing:

- :data:`SKIPPED`: passes whose second run changes nothing at all. ``s_tir.CompactBufferAllocation``
  re-derives the region of every local array from every access under the whole kernel's conditions
  (29.8 s of SqueezeNet's 34 s ``tvm.compile``; TVM's default pipeline takes 2.4 s for the model).
- :data:`REDONE_BY_NVCC`: optimisations that already ran on every body and whose second run over the
  assembled kernel rewrites its TIR (simplified and shared index expressions, renamed variables)
  but not the machine code: nvcc's own optimiser does that work again, and on every zoo model the
  persistent kernel's SASS is the same either way (``scripts/relower_check.py`` compares the
  listings, and on a GPU the outputs and latencies;
  ``benchmarks/results/relower-2026-11-23-7d7a306.json``).
  ``s_tir.HoistIfThenElse`` is three steps (the hoisting, ``StmtSimplify``, ``RemoveNoOp``): its
  ``RemoveNoOp`` is among them (named ``"s_tir.HoistIfThenElse/tirx.RemoveNoOp"``), its other steps
  are not. Skipping its ``StmtSimplify``, or ``s_tir.RenormalizeSplitPattern``, changes the SASS of
  some models (NASNet's kernel: 16 instructions and 28 spill bytes fewer without that simplify;
  ResNeXt-29's: 16 instructions and 24 spill bytes more without the renormalisation), which only a
  GPU can say is as fast; so does skipping the ``StmtSimplify`` of ``tvm.tirx.build``'s device
  finalization (AlexNet's kernel).

:func:`install` registers, in TVM's TIR pipeline registry, a ``"s_tir"`` pipeline that runs TVM's own
one, except that functions carrying :data:`PRELOWERED_ATTR` skip the passes in :data:`SKIPPED` and
:data:`REDONE_BY_NVCC` (:func:`prelowered_passes`); each of those passes runs on the other functions
only. A module with no such function gets exactly TVM's pipeline. ``tests/test_tir_pipeline.py``
checks that skipping :data:`SKIPPED` gives TVM's TIR, that every other function is lowered as by
TVM, and that the persistent kernels' SASS is the same as with TVM's whole pipeline.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

from tir_templates.s_tir_passes import s_tir_passes

from . import rkernel_functions

PRELOWERED_ATTR = "rammer.prelowered"
_NAME = "s_tir"
_MARK = "_rammer_prelowered_aware"

# Passes of TVM's s_tir pipeline whose second run leaves a persistent kernel as it is: each ran on
# every rKernel body in tir_templates.prelower, and the glue around the bodies is written flat and
# simplified already (tests/test_tir_pipeline.py compares the lowered kernels).
SKIPPED = frozenset({
    "s_tir.CompactBufferAllocation",
    "s_tir.StmtSimplify",
    "tirx.RemoveNoOp",
})

# Optimisations that ran on every body in prelower and change the assembled kernel's TIR but not
# its SASS (the same listing on every zoo model: benchmarks/results/relower-2026-11-23-7d7a306.json,
# from scripts/relower_check.py; tests/test_tir_pipeline.py on reduced models).
REDONE_BY_NVCC = frozenset({
    "tirx.StmtSimplify",
    "tirx.CommonSubexprElim",
    "s_tir.HoistIfThenElse/tirx.RemoveNoOp",  # the last step of the hoisting pass
})


def prelowered_passes(config=None, skipped=SKIPPED | REDONE_BY_NVCC) -> list:
    """TVM's s_tir list for a module with prelowered functions: each pass in ``skipped`` runs on
    the other functions only; every other pass runs on the whole module, as in TVM's pipeline. A
    step of one of TVM's composite passes is named ``"<pass>/<step>"`` (``s_tir.HoistIfThenElse``
    is ``s_tir.InsertHoistIfThenElse``, ``s_tir.StmtSimplify`` and ``tirx.RemoveNoOp``)."""
    config = tvm.transform.PassContext.current().config if config is None else config
    return [_restricted(p, skipped) for p in s_tir_passes(config)]


def _restricted(pass_, skipped, parent: str = ""):
    """``pass_`` with itself, or each of its steps named in ``skipped``, run on the functions that
    are not prelowered only."""
    name = f"{parent}/{pass_.info.name}" if parent else pass_.info.name
    if name in skipped:
        return _on_others(pass_)
    if isinstance(pass_, tvm.transform.Sequential) and any(
            f"{name}/{p.info.name}" in skipped for p in pass_.passes):
        return tvm.transform.Sequential([_restricted(p, skipped, name) for p in pass_.passes],
                                        opt_level=pass_.info.opt_level, name=pass_.info.name,
                                        required=list(pass_.info.required))
    return pass_


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
            mod = tvm.transform.Sequential(prelowered_passes())(mod)
            return rkernel_functions.outline_module(mod)

        return _run, finalize_host, finalize_device

    setattr(factory, _MARK, True)
    return factory


def install() -> None:
    """Wrap TVM's ``"s_tir"`` TIR pipeline and register the CUDA source post-processing of
    ``rkernel_functions`` (idempotent; called when ``tvm_rammer`` is imported)."""
    rkernel_functions.install_postproc()  # __noinline__ on the outlined rKernel bodies
    original = compilation_pipeline.PIPELINE_MAP[_NAME]
    if getattr(original, _MARK, False):
        return
    compilation_pipeline.register_tir_pipeline(_NAME, _aware(original))
