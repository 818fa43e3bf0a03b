"""``inspect`` for ROCm targets: what each rProgram's code object says.

:func:`code_object_reports` builds the persistent kernels of a rammer-lowered module through TVM's
ROCm build (``tvm_rammer.rocm.build``, code objects captured) and reads, per rProgram, the
metadata (``code_object``: VGPRs, SGPRs, LDS, scratch, workgroup limit, wavefront size), the vEUs
per CU that metadata allows (``veus_per_cu_code_object``, :mod:`tvm_rammer.rocm.occupancy`) and
the memory-ordering check of its disassembly (``ordering``). :func:`add_code_objects` puts them
into ``report.summarize``'s dict.
"""

from __future__ import annotations

import logging

import tvm
from tvm import tirx

from .build import capture
from .codeobject import check_ordering, disassemble, read_metadata
from .occupancy import veus_per_cu
from .targets import rocm_arch

LOG = logging.getLogger("tvm_rammer")
KERNEL_SUFFIX = "_kernel"  # TVM's device function of PrimFunc f is f_kernel


def persistent_funcs(mod: tvm.IRModule) -> dict:
    """``{name: PrimFunc}`` of the persistent kernels (``rammer.num_veus``) in ``mod``."""
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None
            and "rammer.num_veus" in f.attrs}


def build_code_object(funcs: dict, target) -> bytes:
    """The code object TVM's ROCm build makes of ``funcs`` (one module, one code object)."""
    with capture(code_only=True) as found:
        tvm.tirx.build(tvm.IRModule(funcs), target=tvm.target.Target(target, host="llvm"))
    if not found:
        raise RuntimeError("TVM's ROCm build linked no code object")
    return found[-1]


def probe_registers(spec, target) -> int:
    """Registers per thread (the unified VGPR+AGPR total, in granules of 8) of ``spec``'s persistent
    kernel compiled for ``target`` with barrier code and no occupancy request: what the placement
    must budget for (``resources.ResourceProbe``; paper 4.1.2 reads nvcc's figure the same way).
    Raises when the build fails (a kernel that cannot be compiled cannot be placed either)."""
    from tir_templates.rtask_rewrite import instantiate  # pylint: disable=import-outside-toplevel
    from ..codegen.persistent import build_persistent_func  # pylint: disable=import-outside-toplevel

    with target:
        func = build_persistent_func(spec, num_veus=1, table_len=16, with_barriers=True,
                                     instantiate=instantiate)
    meta = read_metadata(build_code_object({spec.name: func}, target))[spec.name + KERNEL_SUFFIX]
    if meta.scratch_bytes or meta.vgpr_spills:
        LOG.warning("tvm-rammer: %s's persistent kernel spills to scratch (%d B, %d VGPR spills at "
                    "%d VGPRs): correct but slow; inspect --json lists its code object",
                    spec.name, meta.scratch_bytes, meta.vgpr_spills, meta.vgprs)
    return -(-meta.vgprs // 8) * 8


def code_object_reports(mod: tvm.IRModule, target) -> dict:
    """``{rProgram kernel name: {"code_object", "veus_per_cu_code_object", "ordering"}}``."""
    funcs = persistent_funcs(mod)
    if not funcs:
        return {}
    arch = rocm_arch(target)
    hsaco = build_code_object(funcs, target)
    metadata = read_metadata(hsaco)
    code = disassemble(hsaco, arch)
    out = {}
    for name, func in funcs.items():
        symbol = name + KERNEL_SUFFIX
        meta = metadata[symbol]
        threads = int(func.attrs["rammer.veu_threads"])
        try:
            fits = veus_per_cu(meta, threads, arch)
        except ValueError as err:
            fits = f"none: {err}"
        out[name] = {"code_object": meta.as_dict(), "veus_per_cu_code_object": fits,
                     "ordering": check_ordering(code.get(symbol, []), arch)}
    return out


def add_code_objects(summary: dict, mod: tvm.IRModule, target) -> None:
    """Each entry of ``summary["programs"]`` (``report.summarize``) gets its code object's
    figures (:func:`code_object_reports`)."""
    reports = code_object_reports(mod, target)
    for program in summary.get("programs", []):
        program.update(reports.get(program["kernel"], {}))


def problems_of(program: dict) -> list:
    """What is wrong with one rProgram's entry of ``inspect``'s ``programs`` (with
    :func:`add_code_objects`' fields): scratch or VGPR spills, LDS over 64 KiB, a workgroup limit
    below the vEU width, not wave64, fewer vEUs per CU than the placement assumed, a memory-ordering
    problem. Empty: nothing."""
    code = program.get("code_object")
    if code is None:
        return ["no code object figures"]
    found = []
    if code["scratch_bytes"] or code["vgpr_spills"]:
        found.append(f"scratch {code['scratch_bytes']} B, {code['vgpr_spills']} VGPR spills")
    if code["lds_bytes"] > 65536:
        found.append(f"LDS {code['lds_bytes']} B > 64 KiB")
    if code["max_flat_workgroup_size"] < program["veu_threads"]:
        found.append(f"workgroup limit {code['max_flat_workgroup_size']} < vEU {program['veu_threads']}")
    if code["wavefront_size"] != 64:
        found.append(f"wavefront {code['wavefront_size']}")
    fits = program.get("veus_per_cu_code_object")
    if not isinstance(fits, int) or fits < program["veus_per_sm"]:
        found.append(f"{fits} vEUs per CU fit, the placement assumed {program['veus_per_sm']}")
    found += program["ordering"]["problems"]
    return found


def format_code_objects(summary: dict) -> str:
    """Lines for a human: per rProgram its code object's figures and what is wrong with it; the
    closing line says that nothing runs (the installed TVM has no ROCm runtime)."""
    lines = []
    for p in summary.get("programs", []):
        code = p.get("code_object", {})
        problems = problems_of(p)
        lines.append(f"  {p['kernel']}: {code.get('vgprs')} VGPRs, {code.get('sgprs')} SGPRs, "
                     f"{code.get('lds_bytes')} B LDS, {code.get('scratch_bytes')} B scratch, "
                     f"workgroup <= {code.get('max_flat_workgroup_size')} (vEU "
                     f"{p['veu_threads']}), wave{code.get('wavefront_size')}, "
                     f"{p.get('veus_per_cu_code_object')} vEUs/CU fit ({p['veus_per_sm']} placed), "
                     f"{p['ordering']['acquires']} acquires / {p['ordering']['releases']} releases: "
                     + ("; ".join(problems) if problems else "ok"))
    lines.append("AMD target: built and checked on the code object; nothing runs here (TVM has no "
                 "ROCm runtime in this installation)")
    return "\n".join(lines)
