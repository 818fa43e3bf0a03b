"""Each dispatch entry's rKernel body as its own ``__device__ __noinline__`` function.

A persistent kernel holds every rKernel body of its rProgram in one function, and NVVM's optimiser
(cicc) spends most of nvcc's time on that one function (GoogLeNet: 42.5 s of nvcc's 49 s). With
``PersistentKernelSpec.rkernel_functions`` the kernel is built with each dispatch entry's body
inside an ``AttrStmt`` :data:`ATTR` (:func:`mark`), and :func:`outline` (run by
``tir_pipeline`` at the end of the TIR pipeline, after ``SplitHostDevice``) moves each marked body
of a CUDA kernel into a PrimFunc of its own, called from the dispatch loop:

* the callee is ``<kernel>_rkernel<k>`` (``k``: the dispatch index), target = the kernel's,
  ``calling_conv`` 0 (TVM's CUDA code generation prints it ``extern "C" __device__``), no
  ``global_symbol`` (it is no entry point of the module), ``tirx.noalias`` as the kernel;
* its parameters: the kernel's pointer parameters the body reaches (through the buffers declared on
  them, whose declarations are repeated in the callee), the data of the static shared-memory
  allocations it uses, and the scalars it reads (the rtask_id, the operator's table record, the
  thread index). Its pointers are distinct kernel parameters or distinct allocations, so the
  kernel's no-alias promise holds for the callee too;
* the shared-memory pool is dynamic shared memory in an outlined kernel (``persistent``), and each
  callee declares it again (``extern __shared__``, the same memory): the bodies address it as
  shared memory, not through a generic pointer, and the launch passes its size as before (TVM
  computed it from the kernel's allocation before the outlining);
* the thread-local arrays the body uses (``StorageRewrite`` hoists every body's local arrays to the
  top of the kernel) are allocated in the callee instead, and dropped from the kernel when no other
  code uses them: no data passes between rTask bodies through local arrays;
* the thread index is a parameter; the callee's body runs under ``if (0 <= tid && tid < extent)``
  so that TVM's last passes still know its range (:func:`_thread_extents`);
* a body that uses an allocation of another scope (warp memory, wmma fragments) stays inline;
* callees of different kernels of the module (one per rProgram) that are the same function are
  defined once and called from each (:func:`_shared_callees`), so nvcc compiles each once.

TVM prints no ``__noinline__``: :func:`noinline_source` adds it to the callees' definitions in the
generated CUDA (``tvm_callback_cuda_postproc``, installed with the pipeline; see
:func:`install_postproc`), so that cicc optimises one body at a time.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx.buffer import buffer_data, buffer_data_pointer_type

ATTR = "rammer.rkernel_function"
SUFFIX = "_rkernel"
_SINKABLE = ("local",)
_POSTPROC = "tvm_callback_cuda_postproc"
_MIN_BLOCKS = "tirx.launch_bounds_min_blocks_per_sm"


def mark(body: tirx.Stmt, k: int) -> tirx.Stmt:
    """``body`` (dispatch entry ``k``'s rTask) marked to become a function of its own."""
    return tirx.AttrStmt(tirx.const(k, "int32"), ATTR, tirx.const(k, "int32"), body)


def has_marks(func) -> bool:
    found = []

    def visit(node):
        if node.attr_key == ATTR:
            found.append(node)

    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, visit))
    return bool(found)


def unmark(stmt):
    """``stmt`` with every mark removed (the bodies inline, as without the option)."""
    return tvm_ffi.structural_map(stmt, (tirx.AttrStmt, lambda n: n.body if n.attr_key == ATTR else n))


class _Inline(Exception):
    """A body that cannot be a function of its own (an allocation of an unsupported scope)."""


def _definitions(body):
    """{buffer Var: its DeclBuffer or AllocBuffer statement} of the kernel."""
    defs = {}

    def define(node):
        defs.setdefault(node.buffer, node)

    tvm_ffi.structural_walk(body, [((tirx.DeclBuffer, tirx.AllocBuffer), define)])
    return defs


def _glue_uses(body) -> set:
    """The Vars that ``body`` uses outside its marked bodies (the dispatch loop's own)."""
    used = set()

    def skip_marked(node):
        return tvm_ffi.WalkResult.SKIP if node.attr_key == ATTR else None

    def use(var, kind):
        if kind == tvm_ffi.DefRegionKind.NONE:
            used.add(var)

    tvm_ffi.structural_walk(body, (tirx.AttrStmt, skip_marked), with_def_region_kind=(tvm.ir.Var, use),
                            order="pre")
    return used


def _closure(stmt, defs, glue=frozenset()):
    """(params, call arguments, prologue statements, sunk local buffers) of the callee of ``stmt``;
    ``glue``: the Vars the kernel uses outside the marked bodies (a local array among them would
    carry data between the body and the dispatch loop: that body stays inline)."""
    params, args, prologue, sunk, seen = [], [], [], [], set()

    def need(var):
        if var in seen:
            return
        seen.add(var)
        node = defs.get(var)
        if isinstance(node, tirx.DeclBuffer):
            for dep in _vars_in(node.data):
                need(dep)
            prologue.append(node)
        elif isinstance(node, tirx.AllocBuffer):
            scope = var.scope()
            if scope in _SINKABLE:
                if var in glue:
                    raise _Inline(f"{var.name} is used by the dispatch loop too")
                prologue.append(node)
                sunk.append(var)
            elif scope == "shared.dyn":  # the one dynamic allocation: declared again, not passed
                prologue.append(node)
            elif scope == "shared":
                ptr = tirx.Var(f"{var.name}_ptr", buffer_data_pointer_type(var))
                params.append(ptr)
                args.append(buffer_data(var))
                prologue.append(tirx.DeclBuffer(var, data=ptr))
            else:
                raise _Inline(f"{var.name} is a {scope} allocation")
        else:  # a kernel parameter (pointer) or a scalar defined around the body
            params.append(var)
            args.append(var)

    for var in tirx.analysis.undefined_vars(stmt):
        need(var)
    order = sorted(range(len(params)), key=lambda i: (not _is_pointer(params[i]), params[i].name))
    return [params[i] for i in order], [args[i] for i in order], prologue, sunk


def _vars_in(expr) -> list:
    """The Vars ``expr`` (a DeclBuffer's data: a pointer Var or ``buffer_data(buffer)``) names."""
    if isinstance(expr, tvm.ir.Var):
        return [expr]
    found = []

    def visit(var):
        if var not in found:
            found.append(var)

    tvm_ffi.structural_walk(expr, (tvm.ir.Var, visit))
    return found


def _is_pointer(var) -> bool:
    return isinstance(var.ty, tvm.ir.PointerType)


def outline(gvar: tvm.ir.GlobalVar, func: tirx.PrimFunc) -> dict:
    """``{GlobalVar: PrimFunc}``: ``func`` with each marked body replaced by a call, and one
    callee per dispatch entry (see the module docstring). A body that must stay inline does."""
    defs, glue, threads = _definitions(func.body), _glue_uses(func.body), _thread_extents(func.body)
    min_blocks = _min_blocks_per_sm(func)
    callees, sunk_all = {}, set()
    target = func.attrs["target"]
    noalias = bool(func.attrs.get("tirx.noalias", False))

    def replace(node):
        if node.attr_key != ATTR:
            return node
        k = int(node.value)
        try:
            params, args, prologue, sunk = _closure(node.body, defs, glue)
        except _Inline:
            return node.body
        name = f"{gvar.name_hint}{SUFFIX}{k}"
        callee = tvm.ir.GlobalVar(name)
        body = node.body
        bounds = [(p, threads[p]) for p in params if p in threads]
        if bounds:  # see _thread_extents
            cond = tirx.all(*[tirx.all(p >= 0, p < extent) for p, extent in bounds])
            body = tirx.IfThenElse(cond, body, None)
        body = tirx.SeqStmt([*prologue, body]) if prologue else body
        attrs = {"target": target, "calling_conv": 0}
        if min_blocks is not None:  # bodies of kernels with other launch bounds stay apart
            attrs["rammer.min_blocks_per_sm"] = min_blocks
        if noalias:
            attrs["tirx.noalias"] = True
        callees[callee] = tirx.PrimFunc(params, body, ret_type=None).with_attrs(attrs)
        sunk_all.update(sunk)
        return tirx.Evaluate(tvm.ir.Call(callee, args, ret_ty="void"))

    body = tvm_ffi.structural_map(func.body, (tirx.AttrStmt, replace), order="pre")
    body = _drop_unused(body, sunk_all)
    return {gvar: func.with_body(body), **callees}


def _min_blocks_per_sm(func: tirx.PrimFunc):
    """The kernel's ``__launch_bounds__`` minimum of blocks per SM (its vEUs per SM), or None.
    ptxas compiles a callee once for every kernel that calls it, so a callee records it and
    :func:`_shared_callees` merges only callees of kernels with the same bounds. After
    ``SplitHostDevice`` (where :func:`outline` runs) it is the kernel's attribute; before, an
    AttrStmt of its body."""
    value = (func.attrs or {}).get(_MIN_BLOCKS)
    if value is not None:
        return int(value)
    found = []

    def visit(node):
        if node.attr_key == _MIN_BLOCKS:
            found.append(int(node.value))

    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, visit))
    return found[0] if found else None


def _thread_extents(body) -> dict:
    """{thread index Var: its extent} of a kernel.

    In the kernel, TVM's simplifier and ``LowerIntrin`` know that ``threadIdx.x`` lies in
    ``[0, extent)``; a callee gets it as a plain int parameter. Its body is therefore wrapped in
    ``if (0 <= tid && tid < extent)`` (always true, one comparison per call), under which they know
    it again: without it ``LowerIntrin`` turns every ``//`` and ``%`` of the index into a
    sign-corrected form (and overflowed an int32 constant on AlexNet's first convolution)."""
    found = {}

    def visit(node):
        if node.attr_key == "thread_extent":
            found[node.node.var] = node.value

    tvm_ffi.structural_walk(body, (tirx.AttrStmt, visit))
    return found


def _drop_unused(body, candidates):
    """``body`` without the AllocBuffer of each candidate buffer that nothing in it uses."""
    if not candidates:
        return body
    drop = set(candidates)

    def without(node):
        kept = [s for s in node.seq if not (isinstance(s, tirx.AllocBuffer) and s.buffer in drop)]
        if len(kept) == len(node.seq):
            return node
        # TVM rejects a SeqStmt of one statement (GPT-2 small's bodies: an allocation and a loop)
        return kept[0] if len(kept) == 1 else tirx.SeqStmt(kept) if kept else tirx.Evaluate(0)

    while True:
        out = tvm_ffi.structural_map(body, (tirx.SeqStmt, without))
        still = {v for v in tirx.analysis.undefined_vars(out) if v in drop}
        if not still:
            return out
        drop -= still


def outline_module(mod: tvm.IRModule) -> tvm.IRModule:
    """Outline the marked bodies of the module's CUDA kernels; other targets' marks are removed.
    Callees of different kernels that are the same function are one (:func:`_shared_callees`)."""
    updates, kernels, callees = {}, {}, {}
    for gv, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):
        if not isinstance(func, tirx.PrimFunc) or not has_marks(func):
            continue
        target = func.attrs.get("target") if func.attrs else None
        if target is not None and target.kind.name == "cuda" and int(
                func.attrs.get("calling_conv", 0)) == 2:
            out = outline(gv, func)
            kernels[gv] = out.pop(gv)
            callees.update(out)
        else:
            updates[gv] = func.with_body(unmark(func.body))
    same = _shared_callees(callees)
    updates.update({gv: _redirect(f, same) if same else f for gv, f in kernels.items()})
    updates.update({gv: f for gv, f in callees.items() if gv not in same})
    if not updates:
        return mod
    out = tvm.IRModule({gv: f for gv, f in mod.functions_items()}, attrs=mod.attrs,
                       global_infos=mod.global_infos)
    for gv, func in updates.items():
        out[gv] = func
    return out


def _shared_callees(callees: dict) -> dict:
    """{GlobalVar of a callee: the GlobalVar of an earlier callee that is the same function}.

    A model split into several rPrograms has one kernel per rProgram, and a body two of them hold
    (the same rKernel of operators alike, whose tensors are reached the same way) was outlined once
    per kernel: nvcc then compiles each copy (reduced to 221 distinct functions of 376 in the
    profiled NASNet-CIFAR module of ``benchmarks/README.md``). Structurally equal callees (same
    parameters, body and attributes: the thread-extent guard and the kernel's minimum blocks per
    SM among them, so only kernels of the same launch bounds share one) are one function, defined
    once and called from every kernel that has it; the first in name order is kept."""
    kept, same = {}, {}
    for gv, func in sorted(callees.items(), key=lambda item: item[0].name_hint):
        bucket = kept.setdefault(tvm_ffi.structural_hash(func), [])
        twin = next((k for k, f in bucket if tvm_ffi.structural_equal(f, func)), None)
        if twin is None:
            bucket.append((gv, func))
        else:
            same[gv] = twin
    return same


def _redirect(func: tirx.PrimFunc, same: dict) -> tirx.PrimFunc:
    """``func`` with each call of a callee in ``same`` calling the one kept instead."""
    def call(node):
        op = node.op
        if isinstance(op, tvm.ir.GlobalVar) and op in same:
            return tvm.ir.Call(same[op], node.args, ret_ty="void")
        return node

    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.Call, call)))


# --- __noinline__ in the generated CUDA ------------------------------------------------------------

_DEFINITION = re.compile(r'^(extern "C" __device__ )(void \w+' + SUFFIX + r'\d+\()', re.MULTILINE)


def noinline_source(code: str) -> str:
    """``code`` with ``__noinline__`` on every callee of :func:`outline` (their declarations and
    definitions: ``extern "C" __device__ void <kernel>_rkernel<k>(``); nothing else changes."""
    return _DEFINITION.sub(r"\1__noinline__ \2", code)


def install_postproc() -> None:
    """Register ``tvm_callback_cuda_postproc`` (TVM calls it on the CUDA source of every device
    module it generates) as :func:`noinline_source`, after any callback registered before
    (idempotent: ours is also registered as ``tvm_rammer.cuda_postproc``, so TVM's registry, not
    module state, says whether it is installed). A source without outlined bodies comes back
    unchanged."""
    previous = tvm_ffi.get_global_func(_POSTPROC, allow_missing=True)
    ours = tvm_ffi.get_global_func(_OURS, allow_missing=True)
    if previous is not None and ours is not None and previous.same_as(ours):
        return

    def postproc(code, target):
        if previous is not None:
            code = previous(code, target)
        return noinline_source(str(code))

    tvm_ffi.register_global_func(_POSTPROC, postproc, override=True)
    tvm_ffi.register_global_func(_OURS, tvm_ffi.get_global_func(_POSTPROC), override=True)


_OURS = "tvm_rammer.cuda_postproc"
