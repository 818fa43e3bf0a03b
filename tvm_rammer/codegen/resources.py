"""Resources of a compiled persistent kernel (registers, shared memory), for its occupancy.

Paper 4.1.2: "we set the number of vEUs on each SM according to the maximum active PTB number
provided by the CUDA compiler nvcc". The kernel's code does not depend on the placement (the
rProgram is a table), so it is compiled once with a provisional vEU count, its registers are read
from ``ptxas -v``, and the rProgram is placed for the occupancy they allow.
"""

from __future__ import annotations

import logging
import shutil

import tvm

from tir_templates.rtask_rewrite import instantiate

from .persistent import PersistentKernelSpec, build_persistent_func
from ..target import target_arch

LOG = logging.getLogger("tvm_rammer")


def module_cuda_source(module) -> str:
    """The CUDA C source of a built module's CUDA import. Which format name holds it depends on the
    build (a source-only module here, a compiled one on a GPU machine): the first that does."""
    device = module.imports[0]
    for fmt in ("cu", "cuda", ""):
        try:
            source = str(device.inspect_source(fmt) if fmt else device.inspect_source())
        except Exception:  # pylint: disable=broad-except  (a format this module does not keep)
            continue
        if "__global__" in source:
            return source
    raise ValueError("the built module keeps no CUDA source (set TVM_CUDA_COMPILE_MODE=nvcc?)")


def cuda_source(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> str:
    """The CUDA source TVM's full build generates for one PrimFunc (named by its global_symbol,
    "main" without one)."""
    name = str((func.attrs or {}).get("global_symbol", "main"))
    return module_cuda_source(tvm.tirx.build(tvm.IRModule({name: func}), target))


class ResourceProbe:
    """Reads the registers a persistent kernel needs; None when disabled or nvcc is missing."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and shutil.which("nvcc") is not None
        if enabled and not self.enabled:
            LOG.info("tvm-rammer: nvcc not found; vEUs per SM use the register estimate")

    def registers(self, spec: PersistentKernelSpec, target: tvm.target.Target):
        """Registers per thread of ``spec``'s kernel (with barrier code), or None."""
        if target.kind.name == "rocm":  # always: no cooperative launch refuses a grid that cannot
            # be co-resident, so the placement must use the compiled kernel's VGPRs (tvm_rammer.rocm)
            from ..rocm.report import probe_registers  # pylint: disable=import-outside-toplevel
            return probe_registers(spec, target)
        if not self.enabled:
            return None
        from tir_templates.cuda_resources import compile_cuda_resources

        func = build_persistent_func(spec, num_veus=1, table_len=16, with_barriers=True,
                                     instantiate=instantiate)
        arch = target_arch(target)
        try:
            usage = compile_cuda_resources(cuda_source(func, target), arch)
        except (RuntimeError, ValueError, OSError) as err:
            LOG.warning("tvm-rammer: could not read %s's registers (%s); using the estimate",
                        spec.name, str(err).splitlines()[0])
            return None
        return int(usage["registers"])
