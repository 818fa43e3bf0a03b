"""The cost model's prediction of one whole inference of a lowered module (``inspect``'s
``predicted_us``).

Input: the module the rammer pipeline lowered (a Relax module after the VM lowering, its PrimFuncs
scheduled), the target and the ``RammerConfig`` it was lowered with. Output
(:func:`predict_inference`): ``predicted_us`` and its parts, where

    predicted_us = sum of every rProgram's ``predicted_us`` (its report: the policy's makespan, one
                   launch, and the grid sync when it has barriers; a profiled time where measured)
                 + sum over every call of an ordinary kernel (a PrimFunc of ``main`` that is not an
                   rProgram) of  launches x launch_us + rounds x per-block time

with the ordinary kernel priced by the same analytical model as an rKernel version
(``scheduling.rkernels.predicted_kernel_us``): its FLOPs and bytes (``rkernels.flops_and_bytes``,
the regions it reads and writes, a Gather's rows), its thread blocks, threads per block and shared
memory as ``tir_templates.prelower`` reads them from the lowered kernel (as for an rKernel
version; for a PrimFunc ``prelower`` rejects, e.g. one of several kernels: the product of its
blockIdx extents, of its threadIdx extents, and its ``AllocBuffer``'d shared memory), as many blocks
per SM as the vDevice's occupancy allows, ``rounds`` = blocks / (SMs x blocks per SM) rounded up, each
block at ``rtask_time_us`` (its share of the FLOPs and bytes at its share of the SM, plus the fixed
per-block overhead). ``launch_us`` is the cost model's (``RammerConfig.launch_us``), once per device
kernel of the PrimFunc (``driver.launches.kernels_in_primfunc``: TVM's ``scatter_nd`` is two). A
PrimFunc with several kernels is priced as one kernel of its largest grid with all its bytes. The
kernels run one after another on one stream, so the times add up. Calls the model cannot price (an
external library call, a symbolic extent) are listed in ``unpriced`` and counted as one launch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx

from tir_templates.prelower import UnsupportedKernel, prelower

from ..config import RammerConfig
from ..driver.launches import kernels_in_primfunc
from ..driver.report import REPORT_ATTR
from ..scheduling import rkernels
from ..target import plain_target, resolve_target

_BUILTIN_PREFIXES = ("vm.builtin.", "relax.", "runtime.", "tvm_rammer.")


@dataclass(frozen=True)
class Grid:
    """One kernel's launch shape, as ``rkernels.predicted_kernel_us`` reads a lowered rKernel."""

    num_rtasks: int  # thread blocks
    threads: int
    shared_bytes: int


def kernel_grid(func: tirx.PrimFunc) -> Grid | None:
    """Blocks (product of the blockIdx extents), threads (product of the threadIdx extents, the
    largest of each tag) and the shared-memory bytes of its ``AllocBuffer`` nodes (a PrimFunc
    ``prelower`` rejects: TVM's multi-kernel ones are lowered already); None where an extent is
    symbolic."""
    extents: dict = {}
    symbolic = []

    def bind(tag: str, extent) -> None:
        if not isinstance(extent, tirx.IntImm):
            symbolic.append(tag)
            return
        extents[tag] = max(extents.get(tag, 1), int(extent))

    def on_for(loop):
        if loop.thread_binding is not None:
            bind(str(loop.thread_binding.thread_tag), loop.extent)

    def on_attr(attr):
        if attr.attr_key == "thread_extent":
            bind(str(attr.node.thread_tag), attr.value)

    shared = [0]

    def on_allocate(node):
        buf = node.buffer
        if buf.scope() in ("shared", "shared.dyn") and all(isinstance(d, tirx.IntImm)
                                                           for d in buf.shape):
            shared[0] += math.prod(int(d) for d in buf.shape) * tvm.DataType(str(buf.dtype)).bits // 8

    tvm_ffi.structural_walk(func.body, [(tirx.For, on_for), (tirx.AttrStmt, on_attr),
                                        (tirx.AllocBuffer, on_allocate)])
    if symbolic:
        return None
    grid = math.prod(v for k, v in extents.items() if k.startswith("blockIdx"))
    threads = math.prod(v for k, v in extents.items() if k.startswith("threadIdx"))
    return Grid(max(1, grid), max(1, threads), shared[0])


def launch_shape(func: tirx.PrimFunc, target) -> Grid | None:
    """``func``'s blocks, threads and shared bytes: ``prelower``'s where it lowers ``func`` (one
    kernel), else :func:`kernel_grid`'s."""
    try:
        lowered = prelower(func, target, name="ordinary")
    except UnsupportedKernel:
        return kernel_grid(func)
    return Grid(lowered.num_rtasks, lowered.threads, lowered.shared_bytes)


def ordinary_kernel_us(func: tirx.PrimFunc, config: RammerConfig, vdevice,
                       target) -> float | None:
    """One call of the ordinary kernel ``func`` built for ``target`` (a plain CUDA target):
    launches x launch_us + its analytical time (module docstring); None when it cannot be
    priced."""
    grid = launch_shape(func, target)
    if grid is None:
        return None
    try:
        flops, nbytes = rkernels.flops_and_bytes(func)
        body = rkernels.predicted_kernel_us(flops, nbytes, grid, config, vdevice)
    except Exception:  # pylint: disable=broad-except  (an opaque PrimFunc: not priced, said so)
        return None
    if body is None:
        return None
    launch = rkernels.cost_config(config, vdevice).launch_us
    return kernels_in_primfunc(func) * launch + body


def _calls(mod: tvm.IRModule, entry: str = "main") -> list:
    """Names of the PrimFuncs and external functions ``mod[entry]`` calls, once per call (calls in
    Relax functions it calls included), as ``driver.launches.count_launches`` counts them."""
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function)}
    found: list = []

    def walk(func, visiting):
        def on_call(call):
            op = call.op
            if isinstance(op, tvm.ir.GlobalVar):
                name = op.name_hint
                if name in relax_funcs and name not in visiting:
                    walk(relax_funcs[name], visiting | {name})
                elif name not in relax_funcs:
                    found.append(("func", name))
            elif isinstance(op, relax.ExternFunc):
                if not str(op.global_symbol).startswith(_BUILTIN_PREFIXES):
                    found.append(("extern", str(op.global_symbol)))
            elif isinstance(op, tvm.ir.Op) and op.name in ("relax.call_tir",
                                                           "relax.call_tir_inplace"):
                found.append(("func", call.args[0].name_hint))
            elif isinstance(op, tvm.ir.Op) and op.name == "relax.call_dps_packed":
                callee = call.args[0]  # an ExternFunc: its symbol, as for a direct call above
                symbol = str(getattr(callee, "global_symbol", callee))
                if not symbol.startswith(_BUILTIN_PREFIXES):
                    found.append(("extern", symbol))

        tvm_ffi.structural_walk(func.body, (relax.Call, on_call))

    if entry in relax_funcs:
        walk(relax_funcs[entry], {entry})
    return found


def predict_inference(lowered: tvm.IRModule, target, config: RammerConfig | None = None) -> dict:
    """``predicted_us`` of one inference of ``lowered`` and its parts (module docstring):
    ``rprograms_us``, ``ordinary_us``, ``ordinary_kernels`` (name, calls, us per call) and
    ``unpriced`` (names)."""
    config = config or RammerConfig()
    target = resolve_target(target)
    vdevice = rkernels.vdevice_for(target, config)
    plain = plain_target(target)
    launch = rkernels.cost_config(config, vdevice).launch_us
    prims = {gv.name_hint: f for gv, f in lowered.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    # keyed by the function's name in the module, which may differ from the report's "kernel"
    # (spec.name): GPT-2 small's rammer_rprogram11 is the module's rammer_rprogram111
    reports = {gv.name_hint: json.loads(str(f.attrs[REPORT_ATTR]))
               for gv, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and f.attrs is not None and REPORT_ATTR in f.attrs}
    rprograms_us, ordinary_us, per_kernel, unpriced, priced = 0.0, 0.0, {}, [], {}
    for kind, name in _calls(lowered):
        if name in reports:  # an rProgram: its report's prediction, once per call
            rprograms_us += float(reports[name]["predicted_us"])
            continue
        func = prims.get(name)
        if kind == "func" and func is None:
            continue  # not a kernel of this module
        if func is not None and name not in priced:
            priced[name] = ordinary_kernel_us(func, config, vdevice, plain)
        us = priced.get(name) if func is not None else None
        if us is None:
            unpriced.append(name)
            us = launch
        entry = per_kernel.setdefault(name, {"kernel": name, "calls": 0, "us_per_call": us})
        entry["calls"] += 1
        ordinary_us += us
    return {"predicted_us": rprograms_us + ordinary_us, "rprograms_us": rprograms_us,
            "ordinary_us": ordinary_us, "ordinary_kernels": list(per_kernel.values()),
            "unpriced": sorted(set(unpriced))}
