"""The dataflow graph of `main`'s dataflow block: nodes, tensors, levels and waves.

Input: a Relax function in dataflow form whose body is ONE DataflowBlock (after LegalizeOps,
FoldConstant, fusion, FuseTIR and dlight this is mostly `R.call_tir` bindings). Output: a read-only
`DataflowGraph` with one `Node` per binding, in binding order (already a topological order).

Tensors are identified through aliases: `TupleGetItem(v, i)` of a node's tuple output and a plain
`y = x` binding name the same tensor as their source, so consumers depend on the producing kernel.
A binding that only packs existing tensors into a Tuple is an alias of those tensors too. Alias
bindings are nodes of kind "alias"; they take their sources' level and stay out of `waves()`.

Symbolic shape variables count as dependencies too: a binding that uses a shape variable (in its
type or its value) depends on the `R.match_cast` that defines it, although no tensor flows between
them (`gv = call_tir(reshape, (x,), out=R.Tensor((n, m)))` must come after `R.match_cast(s,
R.Shape([n, m]))`). Such definers are among the user's `preds`, so they order the levels too.

A node is *placeable* (can become rTasks) when it is a `call_tir` with static input and output
shapes, no `tir_vars`, and a callee PrimFunc in the module that binds `blockIdx` (a scheduled GPU
kernel). Otherwise `reason` says why not.

An `R.call_tir_inplace` (``relay_passes.cache_write``'s KV-cache write) is a node of kind
"call_tir_inplace": its `inputs` line up with its PrimFunc's parameters (it has no output
parameters), each output is a tensor of its own (its readers depend on this node) whose bytes are
those of the input it was written into (`inplace[k]`: the position in `inputs` of output k). It is
placeable as a call_tir is, when every output is written in place into a function parameter that no
other binding reads and that does not itself leave the block (so nothing can read the old contents
after the write).
"""
import functools
from dataclasses import dataclass, field
from typing import Optional

import tvm
import tvm_ffi
from tvm import relax, tirx

from .cache_write import beside_write_params

CALL_TIR = tvm.ir.Op.get("relax.call_tir")
CALL_TIR_INPLACE = tvm.ir.Op.get("relax.call_tir_inplace")
EXTERN_CALL_OPS = ("relax.call_dps_packed", "relax.call_pure_packed", "relax.call_packed")


@dataclass(frozen=True, eq=False)
class TensorRef:
    """One tensor of the block: output `index` of node `producer` (None for a function parameter or
    a constant). `expr` is the Relax expression to pass as an argument (a Var or Constant; for a
    tuple element that no binding extracts, a TupleGetItem). `ty` is its relax.TensorType."""

    producer: Optional[int]
    index: int
    expr: relax.Expr
    ty: relax.Type

    def _key(self):
        return ("node", self.producer, self.index) if self.producer is not None else ("expr", self.expr)

    def __eq__(self, other):
        return isinstance(other, TensorRef) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @functools.cached_property
    def shape(self):
        """Tuple of dims (int when static, PrimExpr when symbolic), or None when unknown (read
        from ``ty`` once: the passes ask for it hundreds of thousands of times on an RNN)."""
        return _shape_of(self.ty)

    @property
    def dtype(self):
        """The element dtype as a string."""
        return str(self.ty.dtype)

    @property
    def is_constant(self):
        """True for a Relax constant (weights folded into the module)."""
        return isinstance(self.expr, tvm.ir.expr.Constant)


@dataclass
class Node:
    """One binding of the dataflow block. `kind` is "call_tir", "call_tir_inplace", "alias" or
    "opaque"; `value` is the bound expression; `gvar` is the callee of a call_tir(_inplace); `preds`
    are the indices of the nodes whose outputs it reads or that define (match_cast) a symbolic shape
    variable it uses. A call_tir's `inputs` follow its argument tuple (a tensor passed twice is
    listed twice), so `inputs + outputs` line up with the PrimFunc's params; a call_tir_inplace's
    `inputs` alone do, and `inplace[k]` is the position in `inputs` its output k is written into;
    other nodes list each tensor they read once."""

    index: int
    var: relax.Var
    kind: str
    value: Optional[relax.Expr] = None
    gvar: Optional[tvm.ir.GlobalVar] = None
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    preds: list = field(default_factory=list)
    placeable: bool = False
    reason: str = ""
    inplace: tuple = ()

    @property
    def name(self):
        """The bound variable's name."""
        return str(self.var.name)


def _shape_of(ty):
    """Dims of a TensorType (ints where static), or None when the shape is unknown."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return tuple(int(v.value) if isinstance(v, tirx.IntImm) else v for v in shape.values)


def _is_static(ty):
    """True when `ty` is a TensorType (or tuple of them) with every dim known at compile time."""
    if isinstance(ty, relax.TupleType):
        return all(_is_static(f) for f in ty.fields)
    shape = _shape_of(ty)
    return shape is not None and all(isinstance(d, int) for d in shape)


def _tensor_types(ty):
    """Flat list of the tensor types of a (possibly tuple) type."""
    return list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]


def _op_name(call):
    """The operator name of a Call whose op is an Op, else the callee's type name."""
    return str(call.op.name) if isinstance(call.op, tvm.ir.Op) else type(call.op).__name__


def has_block_binding(prim_func):
    """True when the PrimFunc binds a loop (or thread_extent attr) to blockIdx: a GPU kernel."""
    found = []

    def on_for(loop):
        """A loop bound to blockIdx (s_tir schedules)."""
        if loop.kind == tirx.ForKind.THREAD_BINDING and str(loop.thread_binding.thread_tag).startswith("blockIdx"):
            found.append(loop)

    def on_attr(stmt):
        """A thread_extent attr on blockIdx (lowered TIR)."""
        if str(stmt.attr_key) == "thread_extent" and str(stmt.node.thread_tag).startswith("blockIdx"):
            found.append(stmt)

    tvm_ffi.structural_walk(prim_func.body, [(tirx.For, on_for), (tirx.AttrStmt, on_attr)])
    return bool(found)


def _leaf_vars(expr):
    """Relax Vars and Constants read by `expr` (through Tuples, TupleGetItems and Call args)."""
    if isinstance(expr, (relax.Var, tvm.ir.expr.Constant)):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [leaf for f in expr.fields for leaf in _leaf_vars(f)]
    if isinstance(expr, relax.TupleGetItem):
        return _leaf_vars(expr.tuple_value)
    if isinstance(expr, relax.Call):
        return [leaf for a in expr.args for leaf in _leaf_vars(a)]
    return []


def _single_dataflow_block(func):
    """The one DataflowBlock of `func`, or ValueError saying how to get there."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise ValueError(f"main's body is a {type(body).__name__}, not a SeqExpr; "
                         "run relax.transform.Normalize() and ConvertToDataflow() first")
    blocks = list(body.blocks)
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        kinds = [type(b).__name__ for b in blocks]
        raise ValueError(f"main must hold exactly one DataflowBlock, found {kinds}; run "
                         "relax.transform.ConvertToDataflow() and keep control flow out of main")
    return blocks[0]


class DataflowGraph:
    """Nodes and tensors of one dataflow block; see the module docstring."""

    def __init__(self, func, mod, block, nodes, outputs, tensor_of):
        self.func, self.mod, self.block = func, mod, block
        self.nodes = nodes
        self.graph_outputs = outputs
        self._tensor_of = tensor_of
        self._consumers = {}
        for node in nodes:
            for t in node.inputs:
                self._consumers.setdefault(t, [])
                if node.index not in self._consumers[t]:
                    self._consumers[t].append(node.index)
        self._levels = self._compute_levels()
        self.topo_order()

    @staticmethod
    def from_function(func, mod):
        """Build the graph of `func` (normally `mod["main"]`); ValueError unless dataflow form."""
        return _GraphBuilder(func, mod).build()

    @staticmethod
    def of_main(mod):
        """The graph of ``mod["main"]``, or None when ``mod`` has no main or main is not in
        dataflow form (control flow): what a rewrite pass then leaves as it is."""
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return None
        try:
            return DataflowGraph.from_function(mod["main"], mod)
        except ValueError:
            return None

    def consumers(self, tensor):
        """Indices of the nodes that read `tensor` (alias nodes included), in binding order."""
        return list(self._consumers.get(tensor, []))

    def tensor_of_expr(self, expr):
        """The TensorRef a leaf expr (bound Var, parameter or Constant) names."""
        if expr in self._tensor_of:
            refs = self._tensor_of[expr]
            assert len(refs) == 1, f"{expr} names a tuple of {len(refs)} tensors"
            return refs[0]
        return TensorRef(None, 0, expr, expr.ty)

    def is_graph_output(self, tensor):
        """True when the tensor leaves the block (an R.output var or part of the return value)."""
        return tensor in self.graph_outputs

    def outputs_used_outside(self, node_set):
        """Tensors produced by `node_set` that a node outside it, or the block's output, reads.
        Alias nodes are looked through: whoever reads an alias var reads the same TensorRef."""
        node_set = set(node_set)
        used = {}
        for i in sorted(node_set):
            for t in self.nodes[i].outputs:
                if t not in used and (self.is_graph_output(t) or any(
                        c not in node_set and self.nodes[c].kind != "alias" for c in self.consumers(t))):
                    used[t] = None
        return list(used)

    def _compute_levels(self):
        """Longest-path level: 0 reads only params/constants; aliases take their source's level."""
        levels = []
        for node in self.nodes:
            pred_levels = [levels[p] for p in node.preds]
            if node.kind == "alias":
                levels.append(max(pred_levels, default=0))
            else:
                levels.append(1 + max(pred_levels, default=-1))
        return levels

    def levels(self):
        """List: the level of every node, by node index."""
        return list(self._levels)

    def waves(self):
        """The paper's BFS fronts: lists of non-alias node indices with equal level, level order."""
        by_level = {}
        for node in self.nodes:
            if node.kind != "alias":
                by_level.setdefault(self._levels[node.index], []).append(node.index)
        return [by_level[lv] for lv in sorted(by_level)]

    def topo_order(self):
        """Node indices in a topological order (binding order); asserts every pred comes first."""
        for node in self.nodes:
            assert all(p < node.index for p in node.preds), f"{node.name} reads a later binding"
        return [n.index for n in self.nodes]


class _GraphBuilder:
    """Walks the bindings once, resolving aliases, and fills in Nodes."""

    def __init__(self, func, mod):
        self.func, self.mod = func, mod
        self.block = _single_dataflow_block(func)
        self.tensor_of = {}
        self.first_extract = {}
        self._static = {}  # TensorRef -> all dims static (each tensor's shape is read once)
        self._kernels = {}  # GlobalVar -> (placeable, reason) of its callee
        self.shape_var_def = {}  # hash of a symbolic shape variable -> index of its match_cast
        for b in self.block.bindings:
            value = getattr(b, "value", None)
            if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
                self.first_extract.setdefault((value.tuple_value, int(value.index)), b.var)

    def build(self):
        """Create every node, then the set of block outputs."""
        nodes = [self._node(i, b) for i, b in enumerate(self.block.bindings)]
        outputs = []
        for b in self.block.bindings:
            if not isinstance(b.var, relax.DataflowVar):
                outputs += self._resolve(b.var)
        for leaf in _leaf_vars(self.func.body.body):
            outputs += self._resolve(leaf)
        _check_inplace(nodes, set(outputs), self.mod)
        return DataflowGraph(self.func, self.mod, self.block, nodes, set(outputs), self.tensor_of)

    def _resolve(self, expr):
        """TensorRefs named by a leaf expr: an earlier binding's (aliased) tensors, or itself."""
        if expr in self.tensor_of:
            return list(self.tensor_of[expr])
        ty = getattr(expr, "ty", None)
        if not isinstance(ty, (relax.TensorType, relax.TupleType)):
            return []
        return [TensorRef(None, i, expr, t) for i, t in enumerate(_tensor_types(ty))]

    def _own_outputs(self, index, var):
        """The TensorRefs a computing binding produces (several for a tuple-typed var)."""
        if isinstance(var.ty, relax.TupleType):
            return [TensorRef(index, i, self.first_extract.get((var, i), relax.TupleGetItem(var, i)), t)
                    for i, t in enumerate(var.ty.fields)]
        return [TensorRef(index, 0, var, var.ty)]

    def _alias_source(self, value):
        """TensorRefs an alias binding names, or None when `value` is not an alias."""
        if isinstance(value, relax.Var):
            return self._resolve(value)
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            src = self._resolve(value.tuple_value)
            idx = int(value.index)
            if value.tuple_value in self.tensor_of and idx < len(src):
                return [src[idx]]
        if isinstance(value, relax.Tuple):
            fields = [self._resolve(f) if isinstance(f, (relax.Var, tvm.ir.expr.Constant)) else []
                      for f in value.fields]
            if all(len(f) == 1 for f in fields):
                return [f[0] for f in fields]
        return None

    def _node(self, index, binding):
        """Classify one binding and record the tensors its var names."""
        var, value = binding.var, getattr(binding, "value", None)
        alias = None if isinstance(binding, relax.MatchCast) else self._alias_source(value)
        if alias is not None:
            node = Node(index, var, "alias", value, inputs=alias, outputs=alias,
                        reason="alias (TupleGetItem, Tuple or var binding) of other tensors; no kernel")
            self.tensor_of[var] = alias
        else:
            inputs = [t for leaf in _leaf_vars(value) for t in self._resolve(leaf)]
            outputs = self._own_outputs(index, var)
            node = Node(index, var, "opaque", value, inputs=inputs, outputs=outputs)
            self.tensor_of[var] = outputs
            self._classify(node, binding)
            if node.kind not in ("call_tir", "call_tir_inplace"):
                node.inputs = _dedup(inputs)
        preds = {t.producer for t in node.inputs if t.producer is not None}
        node.preds = sorted((preds | self._shape_var_definers(index, binding)) - {index})
        return node

    def _shape_var_definers(self, index, binding):
        """Indices of the earlier match_casts defining a symbolic variable this binding uses; a
        match_cast then registers the variables it defines."""
        used = [v.__hash__() for v in relax.analysis.tir_vars_in_type(binding.var.ty)]
        tvm_ffi.structural_walk(binding.value, (tirx.Var, lambda v: used.append(v.__hash__())))
        definers = {self.shape_var_def[h] for h in used if h in self.shape_var_def}
        if isinstance(binding, relax.MatchCast):
            for v in relax.analysis.definable_tir_vars_in_type(binding.ty):
                self.shape_var_def.setdefault(v.__hash__(), index)
        return definers

    def _classify(self, node, binding):
        """Set kind, gvar, placeable and reason of a computing node."""
        value = binding.value if isinstance(binding, relax.VarBinding) else None
        if not isinstance(value, relax.Call):
            node.reason = f"opaque binding ({type(binding.value).__name__})"
            return
        op = _op_name(value)
        if op in EXTERN_CALL_OPS or isinstance(value.op, relax.ExternFunc):
            node.reason = f"not a PrimFunc (library/extern call {op})"
            return
        if value.op.same_as(CALL_TIR_INPLACE):
            node.kind, node.gvar = "call_tir_inplace", value.args[0]
            node.inplace = tuple(int(k) for k in value.attrs.inplace_indices)
            node.placeable, node.reason = self._call_tir_placeable(value, node)
            if any(k < 0 for k in node.inplace):
                node.placeable, node.reason = False, "call_tir_inplace with outputs of its own"
            return
        if not value.op.same_as(CALL_TIR):
            node.reason = f"opaque binding ({op})"
            return
        node.kind, node.gvar = "call_tir", value.args[0]
        node.placeable, node.reason = self._call_tir_placeable(value, node)

    def _is_static(self, tensor):
        if tensor not in self._static:
            self._static[tensor] = _is_static(tensor.ty)
        return self._static[tensor]

    def _call_tir_placeable(self, call, node):
        """(placeable, reason) for a call_tir node (the callee's part checked once per callee)."""
        if has_tir_vars(call):
            return False, "tir_vars (scalar or symbolic arguments besides tensors)"
        if not all(self._is_static(t) for t in node.inputs + node.outputs):
            return False, "dynamic shape"
        if node.gvar not in self._kernels:
            self._kernels[node.gvar] = _callee_placeable(node.gvar, self.mod)
        return self._kernels[node.gvar]


def _check_inplace(nodes, graph_outputs, mod=None):
    """A placeable call_tir_inplace stays placeable only when each tensor it writes into is a
    function parameter that no other binding reads and that does not leave the block itself: in
    an rProgram nothing may read the old contents after the write, and the old tensor must not
    be anyone's result. A call_tir whose PrimFunc reads it only beside the write
    (``cache_write.beside_write_params``: never the slot written, the same result before, during
    or after it) is no such reader."""
    for node in nodes:
        if node.kind != "call_tir_inplace" or not node.placeable:
            continue
        for k in node.inplace:
            written = node.inputs[k]
            others = [n for n in nodes if n.index != node.index and written in n.inputs
                      and not _reads_beside(n, written, mod)]
            if written.producer is not None or written.is_constant:
                why = "writes in place into a tensor that is not a function parameter"
            elif others or written in graph_outputs or node.inputs.count(written) > 1:
                why = "writes in place into a tensor that is also read elsewhere"
            else:
                continue
            node.placeable, node.reason = False, why
            break


def _reads_beside(node, tensor, mod) -> bool:
    """Whether ``node`` (a call_tir) reads ``tensor`` only at parameters its PrimFunc reads beside
    a one-slot write (``cache_write.beside_write_params``)."""
    if node.kind != "call_tir" or mod is None or node.gvar not in mod.functions:
        return False
    beside = {cache for cache, _ in beside_write_params(mod[node.gvar])}
    at = [p for p, t in enumerate(node.inputs) if t == tensor]
    return bool(beside) and all(p in beside for p in at)


def has_tir_vars(call):
    """True when a call_tir passes anything but tensors (Vars, Constants): TVM 0.27 puts the
    tir_vars (PrimExprs, PrimValues) into the argument tuple; older builds add a third argument."""
    if len(call.args) > 2 or not isinstance(call.args[1], relax.Tuple):
        return True
    return not all(_is_tensor_leaf(a) for a in call.args[1].fields)


def _is_tensor_leaf(expr):
    """True for a Var or Constant of tensor type (in TVM 0.27 a tirx.Var is a relax.Var too)."""
    return isinstance(expr, (relax.Var, tvm.ir.expr.Constant)) and isinstance(expr.ty, relax.TensorType)


def _callee_placeable(gvar, mod):
    """(placeable, reason) of a call_tir's callee: a PrimFunc with a thread-block schedule."""
    callee = mod[gvar] if gvar in mod.functions else None
    if not isinstance(callee, tirx.PrimFunc):
        return False, "not a PrimFunc (library/extern call)"
    if not has_block_binding(callee):
        return False, "PrimFunc has no thread-block schedule"
    return True, ""


def _dedup(tensors):
    """Keep the first occurrence of each tensor, in order."""
    out = []
    for t in tensors:
        if t not in out:
            out.append(t)
    return out


def becomes_view(node, mod):
    """True when TVM's ``RewriteDataflowReshape`` will turn this call_tir into a view (no kernel):
    its callee only reshapes (``relax.analysis.has_reshape_pattern``) and its result stays inside
    the dataflow block (a DataflowVar), as that pass requires."""
    if node.kind != "call_tir" or not isinstance(node.var, relax.DataflowVar):
        return False
    callee = mod[node.gvar] if node.gvar in mod.functions else None
    return isinstance(callee, tirx.PrimFunc) and bool(relax.analysis.has_reshape_pattern(callee))
