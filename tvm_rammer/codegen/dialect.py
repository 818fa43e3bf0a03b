"""The device dialect of the persistent kernel: how its helpers are called on one GPU family.

``persistent.build_persistent_func`` builds the same TIR for every GPU; the few places that are
device-specific go through a dialect object, chosen by the target kind (:func:`dialect_for`):

* ``call(name, *args, source_code, return_type)``: one helper call (wait, signal, count, stopped,
  timer, record; names and arguments in ``cuda_helpers``);
* ``grid_sync(page, state, num_veus, tid, timeout_ns, kernel_id)``: the grid barrier of the
  prologue, an int32 expression: 1 when it timed out (the vEU then skips its instructions);
* ``instantiate(default)``: the rTask instantiation to use (``tir_templates.rtask_rewrite``'s
  for CUDA; the early-exit scheme differs on AMDGPU, which has no named barriers);
* ``finalize(func)``: the finished PrimFunc, rewritten for the device (barriers, attributes).

:class:`CudaDialect` is what the persistent kernel always did: ``cuda_func_call`` with the CUDA
source of ``cuda_helpers``, its software grid barrier, ``tvm_storage_sync("shared")``
(``__syncthreads``). ``tvm_rammer.rocm.dialect.AmdgpuDialect`` is the AMDGPU one.
"""

from __future__ import annotations

from tvm.backend.cuda import op as cuda_op
from tvm import tirx

from . import cuda_helpers


class CudaDialect:
    """The persistent kernel on CUDA: helpers as ``cuda_func_call`` with their CUDA source."""

    kind = "cuda"

    def call(self, name, *args, source_code, return_type="void"):
        """A call of helper ``name`` (its CUDA source placed once in the kernel's .cu file)."""
        return cuda_op.cuda_func_call(name, *args, source_code=source_code,
                                      return_type=return_type)

    def grid_sync(self, page, state, num_veus, tid, timeout_ns, kernel_id):
        """The prologue's grid barrier, an int32 expression (1: it timed out and the vEU stops):
        ``cuda_helpers``' software barrier on the fault page (the kernel is still launched
        cooperatively); not TVM's cooperative-groups ``cuda_grid_sync``, whose headers cost nvcc
        most of a second per build (``cuda_helpers.GRID_SYNC_SOURCE``)."""
        return self.call(cuda_helpers.GRID_SYNC_NAME, page, state, tirx.const(num_veus, "int32"),
                         tid, tirx.const(timeout_ns, "int64"), tirx.const(kernel_id, "int32"),
                         source_code=cuda_helpers.GRID_SYNC_SOURCE, return_type="int32")

    def instantiate(self, default):
        """The rTask instantiation: ``default`` (named barriers over the active threads)."""
        return default

    def finalize(self, func):
        """The PrimFunc as built."""
        return func


def dialect_for(target):
    """The dialect of ``target``'s kind: AMDGPU for ``rocm``, CUDA otherwise (and without a
    target in scope, as before the dialects existed)."""
    if target is not None and target.kind.name == "rocm":
        from ..rocm.dialect import AmdgpuDialect  # pylint: disable=import-outside-toplevel
        return AmdgpuDialect(target)
    return CudaDialect()
