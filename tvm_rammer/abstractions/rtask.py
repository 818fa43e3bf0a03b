"""rTask abstractions: rKernel, rOperator, rTask and barrier-rTask (Rammer, OSDI'20, sections 3.1-3.2).

An rOperator is one node of the dataflow graph. It has one or more rKernels: each rKernel is one way to
break the operator into ``num_rtasks`` independent rTasks (one per CUDA thread block of the original
kernel, paper 4.1). The policy picks one rKernel per rOperator (``SelectRKernels``, paper 3.3):

- the *fastest* rKernel has the smallest standalone time, i.e. the time of the operator when its rTasks
  are spread over every vEU of the device: ``ceil(num_rtasks / num_veus) * time_us``;
- the *most efficient* rKernel has the smallest product ``time_us * num_rtasks`` (the vEU-time it uses).

An rTask is identified by ``(operator uid, rtask_id)``; a barrier-rTask waits for rTasks given as
``(vEU, order)`` positions of an rProgram (paper 3.2).

Pure Python: nothing here imports TVM. ``RKernel.payload`` carries the lowered kernel for codegen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["RKernel", "ROperator", "RTask", "BarrierRTask", "standalone_time"]


def _check_positive_int(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class RKernel:
    """One version (rKernel) of an rOperator (paper 3.1).

    Attributes:
        name: a readable name, e.g. the PrimFunc's name plus the tiling.
        num_rtasks: how many rTasks the operator is broken into (the kernel's grid size).
        threads: threads one rTask needs (the kernel's block size).
        registers: registers per thread, ``None`` when unknown (the vDevice then assumes a default).
        shared_bytes: static shared memory one rTask needs.
        time_us: estimated or profiled time of ONE rTask on a vEU (paper 3.2, profiler item 1).
        source: where the rKernel comes from: "dlight", "template", "metaschedule", ...
        payload: opaque handle to the lowered kernel for codegen; ignored by equality and hashing.
        blocks_per_rtask: thread blocks of the lowered kernel one rTask runs one after the other
            (rTask coarsening: the same kernel code, fewer and longer rTasks, so fewer rProgram
            instructions to dispatch); ``num_rtasks`` is then ``ceil(blocks / blocks_per_rtask)``.
        prefetch_us: the part of ``time_us`` that is the rTask's read of its share of the
            operator's weights, which the persistent kernel prefetches into L2 while the vEU
            waits at the barrier-rTask before it (``scheduling.cost_model.weight_read_us``); 0
            where no prefetch is emitted. The policy overlaps it with that wait.
    """

    name: str
    num_rtasks: int
    threads: int
    registers: int | None
    shared_bytes: int
    time_us: float
    source: str
    payload: object = field(default=None, compare=False, hash=False)
    blocks_per_rtask: int = 1
    prefetch_us: float = 0.0

    def __post_init__(self) -> None:
        _check_positive_int("RKernel", "num_rtasks", self.num_rtasks)
        _check_positive_int("RKernel", "blocks_per_rtask", self.blocks_per_rtask)
        _check_positive_int("RKernel", "threads", self.threads)
        if self.registers is not None:
            _check_positive_int("RKernel", "registers", self.registers)
        _check_positive_int("RKernel", "shared_bytes", self.shared_bytes, minimum=0)
        if isinstance(self.time_us, bool) or not isinstance(self.time_us, (int, float)):
            raise TypeError(f"RKernel.time_us must be a number, got {self.time_us!r}")
        if not math.isfinite(self.time_us) or self.time_us <= 0:
            raise ValueError(f"RKernel.time_us must be a finite positive number of microseconds, got {self.time_us}")
        if isinstance(self.prefetch_us, bool) or not isinstance(self.prefetch_us, (int, float)) \
                or not 0 <= self.prefetch_us < self.time_us:
            raise ValueError(f"RKernel.prefetch_us must be a number in [0, time_us={self.time_us}), "
                             f"got {self.prefetch_us!r}")

    @property
    def work_us(self) -> float:
        """vEU-time the whole operator uses with this rKernel: ``time_us * num_rtasks``."""
        return self.time_us * self.num_rtasks


def standalone_time(kernel: RKernel, num_veus: int) -> float:
    """Time of ``kernel``'s operator run alone on ``num_veus`` vEUs: ``ceil(num_rtasks / num_veus) * time_us``."""
    _check_positive_int("standalone_time", "num_veus", num_veus)
    return math.ceil(kernel.num_rtasks / num_veus) * kernel.time_us


@dataclass
class ROperator:
    """An operator of the dataflow graph with its rKernel versions (paper 3.1).

    Attributes:
        uid: unique id of the operator in its graph.
        name: readable name (the Relax binding or PrimFunc name).
        kernels: the rKernel versions, at least one.
        flops, bytes: the operator's total floating-point operations and memory traffic, when known
            (input to the analytical cost model).
        prefetch_inputs: positions (among its call's arguments) of the weights its rTasks have
            prefetched into L2 across the barrier-rTask before them (``RKernel.prefetch_us``).
        prefetch_fraction: the leading part of each rTask's share of those weights that is
            prefetched (1: all of it; less where the weights together exceed what the L2 holds).
    """

    uid: int
    name: str
    kernels: list[RKernel]
    flops: float | None = None
    bytes: float | None = None
    prefetch_inputs: tuple = ()
    prefetch_fraction: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.prefetch_fraction, bool) or not isinstance(
                self.prefetch_fraction, (int, float)) or not 0 < self.prefetch_fraction <= 1:
            raise ValueError(f"ROperator {self.name!r}: prefetch_fraction must be in (0, 1], got "
                             f"{self.prefetch_fraction!r}")
        if not isinstance(self.kernels, list) or not self.kernels:
            raise ValueError(f"ROperator {self.name!r} (uid {self.uid}) needs a non-empty list of RKernel, got {self.kernels!r}")
        for kernel in self.kernels:
            if not isinstance(kernel, RKernel):
                raise TypeError(f"ROperator {self.name!r}: kernels must be RKernel, got {type(kernel).__name__}")

    def fastest_index(self, num_veus: int | Callable[[RKernel], int]) -> int:
        """Index of the rKernel with the smallest standalone time (ties: lowest index).

        ``num_veus`` is the vEU count of the device, or a function giving it per rKernel (the count
        depends on the rKernel's occupancy, paper 4.1.2).
        """
        count = num_veus if callable(num_veus) else (lambda _kernel: num_veus)
        times = [standalone_time(kernel, count(kernel)) for kernel in self.kernels]
        return min(range(len(times)), key=lambda i: (times[i], i))

    def fastest(self, num_veus: int | Callable[[RKernel], int]) -> RKernel:
        """The fastest rKernel on a device with ``num_veus`` vEUs (see :meth:`fastest_index`)."""
        return self.kernels[self.fastest_index(num_veus)]

    @property
    def most_efficient_index(self) -> int:
        """Index of the rKernel with the smallest ``time_us * num_rtasks`` (ties: lowest index)."""
        return min(range(len(self.kernels)), key=lambda i: (self.kernels[i].work_us, i))

    @property
    def most_efficient(self) -> RKernel:
        """The most efficient rKernel: smallest ``time_us * num_rtasks`` (paper 3.3)."""
        return self.kernels[self.most_efficient_index]


@dataclass(frozen=True)
class RTask:
    """rTask ``rtask_id`` of operator ``op`` (paper 3.1: task_uid = operator id + rtask_id)."""

    op: int
    rtask_id: int


@dataclass(frozen=True)
class BarrierRTask:
    """A barrier-rTask: waits until every rTask at the given ``(vEU, order)`` positions finished (paper
    3.2), and every rTask of the operators in ``ops`` (``(op uid, its rTask count)``) finished.

    Waiting for a whole operator is what a dependency on an operator spread over many vEUs means; one
    ``ops`` entry says it with one operator-completion counter instead of one position per vEU (an
    all-to-all dependency between two operators on 528 vEUs would otherwise be 528 x 527 positions).
    """

    waits: tuple[tuple[int, int], ...]
    ops: tuple[tuple[int, int], ...] = ()
