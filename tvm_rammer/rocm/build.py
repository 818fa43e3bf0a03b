"""TVM's ROCm build, with our helpers linked and each kernel's real workgroup size.

TVM 0.27 builds a ``rocm`` module in ``target.build.rocm``: its LLVM (22) generates the kernels,
links the bitcode files that the global function ``tvm_callback_rocm_bitcode_path`` lists, emits a
relocatable object and hands it to ``tvm_callback_rocm_link``, which links it with ld.lld into the
HSA code object the module holds. Two things are not right for persistent kernels:

* no helper bitcode of ours is linked: :func:`bitcode_paths` (registered as
  ``tvm_callback_rocm_bitcode_path``) returns ROCm's device libraries (TVM's own list, when they are
  installed) plus :mod:`tvm_rammer.rocm.helpers`' bitcode for the target's ``mcpu``;
* without a ROCm device TVM sets ``amdgpu-flat-work-group-size="1,256"`` on every kernel whatever
  its thread count, so a 1024-thread vEU would get a code object limited to 256 threads and
  registers allocated for 256. :func:`build_rocm` (registered over ``target.build.rocm``) runs
  TVM's build, takes its LLVM IR, sets each kernel's ``amdgpu-flat-work-group-size`` to
  ``"1,<its threads>"`` (the product of its ``threadIdx`` extents) and, for persistent kernels,
  ``amdgpu-waves-per-eu`` to the waves per SIMD the placement assumed (``__launch_bounds__``'s
  AMDGPU counterpart: TVM ignores ``launch_bounds_min_blocks_per_sm`` on ROCm), compiles that IR
  with ``llc-22`` (the same LLVM, codegen only: the IR is TVM's optimized IR) and links it with
  ld.lld; then TVM's build runs once more with the link callback answering our code object, so the
  module TVM returns (and ``export_library`` saves) holds it. An IR that TVM's optimizer already
  specialised for 256 threads (LDS promotion of private arrays) is refused, not patched.

Code objects are cached on disk by content (:func:`cache_key`: the device module's TIR, the
target, the attributes, our helpers' bitcode, the tools; :func:`cache_dir`): a kernel built once
(the register probe's, ``compile``'s, ``inspect``'s rebuild of the same rProgram) is not given to
LLVM again; with ``capture(code_only=True)`` a hit builds none of the kernels at all, otherwise
TVM's build runs once, to hold the cached code object.

Callers that want the code objects (``inspect``, tests) wrap the build in :func:`capture`: every
code object linked meanwhile is appended to the list it yields.

The wrapped callbacks and build are TVM registry entries, like the pipeline's
``get_default_pipeline`` wrapper; :func:`install` is idempotent. The context of a running build
(target ``mcpu``, the code object to answer, the capture lists) is thread-local.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import threading

import tvm
import tvm_ffi
from tvm import tirx

from ..host.binary_cache import ROCM, binary_cache, digest
from .dialect import WAVES_PER_EU_ATTR
from .helpers import HELPER_NAMES, compile_bitcode
from .toolchain import find_toolchain, rocm_path

BUILD_FUNC = "target.build.rocm"
BITCODE_FUNC = "tvm_callback_rocm_bitcode_path"
LINK_FUNC = "tvm_callback_rocm_link"
HELPERS_KEY = "rammer-helpers"
_EXTERN = tvm.ir.Op.get("tirx.call_extern")
TVM_FLAT_LIMIT = 256  # what TVM's codegen allows every kernel without a ROCm device
CACHE_VERSION = "1"  # bump when build_rocm makes a different code object of the same input
_STATE = threading.local()
_ORIGINAL = {}
_LDS_RE = re.compile(r'^@"?([\w.$]+)"? = internal (?:unnamed_addr )?addrspace\(3\) global \[(\d+) x',
                     re.M)
_ATTRS_RE = re.compile(r"^attributes #(\d+) = \{ (.*) \}$", re.M)
_DEFINE_RE = re.compile(r"^define [^@\n]*amdgpu_kernel [^@\n]*@([\w.$]+)\(.*\) (?:[^#\n]*)#(\d+)",
                        re.M)


def _stack(name: str) -> list:
    if not hasattr(_STATE, name):
        setattr(_STATE, name, [])
    return getattr(_STATE, name)


def _remove(stack: list, item) -> None:
    """Remove ``item`` itself (not an equal one: captures are lists, empty ones compare equal)."""
    del stack[next(i for i, x in enumerate(stack) if x is item)]


@contextlib.contextmanager
def capture(code_only: bool = False):
    """Collect the code objects (bytes) linked by ROCm builds in this thread meanwhile (not
    those of a nested capture).

    ``code_only``: the caller wants the code objects, not the modules: :func:`build_rocm` then
    skips the second TVM build that only puts the code object into the module (the module it
    returns holds TVM's own code object, limited to 256 threads: discard it)."""
    found: list = []
    _stack("captures").append(found)
    _stack("code_only").append(code_only)
    try:
        yield found
    finally:
        _remove(_stack("captures"), found)
        _stack("code_only").pop()


def bitcode_paths(*args):
    """``tvm_callback_rocm_bitcode_path``: ROCm's device libraries (TVM's list, when installed)
    and, inside :func:`build_rocm`, our helpers' bitcode for the target being built."""
    building = _stack("building")
    root = rocm_path()
    if args:  # a directory named by the caller: TVM's list from it
        files = [str(p) for p in _ORIGINAL[BITCODE_FUNC](*args)]
    elif root is not None:  # TVM's list, from the libraries found (Debian's need no ROCM_PATH)
        files = [str(p) for p in _ORIGINAL[BITCODE_FUNC](os.path.join(root, "amdgcn", "bitcode"))]
    elif building:  # no device libraries: kernels that call no ocml function still link
        files = []
    else:
        return _ORIGINAL[BITCODE_FUNC]()  # somebody else's build: TVM's answer (or error)
    if building:
        files.append(compile_bitcode(find_toolchain(), building[-1]["mcpu"]))
    return files


def link(obj_bin):
    """``tvm_callback_rocm_link``: ld.lld (TVM's), or the code object :func:`build_rocm`
    compiled itself; the result is recorded in the innermost open :func:`capture` (a build
    nested in another, e.g. the register probe inside a compile, is not the outer one's)."""
    building = _stack("building")
    if building and building[-1]["hsaco"] is not None:
        hsaco = building[-1]["hsaco"]
    else:
        hsaco = bytes(_ORIGINAL[LINK_FUNC](obj_bin))
    captures = _stack("captures")
    if captures and (not building or building[-1]["record"]):
        captures[-1].append(bytes(hsaco))  # the innermost capture claims it
    return bytearray(hsaco)


def kernel_attributes(mod: tvm.IRModule) -> dict:
    """Per device kernel of ``mod`` (its global symbol): the LLVM function attributes it needs,
    ``amdgpu-flat-work-group-size`` from its thread extents and, when it carries
    ``rocm.dialect.WAVES_PER_EU_ATTR`` (persistent kernels), ``amdgpu-waves-per-eu``;
    :data:`HELPERS_KEY` when it calls a helper of ours (not an LLVM attribute)."""
    out = {}
    for gvar, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        extents, waves, helpers = {}, [], []

        def visit(stmt):
            if stmt.attr_key == "thread_extent" and isinstance(stmt.value, tirx.IntImm):
                tag = stmt.node.thread_tag
                if tag.startswith("threadIdx"):
                    extents[tag] = int(stmt.value)
            elif stmt.attr_key == WAVES_PER_EU_ATTR:
                waves.append(int(stmt.value))

        def call(node):
            if node.op.same_as(_EXTERN) and str(node.args[0].value) in HELPER_NAMES:
                helpers.append(node)

        tvm_ffi.structural_walk(func.body, [(tirx.AttrStmt, visit), (tvm.ir.Call, call)])
        threads = 1
        for extent in extents.values():
            threads *= extent
        attrs = {"amdgpu-flat-work-group-size": f"1,{threads}"}
        if waves:
            attrs["amdgpu-waves-per-eu"] = str(waves[0])
        if helpers:
            attrs[HELPERS_KEY] = True
        name = func.attrs.get("global_symbol", gvar.name_hint) if func.attrs else gvar.name_hint
        out[str(name)] = attrs
    return out


def patch_attributes(ir_text: str, kernels: dict) -> str:
    """``ir_text`` with each kernel of ``kernels`` (name -> {attribute: value}) given those string
    attributes in an attribute group of its own. Raises ValueError when a kernel is missing or
    a kernel made wider than 256 threads had a private array promoted to LDS by TVM's optimizer
    (``<kernel>.<alloca>``, one slot per thread of a 256-thread workgroup: too small for it;
    promotion to registers, ``%promotealloca`` values, is harmless)."""
    promoted = {m.group(1).split(".")[0] for m in _LDS_RE.finditer(ir_text)
                if int(m.group(2)) == TVM_FLAT_LIMIT and "." in m.group(1)}
    for name, attrs in kernels.items():
        size = attrs.get("amdgpu-flat-work-group-size", "1,0")
        if name in promoted and int(size.split(",")[1]) > TVM_FLAT_LIMIT:
            raise ValueError(f"{name}: TVM's optimizer promoted a private array to LDS for "
                             f"{TVM_FLAT_LIMIT}-thread workgroups; it cannot be rebuilt for "
                             f"{size.split(',')[1]} threads")
    groups = {m.group(1): m.group(2) for m in _ATTRS_RE.finditer(ir_text)}
    next_id = max((int(k) for k in groups), default=-1) + 1
    defined = {}
    new_groups = []
    lines = ir_text.split("\n")
    for i, line in enumerate(lines):
        match = _DEFINE_RE.match(line)
        if not match or match.group(1) not in kernels:
            continue
        name, group = match.group(1), match.group(2)
        body = groups[group]
        for key, value in kernels[name].items():
            entry = f'"{key}"="{value}"'
            body, n = re.subn(rf'"{re.escape(key)}"="[^"]*"', entry, body)
            if not n:
                body = f"{body} {entry}"
        lines[i] = line[:match.start(2) - 1] + f"#{next_id}" + line[match.end(2):]
        new_groups.append(f"attributes #{next_id} = {{ {body} }}")
        defined[name] = next_id
        next_id += 1
    missing = sorted(set(kernels) - set(defined))
    if missing:
        raise ValueError(f"kernels {missing} not found in the module's LLVM IR")
    return "\n".join(lines + new_groups) + "\n"


def compile_ir(ir_text: str, mcpu: str) -> bytes:
    """The HSA code object of optimized LLVM IR: ``llc-22`` then ld.lld (``--no-undefined``)."""
    toolchain = find_toolchain()
    from tvm.support.rocm import rocm_link  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory() as tmp:
        ll, obj, hsaco = (os.path.join(tmp, f"kernels.{e}") for e in ("ll", "o", "co"))
        with open(ll, "w", encoding="utf-8") as f:
            f.write(ir_text)
        cmd = [toolchain.llc, "-O3", f"-mcpu={mcpu}", "-filetype=obj", ll, "-o", obj]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"llc failed: {proc.stderr.strip()}\ncommand: {' '.join(cmd)}")
        rocm_link(obj, hsaco, toolchain.ld_lld)
        with open(hsaco, "rb") as f:
            return f.read()


def _threads(attrs: dict) -> int:
    return int(attrs["amdgpu-flat-work-group-size"].split(",")[1])


def build_rocm(mod, target):
    """``target.build.rocm``: TVM's build with our bitcode and each kernel's real workgroup size
    (module docstring). A module with neither a persistent kernel nor a kernel wider than TVM's
    256 threads is TVM's build, untouched."""
    kernels = kernel_attributes(mod)
    if not any(a.pop(HELPERS_KEY, False) | (_threads(a) > TVM_FLAT_LIMIT)
               for a in kernels.values()):
        return _ORIGINAL[BUILD_FUNC](mod, target)
    toolchain = find_toolchain()  # ToolchainMissing names what to install
    mcpu = str(target.attrs.get("mcpu", "gfx900"))
    context = {"mcpu": mcpu, "hsaco": None, "record": False}
    code_only = _stack("code_only")
    code_only = bool(code_only and code_only[-1])
    building = _stack("building")
    building.append(context)
    try:
        key = cache_key(mod, target, kernels, toolchain, mcpu)
        context["hsaco"] = _cached(key)
        if context["hsaco"] is None:
            first = _ORIGINAL[BUILD_FUNC](mod, target)  # its code object is nobody's: unrecorded
            context["hsaco"] = compile_ir(patch_attributes(first.inspect_source("hip"), kernels),
                                          mcpu)
            _store(key, context["hsaco"])
        elif code_only:  # nobody uses the module: an empty one, no build of these kernels
            first = _ORIGINAL[BUILD_FUNC](tvm.IRModule({}), target)
        context["record"] = True
        if code_only:
            link(None)  # records our code object in the open captures
            return first
        return _ORIGINAL[BUILD_FUNC](mod, target)
    finally:
        _remove(building, context)


def cache_dir() -> str | None:
    """Where code objects are cached: ``$XDG_CACHE_HOME/tvm-rammer/rocm/code`` (``~/.cache``; see
    ``host.binary_cache``: None when ``TVM_RAMMER_BINARY_CACHE=off``)."""
    return _code_cache().directory


def _code_cache():
    return binary_cache(ROCM)


def cache_key(mod, target, kernels: dict, toolchain, mcpu: str) -> str:
    """What a code object of :func:`build_rocm` depends on, hashed: the device module's functions
    (serialized TIR; not the module's attributes, which hold e.g. the compile's timings), the
    target, the kernels' attributes, our helpers' bitcode (its file name hashes the helpers'
    source, mcpu and clang), the LLVM tools and TVM's version."""
    return digest(CACHE_VERSION, tvm.__version__, str(target), mcpu, repr(sorted(kernels.items())),
                  compile_bitcode(toolchain, mcpu), toolchain.llc, toolchain.ld_lld,
                  str(rocm_path()), *sorted(f"{gv.name_hint}\0{tvm.ir.save_json(func)}"
                                            for gv, func in mod.functions_items()))


def _cached(key: str) -> bytes | None:
    return _code_cache().get(key)


def _store(key: str, hsaco: bytes) -> None:
    _code_cache().put(key, hsaco)  # a read-only cache is no error: the next build compiles again


def install() -> None:
    """Register :func:`build_rocm`, :func:`bitcode_paths` and :func:`link` over TVM's (idempotent;
    TVM's own are kept and called)."""
    import tvm.support.rocm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    for name, ours in ((BUILD_FUNC, build_rocm), (BITCODE_FUNC, bitcode_paths), (LINK_FUNC, link)):
        if name not in _ORIGINAL:
            _ORIGINAL[name] = tvm_ffi.get_global_func(name)
            tvm_ffi.register_global_func(name, ours, override=True)
