"""CUDA libraries cross-compiled: built on a machine without a GPU, loaded as they are by one.

Without the NVIDIA driver TVM 0.27 cannot load its CUDA runtime (``libtvm_runtime_cuda.so``
links ``libcuda.so.1``), so its CUDA codegen keeps each CUDA module's source (a
``CUDAFallbackModuleNode``, format "cuda") and the GPU host compiles it when it loads the library
(seconds to a minute per model, on the host whose time is scarce). :func:`export` writes the
library with that source compiled here, for the target's arch, so the GPU host compiles nothing.

How (TVM's ``export_library`` hook ``fpack_imports``; no stub driver, nothing loaded into the
process, TVM's own state untouched):

1. the imported modules are serialized as TVM serializes them
   (``runtime.ModulePackImportsToTensor``: an import tree, then each module as its kind and its
   ``SaveToBytes``);
2. a CUDA module's bytes are ``[fmt][function table][code]`` (``CUDAModuleNode::SaveToBytes``,
   which the fallback mirrors byte for byte); one whose fmt is "cuda" has its code compiled here by
   the project's CUDA callback (``host.cuda_compile.compile_callback``: nvcc or NVRTC as
   ``compiler_choice`` says, the binary cache, TVM's flags) under the target, so the arch is
   ``target.arch`` (e.g. sm_90a for ``rammer/nvidia-h200``), and written back with the label TVM's
   own build on a GPU host gives it ("cubin" for a binary, "ptx" for text:
   ``CUDAModuleNode::DetermineCompiledFormat``): the GPU host's loader
   (``ffi.Module.load_from_bytes.cuda``) gets what a build there would have written;
3. the blob becomes the library's object as TVM makes it (``codegen.codegen_blob`` with the host
   module's LLVM target; a C array where TVM has no LLVM), and ``export_library`` links it.

A library with no CUDA source (built on a GPU host, where TVM compiled already; a CPU target) is
exported by TVM's plain ``export_library``: nothing changes where a GPU exists. Without a CUDA
compiler, or for a CUDA target without an arch, the source is kept, as TVM does (:func:`plan` says
why, for the caller's warning).

:func:`library_cuda_modules` reads a written library's CUDA modules back (format and code) from
its ELF file alone, and :func:`binary_arches` lists the archs a fatbin or cubin holds: the checks of
a cross-compiled library that need neither a GPU nor TVM's CUDA runtime.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import secrets
import subprocess
from dataclasses import dataclass

from . import cuda_compile

__all__ = ["CrossPlan", "Exported", "CudaModuleBytes", "plan", "source_warning", "export",
           "source_modules", "library_cuda_modules", "binary_arches", "compile_sources",
           "SOURCE", "BINARY", "NO_CUDA", "BLOB_SYMBOL"]

SOURCE, BINARY, NO_CUDA = "source", "binary", "none"  # what a library's CUDA modules hold
BLOB_SYMBOL = "__tvm_ffi__library_bin"  # the packed imports in an exported library (ffi::symbol)
FATBIN_MAGIC = 0xBA55ED50
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class CrossPlan:
    """What :func:`export` does with a CUDA source for ``target`` on this machine: ``compiles``
    (True: a binary for ``arch``; False: the source is kept), ``why`` (a sentence, for a
    warning when the source is kept)."""

    compiles: bool
    arch: str | None
    why: str


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: ``path``, ``cuda`` (:data:`BINARY`, :data:`SOURCE` or
    :data:`NO_CUDA`), ``arch`` of the binaries compiled here (None when none was), ``compiled``
    (CUDA modules compiled here) and ``why`` (the plan's reason when the source was kept)."""

    path: str
    cuda: str
    arch: str | None = None
    compiled: int = 0
    why: str = ""


@dataclass(frozen=True)
class CudaModuleBytes:
    """One serialized CUDA module: ``fmt`` ("cuda" = source, "cubin", "ptx", "fatbin"), ``code``
    (the source or the binary) and ``table`` (the function table's bytes, as TVM wrote them)."""

    fmt: str
    code: bytes
    table: bytes

    @property
    def is_source(self) -> bool:
        return self.fmt == "cuda"


def target_arch(target) -> str | None:
    """``target.arch`` of a CUDA target when it names an SM ("sm_90a"), else None."""
    if target is None or target.kind.name != "cuda":
        return None
    arch = str(target.attrs.get("arch", "") or "")
    return arch if arch.startswith("sm_") else None


def plan(target) -> CrossPlan:
    """What :func:`export` does here with ``target``'s CUDA source (a ``tvm.target.Target``): a
    binary for ``target.arch`` when a CUDA compiler is usable (``cuda_compile.compiler_choice``),
    else the source, with the reason."""
    arch = target_arch(target)
    if target is None or target.kind.name != "cuda":
        return CrossPlan(False, None, "not a CUDA target")
    if arch is None:
        return CrossPlan(False, None, f"the target names no arch ({target}): add arch=sm_XX "
                                      "to compile its CUDA here")
    choice = cuda_compile.compiler_choice()
    if choice.compiler is None:
        return CrossPlan(False, arch, f"no CUDA compiler here ({choice.why.split(':')[0]}): the "
                                      "library keeps its CUDA source, and the GPU host compiles it "
                                      "when it loads the library (install the CUDA toolkit's nvcc "
                                      "to compile it here)")
    if choice.compiler == "nvcc" and not os.environ.get(cuda_compile.ENV):
        known = _nvcc_arches()
        if known and arch[3:].rstrip("af") not in known:
            return CrossPlan(False, arch, f"the nvcc here cannot compile for {arch} (it knows "
                                          f"sm_{', sm_'.join(known)}): the library keeps its CUDA "
                                          "source, and the GPU host compiles it when it loads "
                                          "the library")
    return CrossPlan(True, arch, f"CUDA compiled here for {arch} ({choice.compiler})")


@functools.cache
def _nvcc_arches() -> tuple:
    """The SM numbers the nvcc on PATH compiles for ("75", "90", ...; () when it does not say)."""
    path, _ = cuda_compile.nvcc_status()
    if path is None:
        return ()
    try:
        out = subprocess.run([path, "--list-gpu-arch"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(re.findall(r"compute_(\d+)", out))


def source_warning(target) -> str | None:
    """Why a CUDA library for ``target`` built here keeps its source (None when it will not: TVM
    compiles CUDA here itself, :func:`export` compiles it, or the target is not CUDA): the warning
    ``tvm-rammer compile`` prints before it compiles."""
    if target is None or target.kind.name != "cuda" or cuda_compile.tvm_builds_cuda():
        return None
    how = plan(target)
    return None if how.compiles else how.why


def source_modules(mod) -> list:
    """The CUDA modules of ``mod``'s import tree that hold source (TVM's fallback module: a
    "cuda" module that cannot run, built where TVM's CUDA runtime is not loaded)."""
    found, stack, seen = [], [mod], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.kind == "cuda" and not m.is_runnable():
            found.append(m)
        stack.extend(m.imports)
    return found


def export(ex, path: str, target, **kwargs) -> Exported:
    """Write ``ex`` (a ``tvm.compile`` result: ``relax.VMExecutable`` or a runtime module) to the
    library ``path`` (``.so``; ``.tar`` as ``export_library`` makes it), its CUDA source compiled
    here for ``target``'s arch (``target``: the ``tvm.target.Target`` it was compiled for; a tag
    string is resolved by TVM).

    The lease's prepare step and ``tvm-rammer compile`` call this instead of
    ``ex.export_library(path)``::

        ex = tvm.compile(mod, target=target, relax_pipeline=...)
        done = tvm_rammer.host.cross.export(ex, "m.so", target)
        done.cuda   # "binary" (compiled here for done.arch), "source" (done.why) or "none"

    The file appears only when complete (written under a temporary name beside it, then
    renamed). Where TVM compiled the CUDA already (a GPU host) or there is none, this is
    ``export_library`` unchanged; without a compiler or an arch the source is kept (``why``).
    ``kwargs`` go to ``export_library``. RuntimeError when the compiler fails."""
    import tvm

    if isinstance(target, str):
        target = tvm.target.Target(target)
    mod = getattr(ex, "mod", ex)
    sources = source_modules(mod)
    how = plan(target)
    folder = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1] or ".so"
    # a unique name, not created here: the linker creates it with the mode a new file gets
    part = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}."
                                f"{secrets.token_hex(4)}.part{suffix}")
    compiled = []
    try:
        if sources and how.compiles:
            kwargs["fpack_imports"] = _packer(target, compiled)
        ex.export_library(part, **kwargs)
        os.replace(part, path)
        part = None
    finally:
        if part is not None and os.path.exists(part):
            os.remove(part)
    if not sources:
        cuda = BINARY if _has_cuda(mod) else NO_CUDA
        return Exported(path, cuda)
    if how.compiles:
        return Exported(path, BINARY, how.arch, len(compiled))
    return Exported(path, SOURCE, why=how.why)


def _has_cuda(mod) -> bool:
    stack, seen = [mod], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.kind == "cuda":
            return True
        stack.extend(m.imports)
    return False


# --- TVM's packed imports (src/target/codegen.cc: ModuleSerializer, PackImportsToBytes) ----------

def _read(buf, pos: int, n: int) -> tuple:
    if n < 0 or pos + n > len(buf):
        raise ValueError("truncated")
    return bytes(buf[pos:pos + n]), pos + n


def _read_u64(buf, pos: int) -> tuple:
    if pos + 8 > len(buf):
        raise ValueError("truncated")
    return _U64.unpack_from(buf, pos)[0], pos + 8


def _read_str(buf, pos: int) -> tuple:
    n, pos = _read_u64(buf, pos)
    return _read(buf, pos, n)


def _str(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def split_blob(blob) -> tuple:
    """``(tree, modules)`` of a packed-imports blob (bytes or a memoryview, its 8-byte size header
    first): ``tree`` the import tree's bytes as written, ``modules`` a list of ``(kind, data)``,
    ``data`` a memoryview into ``blob`` (None for "_lib", the library's own code). ValueError when
    the blob is not one."""
    buf = memoryview(blob)
    try:
        size, pos = _read_u64(buf, 0)
        if size != len(buf) - 8:
            raise ValueError("size header")
        rows, pos = _read_u64(buf, pos)
        row_ptr = struct.unpack_from(f"<{rows}Q", buf, pos) if rows else ()
        pos += 8 * rows
        children, pos = _read_u64(buf, pos)
        pos += 8 * children
        if not row_ptr or pos > len(buf):
            raise ValueError("import tree")
        tree = bytes(buf[8:pos])
        modules = []
        for _ in range(len(row_ptr) - 1):
            kind, pos = _read_str(buf, pos)
            kind = kind.decode()
            data = None
            if kind != "_lib":  # a view: the weights a module holds are not copied
                n, pos = _read_u64(buf, pos)
                if pos + n > len(buf):
                    raise ValueError("truncated")
                data, pos = buf[pos:pos + n], pos + n
            modules.append((kind, data))
        if pos != len(buf):
            raise ValueError("trailing bytes")
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"not TVM's packed imports ({err}): TVM's serialization "
                         "changed?") from None
    return tree, modules


def join_blob(tree: bytes, modules: list) -> bytes:
    """The blob :func:`split_blob` read (size header, tree, modules)."""
    body = [tree]
    for kind, data in modules:
        body.append(_str(kind.encode()))
        if kind != "_lib":
            body += [_U64.pack(len(data)), data]
    return b"".join([_U64.pack(sum(len(part) for part in body))] + body)  # one copy


def parse_cuda_module(data: bytes) -> CudaModuleBytes:
    """A CUDA module's ``SaveToBytes`` (``[fmt][function table][code]``; the table: a count, then
    per function its name and ``FunctionInfo``: name, argument types (4 bytes each), launch
    parameter tags (strings), argument extra tags (4 bytes each)). ValueError when the bytes do not
    parse to their end exactly."""
    buf = memoryview(data)
    try:
        fmt, pos = _read_str(buf, 0)
        start = pos
        count, pos = _read_u64(buf, pos)
        for _ in range(count):
            _, pos = _read_str(buf, pos)  # the key
            _, pos = _read_str(buf, pos)  # FunctionInfo.name
            n, pos = _read_u64(buf, pos)
            _, pos = _read(buf, pos, 4 * n)  # arg_types (DLDataType)
            n, pos = _read_u64(buf, pos)
            for _ in range(n):
                _, pos = _read_str(buf, pos)  # launch_param_tags
            n, pos = _read_u64(buf, pos)
            _, pos = _read(buf, pos, 4 * n)  # arg_extra_tags
        table = bytes(buf[start:pos])
        code, pos = _read_str(buf, pos)
        if pos != len(buf):
            raise ValueError("trailing bytes")
        return CudaModuleBytes(fmt.decode(), code, table)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"not a CUDA module's bytes ({err}): TVM's CUDA module format "
                         "changed?") from None


def cuda_module_bytes(module: CudaModuleBytes) -> bytes:
    """The inverse of :func:`parse_cuda_module`."""
    return _str(module.fmt.encode()) + module.table + _str(module.code)


def compiled_format(binary: bytes) -> str:
    """TVM's label of a compiled CUDA module (``CUDAModuleNode::DetermineCompiledFormat``): "ptx"
    for text, "cubin" for any binary (a fatbin too: the driver's ``cuModuleLoadData`` takes
    both)."""
    return "ptx" if binary[:1] == b"/" else "cubin"


def _packer(target, compiled: list):
    """``export_library``'s ``fpack_imports``: TVM's packed imports with every CUDA source compiled
    for ``target`` (appended to ``compiled``), as the object file TVM would write."""
    def pack(mod, is_system_lib, prefix, workspace_dir):
        import tvm
        import tvm_ffi

        blob = memoryview(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy())
        blob = compile_sources(blob, target, compiled)
        llvm_target = None
        for m in mod._collect_dso_modules():  # pylint: disable=protected-access
            if m.kind == "llvm":
                llvm_target = m.get_function("_get_target_string")()
        if tvm.runtime.enabled("llvm") and llvm_target:
            path = os.path.join(workspace_dir, f"{prefix}devc.o")
            obj = tvm_ffi.get_global_func("codegen.codegen_blob")(blob, is_system_lib, llvm_target,
                                                                  prefix)
            obj.write_to_file(path)
            return path
        path = os.path.join(workspace_dir, f"{prefix}devc.c")
        with open(path, "w", encoding="ascii") as f:
            f.write(_blob_c_source(blob, prefix + BLOB_SYMBOL, is_system_lib))
        return path

    return pack


def compile_sources(blob: bytes, target, compiled: list | None = None) -> bytes:
    """``blob`` (packed imports) with each CUDA module holding source compiled for ``target`` by
    the project's CUDA callback (binary cache included); the label each binary gets is TVM's
    (:func:`compiled_format`). Each compiled module is appended to ``compiled``."""
    tree, modules = split_blob(blob)
    out = []
    for kind, data in modules:
        if kind == "cuda":
            module = parse_cuda_module(data)
            if module.is_source:
                with target:
                    binary = bytes(cuda_compile.compile_callback(module.code.decode()))
                module = CudaModuleBytes(compiled_format(binary), binary, module.table)
                data = cuda_module_bytes(module)
                if compiled is not None:
                    compiled.append(module)
        out.append((kind, data))
    return join_blob(tree, out)


def _blob_c_source(blob: bytes, symbol: str, system_lib: bool) -> str:
    """The C file TVM writes for packed imports without LLVM (``PackImportsToC``)."""
    lines = ["#ifdef __cplusplus", 'extern "C" {', "#endif",
             f"extern const unsigned char {symbol}[];",
             f"const unsigned char {symbol}[{len(blob)}] = {{"]
    for i in range(0, len(blob), 20):
        lines.append("  " + "".join(f"0x{b:02x}," for b in blob[i:i + 20]))
    lines.append("};")
    if system_lib:
        lines += ["extern int TVMFFIEnvModRegisterSystemLibSymbol(const char*, void*);",
                  f"static int {symbol}_reg_ = TVMFFIEnvModRegisterSystemLibSymbol(\"{symbol}\", "
                  f"(void*){symbol});"]
    lines += ["#ifdef __cplusplus", "}", "#endif", ""]
    return "\n".join(lines)


# --- reading a written library -------------------------------------------------------------------

def library_blob(path: str) -> bytes:
    """The packed imports (:data:`BLOB_SYMBOL`, size header included) of the shared library
    ``path``, read from its ELF dynamic symbol table (nothing is loaded or run). ValueError when the
    file is not a 64-bit little-endian ELF or holds no packed imports."""
    with open(path, "rb") as f:
        elf = f.read()
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError(f"{path!r} is not a 64-bit little-endian ELF shared library")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    for sec in sections:
        if sec[1] not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab = sections[sec[6]]
        for off in range(sec[4], sec[4] + sec[5], 24):
            name_off, _, _, shndx, value, _ = struct.unpack_from("<IBBHQQ", elf, off)
            start = strtab[4] + name_off
            if elf[start:elf.index(b"\0", start)] != BLOB_SYMBOL.encode() or shndx == 0:
                continue
            holder = sections[shndx]
            if holder[1] == 8:  # SHT_NOBITS
                break
            at = holder[4] + value - holder[3]
            size, = struct.unpack_from("<Q", elf, at)
            return elf[at:at + 8 + size]
    raise ValueError(f"{path!r} holds no {BLOB_SYMBOL} (no imported modules, or not exported "
                     "by TVM)")


def library_cuda_modules(path: str) -> list:
    """The CUDA modules (:class:`CudaModuleBytes`) of the library ``path``, as written: what a GPU
    host will load (``fmt == "cuda"``: source it compiles at load)."""
    _, modules = split_blob(library_blob(path))
    return [parse_cuda_module(data) for kind, data in modules if kind == "cuda"]


def binary_arches(code: bytes) -> list:
    """The archs a compiled CUDA module holds: a fatbin's entries ("sm_90a" for a cubin,
    "compute_90a" for PTX; the 'a' variant from the entry's flags), a cubin's ("sm_90" from the ELF
    header's flags, "sm_90a" where its compiler note says so), PTX's ``.target``. [] when
    unknown."""
    if len(code) >= 16 and struct.unpack_from("<I", code, 0)[0] == FATBIN_MAGIC:
        _, _, header, size = struct.unpack_from("<IHHQ", code, 0)
        arches, pos, end = [], header, min(len(code), header + size)
        while pos + 48 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", code, pos)
            sm, = struct.unpack_from("<I", code, pos + 28)
            flags, = struct.unpack_from("<I", code, pos + 40)
            variant = "a" if flags & 0x100000 else ""
            arches.append(f"{'compute' if kind == 1 else 'sm'}_{sm}{variant}")
            pos += entry_header + payload
        return arches
    if code[:4] == b"\x7fELF":
        found = re.search(rb"-arch (sm_\d+[af]?)", code)
        if found:
            return [found.group(1).decode()]
        flags, = struct.unpack_from("<I", code, 48)
        return [f"sm_{(flags >> 8) & 0xff}"]
    found = re.search(rb"\.target\s+(sm_\w+)", code[:4096])
    return [found.group(1).decode()] if found else []
