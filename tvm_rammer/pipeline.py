"""The rammer Relax pipeline and how TVM finds it.

Two ways in, both ordinary TVM usage:

* ``tvm.compile(mod, target=T, relax_pipeline="rammer")`` with any CUDA target (a pipeline registered
  with ``relax.register_pipeline``);
* ``tvm.compile(mod, target=T)`` where ``T`` is a rammer target (``rammer/nvidia-h100`` or
  ``tvm_rammer.rammer_target(...)``: a CUDA target whose keys start with ``"rammer"``).

TVM 0.27 picks the default Relax pipeline of a GPU target by the target kind's name
(``relax.pipeline.get_default_pipeline``) and has no registry for it, so :func:`install` wraps
``tvm.relax.backend.cuda.get_default_pipeline`` once: a target with the ``"rammer"`` key gets the
rammer pipeline, every other target exactly what it got before. This is the only piece of TVM state
tvm-rammer touches outside TVM's registries (pipelines, target tags).

The pipeline itself is the flat list in :func:`rammer_passes`, with the "why" of each ordering
constraint on its right.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from relay_passes.batch_shared_matmuls import BatchSharedWeightMatMuls
from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.group_rprograms import RammerGroupRPrograms
from relay_passes.split_matmul_concat import SplitMatMulOverConcat
from relay_passes.split_tail_fusion import SplitTailFusion
from relay_passes.split_to_slices import SplitToSlices

from .config import RammerConfig
from .target import is_rammer_target, register_tags, rkernel_target
from .tuning.versions import StashUnscheduled

PIPELINE_NAME = "rammer"


def rammer_passes(target: tvm.target.Target, config: RammerConfig) -> list:
    """The rammer Relax pipeline as a flat list of passes."""
    from tvm.relax.backend.cuda import pipeline as cuda_backend

    fusion = [BranchPreservingFusion(prologues=config.prologue_fusion)] if config.fusion else []
    if config.fusion and config.tail_fusion:
        fusion.insert(0, SplitTailFusion())            # before the chains: tails take their fan-outs
    split_matmul = [SplitMatMulOverConcat()] if config.split_concat_matmul else []
    if config.batch_shared_matmuls:
        split_matmul.append(BatchSharedWeightMatMuls())  # after the split: input halves share W_x
    schedule = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                       dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    return [
        *cuda_backend.library_dispatch_passes(target),  # TVM's sampling/sort-scan dispatch, unchanged
        SplitToSlices(),                               # one kernel per part: parts become rTasks
        *split_matmul,                                 # high-level ops; FoldConstant folds 0 @ W_h
        relax.transform.LegalizeOps(),                 # every op -> call_tir of a PrimFunc
        relax.transform.AnnotateTIROpPattern(),        # fusion reads op_pattern
        relax.transform.FoldConstant(),                # before grouping: no rTasks for constants
        *fusion,                                       # never joins two independent branches
        relax.transform.FuseTIR(),                     # one PrimFunc per fused group
        StashUnscheduled(),                            # rKernel versions re-schedule these
        _with_target(rkernel_target(target, config), schedule),  # rKernels = dlight thread blocks
        _with_target(target, RammerGroupRPrograms(config)),      # waves -> rPrograms -> 1 kernel each
        *cuda_backend.dataflow_lower_passes(target),   # TVM's own VM lowering from here on
        *cuda_backend.finalize_passes(target),
    ]


def _with_target(target, pass_):
    @tvm.transform.module_pass(opt_level=0, name=f"WithTarget({pass_.info.name})")
    def _run(mod, _ctx):
        with target:
            return pass_(mod)
    return _run


def rammer_pipeline(target: tvm.target.Target | None = None, config: RammerConfig | None = None):
    """The rammer pipeline as one module pass; the target defaults to the one in scope."""
    config = _config_from(config, {})

    @tvm.transform.module_pass(opt_level=0, name="RammerPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = target or tvm.target.Target.current(allow_none=True)
        if tgt is None or tgt.kind.name != "cuda":
            raise ValueError(
                f"the rammer pipeline needs a CUDA target, got {tgt}; call "
                "tvm.compile(mod, target='rammer/nvidia-h100') or pass a CUDA target")
        with tgt:
            return tvm.transform.Sequential(rammer_passes(tgt, config))(mod)

    return _pipeline


def install() -> None:
    """Register the ``rammer`` pipeline, the ``rammer/...`` tags and the rammer-target dispatch.

    Idempotent; called when ``tvm_rammer`` is imported.
    """
    from tvm.relax import pipeline as relax_pipeline_mod
    from tvm.relax.backend import cuda as cuda_backend

    if PIPELINE_NAME not in relax_pipeline_mod.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(
            lambda config=None, **kwargs: rammer_pipeline(config=_config_from(config, kwargs)))
    register_tags()
    current = cuda_backend.get_default_pipeline
    if getattr(current, "_rammer_dispatch", False):
        return

    def get_default_pipeline(target):
        if is_rammer_target(target):
            return rammer_pipeline(target)
        return current(target)

    get_default_pipeline._rammer_dispatch = True
    get_default_pipeline.__doc__ = current.__doc__
    cuda_backend.get_default_pipeline = get_default_pipeline


def _config_from(config, kwargs) -> RammerConfig:
    if config is not None and kwargs:
        raise TypeError("pass either config=RammerConfig(...) or keyword options, not both")
    if config is not None:
        if not isinstance(config, RammerConfig):
            raise TypeError(f"config must be a RammerConfig, got {type(config).__name__}")
        return config
    return RammerConfig(**kwargs)
