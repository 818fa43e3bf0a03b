"""The persistent kernel's fault page, decoded without TVM's compiler.

In: the page's int32 words, read through a library's VM function ``rammer_fault_page``.
Out: None (no fault) or a record dict and :class:`KernelFault` naming the kernel, the vEU and its
instruction. The layout and the messages are ``tvm_rammer.codegen.faults``' (which needs the compiler to
build the page); ``tests/test_runtime_runner.py`` checks that both decode a page alike.

Layout (int32, :data:`PAGE_WORDS`): 0 code (0 none, 1 a wait timed out, 2 the grid barrier timed
out), 1 kernel id (``rammer_rprogram<k>``), 2 vEU, 3 instruction index, 4 awaited vEU, 5 awaited
step, 6 step reached, 7 dispatch entry, 8 rtask_id; 12-14 the grid barrier's words; the last word
:data:`PAGE_MAGIC`.
"""

from __future__ import annotations

import numpy as np

PAGE_FUNC = "rammer_fault_page"
PAGE_WORDS = 16
PAGE_MAGIC = 0x52414D4D  # "RAMM"
FAULT_WAIT_TIMEOUT = 1
FAULT_GRID_TIMEOUT = 2
_KEYS = ("code", "kernel", "veu", "instruction", "awaited_veu", "awaited_step", "reached_step",
         "entry", "rtask_id")

__all__ = ["KernelFault", "PAGE_FUNC", "PAGE_WORDS", "PAGE_MAGIC", "empty_page", "describe",
           "message"]


class KernelFault(RuntimeError):
    """A persistent kernel gave up a wait; ``record`` holds the page's fields."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


def empty_page() -> np.ndarray:
    """The page's words when no fault is recorded."""
    page = np.zeros(PAGE_WORDS, dtype="int32")
    page[-1] = PAGE_MAGIC
    return page


def describe(words) -> dict | None:
    """The page's fields as a dict (``kernel`` as its function name), or None when word 0 is 0."""
    words = [int(w) for w in words]
    if len(words) != PAGE_WORDS or words[-1] != PAGE_MAGIC:
        raise ValueError(f"the library's {PAGE_FUNC} returned {len(words)} words ending in "
                         f"{words[-1] if words else None}, not a tvm-rammer fault page "
                         f"({PAGE_WORDS} words ending in {PAGE_MAGIC}): its manifest's "
                         f"'fault_page' is wrong; rebuild the library")
    if words[0] == 0:
        return None
    record = dict(zip(_KEYS, words))
    record["kernel"] = f"rammer_rprogram{record['kernel']}"
    return record


def message(record: dict, timeout_ms: float | None = None) -> str:
    """The error text for one fault record (the same as ``tvm_rammer.codegen.faults.message``)."""
    limit = f"more than {timeout_ms:g} ms" if timeout_ms else "past its time limit"
    if record["code"] == FAULT_GRID_TIMEOUT:
        return (f"tvm-rammer: persistent kernel {record['kernel']}: its grid barrier waited "
                f"{limit} for vEUs that never arrived, and its vEUs stopped (one that passed the "
                f"barrier before the time-out may have run rTasks first): the outputs of this run "
                f"are invalid (the page has been reset). On an AMD GPU (its runtime has no "
                f"cooperative launch to refuse such a grid) not all of its vEUs "
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
