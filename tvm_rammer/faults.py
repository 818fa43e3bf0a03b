"""Faults of the persistent kernel, reported on the host as errors a user can act on.

A barrier-rTask that waits longer than ``RammerConfig.wait_timeout_ms`` (a bug: a wait nothing
will ever satisfy) does not hang and does not ``__trap`` (which would poison the CUDA context): the
kernel records the fault and ends normally (``codegen.cuda_helpers``). The record goes to the
*fault page*, a small pinned host page mapped into the GPU's address space, which every persistent
kernel with barriers takes as an extra input; Relax gets it from the packed function
``tvm_rammer.fault_page`` (registered when ``tvm_rammer`` is imported, so import it before running
a compiled module). After a run, :func:`check` reads the page and raises :class:`KernelFault`
naming the kernel, the vEU, its instruction and the rTask the barrier guarded; the page is then
cleared, and the CUDA context is as usable as before.

Page layout (int32, :data:`PAGE_WORDS`): code (0 = none, 1 = wait timed out), kernel id (the ``k``
of ``rammer_rprogram<k>``), vEU, instruction index in that vEU's list, awaited vEU, awaited step,
step it had reached, dispatch entry and rtask_id of the rTask the barrier guarded.

For tests, ``RammerConfig(extra={"inject_unsatisfiable_barrier": True})`` makes the first
barrier-rTask of every rProgram wait for a step nobody publishes (:func:`inject_test_fault`).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .codegen.cuda_helpers import FAULT_WAIT_TIMEOUT, PAGE_WORDS
from .codegen.persistent import BARRIER_KIND, INST_WORDS

FAULT_PAGE_FUNC = "tvm_rammer.fault_page"
INJECT_KEY = "inject_unsatisfiable_barrier"

__all__ = ["KernelFault", "check", "read_fault", "describe", "fault_page_call", "fault_page",
           "inject_test_fault", "FAULT_PAGE_FUNC", "PAGE_WORDS"]


class KernelFault(RuntimeError):
    """A persistent kernel gave up a wait; ``record`` holds the page's fields."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


# --- Relax side -------------------------------------------------------------------------------

def fault_page_call(anchor):
    """The Relax expression that yields the fault page, on the device of ``anchor`` (any tensor
    argument of the persistent kernel's call: the program table)."""
    from tvm import relax

    return relax.call_pure_packed(FAULT_PAGE_FUNC, anchor,
                                  ty_args=[relax.TensorType((PAGE_WORDS,), "int32")])


def inject_test_fault(table: np.ndarray, num_veus: int, config) -> np.ndarray:
    """``table`` unchanged, or (with ``config.extra["inject_unsatisfiable_barrier"]``) with its
    first barrier-rTask waiting for a step 10**9 that no vEU ever publishes."""
    if not config.extra.get(INJECT_KEY, False):
        return table
    table = np.array(table, dtype=np.int32)
    base = num_veus + 1
    for i in range(int(table[num_veus])):
        at = base + INST_WORDS * i
        if table[at] == BARRIER_KIND and table[at + 2] > 0:
            table[table[at + 1] + 1] = 10 ** 9
            return table
    return table


# --- the page ---------------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _p: None)  # the page outlives views


class _View:
    """A DLPack producer for ``words`` int32 at ``address`` on (device_type, device_id); the
    memory is owned elsewhere (the page stays allocated for the process)."""

    def __init__(self, address: int, words: int, device_type: int, device_id: int):
        self.shape = (ctypes.c_int64 * 1)(words)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.ndim, t.byte_offset = address, 1, 0
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None
        t.device = _DLDevice(device_type, device_id)
        t.dtype = _DLDataType(0, 32, 1)  # int32
        self.managed.deleter = ctypes.cast(_DELETER, ctypes.c_void_p)
        self.device = (device_type, device_id)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **_kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                         ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)


class _Page:
    """One pinned, mapped host page per CUDA device (cuMemHostAlloc, portable + device-mapped:
    with unified addressing its host address is also its device address)."""

    def __init__(self, device_id: int):
        cuda = ctypes.CDLL("libcuda.so.1")
        self.words = PAGE_WORDS
        host = ctypes.c_void_p()
        flags = 0x01 | 0x02  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
        err = cuda.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(4 * PAGE_WORDS),
                                  ctypes.c_uint(flags))
        if err != 0:
            raise RuntimeError(f"tvm-rammer: cuMemHostAlloc for the fault page failed (CUresult "
                               f"{err}); is a CUDA context current?")
        dev_ptr = ctypes.c_uint64()
        err = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dev_ptr), host, ctypes.c_uint(0))
        if err != 0:
            raise RuntimeError(f"tvm-rammer: cuMemHostGetDevicePointer failed (CUresult {err})")
        self.host = (ctypes.c_int32 * PAGE_WORDS).from_address(host.value)
        ctypes.memset(host.value, 0, 4 * PAGE_WORDS)
        self.view = _View(dev_ptr.value, PAGE_WORDS, 2, device_id)  # kDLCUDA
        self.tensor = None

    def words_now(self) -> list:
        return list(self.host)

    def clear(self) -> None:
        for i in range(PAGE_WORDS):
            self.host[i] = 0


_PAGES: dict = {}  # CUDA device id -> _Page: one pinned page per device for the process
_PAGES_LOCK = threading.Lock()  # threads sharing a module may ask for the page at the same time


def _page(device_id: int) -> _Page:
    with _PAGES_LOCK:
        if device_id not in _PAGES:
            _PAGES[device_id] = _Page(device_id)
        return _PAGES[device_id]


def fault_page(anchor):
    """The packed function ``tvm_rammer.fault_page``: the page of ``anchor``'s CUDA device."""
    import tvm

    device_id = int(anchor.device.index) if hasattr(anchor.device, "index") else 0
    page = _page(device_id)
    with _PAGES_LOCK:
        if page.tensor is None:
            page.tensor = tvm.runtime.from_dlpack(page.view)
        return page.tensor


def _register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func(FAULT_PAGE_FUNC, fault_page, override=True)


_register()


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


def read_fault(device_id: int = 0) -> dict | None:
    """The fault recorded on ``device_id``'s page since it was last cleared (call after the run
    has finished, e.g. after ``dev.sync()``), or None."""
    if device_id not in _PAGES:
        return None
    return describe(_PAGES[device_id].words_now())


def check(dev=None, timeout_ms: float | None = None) -> None:
    """Raise :class:`KernelFault` when a persistent kernel on ``dev`` (default: CUDA 0) recorded
    a fault; synchronises ``dev`` first. The page is cleared, so each fault is raised once."""
    device_id = 0 if dev is None else int(dev.index)
    if dev is not None:
        dev.sync()
    record = read_fault(device_id)
    if record is None:
        return
    _PAGES[device_id].clear()
    raise KernelFault(message(record, timeout_ms), record)
