"""TVM 0.27's s_tir lowering pipeline as a list of passes (what ``tvm.compile`` runs on every
PrimFunc, ``tvm.s_tir.pipeline.default_s_tir_pipeline``), so that ``prelower`` can run a prefix of it
on one kernel and ``tvm_rammer.codegen.tir_pipeline`` the rest on a persistent kernel. TVM builds
the list inside its pipeline function and does not expose it; this is the same list, in order.
"""
from __future__ import annotations

from tvm import s_tir, tirx


def s_tir_passes(config) -> list:
    """TVM 0.27's ``default_s_tir_pipeline`` list (``tvm/s_tir/pipeline.py``), in order, for a
    PassContext ``config`` (a dict-like; ``{}`` = TVM's defaults)."""
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
