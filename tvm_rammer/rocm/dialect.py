"""The persistent kernel's device dialect for AMDGPU (``codegen.dialect``'s interface).

The same TIR as on CUDA (tables, steps, barrier-rTasks, fault page), with:

* helpers called by ``call_extern`` (the C of :mod:`tvm_rammer.rocm.helpers`, linked as bitcode by
  :mod:`tvm_rammer.rocm.build`); pointer arguments are global (``addrspace(1)``) pointers, as
  TVM's AMDGPU codegen makes a buffer's address;
* the grid barrier of the prologue a software barrier on the fault page (``rammer_grid_sync``; TVM's
  ROCm runtime has no cooperative launch, so the cooperative-launch parameter is dropped and
  co-residency is checked from the code object's metadata: :mod:`tvm_rammer.rocm.occupancy`);
* every workgroup barrier (``tvm_storage_sync("shared")``, a bare ``s_barrier`` in TVM's ROCm
  codegen) replaced by the fenced barrier ``rammer_amd_barrier``;
* the rTask instantiation of :mod:`tvm_rammer.rocm.early_exit` (no named barriers on CDNA);
* the body wrapped in ``hand_threaded``: every barrier is placed already, and TVM's ThreadSync
  would refuse the helper calls under the vEU-uniform conditions ("Cannot insert syncs inside
  condition").
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx

from . import early_exit
from .helpers import BARRIER_NAME, GRID_SYNC_NAME

LAUNCH_PARAMS_ATTR = "tirx.kernel_launch_params"
WAVES_PER_EU_ATTR = "rammer_amdgpu_waves_per_eu"  # read by rocm.build.kernel_attributes
WAVE = 64
SIMDS_PER_CU = 4


class AmdgpuDialect:
    """The persistent kernel for a ``rocm`` target (see the module docstring)."""

    kind = "rocm"

    def __init__(self, target=None):
        self.target = target

    def call(self, name, *args, source_code=None, return_type="void"):  # pylint: disable=unused-argument
        """``call_extern`` of helper ``name`` (its CUDA ``source_code`` is not used here)."""
        return tirx.call_extern(return_type, name, *args)

    def grid_sync(self, page, state, num_veus, tid, timeout_ns, kernel_id):
        """The software grid barrier on the fault page's three barrier words (int32: 1 when it
        timed out and the vEU stops)."""
        return tirx.call_extern("int32", GRID_SYNC_NAME, page, state,
                                tirx.const(num_veus, "int32"), tid,
                                tirx.const(timeout_ns, "int64"), tirx.const(kernel_id, "int32"))

    def instantiate(self, default):
        """AMDGPU's early exit around ``default`` (``tir_templates.rtask_rewrite.instantiate``)."""
        return functools.partial(early_exit.instantiate, default)

    def finalize(self, func):
        """Fenced barriers, ``hand_threaded`` inside the thread extents, no cooperative launch."""
        body = tvm_ffi.structural_map(func.body, (tvm.ir.Call, _fenced))
        func = func.with_body(_hand_threaded(body)) if hasattr(func, "with_body") else \
            tirx.PrimFunc(func.params, _hand_threaded(body), func.ret_type, func.buffer_map,
                          func.attrs)
        if LAUNCH_PARAMS_ATTR in (func.attrs or {}):
            func = func.without_attr(LAUNCH_PARAMS_ATTR)
        return func.with_attr("rammer.device", "amdgpu")


def _fenced(call):
    if early_exit.is_block_barrier(call):
        return tirx.call_extern("void", BARRIER_NAME)
    return call


def _hand_threaded(stmt, threads=None, veus_per_cu=None):
    """``hand_threaded`` just inside the kernel's thread-extent (and launch-bounds) attributes,
    and inside it :data:`WAVES_PER_EU_ATTR` when the vEUs per CU are known (TVM's device
    functions keep no PrimFunc attribute of ours, the body's AttrStmts survive)."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key in (
            "thread_extent", "tirx.launch_bounds_min_blocks_per_sm"):
        if stmt.attr_key == "thread_extent" and stmt.node.thread_tag == "threadIdx.x":
            threads = int(stmt.value)
        if stmt.attr_key == "tirx.launch_bounds_min_blocks_per_sm":
            veus_per_cu = int(stmt.value)
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value,
                             _hand_threaded(stmt.body, threads, veus_per_cu))
    if threads and veus_per_cu:
        stmt = tirx.AttrStmt(tirx.const(0, "int32"), WAVES_PER_EU_ATTR,
                             waves_per_eu(threads, veus_per_cu), stmt)
    return tirx.AttrStmt(tirx.const(0, "int32"), "hand_threaded", 0, stmt)


def waves_per_eu(threads: int, veus_per_cu: int) -> int:
    """Waves each SIMD must hold for ``veus_per_cu`` vEUs of ``threads`` threads on a CU (wave64,
    4 SIMDs): the ``amdgpu-waves-per-eu`` minimum, AMDGPU's ``__launch_bounds__`` occupancy."""
    return max(1, -(-veus_per_cu * -(-threads // WAVE) // SIMDS_PER_CU))
