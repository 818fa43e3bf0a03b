"""ROCm: persistent kernels through TVM's ROCm target, checked on the code object (no AMD GPU).

Nothing here runs on an AMD GPU: every check reads the HSA code object TVM's ROCm build links
(metadata notes, disassembly). They need LLVM 22's tools and ROCm's device bitcode; scripts/test.sh
installs them where it can, otherwise these tests skip with the command to run.
"""

import json
import os
import subprocess
import sys

import onnx
import pytest
import tvm
from tvm import tirx

import tvm_rammer
from tvm_rammer.config import RammerConfig
from tvm_rammer.rocm import build as rocm_build
from tvm_rammer.rocm import codeobject, helpers, toolchain
from tvm_rammer.rocm.dialect import waves_per_eu
from tvm_rammer.rocm.early_exit import guard_work
from tvm_rammer.rocm.occupancy import veus_per_cu
from tvm_rammer.abstractions.vdevice import VDevice
from tir_templates.prelower import UnsupportedKernel

sys.path.insert(0, os.path.dirname(__file__))
from onnx_builders import parallel_branches, to_relax  # noqa: E402

REASON = toolchain.missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
MI300X = "rammer/amd-mi300x"


def _build(mod, target=MI300X, config=None):
    """(executable, code object) of ``tvm.compile`` for a rammer ROCm target."""
    with rocm_build.capture() as found:
        if config is None:
            ex = tvm.compile(mod, target=target)
        else:
            from tvm_rammer.driver.pipeline import rammer_pipeline
            ex = tvm.compile(mod, target=tvm_rammer.rammer_target(target),
                             relax_pipeline=rammer_pipeline(config=config))
    assert len(found) == 1, "one device module, one code object"
    return ex, found[0]


def _persistent(hsaco, target_mcpu="gfx942"):
    meta = codeobject.read_metadata(hsaco)
    code = codeobject.disassemble(hsaco, target_mcpu)
    names = sorted(n for n in meta if n.startswith("rammer_rprogram"))
    assert names, f"no persistent kernel in {sorted(meta)}"
    return meta, code, names


@pytest.fixture(scope="module")
def branches():
    """A 4-branch model built for MI300X: (relax module, executable, code object)."""
    mod = to_relax(parallel_branches(4, hidden=64))
    ex, hsaco = _build(mod)
    return mod, ex, hsaco


# --- targets and vDevice ---------------------------------------------------------------------

def test_amd_tags_and_any_rocm_target_are_rammer_targets():
    t = tvm_rammer.rammer_target(MI300X)
    assert t.kind.name == "rocm" and str(t.attrs["mcpu"]) == "gfx942"
    assert tvm_rammer.is_rammer_target(t) and int(t.attrs["thread_warp_size"]) == 64
    assert str(tvm_rammer.rammer_target("rammer/amd-mi210").attrs["mcpu"]) == "gfx90a"
    plain = tvm_rammer.rammer_target({"kind": "rocm", "mcpu": "gfx942"})
    assert tvm_rammer.is_rammer_target(plain)
    from tvm_rammer.target import target_arch
    assert target_arch(plain) == "gfx942"
    with pytest.raises(ValueError, match="must be CUDA or ROCm targets"):
        tvm_rammer.rammer_target("llvm")


def test_cdna_vdevice_counts_waves_vgprs_and_lds_per_cu():
    mi300x, mi210 = VDevice.for_arch("gfx942"), VDevice.for_arch("gfx90a")
    assert (mi300x.num_sms, mi210.num_sms, mi300x.warp_size) == (304, 104, 64)
    # 4 waves x 128 VGPRs: 512 // 128 = 4 waves per SIMD, 16 per CU -> 4 vEUs
    assert mi300x.occupancy(256, 128, 0) == 4
    # 16 waves of a 1024-thread vEU fill the CU at 128 VGPRs; at 256 VGPRs it cannot fit
    assert mi300x.occupancy(1024, 128, 0) == 1
    with pytest.raises(ValueError, match="registers"):
        mi300x.occupancy(1024, 256, 0)
    # LDS: 64 KiB per CU in 512-byte granules
    assert mi300x.occupancy(64, 32, 20000) == 65536 // 20480
    # one-wave vEUs: 8 waves x 4 SIMDs, capped by 16 workgroups per CU
    assert mi300x.occupancy(64, 32, 0) == 16


def test_veus_per_cu_from_metadata_counts_vgprs_sgprs_and_refuses_a_narrow_code_object():
    def meta(**kw):
        base = dict(name="k", vgprs=64, agprs=0, sgprs=40, lds_bytes=0, scratch_bytes=0,
                    max_flat_workgroup_size=256, wavefront_size=64, vgpr_spills=0,
                    sgpr_spills=0, uses_dynamic_stack=False)
        return codeobject.KernelMetadata(**{**base, **kw})
    assert veus_per_cu(meta(), 256, "gfx942") == 8          # 8 waves per SIMD at 64 VGPRs
    assert veus_per_cu(meta(vgprs=100), 256, "gfx942") == 4  # 104 allocated: 512 // 104 = 4 waves
    assert veus_per_cu(meta(vgprs=160, agprs=60), 256, "gfx942") == 3  # unified total: 160 -> 3
    assert veus_per_cu(meta(sgprs=102), 256, "gfx942") == 7  # 800 // 112 = 7 waves per SIMD
    with pytest.raises(ValueError, match="allows 256 threads per workgroup, the vEU has 512"):
        veus_per_cu(meta(), 512, "gfx942")
    assert waves_per_eu(256, 8) == 8 and waves_per_eu(1024, 1) == 4 and waves_per_eu(64, 1) == 1


# --- the build: helpers linked, real workgroup size -------------------------------------------

def test_helpers_are_linkonce_odr_bitcode():
    tc = toolchain.find_toolchain()
    path = helpers.compile_bitcode(tc, "gfx942")
    dis = subprocess.run([tc.llvm_as.replace("llvm-as", "llvm-dis"), path, "-o", "-"],
                         capture_output=True, text=True, check=True).stdout
    defined = [line for line in dis.splitlines() if line.startswith("define ")]
    names = {line.split("@")[1].split("(")[0] for line in defined}
    assert set(helpers.HELPER_NAMES) <= names
    assert all(line.startswith("define linkonce_odr ") for line in defined)


def test_patch_attributes_gives_each_kernel_its_own_group():
    ir = ('define dllexport amdgpu_kernel void @a_kernel(ptr %x) local_unnamed_addr #0 {\n'
          'ret void\n}\n'
          'define dllexport amdgpu_kernel void @b_kernel(ptr %x) local_unnamed_addr #0 {\n'
          'ret void\n}\n'
          'attributes #0 = { nounwind "amdgpu-flat-work-group-size"="1,256" }\n')
    out = rocm_build.patch_attributes(ir, {"a_kernel": {"amdgpu-flat-work-group-size": "1,1024",
                                                        "amdgpu-waves-per-eu": "2"}})
    assert '@a_kernel(ptr %x) local_unnamed_addr #1 {' in out
    assert '@b_kernel(ptr %x) local_unnamed_addr #0 {' in out  # untouched
    assert 'attributes #1 = { nounwind "amdgpu-flat-work-group-size"="1,1024" ' \
           '"amdgpu-waves-per-eu"="2" }' in out
    with pytest.raises(ValueError, match="not found"):
        rocm_build.patch_attributes(ir, {"c_kernel": {}})
    # a private array TVM's optimizer put into LDS, one slot per thread of 256: too small for 1024
    promoted = ir + "@a_kernel.buf = internal unnamed_addr addrspace(3) global [256 x float] poison\n"
    assert "#1" in rocm_build.patch_attributes(promoted, {"a_kernel": {
        "amdgpu-flat-work-group-size": "1,128"}})
    with pytest.raises(ValueError, match="promoted a private array to LDS"):
        rocm_build.patch_attributes(promoted, {"a_kernel": {
            "amdgpu-flat-work-group-size": "1,1024"}})


def test_library_holds_the_code_object(branches, tmp_path):
    _, ex, hsaco = branches
    path = tmp_path / "m.so"
    ex.export_library(str(path))
    assert hsaco[:4] == b"\x7fELF" and hsaco in path.read_bytes()


def test_code_object_metadata_of_every_persistent_kernel(branches):
    _, _, hsaco = branches
    meta, _, names = _persistent(hsaco)
    for name in names:
        m = meta[name]
        assert m.wavefront_size == 64
        assert m.scratch_bytes == 0 and m.vgpr_spills == 0 and m.sgpr_spills == 0
        assert not m.uses_dynamic_stack
        assert 0 < m.lds_bytes <= 65536  # the rTask pool + the stop flag of rammer_stopped
        assert 0 < m.vgprs <= 512 and 0 < m.sgprs <= 102


def test_inspect_reports_code_object_and_fitting_veus(branches):
    mod, _, _ = branches
    from tvm_rammer.views.inspection import inspect_model
    summary = inspect_model(mod, MI300X)
    assert summary["rprograms"] >= 1
    for program in summary["programs"]:
        code = program["code_object"]
        assert set(code) >= {"vgprs", "sgprs", "lds_bytes", "scratch_bytes",
                             "max_flat_workgroup_size", "wavefront_size"}
        assert code["max_flat_workgroup_size"] == program["veu_threads"]
        assert code["scratch_bytes"] == 0
        # co-residency: the compiled kernel allows at least the vEUs per CU the placement assumed
        assert program["veus_per_cu_code_object"] >= program["veus_per_sm"]
        assert program["ordering"]["problems"] == []


def test_wide_veu_gets_its_real_workgroup_size():
    """TVM marks every kernel "1,256" without a ROCm device; a 1024-thread vEU must not be."""
    mod = to_relax(parallel_branches(4, hidden=64))
    config = RammerConfig(max_rtask_threads=1024)
    ex, hsaco = _build(mod, config=config)
    meta, _, names = _persistent(hsaco)
    from tvm_rammer.views.inspection import inspect_model
    widths = {p["kernel"] + "_kernel": p["veu_threads"]
              for p in inspect_model(mod, MI300X, config)["programs"]}
    assert max(widths.values()) > rocm_build.TVM_FLAT_LIMIT
    for name in names:
        assert meta[name].max_flat_workgroup_size == widths[name]


# --- memory ordering in the disassembly --------------------------------------------------------

def test_every_acquire_and_release_has_its_memory_model_sequence(branches):
    _, _, hsaco = branches
    _, code, names = _persistent(hsaco)
    for name in names:
        found = codeobject.check_ordering(code[name], "gfx942")
        assert found["problems"] == []
        assert found["acquires"] > 0 and found["releases"] > 0


def _broken(old, new):
    src = helpers.source()
    assert old in src
    return src.replace(old, new)


def test_code_objects_are_cached_by_content(monkeypatch, tmp_path):
    """A second build of the same kernels takes the cached code object (no LLVM build of them,
    same bytes); a different kernel is built (negative control)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = []
    compile_ir = rocm_build.compile_ir
    monkeypatch.setattr(rocm_build, "compile_ir",
                        lambda ir, mcpu: (built.append(mcpu), compile_ir(ir, mcpu))[1])
    _, first = _build(to_relax(parallel_branches(4, hidden=64)))
    assert len(built) == 2 and os.listdir(rocm_build.cache_dir())  # the probe and the module
    _, again = _build(to_relax(parallel_branches(4, hidden=64)))
    assert len(built) == 2 and again == first
    _, other = _build(to_relax(parallel_branches(4, hidden=32)))
    assert len(built) == 4 and other != first


@pytest.mark.parametrize("old,new,expected", [
    ("__scoped_atomic_store_n(state + veu, step, __ATOMIC_RELEASE, AGENT)",
     "__scoped_atomic_store_n(state + veu, step, __ATOMIC_RELAXED, AGENT)",
     "store without release"),
    ("return __scoped_atomic_load_n(p, __ATOMIC_ACQUIRE, AGENT);",
     "return __scoped_atomic_load_n(p, __ATOMIC_RELAXED, AGENT);",
     "acquire load without acquire"),
])
def test_helpers_without_acquire_or_release_are_detected(monkeypatch, old, new, expected):
    """Negative controls: the same kernel with a helper compiled without its ordering."""
    src = _broken(old, new)
    monkeypatch.setattr(rocm_build, "compile_bitcode",
                        lambda tc, mcpu: helpers.compile_bitcode(tc, mcpu, src=src))
    _, hsaco = _build(to_relax(parallel_branches(4, hidden=64)))
    _, code, names = _persistent(hsaco)
    problems = [p for n in names for p in codeobject.check_ordering(code[n], "gfx942")["problems"]]
    assert any(expected in p for p in problems), problems


def test_a_missing_helper_fails_the_link(monkeypatch):
    """ld.lld runs with --no-undefined: a helper the bitcode lacks is a link error, not a code
    object that fails to load on the GPU."""
    start = helpers.SOURCE.index("void rammer_signal(")
    end = helpers.SOURCE.index("void rammer_count(")
    src = helpers.source().replace(helpers.SOURCE[start:end], "")
    monkeypatch.setattr(rocm_build, "compile_bitcode",
                        lambda tc, mcpu: helpers.compile_bitcode(tc, mcpu, src=src))
    with pytest.raises(Exception, match="undefined symbol: rammer_signal"):
        _build(to_relax(parallel_branches(4, hidden=64)))


def test_mi210_acquires_invalidate_the_l1():
    _, hsaco = _build(to_relax(parallel_branches(4, hidden=64)), target="rammer/amd-mi210")
    _, code, names = _persistent(hsaco, "gfx90a")
    for name in names:
        found = codeobject.check_ordering(code[name], "gfx90a")
        assert found["problems"] == [] and found["acquires"] > 0
        assert any(i.startswith("buffer_wbinvl1_vol") for i in code[name])


# --- early exit without named barriers ---------------------------------------------------------

def _barrier():
    return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def test_surplus_threads_skip_work_but_reach_every_barrier():
    tid = tirx.Var("tid", "int32")
    buf = tirx.decl_buffer((64,), "float32", name="a")
    k = tirx.Var("k", "int32")
    work = tirx.BufferStore(buf, tirx.const(1.0, "float32"), [tid])
    body = tirx.SeqStmt([
        tirx.Bind(tirx.Var("tx", "int32"), tid % 32),
        tirx.For(k, 0, 4, tirx.ForKind.SERIAL, tirx.SeqStmt([work, _barrier()])),
        work])
    out = guard_work(body, tid, 32)
    text = str(out)
    assert text.count("tvm_storage_sync") == 1
    loop = out.seq[1]
    assert isinstance(loop, tirx.For)
    inner = loop.body.seq
    assert isinstance(inner[0], tirx.IfThenElse) and "tid < 32" in str(inner[0].condition)
    assert isinstance(inner[1], tirx.Evaluate)  # the barrier itself: every thread
    assert isinstance(out.seq[2], tirx.IfThenElse)


def test_barrier_under_thread_dependent_control_flow_is_refused():
    tid = tirx.Var("tid", "int32")
    k = tirx.Var("k", "int32")
    body = tirx.For(k, 0, tid, tirx.ForKind.SERIAL, _barrier())
    with pytest.raises(UnsupportedKernel, match="depends on the thread"):
        guard_work(body, tid, 32, "kernel")


def test_guarded_bind_loads_only_on_active_threads():
    tid = tirx.Var("tid", "int32")
    buf = tirx.decl_buffer((64,), "int32", name="a")
    v = tirx.Var("v", "int32")
    body = tirx.SeqStmt([tirx.Bind(v, tirx.BufferLoad(buf, [tid])),
                         tirx.For(tirx.Var("k", "int32"), 0, 2, tirx.ForKind.SERIAL, _barrier())])
    out = guard_work(body, tid, 16)
    assert "if_then_else" in str(out.seq[0].value) or "T.if_then_else" in str(out.seq[0])


def test_local_arrays_are_cleared_where_declared_outside_the_guard():
    """Every thread zeroes a body's ``alloc_local`` array right after its declaration, before the
    early-exit guard; shared buffers and arrays too large for registers are left alone."""
    from tvm_rammer.rocm.early_exit import MAX_CLEARED_ELEMENTS, cleared_locals
    tid = tirx.Var("tid", "int32")
    acc = tirx.decl_buffer((4,), "float32x2", name="acc", scope="local")
    big = tirx.decl_buffer((MAX_CLEARED_ELEMENTS + 1,), "float32", name="big", scope="local")
    smem = tirx.decl_buffer((8,), "float32", name="smem", scope="shared")
    out_buf = tirx.decl_buffer((64,), "float32", name="out")
    body = tirx.SeqStmt([
        tirx.AllocBuffer(acc), tirx.AllocBuffer(big), tirx.AllocBuffer(smem),
        tirx.For(tirx.Var("k", "int32"), 0, 2, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.BufferStore(acc, tirx.Broadcast(tirx.const(1.0, "float32"), 2), [1]),
            _barrier()])),
        tirx.BufferStore(out_buf, tirx.const(0.0, "float32"), [tid])])
    out = cleared_locals(guard_work(body, tid, 32))
    items = list(out.seq)
    assert isinstance(items[0], tirx.AllocBuffer) and items[0].buffer.same_as(acc)
    stores = items[1:5]
    assert all(isinstance(s, tirx.BufferStore) and s.buffer.same_as(acc) for s in stores)
    assert sorted(int(s.indices[0]) for s in stores) == [0, 1, 2, 3]
    assert isinstance(items[5], tirx.AllocBuffer) and items[5].buffer.same_as(big)
    assert isinstance(items[6], tirx.AllocBuffer) and items[6].buffer.same_as(smem)
    assert isinstance(items[7], tirx.For)  # the guarded work follows, unchanged


def _instruction_loop_state(model, monkeypatch, clear: bool, cache):
    """(code object metadata, float values the vEU's instruction loop carries from one rTask to
    the next in TVM's optimized LLVM IR) of ``model``'s persistent kernels for MI300X."""
    import re
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.rocm import early_exit
    from tvm_rammer.rocm.report import build_code_object, persistent_funcs
    from tvm_rammer.target import resolve_target
    if not clear:
        monkeypatch.setattr(early_exit, "cleared_locals", lambda stmt: stmt)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))  # no cached code object: the IR is built
    irs = []
    compile_ir = rocm_build.compile_ir
    monkeypatch.setattr(rocm_build, "compile_ir", lambda ir, mcpu: (irs.append(ir),
                                                                      compile_ir(ir, mcpu))[1])
    target = resolve_target(MI300X)
    with target:
        lowered = lower(import_onnx(model), target)
    meta = codeobject.read_metadata(build_code_object(persistent_funcs(lowered), target))
    headers = re.findall(r"^for_body_pc:.*\n((?:  %\S+ = phi .*\n)+)", irs[-1], re.M)
    carried = [line for h in headers for line in h.splitlines()
               if "float" in line.split(" phi ")[1].split("[")[0]]
    return meta, carried


def test_local_accumulators_do_not_live_across_the_instruction_loop(monkeypatch, tmp_path):
    """A small SqueezeNet (fire modules: many conv bodies with register accumulators, early exit):
    with every local array cleared where it is declared, the instruction loop carries no float
    value and the kernel needs fewer VGPRs and no scratch; the negative control (clearing off)
    carries every body's accumulators around the loop (on reduced SqueezeNet: 512 VGPRs and
    956 B of scratch, benchmarks/README.md)."""
    from tvm_rammer.models import get_model
    model = get_model("squeezenet", image_size=32, width=0.125)
    meta, carried = _instruction_loop_state(model, monkeypatch, True, tmp_path / "on")
    monkeypatch.undo()
    bad_meta, bad_carried = _instruction_loop_state(model, monkeypatch, False, tmp_path / "off")
    assert carried == [] and bad_carried, "the control must carry accumulators"
    for name, m in meta.items():
        assert m.scratch_bytes == 0 and m.vgpr_spills == 0, name
        assert m.vgprs < bad_meta[name].vgprs, name


# --- the CLI -----------------------------------------------------------------------------------

def test_cli_compile_and_inspect(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(parallel_branches(3, hidden=32), str(model))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "m.so"
    subprocess.run([sys.executable, "-m", "tvm_rammer.cli", "compile", str(model), "--target",
                    MI300X, "--no-progress", "-o", str(out)], check=True, env=env,
                   capture_output=True)
    assert out.stat().st_size > 0
    proc = subprocess.run([sys.executable, "-m", "tvm_rammer.cli", "inspect", str(model),
                           "--target", MI300X, "--json", "--no-progress"], check=True, env=env,
                          capture_output=True, text=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    code = summary["programs"][0]["code_object"]
    assert code["wavefront_size"] == 64 and code["scratch_bytes"] == 0
    assert code["max_flat_workgroup_size"] >= summary["programs"][0]["veu_threads"]


def test_missing_toolchain_names_the_install_command(tmp_path):
    found = toolchain.locate(str(tmp_path))  # a PATH without any tool
    assert isinstance(found, str) and toolchain.INSTALL_COMMAND in found and "ld.lld-22" in found
    assert all(p in toolchain.INSTALL_COMMAND for p in toolchain.PACKAGES)
    assert isinstance(toolchain.locate(), toolchain.Toolchain)


def test_instrumented_build_reads_the_realtime_counter_and_hardware_id():
    """RammerConfig(timeline=True): rammer_record / rammer_globaltimer on AMDGPU."""
    _, hsaco = _build(to_relax(parallel_branches(4, hidden=64)),
                      config=RammerConfig(timeline=True))
    _, code, names = _persistent(hsaco)
    for name in names:
        assert any(i.startswith("s_memrealtime") for i in code[name])
        assert any(i.startswith("s_getreg_b32") for i in code[name])
        assert codeobject.check_ordering(code[name], "gfx942")["problems"] == []


@pytest.mark.parametrize("name,kwargs", [("branches", {"n": 16}), ("lstm_tc", None)],
                         ids=["demo16", "lstm_tc"])
def test_zoo_subset_compiles_through_the_cli_with_a_clean_code_object(tmp_path, name, kwargs,
                                                                       capsys):
    """The 16-branch demo and the reduced LSTM (barriers, operator counters) in CI; every reduced
    zoo model: scripts/rocm_zoo.py (benchmarks/README.md)."""
    from tvm_rammer.cli import main
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.rocm.report import problems_of
    model = tmp_path / f"{name}.onnx"
    onnx.save(get_model(name, **(kwargs or REDUCED[name])), str(model))
    assert main(["compile", str(model), "--target", MI300X, "--no-progress",
                 "-o", str(tmp_path / "m.so")]) == 0
    assert (tmp_path / "m.so").stat().st_size > 0
    capsys.readouterr()
    assert main(["inspect", str(model), "--target", MI300X, "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rprograms"] >= 1 and sum(summary["barriers"]) > 0
    for program in summary["programs"]:
        assert problems_of(program) == []


def test_problems_of_flags_a_bad_code_object():
    from tvm_rammer.rocm.report import problems_of
    good = {"veu_threads": 256, "veus_per_sm": 4, "veus_per_cu_code_object": 4,
            "ordering": {"problems": []},
            "code_object": {"scratch_bytes": 0, "vgpr_spills": 0, "lds_bytes": 1024,
                            "max_flat_workgroup_size": 256, "wavefront_size": 64}}
    assert problems_of(good) == []
    bad = {**good, "veus_per_cu_code_object": 2,
           "code_object": {**good["code_object"], "scratch_bytes": 64, "vgpr_spills": 3,
                           "max_flat_workgroup_size": 128}}
    found = " ".join(problems_of(bad))
    assert "scratch 64 B" in found and "workgroup limit 128 < vEU 256" in found
    assert "2 vEUs per CU fit, the placement assumed 4" in found


def test_ordering_ignores_spill_traffic_but_not_global_accesses():
    """A spill reload (private scratch) between a release's wait and its store orders nothing; a
    global load there is an unordered prior access."""
    release = ["buffer_wbl2 sc1", "s_waitcnt vmcnt(0) lgkmcnt(0)",
               "scratch_load_dword v9, off, s33 offset:16", "global_store_dword v1, v2, s[0:1] sc1"]
    assert codeobject.check_ordering(release, "gfx942")["problems"] == []
    racy = release[:2] + ["global_load_dword v9, v3, s[4:5]"] + release[3:]
    problems = codeobject.check_ordering(racy, "gfx942")["problems"]
    assert len(problems) == 1 and "global_store_dword v1" in problems[0]



def test_release_wait_is_checked_on_every_control_flow_path():
    """LLVM drops a release's ``s_waitcnt vmcnt(0)`` where every path into its block has nothing
    outstanding: the block that precedes it in address order (here one ending in ``s_branch``)
    is not on those paths. Read in address order this looks like a wait-less release; on the
    control flow it is not, unless a path with an unwaited access branches to it (control)."""
    waited = ["global_load_dword v1, v0, s[0:1] sc1", "s_waitcnt vmcnt(0)", "buffer_inv sc1",
              "s_cbranch_execz 3"]
    elsewhere = ["global_store_dword v1, v2, s[2:3]", "s_branch 9"]
    release = ["buffer_wbl2 sc1", "s_waitcnt lgkmcnt(0)",
               "global_atomic_cmpswap v6, v9, v[8:9], s[4:5] sc0", "s_waitcnt vmcnt(0)",
               "buffer_inv sc1", "s_endpgm"]
    code = waited + elsewhere + release
    flow = codeobject.Disassembly(code, {3: 6})  # the acquire's block branches to the release
    assert codeobject.check_ordering(flow, "gfx942")["problems"] == []
    assert codeobject.check_ordering(list(code), "gfx942")["problems"]  # address order: flagged
    racy = codeobject.Disassembly(["global_store_dword v1, v2, s[2:3]", "s_cbranch_execz 3"]
                                  + elsewhere + release, {1: 4})
    problems = codeobject.check_ordering(racy, "gfx942")["problems"]
    assert len(problems) == 1 and "global_atomic_cmpswap" in problems[0]


def test_disassembly_resolves_branch_targets(branches):
    """Every branch of a real persistent kernel resolves to one of its instructions."""
    _, _, hsaco = branches
    _, code, names = _persistent(hsaco)
    for name in names:
        flow = code[name]
        assert flow.targets, name
        for source, target in flow.targets.items():
            assert flow[source].startswith(("s_branch", "s_cbranch")) and 0 <= target < len(flow)


def test_a_spilling_kernel_is_found_and_named(monkeypatch, tmp_path, caplog):
    """Negative control of the scratch rule: the reduced LSTM-TC (about 150 VGPRs) with its
    persistent kernel limited to 32 VGPRs (``amdgpu-num-vgpr``) spills; the code object says so,
    ``problems_of`` flags it and the register probe warns naming the rProgram. Unlimited: none of
    that."""
    import logging
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.rocm.report import problems_of
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the limit is not in the cache key
    attributes = rocm_build.kernel_attributes

    def tiny(mod):
        out = attributes(mod)
        for name, attrs in out.items():
            if name.startswith("rammer_rprogram"):
                attrs["amdgpu-num-vgpr"] = "32"
        return out

    monkeypatch.setattr(rocm_build, "kernel_attributes", tiny)
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        _, hsaco = _build(import_onnx(model))
    meta, _, names = _persistent(hsaco)
    spilled = [n for n in names if meta[n].scratch_bytes and meta[n].vgpr_spills]
    assert spilled and any("spills to scratch" in r.getMessage() and "rammer_rprogram0" in
                           r.getMessage() for r in caplog.records)
    program = {"code_object": meta[spilled[0]].as_dict(), "veu_threads": 64, "veus_per_sm": 1,
               "veus_per_cu_code_object": 1, "ordering": {"problems": []}}
    assert any("scratch" in p for p in problems_of(program))
    monkeypatch.setattr(rocm_build, "kernel_attributes", attributes)
    caplog.clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "unlimited"))
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        _, hsaco = _build(import_onnx(model))
    meta, _, names = _persistent(hsaco)
    assert all(meta[n].scratch_bytes == 0 for n in names)
    assert not any("spills to scratch" in r.getMessage() for r in caplog.records)
