"""rKernel versions named by an operator record and made only when their code is used (issue 21).

A compile that reads an operator record (``operator_record``) needs, of most versions it names,
only what the policy weighs: the version's name, source and profile key (its kernel record), and
its prelowered launch shape and resources (``grid``, ``block``, ``shared_bytes``, ``has_sync``,
``volatile_shared``: :data:`LOWERED_FIELDS`, which the record stores). Its scheduled PrimFunc and
prelowered body are needed only when it is built: in a persistent kernel the policy chose
(codegen), or measured. Scheduling and prelowering each version costs ~25-50 ms, and the policy
chooses few of them, so a :class:`DeferredVersion` holds the recorded fields and makes the
version (``versions.version_func``, then ``prelower``) on the first use of ``func`` or of a
body field of ``lowered`` (:class:`DeferredLowered`).

What is made late must be what the record says: the same ``func_key`` and the same
:data:`LOWERED_FIELDS`, else (or when it cannot be made at all) :class:`LateVersionError`. The
choices made on the recorded fields would then not be the full path's, so the back end catches
it and compiles again with every operator record ignored (``backend.build_rprograms``): the
compile finishes, as the full path would have. The record's key already includes the source of
every module that makes versions and TVM's version (``operator_record.makers_digest``), so this
is a guard against what those do not capture (a TVM built differently under the same version).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from tir_templates.prelower import LaunchShape, UnsupportedKernel

from . import versions as _versions

__all__ = ["LOWERED_FIELDS", "LateVersionError", "lowered_fields", "valid_fields", "DeferredLowered",
           "DeferredVersion", "Unmade", "func_if_made", "made_func"]

LOG = logging.getLogger("tvm_rammer")
LOWERED_FIELDS = ("grid", "block", "shared_bytes", "has_sync", "volatile_shared")


class LateVersionError(RuntimeError):
    """A deferred version, made when first used, is not the one its operator record describes
    (or could not be made): the compile must be done again without operator records."""


def lowered_fields(lowered) -> dict:
    """The JSON-able :data:`LOWERED_FIELDS` of a ``LoweredKernel`` (what an operator record
    stores per version)."""
    return {"grid": [int(x) for x in lowered.grid], "block": [int(x) for x in lowered.block],
            "shared_bytes": int(lowered.shared_bytes), "has_sync": bool(lowered.has_sync),
            "volatile_shared": bool(lowered.volatile_shared)}


def valid_fields(fields) -> bool:
    """Whether ``fields`` (from a record) has every :data:`LOWERED_FIELDS` entry, well typed."""
    try:
        return (len(fields["grid"]) == 3 and len(fields["block"]) == 3
                and all(isinstance(x, int) and x > 0 for x in (*fields["grid"], *fields["block"]))
                and isinstance(fields["shared_bytes"], int) and fields["shared_bytes"] >= 0
                and isinstance(fields["has_sync"], bool) and isinstance(fields["volatile_shared"], bool))
    except (KeyError, TypeError):
        return False


class DeferredLowered(LaunchShape):
    """A ``LoweredKernel`` whose :data:`LOWERED_FIELDS` (and ``name``, ``num_rtasks``,
    ``threads``) come from the record; any other attribute (``body``, ``params``,
    ``param_buffers``, ``block_vars``, ``thread_vars``) makes the version first (``version``'s
    :meth:`DeferredVersion.made`, which may raise :class:`LateVersionError`)."""

    def __init__(self, name: str, fields: dict, version: "DeferredVersion"):
        self.name = name
        self.grid, self.block = tuple(fields["grid"]), tuple(fields["block"])
        self.shared_bytes, self.has_sync = fields["shared_bytes"], fields["has_sync"]
        self.volatile_shared = fields["volatile_shared"]
        self._version = version

    @property
    def made(self) -> bool:
        """Whether the kernel's body has been made."""
        return self._version.is_made

    def __getattr__(self, attr):  # only for attributes not set above: the body's
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._version.made()[1], attr)


class DeferredVersion:
    """A ``KernelVersion`` of operator ``op_name`` read from its record: ``name``, ``source``
    and ``key`` (the recorded ``func_key``) as recorded, ``lowered`` a :class:`DeferredLowered`
    of the recorded ``fields``; ``func`` (and ``lowered``'s body) made on first use from
    ``scheduled``/``unscheduled`` for ``target`` (``versions.version_func``, ``prelower``)."""

    def __init__(self, op_name: str, name: str, source: str, key: str, fields: dict, target, *,
                 scheduled, unscheduled):
        self.op_name, self.name, self.source, self.key = op_name, name, source, key
        self.fields = dict(fields)
        self.lowered = DeferredLowered(op_name, fields, self)
        self._target, self._scheduled, self._unscheduled = target, scheduled, unscheduled
        self._made = None

    @property
    def is_made(self) -> bool:
        return self._made is not None

    @property
    def func(self):
        """The scheduled PrimFunc (made now when it was not)."""
        return self.made()[0]

    def made(self) -> tuple:
        """(scheduled PrimFunc, LoweredKernel), made once; :class:`LateVersionError` when either
        cannot be made or differs from the record (another ``func_key``, other fields)."""
        if self._made is None:
            where = f"{self.op_name}: version {self.name} made from its operator record"
            try:
                func = _versions.version_func(self.op_name, self._target, self.name, self.source,
                                              scheduled=self._scheduled, unscheduled=self._unscheduled)
            except Exception as err:  # pylint: disable=broad-except  (the full path decides then)
                raise LateVersionError(f"{where} failed: {type(err).__name__}: {err}") from err
            if func is None:
                raise LateVersionError(f"{where}: its schedule no longer applies")
            if _versions.func_key(func) != self.key:
                raise LateVersionError(f"{where} is another kernel ({_versions.func_key(func)}, "
                                       f"recorded {self.key})")
            try:
                lowered = _versions.prelower(func, self._target, name=self.op_name)
            except UnsupportedKernel as err:
                raise LateVersionError(f"{where} is rejected by prelower: {err}") from err
            if lowered_fields(lowered) != self.fields:
                raise LateVersionError(f"{where} has other launch fields {lowered_fields(lowered)} "
                                       f"than recorded {self.fields}")
            self._made = (func, lowered)
            LOG.debug("tvm-rammer: %s", where)
        return self._made



@dataclass(frozen=True, eq=False)
class Unmade:
    """A measuring job's PrimFunc (``KernelJob.func`` or ``reference``) not made yet: ``make()``
    makes it (and may raise :class:`LateVersionError`). ``Profiler.prepare`` makes it
    (:func:`made_func`) only for the jobs it measures."""

    make: Callable
    what: str = ""


def func_if_made(version):
    """``version.func``, or :class:`Unmade` for a :class:`DeferredVersion` not made yet."""
    if isinstance(version, DeferredVersion) and not version.is_made:
        return Unmade(lambda: version.func, f"{version.op_name}:{version.name}")
    return version.func


def made_func(func):
    """``func``, or the PrimFunc of an :class:`Unmade` one, made now (may raise
    :class:`LateVersionError`)."""
    return func.make() if isinstance(func, Unmade) else func
