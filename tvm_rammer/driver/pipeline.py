"""The rammer Relax pipeline and how TVM finds it.

Two ways in, both ordinary TVM usage:

* ``tvm.compile(mod, target=T, relax_pipeline="rammer")`` with any CUDA target (a pipeline registered
  with ``relax.register_pipeline``);
* ``tvm.compile(mod, target=T)`` where ``T`` is a rammer target (``rammer/nvidia-h100`` or
  ``tvm_rammer.rammer_target(...)``: a CUDA target whose keys start with ``"rammer"``).

TVM 0.27 picks the default Relax pipeline of a GPU target by the target kind's name
(``relax.pipeline.get_default_pipeline``) and has no registry for it, so :func:`install` wraps
``tvm.relax.backend.cuda.get_default_pipeline`` and ``tvm.relax.backend.rocm.get_default_pipeline``
once: a target with the ``"rammer"`` key gets the rammer pipeline, every other target exactly what
it got before. This is the only piece of TVM state
tvm-rammer touches outside TVM's registries (pipelines, target tags).

The pipeline itself is the flat list in :func:`rammer_passes`, with the "why" of each ordering
constraint on its right.
"""

from __future__ import annotations

import json
import logging
import time

import tvm
import tvm_ffi
from tvm import relax

from relay_passes.batch_shared_matmuls import BatchSharedWeightMatMuls
from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.cache_write import CacheSlotWrite
from relay_passes.decode_attention import DecodeAttentionSplit
from relay_passes.decode_attention_row import DecodeAttentionStepRow
from relay_passes.float16_accumulate import Float16Accumulation, ToMixedPrecisionChecked
from relay_passes.fold_batch_norm import FoldBatchNormToConvBias
from relay_passes.fold_constant_ops import FoldConstantOps
from relay_passes.gemv_epilogue import GEMVEpilogueFusion
from relay_passes.inference_dropout import RemoveInferenceDropout
from relay_passes.inplace_fusion import InPlaceWriteFusion
from relay_passes.lift_weights import LiftWeightTransforms, WeightsAsInputs
from relay_passes.memo_legalize import MemoLegalizeOps
from relay_passes.norm_gemv import NormGEMVFusion
from relay_passes.return_timelines import ReturnTimelines
from relay_passes.split_k_gemv import SplitKGEMV
from relay_passes.split_matmul_concat import SplitMatMulOverConcat
from relay_passes.split_tail_fusion import SplitTailFusion
from relay_passes.split_to_slices import SplitToSlices
from tir_templates.decode_attention import DecodeAttentionRule
from tir_templates.default_schedule import default_schedule_pass
from tir_templates.exact_pow import ExactPowers
from tir_templates.gemv_epilogue import GEMVEpilogue
from tir_templates.norm_gemv import NormGEMV
from tir_templates.nt_gemv import NTGEMV

from .backend import RammerBackend
from ..codegen.tir_pipeline import install as install_tir_pipeline
from ..codegen.tvm_default import DefaultPipelineFailed, run_default
from ..config import RammerConfig
from ..host.cuda_compile import install as install_cuda_compile
from .launches import count_launches
from .report import UNPLACED_ATTR, unplaced_operators
from ..onnx_prep.shapes import unbound_message, unbound_params
from ..rocm.build import install as install_rocm_build
from ..scheduling.rkernels import cost_config, vdevice_for
from ..target import KINDS, is_rammer_target, plain_target, register_tags, rkernel_target
from ..tuning.versions import StashUnscheduled

PIPELINE_NAME = "rammer"
DEFAULT_UNAVAILABLE_ATTR = "rammer.default_unavailable"  # why TVM's default could not be compared
LOG = logging.getLogger("tvm_rammer")


def own_schedule_rules() -> tuple:
    """The schedule rules the pipeline applies before dlight's, each to the functions one of its
    graph passes made (GEMVEpilogueFusion's cells, DecodeAttentionSplit's phases, NormGEMVFusion's
    norm + GEMVs, SplitKGEMV's transposed-weight GEMVs): an operator's own version is the schedule
    of the rule that took it (its ``schedule_name``), else dlight's."""
    return (GEMVEpilogue(), DecodeAttentionRule(), NormGEMV(), NTGEMV())


def rammer_passes(target: tvm.target.Target, config: RammerConfig, profiler=None,
                  started: float | None = None) -> list:
    """The rammer Relax pipeline as a flat list of passes. ``profiler``: where rKernel and rProgram
    times come from (``tuning.profiler.Profiler``); None = ``backend.make_profiler``'s default,
    whose ``profile_budget_s`` counts from ``started`` (``time.monotonic()``; None: the back end's
    start)."""
    cuda_backend = kind_backend(target)  # TVM's CUDA or ROCm backend passes
    timeline = [ReturnTimelines()] if config.timeline else []
    return [
        *cuda_backend.library_dispatch_passes(target),  # TVM's sampling/sort-scan dispatch, unchanged
        *graph_passes(config, split_k_passes(target, config),  # rewrites and groups, to FuseTIR
                      decode_attention_pass(target, config)),
        StashUnscheduled(),                            # rKernel versions re-schedule these
        _with_target(rkernel_target(target, config),   # rKernels = dlight (fused cells: ours)
                     default_schedule_pass(*own_schedule_rules())),
        _with_target(target, RammerBackend(config, profiler, started)),  # versions, policy, kernels
        *([LiftWeightTransforms()] if config.weights == "apart" else []),  # blobs packed once
        *timeline,                                     # after the rewrite: main returns the buffers
        *cuda_backend.dataflow_lower_passes(target),   # TVM's own VM lowering from here on
        *cuda_backend.finalize_passes(target),
    ]


def graph_passes(config: RammerConfig, split_k: list | tuple = (),
                 decode_attention: DecodeAttentionSplit | None = None) -> list:
    """The target-independent part of :func:`rammer_passes`: the graph rewrites, legalization and
    grouping, to ``FuseTIR`` (one PrimFunc per operator group, unscheduled). Tests build it for
    llvm to check numerics, e.g. with the weights apart. ``split_k``: the SplitKGEMV pass for the
    target's vDevice (:func:`split_k_passes`; run when ``config.split_k``); none by default.
    ``decode_attention``: the DecodeAttentionSplit for the target's vDevice
    (:func:`decode_attention_pass`); None: its target-independent default (a thread per slot,
    runnable on llvm with the thread loops serial)."""
    fusion = [BranchPreservingFusion(prologues=config.prologue_fusion)] if config.fusion else []
    if config.fusion and config.tail_fusion:
        fusion.insert(0, SplitTailFusion())            # before the chains: tails take their fan-outs
    lift = [LiftWeightTransforms()] if config.weights == "apart" else []
    inputs_only = [] if config.weights == "apart" else [WeightsAsInputs()]  # no num_input weights
    if config.fusion and config.gemv_epilogue:
        fusion.append(GEMVEpilogueFusion(config.max_rtask_threads))  # after the groups: cell = 1 op
        fusion += lift                                 # weights apart: its interleave -> transform
    if config.fusion and config.norm_fusion:
        fusion.append(NormGEMVFusion(max_threads=config.max_rtask_threads))  # norm = each GEMV's prologue
    split_matmul = [SplitMatMulOverConcat()] if config.split_concat_matmul else []
    if config.batch_shared_matmuls:
        split_matmul.append(BatchSharedWeightMatMuls())  # after the split: input halves share W_x
    split_k = list(split_k) if config.split_k else []
    return [
        *inputs_only,                                  # embedded: every main parameter an input
        *inference_passes(),                           # BatchNorm folded/decomposed: no split rPrograms
        *mixed_precision_passes(config),               # float16: after BN folding (in fp32), before legalizing
        decode_attention or DecodeAttentionSplit(),    # after ToMixedPrecision (it rejects call_tir)
        *([DecodeAttentionStepRow()] if config.attention_row else []),  # q, k, v from the row
        SplitToSlices(),                               # one kernel per part: parts become rTasks
        *split_matmul,                                 # high-level ops; FoldConstant folds 0 @ W_h
        FoldConstantOps(),                             # bias reshapes, BN scales, casts: numpy, no kernel builds
        *split_k,                                      # after the fold: W constants of their final dtype
        CacheSlotWrite(config.inplace_cache),          # KV-cache scatter: 1 kernel (in place: the slot only)
        MemoLegalizeOps(),                             # every op -> call_tir (each signature built once)
        ExactPowers(),                                 # pow(x, 2) -> x * x: fast math's powf is NaN for x < 0
        relax.transform.AnnotateTIROpPattern(),        # fusion reads op_pattern
        relax.transform.FoldConstant(),                # before grouping: no rTasks for constants
        *lift,                                         # weights apart: no rTasks for weight-only ops
        *fusion,                                       # never joins two independent branches
        *([InPlaceWriteFusion()] if config.fusion else []),  # a cache write + its update: 1 kernel
        relax.transform.FuseTIR(),                     # one PrimFunc per fused group
    ]


def split_k_passes(target: tvm.target.Target, config: RammerConfig) -> list:
    """``[SplitKGEMV]`` for the target's vDevice (``vdevice_for``), [] when ``config.split_k`` is
    off: the vEUs to fill are its SMs x the vEUs per SM of an rTask of ``max_rtask_threads``
    threads (default registers, no shared memory; the count before any rKernel is known, H100
    preset: 132 x 4 = 528); S and whether to split are the cost model's (``cost_config``: its
    bandwidth and per-rTask overhead; a split must save more than a barrier and a dependent
    rTask). A GEMV after a row norm is left to NormGEMVFusion when it runs. A chosen GEMV becomes
    one operator over its transposed weight (``nt``, ``max_rtask_threads`` threads an rTask) where
    that has a layout, else the partial and the sum."""
    if not config.split_k:
        return []
    vdevice = vdevice_for(target, config)
    cost = cost_config(config, vdevice)
    return [SplitKGEMV(_graph_veus(vdevice, config), step_us=cost.barrier_us + cost.per_rtask_overhead_us,
                       mem_bw_gbps=cost.mem_bw_gbps, rtask_us=cost.per_rtask_overhead_us,
                       leave_norm_rows=config.fusion and config.norm_fusion, nt=True,
                       threads=config.max_rtask_threads)]


def decode_attention_pass(target: tvm.target.Target, config: RammerConfig) -> DecodeAttentionSplit:
    """DecodeAttentionSplit for the target's vDevice: phase 1 a warp per slot in rTasks of
    ``max_rtask_threads`` threads, its chunk filling the vEUs (as :func:`split_k_passes` counts
    them: SMs x the vEUs per SM of such an rTask) with one round of rTasks; the combine's cast,
    head transpose and reshape folded into its store. A target whose warps are not 32 lanes
    (ROCm's 64-lane waves: its code generator has no ``tvm_warp_shuffle_xor``, and the warp
    kernels' lanes are 32) keeps the thread-per-slot kernels and ``chunk_for``'s chunk."""
    vdevice = vdevice_for(target, config)
    if vdevice.warp_size != 32:
        return DecodeAttentionSplit(fold_consumers=True)
    return DecodeAttentionSplit(veus=_graph_veus(vdevice, config), threads=config.max_rtask_threads,
                                fold_consumers=True)


def _graph_veus(vdevice, config: RammerConfig) -> int:
    """The vEUs the graph passes fill (SplitKGEMV, DecodeAttentionSplit): the vDevice's SMs x the
    vEUs per SM of an rTask of ``max_rtask_threads`` threads (default registers, no shared memory:
    the count before any rKernel is known; H100 preset 132 x 4 = 528)."""
    return vdevice.num_sms * vdevice.occupancy(config.max_rtask_threads, None, 0)


def inference_passes() -> list:
    """Exported models carry training-time structure that would split rPrograms: inference
    BatchNormalization (a multi-kernel op that cannot become rTasks) and outputs nobody reads
    (BatchNorm's running statistics, Dropout's mask). Run on high-level Relax, before LegalizeOps."""
    return [
        relax.transform.FoldBatchnormToConv2D(),       # conv2d -> BN: BN scales the conv's weights
        FoldBatchNormToConvBias(),                     # conv2d + bias -> BN (ONNX Conv with B): same
        relax.transform.DecomposeOpsForInference(),    # other BNs: elementwise ops that fuse as rTasks
        RemoveInferenceDropout(),                      # Dropout is the identity: no copy kernel
        relax.transform.CanonicalizeBindings(),        # BN's (out, mean, var) tuples -> plain aliases
        relax.transform.DeadCodeElimination(),         # unused statistics and masks cost nothing
    ]


def mixed_precision_passes(config: RammerConfig) -> list:
    """``[ToMixedPrecision(out_dtype="float32")]`` for ``precision="float16"`` (float16 storage,
    conv2d/matmul accumulating in float32; a model it cannot convert: ValueError), else
    Float16Accumulation (the same for a model that is float16 already, e.g. a float16 export;
    nothing for any other)."""
    if config.precision == "float16":
        return [ToMixedPrecisionChecked()]
    return [Float16Accumulation()]


def kind_backend(target: tvm.target.Target):
    """TVM's Relax backend module for the target's kind (``relax.backend.cuda.pipeline`` or
    ``relax.backend.rocm.pipeline``): the library dispatch, legalization, VM lowering passes."""
    if target is not None and target.kind.name == "rocm":
        from tvm.relax.backend.rocm import pipeline as rocm_backend  # pylint: disable=import-outside-toplevel
        return rocm_backend
    from tvm.relax.backend.cuda import pipeline as cuda_backend  # pylint: disable=import-outside-toplevel
    return cuda_backend


def _with_target(target, pass_):
    @tvm.transform.module_pass(opt_level=0, name=f"WithTarget({pass_.info.name})")
    def _run(mod, _ctx):
        with target:
            return pass_(mod)
    return _run


def rammer_pipeline(target: tvm.target.Target | None = None, config: RammerConfig | None = None,
                    profiler=None):
    """The rammer pipeline as one module pass; the target defaults to the one in scope."""
    config = _config_from(config, {})

    @tvm.transform.module_pass(opt_level=0, name="RammerPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        started = time.monotonic()  # the profiling budget counts from the compile's start
        tgt = target or tvm.target.Target.current(allow_none=True)
        if tgt is None or tgt.kind.name not in KINDS:
            raise ValueError(
                f"the rammer pipeline needs a CUDA or ROCm target, got {tgt}; call "
                "tvm.compile(mod, target='rammer/nvidia-h100') or pass a CUDA target")
        unbound = unbound_params(mod)
        if unbound:  # rTasks need static shapes: never worse than TVM's default pipeline
            LOG.warning("tvm-rammer: %s", unbound_message(unbound))
            return _default_or_guarded(mod, plain_target(tgt), config.weights)
        with tgt:
            lowered = tvm.transform.Sequential(rammer_passes(tgt, config, profiler, started))(mod)
        if config.timeline or not unplaced_operators(lowered):
            return lowered  # every operator in an rProgram: at most as many launches as TVM's
        return _fewer_launches(mod, lowered, tgt, config.weights)

    return _pipeline


def _default_or_guarded(mod: tvm.IRModule, plain, weights: str = "embedded") -> tvm.IRModule:
    """TVM's default pipeline of ``mod`` (a model with symbolic shapes); where TVM's default
    pipeline cannot compile it, the same passes with tvm-rammer's guarded schedule for dlight's
    (:func:`guarded_default_passes`), and one warning saying so. ``weights``: the config's
    (:func:`default_pipeline`)."""
    try:
        return run_default(default_pipeline(plain, weights), mod, plain)
    except DefaultPipelineFailed as err:
        LOG.warning("tvm-rammer: %s; compiled with TVM's default passes and tvm-rammer's "
                    "schedule where dlight's rules fail", err.reason)
    with plain:
        return tvm.transform.Sequential(guarded_default_passes(plain, weights))(mod)


def _fewer_launches(mod: tvm.IRModule, lowered: tvm.IRModule, target,
                    weights: str = "embedded") -> tvm.IRModule:
    """``lowered``, or TVM's default lowering of ``mod`` when that launches fewer kernels: operators
    left as ordinary kernels are fused less than TVM's FuseOps would, and a model with many of
    them must never cost more launches than turning tvm-rammer off. TVM's default lowering is made
    only as far as needed to know: its operators before ``FuseOps`` (:func:`default_anchors_at_least`;
    FuseOps takes 13 of the 19 s of DeepSpeech2's, to FuseTIR), then its fused operators
    (:func:`default_launches_at_least`), then the whole of it. Where TVM's default pipeline cannot
    compile the model (``codegen.tvm_default``), ``lowered`` is kept, with one warning and the
    reason in ``DEFAULT_UNAVAILABLE_ATTR``. ``weights``: the config's (with "apart", TVM's default
    lifts its weight-only operators too, as :func:`default_pipeline`)."""
    plain = plain_target(target)
    ours = count_launches(lowered)
    to_fusion, fusion, finish = default_stages(plain, weights)
    try:
        before_fusion = run_default(tvm.transform.Sequential(to_fusion), mod, plain)
        if ours <= default_anchors_at_least(before_fusion):
            return lowered  # no need to fuse the default's operators to know
        fused = run_default(tvm.transform.Sequential(fusion), before_fusion, plain)
        if ours <= default_launches_at_least(fused):
            return lowered  # no need to finish TVM's default lowering to know
        default = run_default(tvm.transform.Sequential(finish), fused, plain)
    except DefaultPipelineFailed as err:
        LOG.warning("tvm-rammer: %s; tvm-rammer's lowering is kept (%d kernel launches)",
                    err.reason, ours)
        return lowered.with_attr(DEFAULT_UNAVAILABLE_ATTR, err.reason)
    theirs = count_launches(default)
    if ours <= theirs:
        return lowered
    reason = (f"the rammer pipeline needs {ours} kernel launches, TVM's default pipeline {theirs}: "
              "TVM's default pipeline is kept for this model")
    LOG.warning("tvm-rammer: %s", reason)
    return default.with_attr(UNPLACED_ATTR, json.dumps([{"name": "main", "reason": reason,
                                                         "kernel": None}]))


def default_passes(target: tvm.target.Target, weights: str = "embedded") -> list:
    """TVM's default CUDA pipeline (``relax.backend.cuda.get_default_pipeline``), the same module
    out, faster: constants' reshapes and casts folded by numpy first (``FoldConstant`` then has
    less to build) and each operator signature legalized once (``MemoLegalizeOps``). ``weights``
    "apart": weight-only operators lifted into ``transform_params`` after ``FoldConstant``."""
    cuda_backend = kind_backend(target)

    legalize = [MemoLegalizeOps() if p.info.name == "LegalizeOps" else p
                for p in cuda_backend.legalize_passes(target)]
    return [*cuda_backend.library_dispatch_passes(target), FoldConstantOps(),
            *_lift_after_fold(legalize, weights),
            *cuda_backend.dataflow_lower_passes(target), *cuda_backend.finalize_passes(target)]


def _lift_after_fold(passes: list, weights: str) -> list:
    """``passes`` with LiftWeightTransforms after their ``FoldConstant`` for weights "apart" (what
    FoldConstant folds with the weights embedded is what it lifts), else unchanged."""
    if weights != "apart":
        return list(passes)
    names = [p.info.name for p in passes]
    if "FoldConstant" not in names:
        raise ValueError("this target's default legalization has no FoldConstant to lift the "
                         "weight transforms after; compile it with the weights embedded")
    at = names.index("FoldConstant") + 1
    return [*passes[:at], LiftWeightTransforms(), *passes[at:]]


def default_pipeline(target: tvm.target.Target, weights: str = "embedded"):
    """TVM's default Relax pipeline for ``target`` (any kind TVM has one for: CUDA, ROCm, llvm);
    with ``weights="apart"`` the same passes plus LiftWeightTransforms after its ``FoldConstant``
    (a module imported with its weights as parameters: ``main(*inputs, *weights)`` and
    ``transform_params(*raw_weights)``, the other side of every weights-apart comparison).
    ``"embedded"``: exactly ``relax.get_default_pipeline(target)``."""
    if weights == "embedded":
        return relax.get_default_pipeline(target)
    if weights != "apart":
        raise ValueError(f"weights={weights!r}: choose 'embedded' or 'apart'")
    backend = _default_backend(target)

    @tvm.transform.module_pass(opt_level=0, name="DefaultPipelineWeightsApart")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = [*backend.library_dispatch_passes(target),
                      *_lift_after_fold(backend.legalize_passes(target), weights),
                      *backend.dataflow_lower_passes(target), *backend.finalize_passes(target)]
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _default_backend(target: tvm.target.Target):
    """TVM's pipeline module of the target's kind (what ``relax.get_default_pipeline`` uses)."""
    if target.kind.name in KINDS:
        return kind_backend(target)
    if target.kind.name == "llvm":
        from tvm.relax.backend.cpu_generic import pipeline as cpu_backend  # pylint: disable=import-outside-toplevel
        return cpu_backend
    raise ValueError(f"no default pipeline with weights apart for target kind "
                     f"{target.kind.name!r}: use a CUDA, ROCm or llvm target")


def guarded_default_passes(target: tvm.target.Target, weights: str = "embedded") -> list:
    """:func:`default_passes` with dlight's ``ApplyDefaultSchedule`` replaced by tvm-rammer's
    guarded one (``tir_templates.default_schedule``: the next rule where a rule raises, then a plain
    schedule of ours): what compiles a model TVM's default pipeline rejects, when tvm-rammer cannot
    make rPrograms of it (symbolic shapes)."""
    return [default_schedule_pass() if p.info.name == "ApplyDefaultSchedule" else p
            for p in default_passes(target, weights)]


def default_stages(target: tvm.target.Target, weights: str = "embedded") -> tuple:
    """:func:`default_passes` in three lists: up to ``FuseOps`` (legalized, ``op_pattern``
    annotated, constants folded: :func:`default_anchors_at_least` reads that), ``FuseOps`` to
    ``FuseTIR`` (its fused operators, before dlight: :func:`default_launches_at_least`), and the
    passes that finish TVM's default lowering from there."""
    passes = default_passes(target, weights)
    names = [p.info.name for p in passes]
    fuse, fused = names.index("FuseOps"), names.index("FuseTIR") + 1
    return passes[:fuse], passes[fuse:fused], passes[fused:]


# tvm/relax/analysis OpPatternKind kOutEWiseFusable
_OUT_EWISE_FUSABLE = 4


def default_anchors_at_least(annotated: tvm.IRModule) -> int:
    """A lower bound on the launches of TVM's default lowering, from its operators before
    ``FuseOps`` (the first of :func:`default_stages`: legalized, ``op_pattern`` annotated, constants
    folded): the calls in ``main`` that a result is read from, of PrimFuncs of pattern
    kOutEWiseFusable (matmul, conv2d, dense; also softmax- and pooling-like reductions with an
    elementwise output). TVM's FuseOps (``GraphPartitioner``, src/relax/analysis/
    graph_partitioner.cc) never puts two of them in one group: merging two groups that each hold one
    stops TVM (``MergeFromTo``'s check of ``anchor_ref``), and the fusion rules never try it (such an
    operator joins only a path of elementwise/broadcast operators, the other groups only paths of at
    most injective ones). So each is in a fused PrimFunc of its own, which holds a reduction (no
    reshape, never a view) and launches at least one kernel: at most
    :func:`default_launches_at_least` (tests/test_pipeline.py checks it on zoo models). Calls
    whose results nobody reads are left out, as FuseOps and FuseTIR drop them (``FoldConstant``
    has removed them already, unless a pass context disables it)."""
    anchors = 0

    def visit(call):
        nonlocal anchors
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            callee = annotated[call.args[0]]
            if isinstance(callee, tvm.tirx.PrimFunc) and callee.attrs is not None \
                    and int(callee.attrs.get("op_pattern", -1)) == _OUT_EWISE_FUSABLE:
                anchors += 1

    tvm_ffi.structural_walk(relax.analysis.remove_all_unused(annotated["main"]).body,
                            (relax.Call, visit))
    return anchors


def default_launches_at_least(fused: tvm.IRModule) -> int:
    """A lower bound on the launches of TVM's default lowering, from its fused operators before
    dlight (the first two of :func:`default_stages`): every call of a fused PrimFunc is at least one kernel, except
    those that only reshape (``RewriteDataflowReshape`` may make them views). dlight only schedules
    a PrimFunc and the VM lowering after it removes no kernel, so the default launches at least
    this many."""
    reshapes = 0

    def visit(call):
        nonlocal reshapes
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            callee = fused[call.args[0]]
            if isinstance(callee, tvm.tirx.PrimFunc) and relax.analysis.has_reshape_pattern(callee):
                reshapes += 1

    tvm_ffi.structural_walk(fused["main"].body, (relax.Call, visit))
    return count_launches(fused) - reshapes


def install() -> None:
    """Register the ``rammer`` pipeline, the ``rammer/...`` tags, the rammer-target dispatch, the
    TIR pipeline that leaves prelowered persistent kernels' bodies alone (``codegen.tir_pipeline``)
    and the CUDA compile callback that uses nvcc where NVRTC is not usable (``host.cuda_compile``).

    Idempotent; called when ``tvm_rammer`` is imported.
    """
    from tvm.relax import pipeline as relax_pipeline_mod
    from tvm.relax.backend import cuda as cuda_backend

    if PIPELINE_NAME not in relax_pipeline_mod.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(
            lambda config=None, **kwargs: rammer_pipeline(config=_config_from(config, kwargs)))
    register_tags()
    install_tir_pipeline()  # tvm.compile does not lower the persistent kernels a second time
    install_cuda_compile()  # nvcc where NVRTC is not usable (host.cuda_compile)
    install_rocm_build()  # our helper bitcode, each kernel's real workgroup size (rocm.build)
    from tvm.relax.backend import rocm as rocm_backend  # pylint: disable=import-outside-toplevel
    for backend in (cuda_backend, rocm_backend):
        _dispatch_rammer_targets(backend)


def _dispatch_rammer_targets(backend) -> None:
    """``backend.get_default_pipeline`` (TVM picks it by target kind) wrapped once: a rammer
    target gets the rammer pipeline, every other target what it got before."""
    current = backend.get_default_pipeline
    if getattr(current, "_rammer_dispatch", False):
        return

    def get_default_pipeline(target):
        if is_rammer_target(target):
            return rammer_pipeline(target)
        return current(target)

    get_default_pipeline._rammer_dispatch = True
    get_default_pipeline.__doc__ = current.__doc__
    backend.get_default_pipeline = get_default_pipeline


def _config_from(config, kwargs) -> RammerConfig:
    if config is not None and kwargs:
        raise TypeError("pass either config=RammerConfig(...) or keyword options, not both")
    if config is not None:
        if not isinstance(config, RammerConfig):
            raise TypeError(f"config must be a RammerConfig, got {type(config).__name__}")
        return config
    return RammerConfig(**kwargs)
