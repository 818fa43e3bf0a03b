"""Count kernel launches per inference in a Relax module lowered for the VM.

Counted from the lowered program, not from the number of distinct kernels: every call of a PrimFunc
in ``main`` counts as many launches as the PrimFunc has device kernels (outermost ``blockIdx``
regions), and every call of an external packed function that is not a VM builtin (cuBLAS, cuDNN,
...) counts one. A call inside a Relax ``If`` branch counts once.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

# VM builtins and tvm-rammer's host-side helpers (the fault page, tvm_rammer.codegen.faults) launch nothing
_BUILTIN_PREFIXES = ("vm.builtin.", "relax.", "runtime.", "tvm_rammer.")


def _block_idx_nodes(stmt) -> list:
    """Every loop or thread_extent attribute in ``stmt`` that binds a blockIdx."""
    found = []

    def on_for(loop):
        binding = loop.thread_binding
        if binding is not None and str(binding.thread_tag).startswith("blockIdx"):
            found.append(loop)

    def on_attr(attr):
        if attr.attr_key == "thread_extent" and str(attr.node.thread_tag).startswith("blockIdx"):
            found.append(attr)

    tvm_ffi.structural_walk(stmt, [(tirx.For, on_for), (tirx.AttrStmt, on_attr)])
    return found


def kernels_in_primfunc(func: tirx.PrimFunc) -> int:
    """Device kernels that one call of ``func`` launches (outermost blockIdx regions)."""
    nodes = _block_idx_nodes(func.body)
    nested = set()
    for node in nodes:
        for inner in _block_idx_nodes(node.body):
            if not inner.same_as(node):
                nested.add(inner.__hash__())
    outermost = [n for n in nodes if n.__hash__() not in nested]
    return max(1, len(outermost))


def count_launches(mod: tvm.IRModule, entry: str = "main") -> int:
    """Kernel launches of one call of ``mod[entry]`` (a module after the Relax VM lowering)."""
    per_func = {gv.name_hint: kernels_in_primfunc(f) for gv, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc)}
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function)}
    if entry not in relax_funcs:
        raise ValueError(f"module has no Relax function {entry!r}; it has {sorted(relax_funcs)}")
    return _count_in(relax_funcs[entry], per_func, relax_funcs, set())


def _count_in(func, per_func, relax_funcs, visiting) -> int:
    total = 0

    def on_call(call):
        nonlocal total
        op = call.op
        if isinstance(op, tvm.ir.GlobalVar):
            name = op.name_hint
            if name in per_func:
                total += per_func[name]
            elif name in relax_funcs and name not in visiting:
                visiting.add(name)
                total += _count_in(relax_funcs[name], per_func, relax_funcs, visiting)
                visiting.discard(name)
        elif isinstance(op, relax.ExternFunc):
            if not str(op.global_symbol).startswith(_BUILTIN_PREFIXES):
                total += 1
        elif isinstance(op, tvm.ir.Op) and op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            gv = call.args[0]
            total += per_func.get(gv.name_hint, 1)
        elif isinstance(op, tvm.ir.Op) and op.name == "relax.call_dps_packed":
            total += 1

    tvm_ffi.structural_walk(func.body, (relax.Call, on_call))
    return total


RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"


def count_cuda_graph_launches(mod: tvm.IRModule, entry: str = "main") -> dict:
    """Kernels per inference of a module lowered with CUDA graphs (``relax.backend.use_cuda_graph``):
    a replay counts as the kernels captured in it, plus the kernels launched outside any graph."""
    per_func = {gv.name_hint: kernels_in_primfunc(f) for gv, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc)}
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function)}
    outside = count_launches(mod, entry)
    captured, replays = 0, 0

    def on_call(call):
        nonlocal captured, replays
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name == "relax.call_builtin_with_ctx":
            name = str(call.args[0].global_symbol) if isinstance(call.args[0], relax.ExternFunc) \
                else ""
            if name == RUN_OR_CAPTURE:
                capture = call.args[1].fields[0]
                replays += 1
                captured += _count_in(relax_funcs[capture.name_hint], per_func, relax_funcs, set())

    tvm_ffi.structural_walk(relax_funcs[entry].body, (relax.Call, on_call))
    return {"launches": outside + captured, "graph_replays": replays,
            "captured_kernels": captured, "kernels_outside_graphs": outside,
            "launch_note": f"{captured} kernels captured in {replays} CUDA graph(s), counted as "
                           f"kernels, + {outside} launched outside graphs"}
