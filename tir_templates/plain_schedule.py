"""A GPU schedule for any PrimFunc of SBlocks: tvm-rammer's own last resort after dlight.

When every dlight rule raises on a function (``default_schedule.GuardedDefaultSchedule``), the
function must still get thread bindings, or TVM's build rejects it ("did you forget to bind?").
:func:`plain_schedule` gives it the plainest correct schedule:

- the blocks that can be inlined into their consumers are (elementwise producers);
- each loop nest left under the root block becomes one kernel;
- its outermost loops that are data-parallel are fused and split over ``blockIdx.x`` x
  ``threadIdx.x`` (at most the target's ``max_num_threads`` per block): one output element per
  thread, the reduction loops serial inside it (TVM's ``bind`` refuses a loop that is not
  data-parallel, so what is bound is always parallel);
- a nest whose outermost loop is not data-parallel (a scan, a reduction over everything), and a
  block without loops, runs on one thread of one block (two unit loops, bound).

Slow, never wrong: it exists so that a model compiles where TVM's rules fail; the warning that the
caller prints names the function. Input: an unscheduled PrimFunc and a CUDA/ROCm target. Output:
the scheduled PrimFunc (``tirx.is_scheduled``), or None for a function that launches threads
itself or is not a tree of SBlocks.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

__all__ = ["plain_schedule", "PLAIN_SCHEDULE"]

PLAIN_SCHEDULE = "tvm_rammer.plain_schedule"  # the name in rammer.scheduled_by


def _launches_threads(func: tirx.PrimFunc) -> bool:
    found = []

    def visit_attr(node):
        if node.attr_key in ("thread_extent", "virtual_thread"):
            found.append(node)

    def visit_for(node):
        if node.kind == tirx.ForKind.THREAD_BINDING:
            found.append(node)

    tvm_ffi.structural_walk(func.body, [(tirx.AttrStmt, visit_attr), (tirx.For, visit_for)])
    return bool(found)


def _max_threads(target) -> int:
    try:
        return int(target.attrs["max_num_threads"])
    except Exception:  # pylint: disable=broad-except  (a target without the attribute)
        return 256


def _bound(sch, block) -> bool:
    return any(sch.get(loop).thread_binding is not None for loop in sch.get_loops(block))


def _bind_parallel(sch, block, threads: int):
    """A copy of ``sch`` where the longest data-parallel prefix of ``block``'s loops is fused and
    bound to blockIdx.x x threadIdx.x; None when not even the outermost loop can be bound."""
    loops = sch.get_loops(block)
    for count in range(len(loops), 0, -1):
        trial = sch.copy()
        try:
            outer = trial.get_loops(block)[:count]
            fused = trial.fuse(*outer) if count > 1 else outer[0]
            extent = trial.get(fused).extent
            per_block = min(threads, int(extent)) if isinstance(extent, tirx.IntImm) else threads
            bx, tx = trial.split(fused, factors=[None, per_block])
            trial.bind(bx, "blockIdx.x")
            trial.bind(tx, "threadIdx.x")
        except Exception:  # pylint: disable=broad-except  (ScheduleError: not data-parallel)
            continue
        return trial
    return None


def _bind_single_thread(sch, block) -> None:
    loops = sch.get_loops(block)
    top = loops[0] if loops else block
    sch.bind(sch.add_unit_loop(top), "blockIdx.x")
    sch.bind(sch.add_unit_loop(top), "threadIdx.x")


def _compute_at_consumer(sch, block):
    """A copy of ``sch`` where ``block`` (an intermediate result, e.g. a reduction) is under its
    consumers' thread loop, its buffer a register: each thread computes what it reads, one kernel
    and no intermediate buffer in global memory. None when it has no bound consumer or TVM
    refuses (consumers in other nests: it gets a kernel of its own)."""
    consumers = sch.get_consumers(block)
    if not consumers:
        return None
    loops = [loop for loop in sch.get_loops(consumers[0]) if sch.get(loop).thread_binding is not None]
    if not loops:
        return None
    trial = sch.copy()
    try:
        trial.compute_at(block, loops[-1], preserve_unit_loops=True)
        trial.set_scope(block, 0, "local")
    except Exception:  # pylint: disable=broad-except  (consumers in other nests: its own kernel)
        return None
    return trial


def plain_schedule(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """``func`` with every loop nest bound to GPU threads (see the module docstring), or None."""
    if _launches_threads(func) or not isinstance(func.body, s_tir.SBlockRealize):
        return None
    threads = _max_threads(target)
    try:
        sch = s_tir.Schedule(func)
        root = sch.get_sblock(func.body.block.name_hint)
        for block in sch.get_child_blocks(root):  # fewer nests, fewer kernels: inline what can be
            try:
                sch.compute_inline(block)
            except Exception:  # pylint: disable=broad-except  (a reduction, an output: stays)
                pass
        for block in reversed(sch.get_child_blocks(root)):  # consumers first
            if _bound(sch, block):
                continue  # shares a nest bound for a later block
            moved = _compute_at_consumer(sch, block)
            if moved is not None:
                sch = moved
                continue
            parallel = _bind_parallel(sch, block, threads)
            if parallel is not None:
                sch = parallel
            else:
                _bind_single_thread(sch, block)
    except Exception:  # pylint: disable=broad-except  (a tree this schedule cannot bind)
        return None
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
