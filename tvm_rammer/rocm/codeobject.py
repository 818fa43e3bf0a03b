"""What an HSA code object says: per-kernel metadata, disassembly, memory-ordering checks.

Nothing here runs a kernel; it reads the code object (the bytes ``tvm_rammer.rocm.build.capture``
collects) with ``llvm-readelf-22 --notes`` (the AMDGPU metadata note: registers, LDS, scratch,
workgroup limit, wavefront size) and ``llvm-objdump-22 -d`` (the machine code).

:func:`check_ordering` checks in the disassembly of one kernel that every synchronizing access has
the code sequence of LLVM's AMDGPU memory model (``AMDGPUUsage``, "Memory Model GFX942" and
"GFX90A"), i.e. that the helpers' acquire and release survived inlining and code generation:

* gfx942 (MI300X), acquire load at agent (or system) scope: ``global_load ... sc1``, then
  ``s_waitcnt vmcnt(0)``, then ``buffer_inv sc1`` before any other vector memory access; a release
  at agent scope: ``buffer_wbl2 sc1`` and ``s_waitcnt vmcnt(0)`` with no vector memory access
  between them and the store/atomic (``sc0 sc1`` on both for system scope); an atomic store at
  agent scope (``global_store ... sc1``) must be such a release (the persistent kernel has no
  relaxed one);
* gfx90a (MI210), acquire at agent scope: ``global_load ... glc``, ``s_waitcnt vmcnt(0)``,
  ``buffer_wbinvl1_vol``; a gfx90a release at agent scope is only an ``s_waitcnt vmcnt(0)``
  before an ordinary-looking store, which the disassembly cannot tell from a plain store, so only
  acquires are checked there.

A kernel whose helpers were compiled without acquire or release (the tests' negative controls)
fails these checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .toolchain import Toolchain, find_toolchain

# vector memory accesses that other threads can observe; scratch_* (a spill's private memory) is
# nobody else's, so a spill reload between a release's waitcnt and its store orders nothing
_VMEM = re.compile(r"^(global|buffer|flat)_")
_CACHE_CONTROL = ("buffer_wbl2", "buffer_inv", "buffer_wbinvl1", "buffer_wbinvl1_vol",
                  "buffer_invl2")


@dataclass(frozen=True)
class KernelMetadata:
    """One kernel's entry of the code object's AMDGPU metadata note."""

    name: str
    vgprs: int
    agprs: int
    sgprs: int
    lds_bytes: int
    scratch_bytes: int
    max_flat_workgroup_size: int
    wavefront_size: int
    vgpr_spills: int
    sgpr_spills: int
    uses_dynamic_stack: bool

    def as_dict(self) -> dict:
        """The figures ``inspect`` reports (``code_object``)."""
        return {"vgprs": self.vgprs, "agprs": self.agprs, "sgprs": self.sgprs,
                "lds_bytes": self.lds_bytes, "scratch_bytes": self.scratch_bytes,
                "max_flat_workgroup_size": self.max_flat_workgroup_size,
                "wavefront_size": self.wavefront_size,
                # VGPR spills go to scratch memory; SGPR spills to VGPR lanes (no memory)
                "vgpr_spills": self.vgpr_spills, "sgpr_spills": self.sgpr_spills}


def _tool(toolchain: Toolchain | None, args: list, hsaco: bytes) -> str:
    toolchain = toolchain or find_toolchain()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.co")
        with open(path, "wb") as f:
            f.write(hsaco)
        cmd = [getattr(toolchain, args[0]), *args[1:], path]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed: {proc.stderr.strip()}")
    return proc.stdout


def parse_notes(text: str) -> dict:
    """``{kernel name: KernelMetadata}`` from ``llvm-readelf --notes`` output."""
    kernels, current = [], None
    for line in text.splitlines():
        if line.startswith("  - ."):
            current = {}
            kernels.append(current)
            line = "    " + line[4:]
        if current is not None and line.startswith("    .") and not line.startswith("     "):
            key, _, value = line.strip()[1:].partition(":")
            current[key.strip()] = value.strip()
        elif not line.startswith(" "):
            current = None
    out = {}
    for k in kernels:
        meta = KernelMetadata(
            name=k["name"], vgprs=int(k.get("vgpr_count", 0)), agprs=int(k.get("agpr_count", 0)),
            sgprs=int(k.get("sgpr_count", 0)), lds_bytes=int(k.get("group_segment_fixed_size", 0)),
            scratch_bytes=int(k.get("private_segment_fixed_size", 0)),
            max_flat_workgroup_size=int(k.get("max_flat_workgroup_size", 0)),
            wavefront_size=int(k.get("wavefront_size", 0)),
            vgpr_spills=int(k.get("vgpr_spill_count", 0)),
            sgpr_spills=int(k.get("sgpr_spill_count", 0)),
            uses_dynamic_stack=k.get("uses_dynamic_stack", "false") == "true")
        out[meta.name] = meta
    return out


def read_metadata(hsaco: bytes, toolchain: Toolchain | None = None) -> dict:
    """``{kernel name: KernelMetadata}`` of a code object."""
    return parse_notes(_tool(toolchain, ["readelf", "--notes"], hsaco))


class Disassembly(list):
    """One function's instructions (text, operands kept) and its branches: ``targets[i]`` is the
    index of the instruction that branch ``i`` jumps to; None when some branch target could not
    be resolved (the checks then read the instructions in address order, as for a plain list)."""

    def __init__(self, instructions=(), targets=None):
        super().__init__(instructions)
        self.targets = None if targets is None else dict(targets)


_LINE_RE = re.compile(r"//\s*([0-9A-Fa-f]+):[^<]*(?:<([^>+]+)(?:\+0x([0-9a-fA-F]+))?>)?\s*$")


def disassemble(hsaco: bytes, mcpu: str, toolchain: Toolchain | None = None) -> dict:
    """``{symbol: Disassembly}`` of a code object's functions (operands kept, the encoding
    comments dropped; branch targets resolved from them)."""
    text = _tool(toolchain, ["objdump", "-d", f"--mcpu={mcpu}"], hsaco)
    functions, current, base = {}, None, 0
    raw = {}
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+) <([^>]+)>:$", line)
        if head:
            base = int(head.group(1), 16)
            current = raw.setdefault(head.group(2), [])
            continue
        if current is not None and line.startswith("\t"):
            code, _, comment = line.partition("//")
            found = _LINE_RE.search("//" + comment) if comment else None
            address = int(found.group(1), 16) - base if found else None
            target = int(found.group(3) or "0", 16) if found and found.group(2) else None
            current.append((code.strip(), address, target))
    for name, rows in raw.items():
        index = {address: i for i, (_, address, _) in enumerate(rows) if address is not None}
        branches = [(i, target) for i, (inst, _, target) in enumerate(rows)
                    if _mnemonic(inst).startswith(("s_branch", "s_cbranch"))]
        resolved = all(target in index for _, target in branches)
        functions[name] = Disassembly([inst for inst, _, _ in rows],
                                      {i: index[t] for i, t in branches} if resolved else None)
    return functions


def _mnemonic(inst: str) -> str:
    return inst.split()[0] if inst else ""


def _bits(inst: str) -> set:
    return set(re.findall(r"\b(sc0|sc1|nt|glc|slc|dlc)\b", inst))


def _is_vmem(inst: str) -> bool:
    name = _mnemonic(inst)
    return bool(_VMEM.match(name)) and name not in _CACHE_CONTROL


def _waits_vm(inst: str) -> bool:
    return _mnemonic(inst) == "s_waitcnt" and "vmcnt(0)" in inst


def check_ordering(instructions: list, mcpu: str) -> dict:
    """Check a kernel's synchronizing accesses (module docstring). Returns ``{"acquires": n,
    "releases": n, "problems": [text, ...]}`` (no problem: every acquire and release has its
    memory-model sequence)."""
    problems, acquires, releases = [], 0, 0
    gfx942 = mcpu.startswith("gfx94") or mcpu.startswith("gfx95")
    acquire_bit = "sc1" if gfx942 else "glc"
    invalidate = "buffer_inv" if gfx942 else "buffer_wbinvl1_vol"
    for i, inst in enumerate(instructions):
        name = _mnemonic(inst)
        if name.startswith("global_load") and acquire_bit in _bits(inst):
            acquires += 1
            waited = False
            for later in instructions[i + 1:]:
                if _waits_vm(later):
                    waited = True
                elif _mnemonic(later) == invalidate:
                    if not waited:
                        problems.append(f"{inst!r}: {invalidate} before s_waitcnt vmcnt(0)")
                    break
                elif _is_vmem(later) or _mnemonic(later) in ("s_endpgm", "s_setpc_b64"):
                    problems.append(f"{inst!r}: no s_waitcnt vmcnt(0) + {invalidate} before "
                                    f"{later!r} (acquire load without acquire)")
                    break
        if not gfx942:
            continue
        if name == "buffer_wbl2":
            releases += 1
            problems += _release_problems(instructions, i)
        elif name.startswith("global_store") and "sc1" in _bits(inst):
            if not any(_mnemonic(p) == "buffer_wbl2" for p in _since_last_vmem(instructions, i)):
                problems.append(f"{inst!r}: atomic store at agent scope without buffer_wbl2 "
                                "(store without release)")
    return {"acquires": acquires, "releases": releases, "problems": problems}


def _since_last_vmem(instructions: list, i: int) -> list:
    """The instructions between the last vector memory access before ``i`` and ``i``."""
    out = []
    for prev in reversed(instructions[:i]):
        if _is_vmem(prev):
            break
        out.append(prev)
    return out


def _release_problems(instructions: list, i: int) -> list:
    """A ``buffer_wbl2`` at ``i``: the next vector memory access is the releasing one; every
    access before it must have completed (``s_waitcnt vmcnt(0)`` after the last of them)."""
    wbl2 = instructions[i]
    target = next((j for j in range(i + 1, len(instructions)) if _is_vmem(instructions[j])), None)
    if target is None:
        return [f"{wbl2!r} at {i}: no store or atomic follows"]
    store = instructions[target]
    if "sc0" in _bits(wbl2) and "sc0" not in _bits(store) and _mnemonic(store).startswith(
            "global_store"):
        return [f"{store!r}: system-scope write-back before a store without sc0"]
    if not _waited_on_every_path(instructions, target):
        return [f"{store!r}: released without s_waitcnt vmcnt(0) after the previous accesses"]
    return []


def _predecessors(instructions: list) -> dict:
    """``{i: [instructions control reaches i from]}``: the one before it unless that one ends or
    always branches, and every branch to it (``Disassembly.targets``); for a plain list (or
    unresolved branches) the one before it, always."""
    targets = getattr(instructions, "targets", None)
    preds = {i: [] for i in range(len(instructions))}
    for i in range(1, len(instructions)):
        if targets is None or _mnemonic(instructions[i - 1]) not in (
                "s_branch", "s_endpgm", "s_setpc_b64"):
            preds[i].append(i - 1)  # without the branches: address order, every instruction
    for source, target in (targets or {}).items():
        preds[target].append(source)
    return preds


def _waited_on_every_path(instructions: list, target: int) -> bool:
    """True when every path from the kernel's entry to ``target`` has an ``s_waitcnt vmcnt(0)``
    after its last vector memory access (the hardware waits per path: LLVM drops a release's
    wait on a block whose every predecessor has none outstanding, so reading the instructions in
    address order would see a wait-less release there)."""
    preds = _predecessors(instructions)
    stack, seen = list(preds[target]), set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if _waits_vm(instructions[i]):
            continue  # this path waited after anything before it
        if _is_vmem(instructions[i]):
            return False
        stack.extend(preds[i])
    return True
