"""Execute a finalized Relax ``main`` in Python, its kernels on the CPU through the emulator.

The Relax module of :class:`~tvm_rammer.checks.emulator.compile.EmulationBuild` is in the form the VM's
code generator takes: bindings of ``relax.vm.alloc_storage`` / ``relax.vm.alloc_tensor`` (a tensor
at a byte offset in a storage), ``relax.vm.kill_object``, ``relax.null_value``, calls of VM builtins
(``vm.builtin.check_tensor_info``, ``match_shape``, ``make_shape``, ``reshape``, ...), calls of the
lowered PrimFuncs (each one's kernels launched through ``EmulatedModule.launch`` with the launch
description of :mod:`tvm_rammer.checks.emulator.launches`), calls of other Relax functions, tuples, tuple
items, constants, ``If``. Tensors are numpy arrays; a storage is one zeroed, 256-byte aligned uint8
array and the tensors allocated in it are views of it, so memory planning (two tensors sharing
bytes) is what the GPU would see.

An :class:`Interpreter` is one "VM": it holds its own copy of every Relax constant, kept by
identity (the same ``Constant`` object is the same memory wherever it is passed), so a persistent
kernel writing into the module's fault page writes the array that ``rammer_fault_page`` returns.
Anything it does not know fails with a ValueError naming it, never silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

__all__ = ["Interpreter", "LaunchRecord", "aligned_empty"]

ALIGN = 256  # bytes: what cudaMalloc guarantees


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data pointer is a multiple of :data:`ALIGN`."""
    raw = np.zeros(int(nbytes) + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start: start + int(nbytes)]


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    out = aligned_empty(max(1, array.nbytes))[: array.nbytes]
    view = out.view(array.dtype).reshape(array.shape)
    view[...] = array
    return view


@dataclass
class LaunchRecord:
    """One kernel launch of a run: which, where from, and its wall seconds on the emulator."""

    func: str
    kernel: str
    grid: tuple
    block: tuple
    cooperative: bool
    seconds: float


class _Storage:
    """A VM storage: one aligned uint8 array."""

    def __init__(self, nbytes: int):
        self.data = aligned_empty(nbytes)

    def tensor(self, offset: int, shape: tuple, dtype: str) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * np.dtype(dtype).itemsize
        if offset + nbytes > self.data.nbytes:
            raise ValueError(f"alloc_tensor of {nbytes} bytes at offset {offset} overflows a storage "
                             f"of {self.data.nbytes} bytes")
        return self.data[offset: offset + nbytes].view(dtype).reshape(shape)


def _np_dtype(dtype: str) -> np.dtype:
    text = str(dtype)
    if text == "bool":
        return np.dtype("bool")
    if text == "bfloat16":
        raise ValueError("bfloat16 tensors are not emulated yet (numpy has no bfloat16)")
    return np.dtype(text)


_SCALAR = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
           "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
           "float16": np.float16, "float32": np.float32, "float64": np.float64, "bool": np.bool_}


class Interpreter:
    """Runs the Relax functions of ``build`` (an EmulationBuild) on ``module`` (its
    EmulatedModule). ``order`` (``"forward"``, ``"reverse"`` or an int seed) and ``wall_limit_s``
    go to every launch. ``records`` lists the launches of the last call."""

    def __init__(self, build, module, order="forward", wall_limit_s: float = 600.0):
        self.build = build
        self.module = module
        self.order = order
        self.wall_limit_s = float(wall_limit_s)
        self.records: list[LaunchRecord] = []
        self._constants: dict = {}  # Constant (by identity) -> this interpreter's array
        self._funcs = {gv.name_hint: f for gv, f in build.relax_mod.functions_items()}
        missing = [k for k in build.kernels if k not in getattr(module, "kernels", build.kernels)]
        if missing:
            raise ValueError(f"the emulated module lacks kernels {missing}")

    # --- public ---------------------------------------------------------------------------------
    def __call__(self, *args, func: str = "main"):
        """Run Relax function ``func`` on numpy ``args``; returns numpy arrays (a tuple for a tuple
        result)."""
        self.records = []
        return self.call(func, list(args))

    def call(self, name: str, args: list):
        f = self._funcs.get(name)
        if not isinstance(f, relax.Function):
            known = sorted(k for k, v in self._funcs.items() if isinstance(v, relax.Function))
            raise ValueError(f"the module has no Relax function {name!r}; it has {known}")
        if len(args) != len(f.params):
            names = ", ".join(p.name for p in f.params)
            raise ValueError(f"{name} takes {len(f.params)} arguments ({names}), got {len(args)}")
        env = {}
        for p, a in zip(f.params, args):
            env[p] = self._argument(p, a)
        return self._eval(f.body, env)

    def constant(self, const) -> np.ndarray:
        """This interpreter's array of Relax constant ``const`` (writable: what the kernels see)."""
        key = const
        if key not in self._constants:
            value = const.value
            if not hasattr(value, "numpy"):
                raise ValueError(f"constant {const} is not a tensor")
            self._constants[key] = _aligned_copy(value.numpy())
        return self._constants[key]

    def has_function(self, name: str) -> bool:
        return isinstance(self._funcs.get(name), relax.Function)

    # --- evaluation -----------------------------------------------------------------------------
    def _argument(self, param, value):
        ty = param.ty
        if isinstance(ty, relax.TensorType):
            array = np.asarray(value)
            if ty.dtype and str(ty.dtype) and array.dtype != _np_dtype(str(ty.dtype)):
                raise ValueError(f"input {param.name}: dtype {array.dtype}, the model takes {ty.dtype}")
            return _aligned_copy(np.ascontiguousarray(array))
        return value

    def _eval(self, e, env):
        if isinstance(e, tvm.ir.Var):
            if e not in env:
                raise ValueError(f"the interpreter read {e.name} before its binding")
            return env[e]
        if isinstance(e, relax.SeqExpr):
            for block in e.blocks:
                for b in block.bindings:
                    env[b.var] = self._eval(b.value, env)
            return self._eval(e.body, env)
        if isinstance(e, tvm.ir.Constant):
            value = e.value
            if hasattr(value, "numpy"):
                return self.constant(e)
            return str(value)  # a dtype
        if isinstance(e, relax.ShapeExpr):
            return tuple(int(self._prim(v, env)) for v in e.values)
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e.value
        if isinstance(e, tvm.ir.StringImm):
            return str(e.value)
        if isinstance(e, (relax.Tuple, tvm.ir.Tuple)):
            return tuple(self._eval(f, env) for f in e.fields)
        if isinstance(e, (relax.TupleGetItem, tvm.ir.TupleGetItem)):
            return self._eval(e.tuple_value, env)[int(e.index)]
        if isinstance(e, relax.If):
            cond = self._eval(e.cond, env)
            branch = e.true_branch if bool(np.asarray(cond).reshape(-1)[0]) else e.false_branch
            return self._eval(branch, env)
        if isinstance(e, tvm.ir.Call):
            return self._call(e, env)
        raise ValueError(f"the emulator's Relax interpreter does not know {type(e).__name__}: "
                         f"{str(e)[:200]}")

    def _prim(self, v, env):
        if isinstance(v, tirx.IntImm):
            return int(v.value)
        raise ValueError(f"symbolic shape value {v}: the emulator runs static shapes only")

    def _call(self, call, env):
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name == "relax.call_builtin_with_ctx":
            fn, inner = call.args[0], self._eval(call.args[1], env)  # (ExternFunc, args tuple)
            return self._builtin(str(fn.global_symbol), list(inner))
        args = [self._eval(a, env) for a in call.args]
        if isinstance(op, tvm.ir.GlobalVar):
            name = op.name_hint
            target = self._funcs.get(name)
            if isinstance(target, tirx.PrimFunc):
                return self._launch(name, args)
            if isinstance(target, relax.Function):
                return self.call(name, args)
            raise ValueError(f"call of {name}, which the module does not define")
        if isinstance(op, relax.ExternFunc):
            return self._builtin(str(op.global_symbol), args)
        if isinstance(op, tvm.ir.Op):
            return self._op(op.name, args)
        raise ValueError(f"the emulator cannot call {op}")

    def _op(self, name: str, args):
        if name == "relax.null_value":
            return None
        if name == "relax.vm.alloc_storage":
            shape, _device, dtype = args[0], args[1], args[2]
            return _Storage(int(np.prod(shape, dtype=np.int64)) * _np_dtype(dtype).itemsize)
        if name == "relax.vm.alloc_tensor":
            storage, offset, shape, dtype = args[:4]
            return storage.tensor(int(offset), tuple(shape), str(_np_dtype(dtype)))
        if name == "relax.vm.kill_object":
            return None
        raise ValueError(f"the emulator does not know the Relax operator {name} (in the finalized "
                         "module); please report it with the model")

    def _builtin(self, name: str, args):
        if name == "vm.builtin.check_tensor_info":
            tensor, ndim, dtype = args[0], int(args[1]), args[2]
            if not isinstance(tensor, np.ndarray):
                raise ValueError(f"{args[-1]}: expected a tensor, got {type(tensor).__name__}")
            if ndim >= 0 and tensor.ndim != ndim:
                raise ValueError(f"{args[-1]}: expected {ndim} dimensions, got shape {tensor.shape}")
            if dtype and str(dtype) != "void" and tensor.dtype != _np_dtype(dtype):
                raise ValueError(f"{args[-1]}: expected dtype {dtype}, got {tensor.dtype}")
            return None
        if name == "vm.builtin.match_shape":
            self._match_shape(args)
            return None
        if name == "vm.builtin.alloc_shape_heap":
            return np.zeros(int(args[0]) if not isinstance(args[0], tuple) else int(args[0][0]),
                            dtype=np.int64)
        if name == "vm.builtin.make_shape":
            return self._make_shape(args)
        if name == "vm.builtin.reshape":
            tensor, shape = args
            out = tensor.reshape(tuple(shape))
            if not np.shares_memory(out, tensor):
                raise ValueError("vm.builtin.reshape of a non-contiguous tensor")
            return out
        if name in ("vm.builtin.null_value",):
            return None
        raise ValueError(f"the emulator does not know the VM builtin {name!r} (an external library "
                         "call or a builtin not emulated yet)")

    def _match_shape(self, args):
        tensor, heap, ndim = args[0], args[1], int(args[2])
        shape = tensor.shape if isinstance(tensor, np.ndarray) else tuple(tensor)
        if len(shape) != ndim:
            raise ValueError(f"{args[-1]}: expected {ndim} dimensions, got {shape}")
        codes = args[3:-1]
        for i in range(ndim):
            code, value = int(codes[2 * i]), int(codes[2 * i + 1])
            if code == 0 and shape[i] != value:  # kAssertEqualToImm
                raise ValueError(f"{args[-1]}: dimension {i} is {shape[i]}, expected {value}")
            if code == 1:  # kStoreToHeap
                heap[value] = shape[i]
            if code == 3 and shape[i] != heap[value]:  # kAssertEqualToLoad
                raise ValueError(f"{args[-1]}: dimension {i} is {shape[i]}, expected {heap[value]}")

    def _make_shape(self, args):
        heap, n = args[0], int(args[1])
        out = []
        for i in range(n):
            code, value = int(args[2 + 2 * i]), int(args[3 + 2 * i])
            out.append(value if code == 0 else int(heap[value]))  # kUseImm / kLoadShape
        return tuple(out)

    # --- kernels ----------------------------------------------------------------------------------
    def _launch(self, name: str, args: list):
        host = self.build.hosts.get(name)
        if host is None:
            raise ValueError(f"PrimFunc {name} has no host function in the build")
        if len(args) != len(host.params):
            raise ValueError(f"{name} takes {len(host.params)} arguments, Relax passes {len(args)}")
        for p, a in zip(host.params, args):
            if p.shape is not None:
                if not isinstance(a, np.ndarray):
                    raise ValueError(f"{name}: parameter {p.name} needs a tensor, got "
                                     f"{type(a).__name__}")
                needed = int(np.prod(p.shape, dtype=np.int64)) * _np_dtype(p.dtype).itemsize
                if a.nbytes < needed:
                    raise ValueError(f"{name}: parameter {p.name} needs {p.shape} {p.dtype}, got "
                                     f"{a.shape} {a.dtype}")
                if not a.flags.c_contiguous:
                    raise ValueError(f"{name}: parameter {p.name} is not contiguous")
        for call in host.calls:
            cuda_args = []
            for k, arg in enumerate(call.args):
                if arg[0] == "scalar":
                    cuda_args.append(_SCALAR[arg[1]](arg[2]) if arg[1] in _SCALAR
                                     else np.int64(arg[2]))
                    continue
                array = args[arg[1]]
                if not isinstance(array, np.ndarray):
                    scalar_dtype = host.params[arg[1]].dtype
                    cuda_args.append(_SCALAR.get(scalar_dtype, np.int64)(array))
                    continue
                if arg[2]:
                    array = array.reshape(-1)[arg[2]:]
                cuda_args.append(array)
            start = time.perf_counter()
            self.module.launch(call.kernel, cuda_args, call.grid, call.block, call.dyn_smem,
                               call.cooperative, order=self.order, wall_limit_s=self.wall_limit_s)
            self.records.append(LaunchRecord(name, call.kernel, call.grid, call.block,
                                             call.cooperative, time.perf_counter() - start))
        return None
