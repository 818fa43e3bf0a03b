"""Faults of the persistent kernel, reported on the host as errors a user can act on.

A barrier-rTask that waits longer than ``RammerConfig.wait_timeout_ms`` (a bug: a wait nothing
will ever satisfy) does not hang and does not ``__trap`` (which would poison the CUDA context): the
kernel records the fault and ends normally (``codegen.cuda_helpers``). The record goes to the
*fault page*, ``int32[PAGE_WORDS]`` of memory that the compiled module owns: one Relax constant per
module, passed to every persistent kernel with barriers, and returned by the module's Relax
function ``rammer_fault_page`` (:data:`PAGE_FUNC`, no parameters). A compiled library therefore
needs nothing but TVM's runtime: no packed function of tvm_rammer, no callback per run. Each
``relax.VirtualMachine`` holds its own device copy of the module's constants, so each VM has its
own page. After a run, :func:`check` reads the page through the VM and raises :class:`KernelFault`
naming the kernel, the vEU, its instruction and the rTask the barrier guarded; the page is then
cleared, and the CUDA context is as usable as before. Without tvm_rammer the same words are one call
away: ``vm["rammer_fault_page"]().numpy()`` (word 0 non-zero: a fault; layout below).

Page layout (int32, :data:`PAGE_WORDS`): code (0 = none, 1 = wait timed out, 2 = the grid barrier
timed out), kernel id (the ``k`` of ``rammer_rprogram<k>``), vEU, instruction index in that vEU's
list, awaited vEU, awaited step, step it had reached, dispatch entry and rtask_id of the rTask the
barrier guarded; words 12-14 are the prologue's grid barrier (``cuda_helpers.GRID_SYNC_SOURCE``:
count and generation, kept between runs, and the word a vEU whose barrier timed out sets); the last
word holds :data:`PAGE_MAGIC` ("RAMM"), so the page is never mistaken for (or merged with) another
constant of the model.

For tests, ``RammerConfig(extra={"inject_unsatisfiable_barrier": True})`` makes the first
barrier-rTask of every rProgram wait for a step nobody publishes (:func:`inject_test_fault`).
"""

from __future__ import annotations

import numpy as np

from .cuda_helpers import FAULT_GRID_TIMEOUT, FAULT_WAIT_TIMEOUT, PAGE_WORDS
from .persistent import waiting_barriers

PAGE_FUNC = "rammer_fault_page"
PAGE_MAGIC = 0x52414D4D  # "RAMM": the page's last word
INJECT_KEY = "inject_unsatisfiable_barrier"

__all__ = ["KernelFault", "check", "read_fault", "clear", "describe", "message", "empty_page",
           "page_constant", "page_function", "inject_test_fault", "PAGE_FUNC", "PAGE_WORDS"]


class KernelFault(RuntimeError):
    """A persistent kernel gave up a wait; ``record`` holds the page's fields."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


# --- Relax side -------------------------------------------------------------------------------

def empty_page() -> np.ndarray:
    """The page's contents when no fault is recorded."""
    page = np.zeros(PAGE_WORDS, dtype="int32")
    page[-1] = PAGE_MAGIC
    return page


def page_constant():
    """A fresh fault page for one module: the same ``relax.Constant`` object must be passed to
    every persistent kernel of the module and returned by :func:`page_function`."""
    from tvm import relax

    return relax.const(empty_page(), "int32")


def page_function(page):
    """The public Relax function :data:`PAGE_FUNC` returning ``page`` (the VM's own copy)."""
    from tvm import relax

    return relax.Function([], relax.SeqExpr([], page), ret_ty=page.ty,
                          is_pure=True).with_attr("global_symbol", PAGE_FUNC)


def inject_test_fault(table: np.ndarray, num_veus: int, config) -> np.ndarray:
    """``table`` unchanged, or (with ``config.extra["inject_unsatisfiable_barrier"]``) with its
    first barrier-rTask waiting for a step 10**9 that no vEU ever publishes."""
    if not config.extra.get(INJECT_KEY, False):
        return table
    table = np.array(table, dtype=np.int32)
    waiting = waiting_barriers(table, num_veus)
    if waiting:
        table[table[waiting[0] + 1] + 1] = 10 ** 9
    return table


# --- the host check ---------------------------------------------------------------------------

def describe(words) -> dict | None:
    """The page's fields as a dict, or None when it records no fault."""
    words = [int(w) for w in words]
    if words[0] == 0:
        return None
    keys = ("code", "kernel", "veu", "instruction", "awaited_veu", "awaited_step", "reached_step",
            "entry", "rtask_id")
    record = dict(zip(keys, words))
    record["kernel"] = f"rammer_rprogram{record['kernel']}"
    return record


def message(record: dict, timeout_ms: float | None = None) -> str:
    """The error text for one fault record."""
    limit = f"more than {timeout_ms:g} ms" if timeout_ms else "past its time limit"
    if record["code"] == FAULT_GRID_TIMEOUT:
        return (f"tvm-rammer: persistent kernel {record['kernel']}: its grid barrier waited {limit} "
                f"for vEUs that never arrived, and its vEUs stopped (one that passed the barrier "
                f"before the time-out may have run rTasks first): the outputs of this run are "
                f"invalid (the page has been reset). On an AMD GPU "
                f"(its runtime has no cooperative launch to refuse such a grid) not all of its vEUs "
                f"were resident at once: compile with fewer vEUs (--veus-per-sm N, "
                f"RammerConfig.veus_per_sm) or leave other work off the GPU while it runs. On CUDA "
                f"the cooperative launch makes them resident, so two runs of one VM at the same "
                f"time (two streams) shared its fault page, whose words the barrier keeps: run one "
                f"VM per stream.")
    what = "timed out" if record["code"] == FAULT_WAIT_TIMEOUT else f"fault {record['code']}"
    awaited = (f"vEU {record['awaited_veu']} to reach step {record['awaited_step']}"
               if record["awaited_veu"] >= 0 else
               f"operator counter {-record['awaited_veu'] - 1} to count {record['awaited_step']} "
               "finished rTasks")
    return (f"tvm-rammer: persistent kernel {record['kernel']}: vEU {record['veu']} waited {limit} "
            f"({what}) at instruction {record['instruction']}, the barrier-rTask before rTask "
            f"{record['rtask_id']} of dispatch entry {record['entry']}, for {awaited} (it reached "
            f"{record['reached_step']}). Every vEU stopped and the kernel ended: the outputs of "
            f"this run are invalid, the CUDA context is still usable. This is a scheduling bug: "
            f"please report it with the model (tvm-rammer inspect --json shows the rProgram).")


def _page(vm):
    """The fault page of ``vm`` (a ``relax.VirtualMachine``), or None when its module has no
    persistent kernel with barriers."""
    try:
        func = vm[PAGE_FUNC]
    except (AttributeError, KeyError, ValueError, RuntimeError):
        return None
    return func()


def read_fault(vm) -> dict | None:
    """The fault recorded in ``vm``'s page since it was last cleared (call after the run has
    finished; reading the page waits for the device), or None."""
    page = _page(vm)
    return None if page is None else describe(page.numpy())


def clear(vm) -> None:
    """Reset ``vm``'s page to no fault."""
    page = _page(vm)
    if page is not None:
        page.copyfrom(empty_page())


def check(vm, timeout_ms: float | None = None) -> None:
    """Raise :class:`KernelFault` when a persistent kernel run by ``vm`` (a
    ``relax.VirtualMachine``) recorded a fault. The page is cleared, so each fault is raised
    once."""
    record = read_fault(vm)
    if record is None:
        return
    clear(vm)
    raise KernelFault(message(record, timeout_ms), record)
