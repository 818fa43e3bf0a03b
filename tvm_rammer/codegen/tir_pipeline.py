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
from tvm import s_tir, tirx
from tvm.tirx import compilation_pipeline

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


def _s_tir_passes(config) -> list:
    """TVM 0.27's ``default_s_tir_pipeline`` list (``tvm/s_tir/pipeline.py``), in order."""
    passes = [
        s_tir.transform.CanonicalizeLoop(),
        s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(),
        s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(),
        s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(),
        s_tir.transform.StmtSimplify(),
        s_tir.transform.InjectPermutedLayout(),
        s_tir.transform.AnnotateIrregularLoop(),
        s_tir.transform.InjectSoftwarePipeline(),
        s_tir.transform.TransformMmaBufferLayout(),
        s_tir.transform.LowerOpaqueBlock(),
        tirx.transform.FlattenBuffer(),
        tirx.transform.BF16ComputeLegalize(),
        tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(),
        tirx.transform.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
        s_tir.transform.InjectVirtualThread(),
        s_tir.transform.InjectDoubleBuffer(),
    ]
    if not bool(config.get("tirx.disable_storage_rewrite", False)):
        passes.append(tirx.transform.StorageRewrite())
    if config.get("tirx.use_async_copy", False):
        passes.append(s_tir.transform.LowerAsyncDMA())
    passes += [
        s_tir.transform.HoistIfThenElse(),
        tirx.transform.UnrollLoop(),
        s_tir.transform.RenormalizeSplitPattern(),
        tirx.transform.StmtSimplify(),
        tirx.transform.RemoveNoOp(),
        s_tir.transform.RewriteUnsafeSelect(),
    ]
    if bool(config.get("tirx.instrument_bound_checkers", False)):
        passes.append(s_tir.transform.InstrumentBoundCheckers())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        passes.append(s_tir.transform.InjectPTXLDG32(True))
    if not bool(config.get("tirx.disable_cse_tir", False)):
        passes.append(tirx.transform.CommonSubexprElim())
    if bool(config.get("tirx.instrument_lwp", False)):
        passes.append(s_tir.transform.InstrumentProfileIntrinsics())
    passes += [
        tirx.transform.FP8ComputeLegalize(),
        s_tir.transform.VerifyVTCMLimit(),
        s_tir.transform.LowerVtcmAlloc(),
        tirx.transform.VerifyMemory(),
        tirx.transform.AnnotateEntryFunc(),
        s_tir.transform.ThreadSync("shared"),
        s_tir.transform.ThreadSync("shared.dyn"),
        s_tir.transform.ThreadSync("warp"),
        s_tir.transform.InferFragment(),
        s_tir.transform.LowerThreadAllreduce(),
    ]
    if bool(config.get("tirx.use_async_copy", False)):
        passes.append(s_tir.transform.InjectPTXAsyncCopy())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        passes.append(s_tir.transform.InjectPTXLDG32())
    passes += [
        s_tir.transform.MergeSharedMemoryAllocations(),
        tirx.transform.SplitHostDevice(),
        tirx.transform.MakePackedAPI(),
        tirx.transform.FP8StorageLegalize(),
        tirx.transform.BF16StorageLegalize(),
    ]
    return passes


def prelowered_passes(config=None, skipped=SKIPPED) -> list:
    """TVM's s_tir list for a module with prelowered functions: each pass in ``skipped`` runs on
    the other functions only; every other pass runs on the whole module, as in TVM's pipeline."""
    config = tvm.transform.PassContext.current().config if config is None else config
    return [_on_others(p) if p.info.name in skipped else p for p in _s_tir_passes(config)]


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
        out = pass_(tvm.IRModule(rest, attrs=mod.attrs, global_infos=mod.global_infos)) if rest \
            else tvm.IRModule({}, attrs=mod.attrs, global_infos=mod.global_infos)
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
