"""Several rKernels per operator (Rammer, OSDI'20, 3.1: "each rOperator has one or more rKernels").

An rKernel version is one scheduled PrimFunc of an operator, prelowered into rTasks
(``tir_templates.prelower``). :func:`kernel_versions` gathers them for one operator from three sources,
in this order, and keeps the first of any two with the same ``(grid, block)``, except that the
pipeline's own dlight schedule (TVM's default kernel, the version every choice falls back to) is
always kept:

1. ``metaschedule``: the best distinct schedules of a MetaSchedule tuning database
   (``tvm-rammer tune`` writes one), each trace applied to the operator's unscheduled PrimFunc;
2. ``dlight``: the schedule the rammer pipeline made, then dlight's rules re-run under other tile
   configurations (``Matmul.Config`` variants; every rule under narrower ``max_num_threads``);
3. ``template``: our own parametrised schedules (``tir_templates.templates``); a decode step's
   GEMVs' vectorised versions (``tir_templates.gemv_templates``) come right after the pipeline's
   own schedule, so ``max_versions`` keeps them.

A version that ``prelower`` rejects is dropped with its reason logged; one whose launch shape,
read from its thread bindings (``prelower.bound_launch``), an earlier version already has is
dropped before it is lowered (lowering costs ~25 ms a version; about a third of the schedules
repeat a shape). :func:`named_versions` makes
only the versions named (a dlight variant or template each made alone, by its name): what a
compile with an operator record (``tuning.operator_record``) needs, without making the others.

Unscheduled PrimFuncs: dlight replaces each PrimFunc of the Relax module by its scheduled version, and
versions 1-3 start from the *unscheduled* one. The least invasive way to keep it is the module pass
:class:`StashUnscheduled`, placed right before dlight in the pipeline: it copies every PrimFunc into
the module attribute ``rammer.unscheduled`` (name -> PrimFunc). Nothing else reads or changes that
attribute; dlight keeps module attributes (it assigns functions in place). :func:`unscheduled_funcs`
reads it back; without it an operator has its pipeline dlight version only (logged once).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import dlight as dl

from tir_templates.default_schedule import default_rules, is_scheduled, scheduled_by
from tir_templates.gemv_templates import gemv_schedules
from tir_templates.prelower import LoweredKernel, UnsupportedKernel, bound_launch, prelower
from tir_templates.templates import template_schedules

from ..target import capped_target

__all__ = ["STASH_ATTR", "StashUnscheduled", "unscheduled_funcs", "KernelVersion", "VersionOptions",
           "dlight_schedules", "metaschedule_schedules", "kernel_versions", "named_versions",
           "version_func", "made_by_name", "func_key", "open_database"]

LOG = logging.getLogger("tvm_rammer")
STASH_ATTR = "rammer.unscheduled"


@tvm.transform.module_pass(opt_level=0, name="StashUnscheduled")
class StashUnscheduled:
    """Copy every unscheduled PrimFunc into the module attribute ``rammer.unscheduled``.

    Input and output: the Relax module after FuseTIR (functions unchanged). Must run right before
    dlight's ``ApplyDefaultSchedule``: :func:`kernel_versions` schedules these copies again.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        stash = {gv.name_hint: func for gv, func in mod.functions_items()
                 if isinstance(func, tirx.PrimFunc) and not is_scheduled(func)}
        return mod.with_attr(STASH_ATTR, stash) if stash else mod


def unscheduled_funcs(mod: tvm.IRModule) -> dict:
    """name -> unscheduled PrimFunc saved by :class:`StashUnscheduled` ({} when it did not run)."""
    stash = mod.attrs.get(STASH_ATTR, None) if mod.attrs is not None else None
    return {str(k): v for k, v in stash.items()} if stash is not None else {}


def func_key(func: tirx.PrimFunc) -> str:
    """The profile-database key of a scheduled kernel: its structural hash, 16 hex digits."""
    return format(tvm_ffi.structural_hash(func) & ((1 << 64) - 1), "016x")


@dataclass(frozen=True)
class KernelVersion:
    """One prelowered schedule of an operator: ``source`` is "metaschedule", "dlight", "template",
    or the name of the rule of ours that made the pipeline's schedule ("gemv_epilogue")."""

    name: str
    source: str
    func: tirx.PrimFunc
    lowered: LoweredKernel

    @property
    def key(self) -> str:
        return func_key(self.func)


@dataclass(frozen=True)
class VersionOptions:
    """Which versions :func:`kernel_versions` tries.

    Attributes:
        dlight_variants: re-run dlight with other tile configurations.
        templates: try ``tir_templates.templates``.
        metaschedule_top_k: distinct schedules taken per operator from the tuning database.
        max_versions: keep at most this many (after dedupe), in source order.
    """

    dlight_variants: bool = True
    templates: bool = True
    metaschedule_top_k: int = 3
    max_versions: int = 8

    def __post_init__(self):
        if self.max_versions < 1:
            raise ValueError(f"VersionOptions.max_versions={self.max_versions}: keep at least 1")
        if self.metaschedule_top_k < 0:
            raise ValueError(f"VersionOptions.metaschedule_top_k={self.metaschedule_top_k} must be >= 0")


class _MatmulWith(dl.gpu.Matmul):
    """dlight's Matmul rule with a fixed tile configuration instead of the per-target default."""

    def __init__(self, config):
        super().__init__()
        self._config = config

    def get_configs(self, target):
        return self._config


_MATMUL_CONFIGS = (
    dict(block_size_x=8, block_size_y=8, micro_size_x=4, micro_size_y=4),
    dict(block_size_x=16, block_size_y=16, micro_size_x=2, micro_size_y=2),
    dict(block_size_x=8, block_size_y=16, micro_size_x=2, micro_size_y=2),
)
_THREAD_CAPS = (64, 128)


def _apply(func, target, *rules):
    with target:
        mod = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": func}))
    out = mod["main"]
    return out if is_scheduled(out) else None


def _dlight_makers(func: tirx.PrimFunc, target: tvm.target.Target) -> list:
    """(name, make) for every dlight variant, in order; ``make()`` is the scheduled PrimFunc or
    None (it may raise: a rule that fails does not apply). Nothing is scheduled until called."""
    makers = []
    base = dl.gpu.Matmul().get_configs(target)
    for overrides in _MATMUL_CONFIGS:
        config = dl.gpu.Matmul.Config(**{**base.__dict__, **overrides})
        name = "dlight_matmul_b{block_size_x}x{block_size_y}_m{micro_size_x}x{micro_size_y}".format(
            **config.__dict__)
        makers.append((name, lambda c=config: _apply(func, target, _MatmulWith(c))))
    for threads in _THREAD_CAPS:
        makers.append((f"dlight_t{threads}",
                       lambda t=threads: _apply(func, capped_target(target, t), *default_rules())))
    # dlight's Fallback alone: serial reductions, no warp shuffles, so a version that can always
    # early-exit in a wider vEU (cross-thread reductions over a partial warp cannot)
    makers.append(("dlight_fallback", lambda: _apply(func, target, dl.gpu.Fallback())))
    return makers


def _made(name: str, make):
    """``make()``, or None (logged) when its rule does not apply or fails."""
    try:
        return make()
    except Exception as err:  # pylint: disable=broad-except  (a rule that fails = does not apply)
        LOG.debug("tvm-rammer: %s does not apply: %s", name, err)
        return None


def dlight_schedules(func: tirx.PrimFunc, target: tvm.target.Target) -> list:
    """(name, scheduled PrimFunc) for dlight's rules under other tile configurations."""
    found = []
    for name, make in _dlight_makers(func, target):
        scheduled = _made(name, make)
        if scheduled is not None:
            found.append((name, scheduled))
    return found


def open_database(work_dir: str):
    """The MetaSchedule JSON database in ``work_dir`` (written by ``tvm-rammer tune``)."""
    import os

    from tvm.s_tir import meta_schedule as ms

    workload = os.path.join(work_dir, "database_workload.json")
    records = os.path.join(work_dir, "database_tuning_record.json")
    if not os.path.isfile(workload) or not os.path.isfile(records):
        raise ValueError(f"--tuning-db {work_dir!r} holds no MetaSchedule database "
                         "(database_workload.json, database_tuning_record.json); "
                         "write one with `tvm-rammer tune MODEL --work-dir DIR`")
    return ms.database.JSONDatabase(path_workload=workload, path_tuning_record=records,
                                    allow_missing=False)


def metaschedule_schedules(func: tirx.PrimFunc, target: tvm.target.Target, database, top_k: int) -> list:
    """(name, scheduled PrimFunc) for the ``top_k`` best records of ``func`` in a MetaSchedule database.

    The lookup normalises ``func`` the way MetaSchedule's own ``MetaScheduleApplyDatabase`` does, so a
    database written by ``tvm-rammer tune`` (or ``tune_relax``) on the same model matches.
    """
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    if database is None or top_k <= 0:
        return []
    mod = _normalize_mod(func)
    if not database.has_workload(mod):
        return []
    workload = database.commit_workload(mod)
    found = []
    for rank, record in enumerate(database.get_top_k(workload, top_k)):
        try:
            sch = Schedule(workload.mod)
            record.trace.apply_to_schedule(sch, remove_postproc=False)
        except Exception as err:  # pylint: disable=broad-except
            LOG.info("tvm-rammer: tuning record %d does not apply: %s", rank, str(err).splitlines()[0])
            continue
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        found.append((f"metaschedule_top{rank}", scheduled))
    return found


_TEMPLATE_NAMES = (  # a template version's name -> (module, function) that makes it from its numbers
    (r"spatial_t(\d+)x(\d+)", "tir_templates.templates", "schedule_spatial"),
    (r"cross_thread_r(\d+)x(\d+)", "tir_templates.templates", "schedule_cross_thread"),
    (r"tiled_matmul_m(\d+)n(\d+)_t(\d+)x(\d+)_k(\d+)", "tir_templates.templates",
     "schedule_tiled_matmul"),
    (r"gemm_m(\d+)n(\d+)_t(\d+)x(\d+)_k(\d+)", "tir_templates.gemm_templates", "schedule_gemm_tiled"),
    (r"small_batch_v(\d+)_n(\d+)_k(\d+)", "tir_templates.gemm_templates",
     "schedule_gemm_small_batch"),
    (r"depthwise_h(\d+)w(\d+)_t(\d+)", "tir_templates.conv_templates", "schedule_depthwise_conv2d"),
    (r"mma_w(\d+)x(\d+)_f(\d+)x(\d+)_k(\d+)", "tir_templates.mma_templates", "schedule_gemm_mma"),
    (r"gemv_v(\d+)_n(\d+)_k(\d+)", "tir_templates.gemv_templates", "schedule_gemv"),
)


def _template_named(func: tirx.PrimFunc, target: tvm.target.Target, vname: str):
    """The template version ``vname`` of ``func`` (unscheduled), made alone when its name says how
    (``_TEMPLATE_NAMES``), else picked from every template (``template_schedules``); None when
    it does not apply."""
    import importlib
    import re

    for pattern, module, function in _TEMPLATE_NAMES:
        match = re.fullmatch(pattern, vname)
        if match:
            make = getattr(importlib.import_module(module), function)
            return _made(vname, lambda: make(func, *(int(g) for g in match.groups())))
    return next((t.func for t in template_schedules(func, target) if t.name == vname), None)


def version_func(name: str, target: tvm.target.Target, vname: str, source: str, *,
                 scheduled: tirx.PrimFunc, unscheduled: tirx.PrimFunc, dlight_makers=None):
    """The scheduled PrimFunc of operator ``name``'s version ``vname`` of ``source``, made alone
    by its name (the pipeline's version "dlight" is ``scheduled``; dlight variants and templates
    are made from ``unscheduled``), or None when it cannot be made so (a name no maker knows, a
    metaschedule version, a schedule that no longer applies, another source). ``dlight_makers``:
    ``dict(_dlight_makers(unscheduled, target))`` when the caller has it."""
    del name  # the operator's name: only in what callers log
    if vname == "dlight":
        func, made_source = scheduled, scheduled_by(scheduled) or "dlight"
    else:
        dlight = dlight_makers if dlight_makers is not None else dict(_dlight_makers(unscheduled, target))
        if vname in dlight:
            func, made_source = _made(vname, dlight[vname]), "dlight"
        elif source == "template":
            func, made_source = _template_named(unscheduled, target, vname), "template"
        else:
            return None
    return func if func is not None and made_source == source else None


def made_by_name(vname: str, source: str, unscheduled: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Whether :func:`version_func` makes ``vname`` of ``source`` alone, by a maker its name
    selects (a dlight variant's name, a template name of ``_TEMPLATE_NAMES``), without
    scheduling anything; False for "dlight" (the pipeline's own) and every other name."""
    import re

    if source == "dlight":
        return vname != "dlight" and any(n == vname for n, _ in _dlight_makers(unscheduled, target))
    return source == "template" and any(re.fullmatch(p, vname) for p, _, _ in _TEMPLATE_NAMES)


def named_versions(name: str, target: tvm.target.Target, wanted, *, scheduled: tirx.PrimFunc,
                   unscheduled: tirx.PrimFunc) -> list[KernelVersion] | None:
    """Only the versions ``wanted`` ((version name, source) pairs, in their order) of one operator,
    each made alone (:func:`version_func`) and prelowered: what :func:`kernel_versions` made under
    those names, without making the others. None when any cannot be made (see
    :func:`version_func`, or ``prelower`` rejects it): the caller then makes every version
    (:func:`kernel_versions`)."""
    dlight = dict(_dlight_makers(unscheduled, target))
    versions = []
    for vname, source in wanted:
        func = version_func(name, target, vname, source, scheduled=scheduled,
                            unscheduled=unscheduled, dlight_makers=dlight)
        if func is None:
            return None
        try:
            lowered = prelower(func, target, name=name)
        except UnsupportedKernel:
            return None
        versions.append(KernelVersion(vname, source, func, lowered))
    return versions


def kernel_versions(name: str, target: tvm.target.Target, *, scheduled: tirx.PrimFunc | None = None,
                    unscheduled: tirx.PrimFunc | None = None, database=None,
                    options: VersionOptions = VersionOptions(),
                    scheduled_lowered: LoweredKernel | None = None) -> list[KernelVersion]:
    """Distinct prelowered versions of one operator (see the module docstring for the order).

    ``scheduled`` is the pipeline's dlight schedule (kept first among the dlight ones), ``unscheduled``
    the PrimFunc before dlight (None: no other version can be made), ``database`` a MetaSchedule
    database or None. Versions ``prelower`` rejects are dropped with a logged reason; the result may be
    empty when every version is rejected. ``scheduled_lowered``: ``scheduled`` prelowered already
    (by the caller, for the same ``target``), not lowered again.
    """
    candidates = []
    if unscheduled is not None:
        candidates += [(n, "metaschedule", f) for n, f in
                       metaschedule_schedules(unscheduled, target, database, options.metaschedule_top_k)]
    if scheduled is not None:  # the pipeline's own schedule: dlight's, or a rule of ours
        candidates.append(("dlight", scheduled_by(scheduled) or "dlight", scheduled))
    if unscheduled is not None and options.templates:  # before the variants: kept under the cap
        candidates += [(t.name, "template", t.func) for t in gemv_schedules(unscheduled, target)]
    if unscheduled is not None and options.dlight_variants:
        candidates += [(n, "dlight", f) for n, f in dlight_schedules(unscheduled, target)]
    if unscheduled is not None and options.templates:
        candidates += [(t.name, "template", t.func) for t in template_schedules(unscheduled, target)]
    versions, shapes = [], set()
    default_pending = scheduled is not None
    for vname, source, func in candidates:
        is_default = vname == "dlight" and func is scheduled
        room = options.max_versions - len(versions) - (1 if default_pending and not is_default else 0)
        if room <= 0 and not is_default:
            continue
        default_pending = default_pending and not is_default
        if not is_default and bound_launch(func) in shapes:
            continue  # an earlier version has its launch shape: lowering it would only drop it
        try:
            lowered = scheduled_lowered if (is_default and scheduled_lowered is not None) \
                else prelower(func, target, name=name)
        except UnsupportedKernel as err:
            LOG.info("tvm-rammer: %s version %s dropped: %s", name, vname, err)
            continue
        shape = (lowered.grid, lowered.block)
        if shape in shapes and not is_default:
            continue
        shapes.add(shape)
        versions.append(KernelVersion(vname, source, func, lowered))
    return versions
