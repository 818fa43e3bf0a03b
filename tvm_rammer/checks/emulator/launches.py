"""The one description of a kernel launch: what runs, with which grid, and what each parameter is.

Two levels, both read from the module that :mod:`tvm_rammer.checks.emulator.compile` keeps:

* :class:`KernelCall` (static, per host PrimFunc): TVM's lowering turns every PrimFunc that Relax
  calls into a host function whose body launches device kernels
  (``T.call_ffi_kernel("<name>_kernel", args..., launch values..., launch_params=[...])``).
  :func:`host_functions` reads those bodies (taken just before ``tirx.MakePackedAPI``, where the
  host function still has its buffer parameters): per launch the kernel name, grid, block, dynamic
  shared memory, whether it is cooperative, and per CUDA parameter where its value comes from (a
  parameter of the host function, or a scalar).
* :class:`Launch` (per call site of the finalized Relax ``main``): the same launch with each CUDA
  parameter bound to what Relax passes, its **role**, byte size and, for a Relax constant, its
  contents (by reference). Roles of a persistent kernel's parameters come from the names
  :mod:`tvm_rammer.codegen.persistent` gives them (``in<k>``, ``weights``, ``rammer_program``,
  ``rammer_fault_page``, ``out<k>``, ``work``, ``rammer_state``, ``rammer_timeline``; the host
  function carries ``rammer.num_veus``); an ordinary kernel's tensor is an ``output`` when the
  device code writes it (a buffer store, a write access pointer, an atomic), else an ``input``.

:meth:`Launch.to_json` is JSON-serialisable (constants summarised by shape, dtype, bytes and a
digest), for ``inspect``-style reports.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

__all__ = ["ROLES", "PERSISTENT_ROLES", "KernelCall", "HostParam", "HostFunc", "LaunchParam",
           "Launch", "host_functions", "bind_launches", "kernel_names"]

# Every role a CUDA parameter can have (EMU_DESIGN.md); "scalar" is a by-value argument.
ROLES = ("input", "output", "weights", "table", "state", "fault_page", "work", "timeline", "scalar")

# codegen.persistent's parameter names -> role (the names are the kernel's contract with Relax:
# backend.BuiltRProgram.call passes the tensors in this order, codegen.tensors names the slots)
PERSISTENT_ROLES = (
    (re.compile(r"in\d+$"), "input"),
    (re.compile(r"weights$"), "weights"),
    (re.compile(r"rammer_program$"), "table"),
    (re.compile(r"rammer_fault_page$"), "fault_page"),
    (re.compile(r"out\d+$"), "output"),
    (re.compile(r"work$"), "work"),
    (re.compile(r"rammer_state$"), "state"),
    (re.compile(r"rammer_timeline$"), "timeline"),
)
PERSISTENT_ATTR = "rammer.num_veus"  # set on every persistent PrimFunc (codegen.persistent)

_VALUE_TAGS = ("blockIdx.", "threadIdx.", "tirx.use_dyn_shared_memory")
_COOPERATIVE = "tirx.use_cooperative_launch"
_KERNEL_DECL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


@dataclass(frozen=True)
class KernelCall:
    """One kernel launch in a host function. ``args`` has one entry per CUDA parameter, in the
    kernel's order: ``("buffer", host parameter index, element offset)`` or
    ``("scalar", dtype, value)``."""

    kernel: str
    grid: tuple
    block: tuple
    dyn_smem: int
    cooperative: bool
    args: tuple
    arg_names: tuple  # the host expressions' names (the host buffer names), for messages
    written: tuple  # per CUDA parameter: True when the device code writes through it


@dataclass(frozen=True)
class HostParam:
    """A parameter of a host function: a buffer (shape, dtype) or a scalar (dtype only)."""

    name: str
    dtype: str
    shape: tuple | None  # None: a scalar


@dataclass(frozen=True)
class HostFunc:
    """A PrimFunc as the host sees it after lowering: its parameters and its launches in order."""

    name: str
    params: tuple
    calls: tuple
    persistent: bool


@dataclass
class LaunchParam:
    """One CUDA parameter of a :class:`Launch`."""

    name: str  # the host function's parameter name (the persistent kernel's slot name)
    role: str
    dtype: str
    shape: tuple | None
    nbytes: int
    constant: np.ndarray | None = None  # a Relax constant's contents (by reference)
    value: object = None  # a scalar's value
    relax_const: object = None  # the Relax Constant itself (an Interpreter keeps its copy by it)


@dataclass
class Launch:
    """One kernel launch of one call site of the Relax ``main`` (see the module docstring)."""

    func: str  # the PrimFunc Relax calls
    site: int  # index of the call site among main's PrimFunc calls
    kernel: str
    grid: tuple
    block: tuple
    dyn_smem: int
    cooperative: bool
    params: list = field(default_factory=list)

    def param(self, role: str) -> LaunchParam | None:
        """The first parameter with ``role``, or None."""
        return next((p for p in self.params if p.role == role), None)

    def to_json(self) -> dict:
        """A JSON-serialisable summary; constants by shape, dtype, bytes and sha256 prefix."""
        params = []
        for p in self.params:
            entry = {"name": p.name, "role": p.role, "dtype": p.dtype, "nbytes": p.nbytes,
                     "shape": list(p.shape) if p.shape is not None else None}
            if p.constant is not None:
                entry["constant"] = {"sha256": hashlib.sha256(
                    np.ascontiguousarray(p.constant).tobytes()).hexdigest()[:16]}
            if p.value is not None:
                entry["value"] = p.value
            params.append(entry)
        return {"func": self.func, "site": self.site, "kernel": self.kernel,
                "grid": list(self.grid), "block": list(self.block), "dyn_smem": self.dyn_smem,
                "cooperative": self.cooperative, "params": params}


# --- reading the host functions ------------------------------------------------------------------

def _is_buffer(var) -> bool:
    return isinstance(getattr(var, "ty", None), tirx.BufferType)


def _dtype_bytes(dtype: str) -> int:
    dt = tvm.DataType(dtype)
    return max(1, dt.bits * dt.lanes // 8)


def _nbytes(shape, dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * _dtype_bytes(dtype) if shape is not None else \
        _dtype_bytes(dtype)


def _scalar_dtype(var) -> str:
    """The dtype of a scalar (PrimType) TIR variable."""
    ty = var.ty
    if isinstance(ty, tvm.ir.PrimType):
        return str(ty.dtype)
    raise ValueError(f"parameter {var.name} of type {ty} is neither a buffer nor a scalar")


def _host_param(var) -> HostParam:
    if _is_buffer(var):
        shape = tuple(_static_int(d, f"the shape of parameter {var.name}") for d in var.ty.shape)
        return HostParam(var.name, str(var.ty.dtype), shape)
    return HostParam(var.name, _scalar_dtype(var), None)


def _static_int(expr, what: str) -> int:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    raise ValueError(f"{what} is not static ({expr}); the emulator runs modules with static shapes "
                     "only: bind the inputs' shapes (--batch N / --input-shape, or shapes= / batch=)"
                     "; a shape computed from data cannot be emulated")


_BINARY = {tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b,
           tirx.Mul: lambda a, b: a * b, tirx.FloorDiv: lambda a, b: a // b,
           tirx.FloorMod: lambda a, b: a % b, tirx.Min: min, tirx.Max: max,
           tirx.EQ: lambda a, b: a == b, tirx.NE: lambda a, b: a != b,
           tirx.LT: lambda a, b: a < b, tirx.LE: lambda a, b: a <= b,
           tirx.GT: lambda a, b: a > b, tirx.GE: lambda a, b: a >= b,
           tirx.And: lambda a, b: a and b, tirx.Or: lambda a, b: a or b}


class _HostEval:
    """Static evaluation of a host function's body: which kernels it launches, with what."""

    def __init__(self, func, device_funcs: dict):
        self.func = func
        self.device_funcs = device_funcs
        self.params = [_host_param(p) for p in func.params]
        self.buffers = {}  # buffer var -> (host param index, element offset)
        self.scalars = {}  # scalar var -> python value
        for i, p in enumerate(func.params):
            if _is_buffer(p):
                self.buffers[p] = (i, 0)
                self._bind_layout(p.ty, self.params[i].shape)
        self.calls = []

    def _bind_layout(self, ty, shape: tuple) -> None:
        """A buffer parameter's offset and stride variables, which ``MakePackedAPI`` would read
        from the DLTensor: the interpreter passes compact tensors, each at its own data pointer
        (offset 0, row-major strides)."""
        if isinstance(ty.elem_offset, tirx.Var):
            self.scalars[ty.elem_offset] = 0
        compact, step = [], 1
        for dim in reversed(shape):
            compact.append(step)
            step *= dim
        for stride, value in zip(ty.strides or (), reversed(compact)):
            if isinstance(stride, tirx.Var):
                self.scalars[stride] = value

    def fail(self, what) -> None:
        name = self.func.attrs.get("global_symbol", "?")
        raise ValueError(f"the emulator cannot read the host function {name}: {what}")

    # expressions
    def value(self, e):
        if isinstance(e, tirx.IntImm):
            return int(e.value)
        if isinstance(e, tirx.FloatImm):
            return float(e.value)
        if isinstance(e, tvm.ir.StringImm):
            return str(e.value)
        if isinstance(e, tirx.Var):
            if e in self.scalars:
                return self.scalars[e]
            self.fail(f"the value of {e.name} is only known at run time (dynamic shapes are not "
                      "emulated: bind the inputs' shapes)")
        if isinstance(e, tirx.Cast):
            v = self.value(e.value)
            return float(v) if "float" in str(e.ty) else int(v)
        for kind, fn in _BINARY.items():
            if isinstance(e, kind):
                return fn(self.value(e.a), self.value(e.b))
        if isinstance(e, tirx.Div):
            a, b = self.value(e.a), self.value(e.b)
            return a / b if isinstance(a, float) or isinstance(b, float) else int(a / b)
        if isinstance(e, tirx.Not):
            return not self.value(e.a)
        if isinstance(e, tirx.Select):
            return self.value(e.true_value) if self.value(e.condition) else self.value(e.false_value)
        self.fail(f"unsupported host expression {type(e).__name__}: {e}")

    def pointer(self, e):
        """(host param index, element offset) of a pointer argument."""
        if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op):
            if e.op.name == "tirx.buffer_data" and e.args[0] in self.buffers:
                return self.buffers[e.args[0]]
            if e.op.name == "tirx.address_of" and isinstance(e.args[0], tirx.BufferLoad):
                load = e.args[0]
                if load.buffer in self.buffers and len(load.indices) == 1:
                    index, offset = self.buffers[load.buffer]
                    return index, offset + int(self.value(load.indices[0]))
        if isinstance(e, tirx.Var) and e in self.buffers:
            return self.buffers[e]
        return None

    # statements
    def run(self, s) -> None:
        if isinstance(s, tirx.SeqStmt):
            for x in s:
                self.run(x)
        elif isinstance(s, tirx.DeclBuffer):
            target = self.pointer(s.data) if s.data is not None else None
            if target is not None:
                self.buffers[s.buffer] = target
        elif isinstance(s, (tirx.Bind, tirx.LetStmt)):
            if str(getattr(s.var, "dtype", "")) == "handle" or _is_buffer(s.var):
                target = self.pointer(s.value)
                if target is not None:
                    self.buffers[s.var] = target
            else:
                self.scalars[s.var] = self.value(s.value)
            if isinstance(s, tirx.LetStmt):
                self.run(s.body)
        elif isinstance(s, tirx.AttrStmt):
            self.run(s.body)
        elif isinstance(s, tirx.AssertStmt):
            try:
                ok = self.value(s.condition)
            except ValueError:
                ok = True  # a run-time check the emulator's static view cannot decide
            if not ok:
                self.fail(f"an assertion fails: {s.condition}")
        elif isinstance(s, tirx.IfThenElse):
            if self.value(s.condition):
                self.run(s.then_case)
            elif s.else_case is not None:
                self.run(s.else_case)
        elif isinstance(s, tirx.For):
            begin, extent = int(self.value(s.min)), int(self.value(s.extent))
            for i in range(begin, begin + extent):
                self.scalars[s.loop_var] = i
                self.run(s.body)
        elif isinstance(s, tirx.Evaluate):
            self.evaluate(s.value)
        else:
            self.fail(f"unsupported host statement {type(s).__name__}")

    def evaluate(self, e) -> None:
        if isinstance(e, tirx.IntImm):
            return
        if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) \
                and e.op.name == "tirx.call_ffi_kernel":
            self.calls.append(self.kernel_call(e))
            return
        self.fail(f"unsupported host call {e}")

    def kernel_call(self, call) -> KernelCall:
        name = str(call.args[0].value)
        tags = [str(t) for t in call.attrs.launch_params]
        valued = [t for t in tags if t.startswith(_VALUE_TAGS)]
        num_args = len(call.args) - 1 - len(valued)
        values = dict(zip(valued, (int(self.value(v)) for v in call.args[1 + num_args:])))
        grid = tuple(values.get(f"blockIdx.{a}", 1) for a in "xyz")
        block = tuple(values.get(f"threadIdx.{a}", 1) for a in "xyz")
        device = self.device_funcs.get(name)
        if device is None:
            self.fail(f"it launches {name}, which is not a device function of the module")
        if len(device.params) != num_args:
            self.fail(f"{name} takes {len(device.params)} parameters, the launch passes {num_args}")
        written = _written_params(device)
        args, names = [], []
        for k, a in enumerate(call.args[1: 1 + num_args]):
            ptr = self.pointer(a)
            if ptr is not None:
                args.append(("buffer", ptr[0], ptr[1]))
                names.append(self.params[ptr[0]].name)
            else:
                dtype = _scalar_dtype(device.params[k])
                args.append(("scalar", dtype, self.value(a)))
                names.append(str(a))
        return KernelCall(kernel=name, grid=grid, block=block,
                          dyn_smem=int(values.get("tirx.use_dyn_shared_memory", 0)),
                          cooperative=_COOPERATIVE in tags, args=tuple(args),
                          arg_names=tuple(names),
                          written=tuple(p in written for p in device.params))


def _written_params(device) -> set:
    """The handle parameters of a device kernel that its code writes through: buffer stores,
    ``tvm_access_ptr`` with the write bit, pointers handed to atomics."""
    data_of = {}

    def on_decl(d):
        if isinstance(d.data, tirx.Var):
            data_of[d.buffer] = d.data

    tvm_ffi.structural_walk(device.body, [(tirx.DeclBuffer, on_decl)])
    params = set(device.params)

    def root(v):
        seen = 0
        while v in data_of and seen < 64:
            v, seen = data_of[v], seen + 1
        return v

    written = set()

    def on_store(s):
        written.add(root(s.buffer))

    def on_call(c):
        if not isinstance(c.op, tvm.ir.Op):
            return
        name = c.op.name
        if name == "tirx.tvm_access_ptr" and len(c.args) >= 5:
            mask = c.args[4]
            if isinstance(mask, tirx.IntImm) and int(mask.value) & 2 and isinstance(c.args[1], tirx.Var):
                written.add(root(c.args[1]))
        elif "atomic" in name or (name == "tirx.call_extern" and c.args and "atomic" in str(c.args[0])):
            for a in c.args:
                if isinstance(a, tvm.ir.Call) and isinstance(a.op, tvm.ir.Op) \
                        and a.op.name == "tirx.address_of" and isinstance(a.args[0], tirx.BufferLoad):
                    written.add(root(a.args[0].buffer))

    tvm_ffi.structural_walk(device.body, [(tirx.BufferStore, on_store), (tvm.ir.Call, on_call)])
    return {p for p in params if p in written}


def host_functions(lowered: tvm.IRModule) -> dict:
    """``{PrimFunc name: HostFunc}`` of a module taken just before ``tirx.MakePackedAPI`` (host
    functions with buffer parameters, device kernels split out)."""
    device = {}
    hosts = []
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if int(func.attrs.get("calling_conv", 0)) == 2:  # kDeviceKernelLaunch
            device[str(func.attrs.get("global_symbol", gv.name_hint))] = func
        else:
            hosts.append((gv.name_hint, func))
    found = {}
    for name, func in hosts:
        run = _HostEval(func, device)
        run.run(func.body)
        found[name] = HostFunc(name=name, params=tuple(run.params), calls=tuple(run.calls),
                               persistent=func.attrs.get(PERSISTENT_ATTR, None) is not None)
    return found


def kernel_names(cuda_source: str) -> tuple:
    """The ``extern "C" __global__`` functions defined in ``cuda_source``."""
    return tuple(dict.fromkeys(_KERNEL_DECL.findall(cuda_source)))


# --- binding to a Relax call site ----------------------------------------------------------------

def persistent_role(name: str) -> str:
    """The role of a persistent kernel's parameter, from the name codegen.persistent gives it."""
    for pattern, role in PERSISTENT_ROLES:
        if pattern.match(name):
            return role
    raise ValueError(f"persistent kernel parameter {name!r} has no known role (codegen.persistent "
                     f"names them {', '.join(p.pattern for p, _ in PERSISTENT_ROLES)})")


def bind_launches(host: HostFunc, site: int, constants: list, nodes: list | None = None) -> list:
    """The :class:`Launch` es of one call of ``host``; ``constants[i]`` is the numpy contents of the
    Relax argument for host parameter ``i`` when it is a constant, else None; ``nodes[i]`` that
    Relax Constant."""
    nodes = nodes or [None] * len(constants)
    launches = []
    for call in host.calls:
        params = []
        for k, arg in enumerate(call.args):
            if arg[0] == "scalar":
                params.append(LaunchParam(name=call.arg_names[k], role="scalar", dtype=arg[1],
                                          shape=None, nbytes=_dtype_bytes(arg[1]), value=arg[2]))
                continue
            index = arg[1]
            p = host.params[index]
            if host.persistent:
                role = persistent_role(p.name)
            else:
                role = "output" if call.written[k] else "input"
            params.append(LaunchParam(name=p.name, role=role, dtype=p.dtype, shape=p.shape,
                                      nbytes=_nbytes(p.shape, p.dtype),
                                      constant=constants[index] if index < len(constants) else None,
                                      relax_const=nodes[index] if index < len(nodes) else None))
        launches.append(Launch(func=host.name, site=site, kernel=call.kernel, grid=call.grid,
                               block=call.block, dyn_smem=call.dyn_smem,
                               cooperative=call.cooperative, params=params))
    return launches
