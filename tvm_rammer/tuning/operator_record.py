"""Per-operator records: which rKernel versions an operator has, so that a compile whose kernel
records are already in the profile database makes only the versions it needs (issue 21).

Making every version of every operator (``versions.kernel_versions``: dlight variants and
templates, each scheduled and prelowered) only to look their records up was most of a second,
fully cached compile (squeezenet: 15 of 16 s). A compile that measures (a device) writes, per
operator, one record of kind "operator" (``profile_db``), keyed by :func:`operator_key`
(the operator's unscheduled and pipeline-scheduled PrimFuncs, the rKernel target, every option
that changes versions or their analytical times, the vDevice, TVM's version, tvm-rammer's version
and the source of the modules that make versions: :func:`makers_digest`), holding:

- ``versions``: every version the full path made, in order: name, source, ``func_key``, its
  prelowered launch fields (``lowered``: ``deferred.LOWERED_FIELDS``) and the analytical time
  the profiler's choice of what to measure used (``predicted_us``);
- ``reference_key``: the ``func_key`` of TVM's default kernel for the operator;
- ``measured``: the versions with a kernel record when it was written, and ``fastest`` among them,
  and ``operator``, the name it was written for (for reading; the choice is made again from the
  kernel records).

A later compile that finds it (:meth:`OperatorRecords.made`) makes only the versions
:func:`needed_versions` names, every one of which the full path would have given the same role:
the pipeline's dlight version, every version with a kernel record (``rkernels.operator_versions``
offers every valid measured one to the policy and lists the wrong ones), and, with a device, the
versions ``profiler.decisive_jobs`` would measure that have no record (with TVM's default kernel
to check them against). The versions left out have no record and would not be measured: the
full path would make them and then never use them, so the operator, its choices and the plan
are the same. Anything missing or inconsistent makes the operator take the full path: no record,
a version not makeable by name or no longer the same kernel (its ``func_key``), a version the
record says was measured whose kernel record is gone, a fresh analytical time that differs from
the recorded one. Of the needed versions, only one whose name does not say how to make it alone is made at once;
every other one (the pipeline's dlight version too) is a ``deferred.DeferredVersion``: its
name, key and recorded launch fields are what the profiler and the policy weigh (its analytical
time from those fields must equal the recorded one), and it is scheduled and prelowered only when
its code is used: built into a persistent kernel the policy chose, or measured (then with TVM's
default kernel, made then too). A version made late that is not what its record says makes the
back end compile again with every record ignored (``deferred.LateVersionError``). The record
names kernels, not measurements: a failed measurement leaves no
kernel record (``profiler.is_failure``), so the next compile makes and measures that version
again.

An operator too small for its choice to matter (``backend._small_operators``: its dlight version
predicted under ``profiler.MIN_SHARE`` of all operators') has only its dlight version made; its
record says so (``dlight_only``) and is used only for an operator that is small now
(:meth:`OperatorRecords.made` with ``dlight_only``). The back end finds those operators before
making anything, from each record's dlight ``predicted_us`` (:meth:`OperatorRecords.base_us`;
checked against a fresh prediction when the record is used).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass

import tvm

from .deferred import DeferredVersion, LateVersionError, Unmade, lowered_fields, valid_fields
from .versions import func_key, made_by_name, named_versions

__all__ = ["KIND", "FORMAT", "operator_key", "base_entry", "needed_versions", "OperatorRecords",
           "Reused"]

LOG = logging.getLogger("tvm_rammer")
KIND = "operator"
FORMAT = 2  # 2: each version's launch fields ("lowered"), so most are made only when used
PIPELINE_VERSION = "dlight"  # rkernels.PIPELINE_VERSION
# RammerConfig fields that change neither an operator's versions nor their analytical times: the
# profiler's own, the policy's and the persistent kernel's code (every other field is in the key:
# a field added later costs a miss, never a wrong record)
_NOT_IN_KEY = ("profile", "profile_db", "rprogram_profiles", "profile_budget_s", "profile_margin",
               "emulate_versions", "selection", "merge", "policy", "max_waits_per_op",
               "check_unmeasured", "block_us", "measure_resources", "timeline", "wait_timeout_ms",
               "rkernel_functions")


# the modules whose code decides which versions an operator has (their names, tile tables, order,
# de-duplication): a record written by other code is another key (a miss, never a stale choice)
_MAKERS = ("tvm_rammer.tuning.versions", "tir_templates.templates", "tir_templates.gemm_templates",
           "tir_templates.mma_templates", "tir_templates.conv_templates", "tir_templates.prelower",
           "tir_templates.default_schedule")


def makers_digest() -> str:
    """16 hex digits of a hash of the source of the modules in ``_MAKERS`` and tvm-rammer's
    version: the version makers a record was written by."""
    import importlib
    import inspect

    from ..version import __version__

    digest = hashlib.sha1(__version__.encode())
    for name in _MAKERS:
        digest.update(inspect.getsource(importlib.import_module(name)).encode())
    return digest.hexdigest()[:16]


def operator_key(unscheduled, scheduled, target, plain, config, vdevice, makers: str = "") -> str:
    """The key of an operator's record: 16 hex digits of a hash of everything its versions and
    their analytical times depend on (see the module docstring); ``makers``: :func:`makers_digest`."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name not in _NOT_IN_KEY}
    doc = {"format": FORMAT, "tvm": tvm.__version__, "makers": makers,
           "unscheduled": func_key(unscheduled),
           "scheduled": func_key(scheduled), "target": str(target), "plain": str(plain),
           "config": options, "vdevice": repr(vdevice)}
    blob = json.dumps(doc, sort_keys=True, default=repr)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def base_entry(record: dict) -> dict | None:
    """The entry of the pipeline's dlight version in ``record["versions"]``, or None."""
    return next((v for v in record.get("versions") or () if v.get("name") == PIPELINE_VERSION), None)


def needed_versions(record: dict, has_record, measures: bool, margin: float | None,
                    max_versions: int) -> tuple | None:
    """(the entries of ``record["versions"]`` a compile needs, in order; whether a version may be
    measured), or None when the record cannot be used (no dlight version, or a version it says
    was measured has no kernel record now). ``has_record(key)``: a kernel record (not a failure)
    exists. With ``measures``, the versions ``decisive_jobs`` (``margin``, ``max_versions``)
    could measure are needed too when they lack a record; its ``min_share`` only leaves whole
    operators out, so it is not applied here (more versions made, never fewer)."""
    versions = record.get("versions") or []
    base = base_entry(record)
    if base is None or record.get("format") != FORMAT:
        return None
    present = {v["name"]: has_record(v["key"]) for v in versions}
    if any(not present.get(name, False) for name in record.get("measured", ())):
        return None  # a kernel record gone: measured again, or chosen without, by the full path
    need = {name for name, found in present.items() if found} | {PIPELINE_VERSION}
    measurable = False
    if measures:
        others = [v for v in versions if v["name"] != PIPELINE_VERSION]
        if margin is None or base.get("predicted_us") is None \
                or any(v.get("predicted_us") is None for v in others):
            close = others
        else:
            close = sorted((v for v in others if v["predicted_us"] <= margin * base["predicted_us"]),
                           key=lambda v: v["predicted_us"])[:max_versions]
        need |= {v["name"] for v in close if not present[v["name"]]}
        measurable = any(not present[name] for name in need)
    return [v for v in versions if v["name"] in need], measurable


@dataclass
class Reused:
    """An operator's versions made from its record: ``versions`` (only the needed ones),
    TVM's default kernel (``reference``, made only when a version may be measured) and its key."""

    versions: list
    reference: object
    reference_key: str | None


class OperatorRecords:
    """Reading and noting operator records for one compile's back end.

    ``profiler``: the compile's ``Profiler`` (records are read from its sources, and written by it
    to its database with its device); ``target``: the compile's target; ``config``: its
    RammerConfig; ``runnable(versions)``: the versions whose rTasks fit a vEU (the back end's
    filter, applied to what :func:`versions.kernel_versions` makes). Handed in by the back end
    (scheduling comes after this stage): ``vdevice``, the compile's vDevice
    (``scheduling.rkernels.vdevice_for``; part of the key); ``predict(scheduled, lowered, config,
    vdevice)``, a version's analytical whole-kernel time
    (``scheduling.rkernels.predicted_version_us``; a service, in no key); ``max_versions``: the
    versions other than dlight the profiler measures per operator (``profiler.MAX_VERSIONS``)."""

    def __init__(self, profiler, target, config, runnable, vdevice, predict, max_versions: int):
        from ..target import plain_target, rkernel_target

        self.profiler, self.config, self.runnable = profiler, config, runnable
        self.target, self.plain = rkernel_target(target, config), plain_target(target)
        self.vdevice, self._predict, self.max_versions = vdevice, predict, max_versions
        self.makers = makers_digest()
        self.counts = {"reused": 0, "full": 0, "deferred": 0}

    def predict(self, scheduled, lowered) -> float | None:
        """A version's analytical whole-kernel time as the back end predicts it for the profiler
        (``backend._predictor``; None when it cannot)."""
        return self._predict(scheduled, lowered, self.config, self.vdevice)

    def default(self, unscheduled):
        """TVM's default kernel for the operator (``schedule_like_default``), or None."""
        from tir_templates.default_schedule import schedule_like_default

        return schedule_like_default(unscheduled, self.plain)

    def key(self, scheduled, unscheduled) -> str:
        return operator_key(unscheduled, scheduled, self.target, self.plain, self.config, self.vdevice,
                            self.makers)

    def base_us(self, scheduled, unscheduled) -> float | None:
        """The analytical time of the operator's dlight version its record holds (what the
        profiler weighed when the record was written), or None: no record, or none recorded.
        :meth:`made` checks it against a fresh prediction before any of it is used."""
        record = self._record(scheduled, unscheduled)
        base = None if record is None else base_entry(record)
        return None if base is None else base.get("predicted_us")

    def _record(self, scheduled, unscheduled) -> dict | None:
        """The operator's record in this tvm-rammer's :data:`FORMAT`, or None."""
        record = self.profiler.operator_record(self.key(scheduled, unscheduled))
        return record if record is not None and record.get("format") == FORMAT else None

    def made(self, name: str, scheduled, unscheduled, dlight_only: bool = False) -> Reused | None:
        """The operator's needed versions made from its record (see the module docstring), or
        None: no usable record, or anything inconsistent (the caller takes the full path).
        ``dlight_only``: the operator is one whose other versions are not made
        (``backend._small_operators``): only the pipeline's dlight version is needed. A record
        written for such an operator (it names no other version) is used only so."""
        try:
            reused = self._made(name, scheduled, unscheduled, self.max_versions, dlight_only)
        except Exception as err:  # pylint: disable=broad-except  (the full path decides then)
            LOG.info("tvm-rammer: %s: operator record not used (%s: %s)", name, type(err).__name__,
                     str(err).splitlines()[0] if str(err) else "")
            reused = None
        self.counts["reused" if reused is not None else "full"] += 1
        return reused

    def _made(self, name, scheduled, unscheduled, max_versions, dlight_only=False) -> Reused | None:
        record = self._record(scheduled, unscheduled)
        if record is None or (record.get("dlight_only") and not dlight_only):
            return None  # a record of the dlight version alone, now that others are wanted
        profiler = self.profiler
        if dlight_only:
            base = base_entry(record)
            found = None if base is None else ([base], False)
        else:
            found = needed_versions(record, profiler.has_kernel_record, profiler.measures,
                                    profiler.margin, max_versions)
        if found is None:
            return None
        entries, measurable = found
        deferred = [self._deferrable(v, unscheduled) for v in entries]
        made = named_versions(name, self.target, [(v["name"], v["source"])
                                                  for v, late in zip(entries, deferred) if not late],
                              scheduled=scheduled, unscheduled=unscheduled)
        if made is None:
            return None
        made = iter(made)
        versions = [DeferredVersion(name, v["name"], v["source"], v["key"], v["lowered"], self.target,
                                    scheduled=scheduled, unscheduled=unscheduled)
                    if late else next(made) for v, late in zip(entries, deferred)]
        if len(self.runnable(versions)) != len(versions):
            return None
        for version, entry in zip(versions, entries):
            if version.key != entry["key"] or lowered_fields(version.lowered) != entry.get("lowered"):
                return None  # the same name is another kernel now
            stored = entry.get("predicted_us")  # None: every version counted as measurable
            fresh = None if stored is None else self.predict(scheduled, version.lowered)
            if stored is not None and (fresh is None or not math.isclose(fresh, stored, rel_tol=1e-9)):
                return None  # the analytical times moved: what is measured may differ
        reference, reference_key = None, record.get("reference_key")
        if measurable and reference_key is not None:  # measured against TVM's default kernel,
            # made when a version is measured (decisive_jobs' min_share may leave all out)
            reference = Unmade(lambda: self._reference(name, unscheduled, reference_key),
                               f"{name}: TVM's default kernel")
        elif measurable and self.default(unscheduled) is not None:
            return None  # the full path had no default kernel for it: now it has one
        self.counts["deferred"] += sum(isinstance(v, DeferredVersion) for v in versions)
        return Reused(versions, reference, reference_key)

    def _deferrable(self, entry: dict, unscheduled) -> bool:
        """Whether a needed version can be made when first used (``deferred.DeferredVersion``):
        its launch fields recorded, and either the pipeline's own (its PrimFunc is the
        operator's, in the record's key: only prelowered late) or made alone by its name
        (``versions.made_by_name``)."""
        return valid_fields(entry.get("lowered")) and (
            entry["name"] == PIPELINE_VERSION
            or made_by_name(entry["name"], entry["source"], unscheduled, self.target))

    def _reference(self, name: str, unscheduled, reference_key: str):
        """TVM's default kernel for the operator, made when a version is measured against it;
        ``LateVersionError`` when it is not the recorded one."""
        try:
            reference = self.default(unscheduled)
        except Exception as err:  # pylint: disable=broad-except  (the full path decides then)
            raise LateVersionError(f"{name}: TVM's default kernel failed: {err}") from err
        if reference is None or func_key(reference) != reference_key:
            raise LateVersionError(f"{name}: TVM's default kernel is not the recorded one")
        return reference

    def note(self, name: str, scheduled, unscheduled, versions, reference_key,
             dlight_only: bool = False) -> None:
        """After the full path: the profiler writes ``name``'s record once it has measured (only
        with a device, and only for an operator whose every version was made, or, with
        ``dlight_only``, whose only version is the pipeline's by that rule)."""
        if not self.profiler.measures or not versions \
                or not any(v.name == PIPELINE_VERSION for v in versions):
            return
        try:
            key = self.key(scheduled, unscheduled)
        except Exception as err:  # pylint: disable=broad-except  (no record: the full path again)
            LOG.info("tvm-rammer: %s: no operator record (%s)", name, err)
            return
        self.profiler.note_operator(name, key, [(v.name, v.source, v.key, lowered_fields(v.lowered))
                                                for v in versions], reference_key,
                                    dlight_only=dlight_only)
