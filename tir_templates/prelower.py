"""Lower ONE dlight-scheduled kernel with TVM's own passes, then describe it as rTasks.

Rammer (OSDI'20, 4.2 "Transforming Legacy CUDA Operators") turns an existing thread-block kernel
into an rOperator by computing ``blockIdx`` from a logical ``rtask_id`` and ``threadIdx`` from the
vEU's 1-D thread index. Doing that rewrite on *scheduled* s_tir (SBlocks, vthreads, cross-thread
reductions) would mean re-implementing half of TVM's lowering, so we let TVM do its work first:

    BindTarget -> default s_tir pipeline from CanonicalizeLoop up to and including
    ThreadSync("shared"/"shared.dyn"/"warp"), InferFragment, LowerThreadAllreduce,
    plus LowerWarpMemory (before CommonSubexprElim) and InjectPTXAsyncCopy

and stop right before ``MergeSharedMemoryAllocations`` / ``SplitHostDevice``. The two extra passes
normally run later (the second only under ``tirx.use_async_copy``, the first on the device
function), but both need the kernel's own thread extents: "warp"-scope buffers (the tensor-core
fragments of ldmatrix/mma, indexed by the lane ``threadIdx.x``) become per-thread local arrays, and
``cp.async`` copies (software pipelines with asynchronous stages) become PTX. LowerWarpMemory runs
before CSE, which would hide the lane in let-bound variables, and once per warp buffer (one run
lowers one allocation per statement list). At that point
vthreads are injected, buffers are flat, block barriers (``tvm_storage_sync("shared")``) are
placed and reductions are shuffles or shared-memory trees, but the kernel is still one statement
under ``thread_extent`` AttrStmts. We strip those AttrStmts, remember each axis' Var and extent,
and hand the body to ``rtask_rewrite.instantiate``.

In TVM 0.27 a buffer *is* a ``Var`` with a ``BufferType`` (there is no separate Buffer object and
no ``buffer_map``): a PrimFunc parameter is the buffer Var itself, and its pointer is the
expression ``buffer_data(param)``. So ``LoweredKernel.params`` and ``param_buffers`` hold the same
Vars; substituting a parameter Var substitutes its data pointer everywhere.

Anything that cannot become rTasks raises ``UnsupportedKernel`` naming the kernel and the reason;
TVM errors raised while lowering are re-raised as ``UnsupportedKernel`` with their first line.
"""
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.tirx.buffer import is_buffer_var
from .s_tir_passes import s_tir_passes

BLOCK_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
THREAD_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
SMEM_ALIGN = 16
_SYNC_OP = tvm.ir.Op.get("tirx.tvm_storage_sync")
SHARED_SCOPES = ("shared", "shared.dyn")  # both become views into the vEU's shared-memory pool
_UNSUPPORTED_SCOPES = {"warp": "warp-scope buffers left after LowerWarpMemory",
                       "global": "global-memory scratch buffers", "": "global-memory scratch buffers"}


class UnsupportedKernel(ValueError):
    """Raised with a clear reason when a kernel cannot become rTasks."""


class LaunchShape:
    """``num_rtasks`` and ``threads`` of anything with a ``grid`` and a ``block`` (x, y, z)."""

    grid: tuple
    block: tuple

    @property
    def num_rtasks(self) -> int:
        """Number of thread blocks = rTasks."""
        gx, gy, gz = self.grid
        return gx * gy * gz

    @property
    def threads(self) -> int:
        """Threads per block."""
        tx, ty, tz = self.block
        return tx * ty * tz


@dataclass(frozen=True)
class LoweredKernel(LaunchShape):
    """One lowered thread-block kernel whose blocks can run as rTasks (see module docstring)."""

    name: str
    body: tirx.Stmt
    params: tuple
    param_buffers: tuple
    block_vars: dict
    thread_vars: dict
    grid: tuple
    block: tuple
    shared_bytes: int
    has_sync: bool
    volatile_shared: bool = False


def _lowering_passes():
    """The s_tir pipeline prefix that leaves one kernel with syncs placed and reductions lowered:
    TVM's list up to ``LowerThreadAllreduce`` (without the Hexagon-only VTCM passes), warp memory
    lowered before ``CommonSubexprElim``, then ``InjectPTXAsyncCopy``."""
    passes = [p for p in s_tir_passes({})
              if p.info.name not in ("s_tir.VerifyVTCMLimit", "s_tir.LowerVtcmAlloc")]
    names = [p.info.name for p in passes]
    passes = passes[: names.index("s_tir.LowerThreadAllreduce") + 1]
    cse = names.index("tirx.CommonSubexprElim")
    # warp memory before CSE hides the lane (threadIdx.x) in let-bound variables
    return [*passes[:cse], _LowerAllWarpMemory(), *passes[cse:],
            s_tir.transform.InjectPTXAsyncCopy()]


def _first_line(err: Exception) -> str:
    """First non-empty line of an exception message (TVM messages carry a long traceback)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _check_signature(func, name: str) -> None:
    """Only static-shape buffer parameters and honourable launch parameters are supported."""
    for p in func.params:
        if not is_buffer_var(p):
            raise UnsupportedKernel(f"{name}: scalar parameter {p} (symbolic shape / dynamic kernel)")
        for dim in p.shape:
            if not isinstance(dim, tirx.IntImm):
                raise UnsupportedKernel(f"{name}: parameter {p.name} has symbolic shape {list(p.shape)}")
    launch = func.attrs.get("tirx.kernel_launch_params", None) if func.attrs else None
    for tag in launch or ():
        if not str(tag).startswith(("blockIdx.", "threadIdx.")):
            raise UnsupportedKernel(f"{name}: kernel launch parameter {tag} cannot be honoured inside an rTask")


def _binds_block_axis(body) -> bool:
    """Whether a (scheduled or lowered) body binds any blockIdx axis."""
    found = []

    def loop(node):
        if node.kind == tirx.ForKind.THREAD_BINDING and node.thread_binding.thread_tag in BLOCK_AXES:
            found.append(node)

    def attr(node):
        if node.attr_key == "thread_extent" and node.node.thread_tag in BLOCK_AXES:
            found.append(node)

    tvm_ffi.structural_walk(body, [(tirx.For, loop), (tirx.AttrStmt, attr)])
    return bool(found)


def bound_launch(func: tirx.PrimFunc):
    """``(grid, block)`` read from the thread-binding loops of a *scheduled* PrimFunc, without
    lowering it: each blockIdx/threadIdx axis' extent (1 when unbound); None when it cannot be
    read so (an axis bound with two extents, a symbolic or offset binding, no blockIdx).

    Where :func:`prelower` accepts the function, its ``(grid, block)`` is this one: the launch's
    ``thread_extent`` AttrStmts are these loops, lifted and unified (checked on every version of
    every zoo model's operators, tests/test_prelower.py). A function with any ``thread_extent``
    AttrStmt (a launch not written as loops) is not read. ``versions.kernel_versions`` uses it to
    skip lowering a schedule whose launch shape an earlier version already has."""
    extents, unreadable = {}, []

    def loop(node):
        if node.kind != tirx.ForKind.THREAD_BINDING:
            return
        tag = node.thread_binding.thread_tag
        if tag not in BLOCK_AXES + THREAD_AXES:
            return
        if not (isinstance(node.extent, tirx.IntImm) and isinstance(node.min, tirx.IntImm)
                and int(node.min) == 0):
            unreadable.append(tag)
        elif extents.setdefault(tag, int(node.extent)) != int(node.extent):
            unreadable.append(tag)

    def launched(node):  # a launch written as an AttrStmt: not read from loops
        if node.attr_key == "thread_extent":
            unreadable.append(node.attr_key)

    tvm_ffi.structural_walk(func.body, [(tirx.For, loop), (tirx.AttrStmt, launched)])
    if unreadable or not any(tag in extents for tag in BLOCK_AXES):
        return None
    return (tuple(extents.get(t, 1) for t in BLOCK_AXES), tuple(extents.get(t, 1) for t in THREAD_AXES))


def _lower(func, target, name: str):
    """Run the pass prefix over ``func`` alone; returns the lowered PrimFunc."""
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    try:
        with target:
            mod = tirx.transform.BindTarget(target)(mod)
            mod = tvm.transform.Sequential(_lowering_passes())(mod)
    except Exception as err:  # pylint: disable=broad-except  (TVM 0.27 raises InternalError,
        # a RuntimeError, and others; it has no tvm.error.TVMError): this kernel stays TVM's own
        raise UnsupportedKernel(f"{name}: TVM lowering failed: {_first_line(err)}") from None
    return mod[name]


def _warp_buffers(func) -> int:
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, lambda n: found.append(n)
                                        if n.buffer.scope() == "warp" else None))
    return len(found)


@tvm.transform.module_pass(opt_level=0, name="LowerAllWarpMemory")
class _LowerAllWarpMemory:
    """"warp" buffers -> per-thread local arrays (TVM's LowerWarpMemory lowers the first warp
    allocation of each statement list per run: it runs until none is left or none changes)."""

    def transform_module(self, mod, _ctx):
        remaining = sum(_warp_buffers(f) for f in mod.functions.values())
        while remaining:
            mod = tirx.transform.LowerWarpMemory()(mod)
            left = sum(_warp_buffers(f) for f in mod.functions.values())
            if left >= remaining:
                break  # _shared_usage reports what is left
            remaining = left
        return mod


def _is_thread_extent(node) -> bool:
    return isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent"


def _top_level_launches(body) -> list:
    """thread_extent AttrStmts not nested in another one: one per kernel launch."""
    found = []

    def visit(node):
        if _is_thread_extent(node):
            found.append(node)
            return tvm_ffi.WalkResult.SKIP
        return tvm_ffi.WalkResult.ADVANCE

    tvm_ffi.structural_walk(body, (tirx.AttrStmt, visit), order="pre")
    return found


def _collect_axes(body, name: str):
    """{tag: (first Var, extent)} for every thread_extent, plus {other Var: first Var} for repeats."""
    axes, alias = {}, {}

    def visit(node):
        if node.attr_key == "virtual_thread":
            raise UnsupportedKernel(f"{name}: virtual thread left after InjectVirtualThread")
        if node.attr_key != "thread_extent":
            return
        tag, var = node.node.thread_tag, node.node.var
        if tag not in BLOCK_AXES + THREAD_AXES:
            raise UnsupportedKernel(f"{name}: unsupported thread axis {tag}")
        if not isinstance(node.value, tirx.IntImm):
            raise UnsupportedKernel(f"{name}: symbolic extent {node.value} for {tag}")
        if tag in axes:
            if axes[tag][1] != int(node.value):
                raise UnsupportedKernel(f"{name}: {tag} launched with two extents")
            if not axes[tag][0].same_as(var):
                alias[var] = axes[tag][0]
        else:
            axes[tag] = (var, int(node.value))

    tvm_ffi.structural_walk(body, (tirx.AttrStmt, visit), order="pre")
    return axes, alias


def _strip_launches(body, alias: dict):
    """Remove thread_extent AttrStmts; repeated launches of one axis use the axis' first Var."""

    def drop(node):
        return node.body if node.attr_key == "thread_extent" else node

    body = tvm_ffi.structural_map(body, (tirx.AttrStmt, drop))
    if alias:
        body = tvm_ffi.structural_map(body, (tvm.ir.Var, lambda v: alias.get(v, v)))
    return body


def _allocations(body) -> list:
    """Every buffer Var allocated by an AllocBuffer in ``body`` (with its annotations)."""
    allocs = []
    tvm_ffi.structural_walk(body, (tirx.AllocBuffer, lambda n: allocs.append(n)))
    return allocs


def aligned_bytes(buf) -> int:
    """Bytes of a flat static buffer rounded up to the shared-memory alignment."""
    nbytes = tvm.DataType(str(buf.dtype)).itemsize
    for dim in buf.shape:
        if not isinstance(dim, tirx.IntImm):
            raise UnsupportedKernel(f"buffer {buf.name} has symbolic extent {dim}")
        nbytes *= int(dim)
    return (nbytes + SMEM_ALIGN - 1) // SMEM_ALIGN * SMEM_ALIGN


def _shared_usage(body, name: str):
    """(shared bytes, static and dynamic, any volatile shared allocation); rejects global scratch
    buffers and warp buffers LowerWarpMemory could not lower."""
    total, volatile = 0, False
    for alloc in _allocations(body):
        scope = alloc.buffer.scope()
        if scope in _UNSUPPORTED_SCOPES:
            raise UnsupportedKernel(f"{name}: {_UNSUPPORTED_SCOPES[scope]} ({alloc.buffer.name}) are not supported")
        if scope in SHARED_SCOPES:
            total += aligned_bytes(alloc.buffer)
            volatile = volatile or "tirx.volatile" in (alloc.annotations or {})
    return total, volatile


def _sync_scopes(body) -> set:
    """Storage scopes of every ``tvm_storage_sync`` in ``body``."""
    scopes = set()

    def visit(call):
        if call.op.same_as(_SYNC_OP):
            scopes.add(str(call.args[0].value))

    tvm_ffi.structural_walk(body, (tvm.ir.Call, visit))
    return scopes


def _dims(axes: dict, tags) -> tuple:
    return tuple(axes[t][1] if t in axes else 1 for t in tags)


def prelower(func: tirx.PrimFunc, target: tvm.target.Target, name: str = "kernel") -> LoweredKernel:
    """Lower a dlight-scheduled single-kernel PrimFunc and describe it as rTasks.

    Raises ``UnsupportedKernel`` for dynamic shapes, unscheduled functions, several kernels,
    global scratch buffers, grid-wide syncs or launch parameters.
    """
    if not isinstance(func, tirx.PrimFunc):
        raise UnsupportedKernel(f"{name}: expected a tirx.PrimFunc, got {type(func).__name__}")
    _check_signature(func, name)
    if not _binds_block_axis(func.body):
        raise UnsupportedKernel(f"{name}: no blockIdx binding (is the function scheduled?)")
    lowered = _lower(func, tvm.target.Target(target), name)
    launches = _top_level_launches(lowered.body)
    if not launches:
        raise UnsupportedKernel(f"{name}: no blockIdx/threadIdx binding (is the function scheduled?)")
    if len(launches) > 1:
        raise UnsupportedKernel(f"{name}: {len(launches)} kernels in one function; one kernel per rOperator")
    axes, alias = _collect_axes(lowered.body, name)
    if not any(t in axes for t in BLOCK_AXES):
        raise UnsupportedKernel(f"{name}: no blockIdx binding (is the function scheduled?)")
    body = _strip_launches(lowered.body, alias)
    shared_bytes, volatile = _shared_usage(body, name)
    scopes = _sync_scopes(body)
    if scopes - {*SHARED_SCOPES, "warp"}:
        raise UnsupportedKernel(f"{name}: unsupported barrier scope(s) {sorted(scopes - {*SHARED_SCOPES, 'warp'})}")
    return LoweredKernel(
        name=name,
        body=body,
        params=tuple(lowered.params),
        param_buffers=tuple(lowered.params),
        block_vars={t: axes[t][0] for t in BLOCK_AXES if t in axes},
        thread_vars={t: axes[t][0] for t in THREAD_AXES if t in axes},
        grid=_dims(axes, BLOCK_AXES),
        block=_dims(axes, THREAD_AXES),
        shared_bytes=shared_bytes,
        has_sync=bool(scopes & set(SHARED_SCOPES)),
        volatile_shared=volatile,
    )
