"""The device timer: kernels built in a process pool, checked against TVM's default kernel, timed."""
import os

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from conftest_tir import TARGET, schedule, scheduled_kernel, single_op_module
from tvm_rammer.host.gpu import DeviceId, LocalGPU, local_gpu
from tvm_rammer.target import capped_target
from tvm_rammer.tuning.measure import CudaDevice, KernelJob, param_specs
from tvm_rammer.tuning.versions import func_key


def _only_kernel(op, *shapes, target=TARGET):
    mod = schedule(single_op_module(op, *shapes), target)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def test_param_specs_name_every_buffer():
    specs = param_specs(scheduled_kernel("matmul"))
    assert [s[1:] for s in specs] == [([128, 256], "float32"), ([256, 512], "float32"),
                                      ([128, 512], "float32")]


@pytest.mark.nvcc
def test_kernels_build_in_parallel_worker_processes_with_their_resources():
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=2)
    try:
        futures = [device._submit_build(scheduled_kernel(m), True) for m in ("matmul", "gemv", "add")]
        infos = [f.result(timeout=300) for f in futures]
    finally:
        device.close()
    assert all(info["registers"] > 0 and info["spills"] == 0 for info in infos)
    assert len({info["path"] for info in infos}) == 3


@T.prim_func(s_tir=True)
def _unprintable_kernel(a: T.Buffer((64,), "float32")):
    """A GPU kernel TVM's CUDA codegen cannot print (an LLVM intrinsic): its build fails."""
    T.func_attr({"tirx.is_scheduled": True})
    for i in T.thread_binding(64, thread="threadIdx.x"):
        with T.sblock("b"):
            v = T.axis.spatial(64, i)
            a[v] = T.call_llvm_pure_intrin("float32", "llvm.sqrt.f32", T.uint32(1), a[v])


def _recording(device, monkeypatch) -> dict:
    """Record every build job ``device`` submits: ``{"batch": [funcs...], "single": [func]}``."""
    jobs: dict = {"batch": [], "single": []}
    submit_batch, submit_build = device._submit_batch, device._submit_build
    monkeypatch.setattr(device, "_submit_batch", lambda chunk: jobs["batch"].append(
        [f for f, _ in chunk]) or submit_batch(chunk))
    monkeypatch.setattr(device, "_submit_build", lambda func, res: jobs["single"].append(func)
                        or submit_build(func, res))
    return jobs


@pytest.mark.nvcc
def test_kernels_build_in_batches_with_each_kernels_own_resources_and_failures(monkeypatch):
    """measure_kernels' builds: one library, link and nvcc per batch; each kernel keeps its own
    entry, registers and shared memory (the same as built alone), and a kernel that does not build
    (:func:`_unprintable_kernel`) fails alone: its batch's others are then built each as a job of
    its own, and the other batch is built whole."""
    kernels = [scheduled_kernel(m) for m in ("matmul", "gemv", "add")]
    broken = _unprintable_kernel
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1,
                        batch_size=4)
    try:
        alone = [device._submit_build(k, True).result(timeout=300) for k in kernels[:2]]
        jobs = _recording(device, monkeypatch)
        members = device._submit_batches([(kernels[0], True), (broken, True), (kernels[1], True),
                                          (kernels[2], False)])
        assert device.batches == 4 and device._count == 6  # at least two batches per process
        good = [device._build_result(members[i]) for i in (0, 2, 3)]
        with pytest.raises(Exception) as failed:
            device._build_result(members[1])
    finally:
        device.close()
    # the failing batch [matmul, broken]: each of its kernels rebuilt as a job of its own
    assert [[k.same_as(f) for f in b] for k, b in zip((kernels[0], kernels[1]), jobs["batch"])] \
        == [[True, False], [True, False]]
    assert len(jobs["single"]) == 2 and jobs["single"][0].same_as(kernels[0]) \
        and jobs["single"][1].same_as(broken)
    assert "llvm" in str(failed.value) and "timed out" not in str(failed.value)  # its own error
    assert good[0]["path"] != good[1]["path"] == good[2]["path"]  # alone; the whole other batch
    assert len({(g["path"], g["entry"]) for g in good}) == 3
    for built, single in zip(good[:2], alone):
        assert built["registers"] == single["registers"] > 0
        assert built["shared_bytes"] == single["shared_bytes"]
    assert "registers" not in good[2]  # asked without resources: none measured
    # the control: the broken kernel's batch does not build as a whole (each was built alone)
    with pytest.raises(Exception):
        tvm.tirx.build(tvm.IRModule({"a": kernels[0].with_attr("global_symbol", "a"),
                                     "b": broken.with_attr("global_symbol", "b")}),
                       tvm.target.Target(device._target_spec))


def _fake_build_device(monkeypatch, build_timeout_s: float):
    """A CudaDevice whose build processes run :mod:`fake_builds` (no TVM, no nvcc), started."""
    import fake_builds

    from tvm_rammer.tuning import measure

    monkeypatch.setattr(measure, "_build_worker", fake_builds.build)
    monkeypatch.setattr(measure, "_batch_build_worker", fake_builds.batch_build)
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1,
                        build_timeout_s=build_timeout_s)
    measure._submit(device._build_pool(), fake_builds.ready).result(timeout=120)
    return device


@pytest.mark.parametrize("hang", [True, False])
def test_a_kernel_that_hangs_its_batchs_build_times_out_alone(monkeypatch, hang):
    """A batch whose build hangs times out; its kernels are then built each as a job of its own
    with its own timeout: only the hanging one times out. The batch killed with the build
    processes is submitted again, whole. The control (no hang): every kernel from its batch."""
    import fake_builds

    kernels = [scheduled_kernel(m) for m in ("matmul", "gemv", "add")]
    if hang:
        kernels[1] = kernels[1].with_attr(fake_builds.HANG, 1)
    device = _fake_build_device(monkeypatch, build_timeout_s=10.0)
    try:
        jobs = _recording(device, monkeypatch)
        members = device._submit_batches([(k, True) for k in kernels])
        first = device._build_result(members[0])
        if hang:
            with pytest.raises(RuntimeError, match="timed out"):
                device._build_result(members[1])
        else:
            assert device._build_result(members[1])["path"] == first["path"]
        last = device._build_result(members[2])
    finally:
        device.close()
    assert len(jobs["batch"]) == (3 if hang else 2)
    assert [[f.same_as(k) for f, k in zip(b, kernels)] for b in jobs["batch"][:2]] == [[True, True], [False]]
    if hang:
        assert jobs["batch"][2][0].same_as(kernels[2])  # killed with the hung batch: again, whole
        assert [f.same_as(k) for f, k in zip(jobs["single"], kernels)] == [True, True]
        assert os.path.basename(first["path"]).startswith("k")  # built alone: its own library
    else:
        assert jobs["single"] == []
        assert os.path.basename(first["path"]).startswith("b")
    assert last["path"] != first["path"] and os.path.basename(last["path"]).startswith("b")


def test_a_failed_batch_past_the_deadline_builds_nothing_alone(monkeypatch):
    """A batch whose build failed, seen past the profiling deadline: BudgetSpent, and none of its
    kernels is submitted alone; the control: before the deadline each one is."""
    import concurrent.futures as cf
    import time

    from tvm_rammer.tuning.measure import BudgetSpent

    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1)
    singles = []

    def failed_batch(chunk):
        failed: cf.Future = cf.Future()
        failed.set_exception(RuntimeError("the batch does not build"))
        return failed

    def built(func, resources):
        singles.append(func)
        done: cf.Future = cf.Future()
        done.set_result({"path": f"k{len(singles)}", "entry": "e"})
        return done

    monkeypatch.setattr(device, "_submit_batch", failed_batch)
    monkeypatch.setattr(device, "_submit_build", built)
    try:
        funcs = [(f"f{i}", True) for i in range(4)]  # two batches of two
        late = device._submit_batches(funcs)
        with pytest.raises(BudgetSpent):
            device._build_result(late[0], deadline=time.monotonic() - 1.0)
        assert singles == []
        members = device._submit_batches(funcs)
        assert [device._build_result(m, deadline=time.monotonic() + 600.0)["path"]
                for m in members] == ["k1", "k2", "k3", "k4"]
    finally:
        device.close()
    assert singles == ["f0", "f1", "f2", "f3"]


def test_each_operators_reference_is_built_with_its_versions(monkeypatch):
    """measure_kernels' batches: operator A's reference comes right before A's versions (in their
    batch), then B's reference and versions; each version runs against its own reference."""
    import concurrent.futures as cf

    from tvm_rammer.tuning import measure

    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1,
                        batch_size=4)
    chunks, runs = [], []

    def submit_batch(chunk):
        chunks.append([f for f, _ in chunk])
        done: cf.Future = cf.Future()
        done.set_result([{"path": f"b{len(chunks)}", "entry": i} for i in range(len(chunk))])
        return done

    monkeypatch.setattr(device, "_submit_batch", submit_batch)
    monkeypatch.setattr(device, "_run", lambda fn, payload, deadline=None: runs.append(payload)
                        or {"valid": True, "error": 0.0, "kernel_us": 1.0})
    monkeypatch.setattr(measure, "param_specs", lambda func: [])
    jobs = [KernelJob(f"{op}{i}", f"{op}:{i}", f"{op}{i}", f"ref{op}", f"ref{op}", 1, operator=op)
            for op, n in (("A", 3), ("B", 2)) for i in range(n)]
    try:
        records = device.measure_kernels(jobs, lambda n: None)
    finally:
        device.close()
    assert chunks == [["refA", "A0", "A1", "A2"], ["refB", "B0", "B1"]]
    assert all(r["valid"] for r in records)
    assert [(r["path"], r["entry"], r["ref_path"], r["ref_entry"]) for r in runs] == \
        [("b1", 1, "b1", 0), ("b1", 2, "b1", 0), ("b1", 3, "b1", 0), ("b2", 1, "b2", 0),
         ("b2", 2, "b2", 0)]
    # the control: with every reference first (as before), A's first version waits for B's reference
    old = sorted({j.reference_key for j in jobs}) + [j.func for j in jobs]
    assert [old[:4], old[4:]] != chunks



def _jobs_with_default_versions() -> list:
    """Operator A: its dlight version is its reference (the same PrimFunc and key), then another
    version; operator B: another version first (B's reference becomes an item without
    resources), then its dlight version, its reference."""
    add, gemv, matmul, softmax = (scheduled_kernel(m) for m in ("add", "gemv", "matmul", "softmax"))
    return [KernelJob(func_key(add), "A:dlight", add, add, func_key(add), 1, operator="A", base=True),
            KernelJob(func_key(gemv), "A:other", gemv, add, func_key(add), 1, operator="A"),
            KernelJob(func_key(softmax), "B:other", softmax, matmul, func_key(matmul), 1,
                      operator="B"),
            KernelJob(func_key(matmul), "B:dlight", matmul, matmul, func_key(matmul), 1,
                      operator="B", base=True)]


def test_build_items_give_a_version_that_is_its_reference_one_item_with_resources():
    """measure_kernels' items: one per kernel key, each operator's reference right before its
    versions; a version whose key is its reference's shares the reference's item (and asks for
    its resources), whichever comes first. The control: other versions have items of their own."""
    from tvm_rammer.tuning.measure import _build_items

    jobs = _jobs_with_default_versions()
    items, builds = _build_items(jobs)
    assert [(f, res) for f, res in items] == [(jobs[0].func, True), (jobs[1].func, True),
                                              (jobs[2].reference, True), (jobs[2].func, True)]
    assert builds == [(0, 0), (1, 0), (3, 2), (2, 2)]
    # vice versa: a version built first is the reference of a later job with its key
    later = KernelJob("C", "C:v", "C", jobs[0].func, func_key(jobs[0].func), 1, operator="C")
    items, builds = _build_items([jobs[0], later])
    assert len(items) == 2 and builds == [(0, 0), (1, 0)]


class _FakeKernels:
    """``measure._load`` and ``measure._time`` of a runner without a GPU: each built kernel
    (path, entry) writes ones to its output; ``calls`` and ``timed`` list its runs and timings
    (a timing's result is its rank: 1.0, 2.0, ...)."""

    def __init__(self):
        self.calls, self.timed = [], []

    def load(self, path):
        kernels = self

        class Lib:
            def __getitem__(self, entry):
                def run(*args):
                    kernels.calls.append((path, entry))
                    out = args[-1]
                    out.copyfrom(np.ones([int(d) for d in out.shape], str(out.dtype)))
                return run
        lib = Lib()
        lib.path = path
        return lib

    def time(self, lib, dev, args, number, repeat, entry="rammer_measured"):
        self.timed.append((lib.path, entry))
        return float(len(self.timed))


def _fake_measure_device(monkeypatch):
    """A CudaDevice with :mod:`fake_builds` build processes whose runs are the real
    ``_run_kernel_worker`` in this process, on the CPU, with :class:`_FakeKernels`: (device,
    kernels, the run payloads)."""
    from tvm_rammer.tuning import measure

    device = _fake_build_device(monkeypatch, build_timeout_s=120.0)
    kernels, payloads = _FakeKernels(), []
    monkeypatch.setattr(measure, "_load", kernels.load)
    monkeypatch.setattr(measure, "_time", kernels.time)
    monkeypatch.setattr(measure, "_DEFAULT_US", {})
    monkeypatch.setattr(tvm, "cuda", tvm.cpu)
    monkeypatch.setattr(device, "_run", lambda fn, payload, deadline=None: payloads.append(payload)
                        or fn(payload))
    return device, kernels, payloads


def test_a_version_that_is_its_operators_default_kernel_is_built_and_run_once(monkeypatch):
    """A job whose version is its operator's default kernel (key == reference_key): one kernel
    built for both, with its resources; its run is not compared with itself and times it once
    (its default time the same: valid, error 0). The control: a version that differs is built
    alone and compared with its reference, each timed (the reference once for its operator)."""
    import fake_builds

    jobs = _jobs_with_default_versions()
    device, kernels, payloads = _fake_measure_device(monkeypatch)
    try:
        records = device.measure_kernels(jobs, lambda n: None)
    finally:
        device.close()
    assert device._count == 4 and device.batches == 2  # 4 kernels for 4 jobs (not 6)
    b1, b2 = (os.path.join(device._dir, f"b{i}.so") for i in (1, 2))
    e0, e1 = "rammer_measured_0000", "rammer_measured_0001"
    assert [(p["path"], p["entry"], p["ref_path"], p["ref_entry"]) for p in payloads] == \
        [(b1, e0, b1, e0), (b1, e1, b1, e0), (b2, e1, b2, e0), (b2, e0, b2, e0)]
    # A:dlight timed once, A:other against it (its time cached), B's reference and B:other,
    # B:dlight from that cache: each kernel timed once, only the other versions compared
    assert kernels.timed == [(b1, e0), (b1, e1), (b2, e0), (b2, e1)]
    assert kernels.calls == [(b1, e1), (b1, e0), (b2, e1), (b2, e0)]
    assert [r["registers"] for r in records] == [fake_builds.REGISTERS] * 4
    assert all(r["valid"] is True and r["error"] == 0.0 and r["tolerance"] > 0 for r in records)
    assert [(r["kernel_us"], r["default_us"]) for r in records] == \
        [(1.0, 1.0), (2.0, 1.0), (4.0, 3.0), (3.0, 3.0)]


def test_the_record_of_a_version_that_is_its_reference_is_the_reference_record(monkeypatch):
    """Profiler.prepare: the record of a version that is its operator's default kernel is the one
    record under that key (the version's: valid, error 0, kernel_us == default_us), not a
    second reference record; the control: an operator whose versions all differ from its
    reference gets a reference record (its default time) besides its versions' records."""
    from tvm_rammer.tuning.profile_db import JsonProfileDB
    from tvm_rammer.tuning.profiler import Profiler

    jobs = _jobs_with_default_versions()[:2]  # A: dlight (its reference) and another version
    matmul, softmax = scheduled_kernel("matmul"), scheduled_kernel("softmax")
    jobs.append(KernelJob(func_key(softmax), "C:other", softmax, matmul, func_key(matmul), 1,
                          operator="C"))
    device, kernels, _ = _fake_measure_device(monkeypatch)
    db, puts = JsonProfileDB(), []
    put_many = db.put_many
    monkeypatch.setattr(db, "put_many", lambda items: puts.extend(items) or put_many(items))
    try:
        Profiler(db, device, "sm_90a", progress=False).prepare(jobs)
    finally:
        device.close()
    written = [(key, record) for kind, key, _, record in puts if kind == "kernel"]
    assert [key for key, _ in written] == [jobs[0].key, jobs[1].key, jobs[2].key,
                                           jobs[2].reference_key]
    default, other, _, reference = (record for _, record in written)
    assert default["valid"] is True and default["error"] == 0.0 and "reference" not in default
    assert default["kernel_us"] == default["default_us"] == other["default_us"]
    assert reference == {"kernel_us": written[2][1]["default_us"], "valid": True, "error": 0.0,
                         "reference": True}
    assert db.get("kernel", jobs[0].key, device.id) == default

@pytest.mark.nvcc
def test_a_batch_whose_nvcc_fails_compiles_each_kernels_resources_alone(monkeypatch, tmp_path):
    """The batch's one ``nvcc -Xptxas -v`` fails: each kernel's resources are compiled on its own
    (the same numbers as the one nvcc gives), and a kernel whose own compile fails has its own
    resources_error while the others keep their numbers."""
    from tir_templates import cuda_resources
    from tvm_rammer.tuning import measure

    names = ["rammer_measured_0000", "rammer_measured_0001", "rammer_measured_0002"]
    kernels = [scheduled_kernel(m) for m in ("matmul", "gemv", "add")]
    mod = tvm.IRModule({n: k.with_attr("global_symbol", n) for n, k in zip(names, kernels)})
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET)
    device.close()

    def batch(name):
        return measure._batch_build_worker(tvm.ir.save_json(mod), device._target_spec,
                                           str(tmp_path / name), names[:2])

    whole = batch("whole.so")  # the control: one nvcc for the batch

    def fails(*args):
        raise cuda_resources.CudaCompileError("nvcc failed (1)")

    monkeypatch.setattr(cuda_resources, "compile_cuda_resources_per_kernel", fails)
    each = batch("each.so")
    compile_one = cuda_resources.compile_cuda_resources
    monkeypatch.setattr(cuda_resources, "compile_cuda_resources", lambda source, arch: fails()
                        if names[1] in source else compile_one(source, arch))
    one_fails = batch("one_fails.so")
    for got in (whole, each):
        assert [g["registers"] > 0 for g in got[:2]] == [True, True] and "registers" not in got[2]
    assert [(e["registers"], e["shared_bytes"], e["spills"]) for e in each[:2]] == \
        [(w["registers"], w["shared_bytes"], w["spills"]) for w in whole[:2]]
    assert one_fails[0]["registers"] == whole[0]["registers"] and "resources_error" not in one_fails[0]
    assert "nvcc failed" in one_fails[1]["resources_error"] and "registers" not in one_fails[1]


class _Nvcc:
    """Counts the nvcc runs of a build: the module's own (``cuda_compile.nvcc_with_log``, what a
    GPU host's build runs with nvcc) and the separate resource compiles."""

    def __init__(self, monkeypatch):
        from tir_templates import cuda_resources
        from tvm_rammer.host import cuda_compile

        self.module, self.resources = 0, 0
        with_log, per_kernel, alone = (cuda_compile.nvcc_with_log,
                                       cuda_resources.compile_cuda_resources_per_kernel,
                                       cuda_resources.compile_cuda_resources)

        def module(*args):
            self.module += 1
            return with_log(*args)

        def resources(compile_):
            def counted(*args):
                self.resources += 1
                return compile_(*args)
            return counted

        monkeypatch.setattr(cuda_compile, "nvcc_with_log", module)
        monkeypatch.setattr(cuda_resources, "compile_cuda_resources_per_kernel", resources(per_kernel))
        monkeypatch.setattr(cuda_resources, "compile_cuda_resources", resources(alone))


@pytest.mark.nvcc
def test_a_batch_compiled_as_on_a_gpu_host_reads_its_resources_from_that_one_nvcc_run(
        monkeypatch, tmp_path):
    """With its module compiled as a GPU host compiles it (TVM's nvcc command, ptxas -v among its
    flags), a batch's resources come from that nvcc run: one nvcc per batch, not two. Control:
    without the module compile (TVM keeps the source on this CPU machine), one resource compile."""
    from tvm_rammer.tuning import measure

    names = ["rammer_measured_0000", "rammer_measured_0001", "rammer_measured_0002"]
    kernels = [scheduled_kernel(m) for m in ("matmul", "gemv", "add")]
    mod = tvm.IRModule({n: k.with_attr("global_symbol", n) for n, k in zip(names, kernels)})
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET)
    device.close()
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")  # as gpu_check.sh: nvcc is the compiler
    nvcc = _Nvcc(monkeypatch)
    once = measure._batch_build_worker(tvm.ir.save_json(mod), device._target_spec,
                                       str(tmp_path / "once.so"), names[:2], True)
    assert (nvcc.module, nvcc.resources) == (1, 0)
    assert [g["registers"] > 0 for g in once[:2]] == [True, True] and "registers" not in once[2]
    assert all(g["spills"] == 0 and g["shared_bytes"] >= 0 for g in once[:2])
    before = measure._batch_build_worker(tvm.ir.save_json(mod), device._target_spec,
                                         str(tmp_path / "source.so"), names[:2])
    assert (nvcc.module, nvcc.resources) == (1, 1)  # the control: TVM compiled nothing here
    assert [b["registers"] > 0 for b in before[:2]] == [True, True]
    one = measure._build_worker(tvm.ir.save_json(tvm.IRModule({measure.ENTRY: kernels[0].with_attr(
        "global_symbol", measure.ENTRY)})), device._target_spec, str(tmp_path / "one.so"), True, True)
    assert (nvcc.module, nvcc.resources) == (2, 1) and one["registers"] > 0
    # where NVRTC is the compiler, its build keeps no log: the resources are compiled apart
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvrtc")
    nvrtc = measure._batch_build_worker(tvm.ir.save_json(mod), device._target_spec,
                                        str(tmp_path / "nvrtc.so"), names[:2])
    assert (nvcc.module, nvcc.resources) == (2, 2) and nvrtc[0]["registers"] > 0


@pytest.mark.nvcc
def test_an_operators_versions_and_its_reference_build_whole_as_one_library():
    """The batches measure_kernels makes hold an operator's versions with TVM's default kernel for
    it (kernels made from one PrimFunc, sharing its parameters): such a batch builds whole, one
    library for all (a fallback to kernel-by-kernel builds would give each its own)."""
    from test_versions import CASES, stashed_and_scheduled
    from tir_templates.default_schedule import schedule_like_default
    from tvm_rammer.target import plain_target
    from tvm_rammer.tuning.versions import kernel_versions, unscheduled_funcs

    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    unscheduled = unscheduled_funcs(mod)[gv.name_hint]
    made = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv], unscheduled=unscheduled)[:3]
    reference = schedule_like_default(unscheduled, plain_target(TARGET))
    assert len(made) == 3 and reference is not None
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1)
    try:
        items = device._submit_batch([(reference, False)] + [(v.func, True) for v in made]) \
            .result(timeout=300)
    finally:
        device.close()
    assert not any("error" in item for item in items)
    assert len({item["path"] for item in items}) == 1 and len({item["entry"] for item in items}) == 4
    assert all(item["registers"] > 0 for item in items[1:])


@pytest.mark.gpu
def test_a_version_that_computes_something_else_is_invalid_and_a_right_one_valid():
    gpu = local_gpu()
    add = _only_kernel(relax.op.add, (128, 512), (128, 512))
    sub = _only_kernel(relax.op.subtract, (128, 512), (128, 512))
    # the same add scheduled with 64 threads a block: another kernel, the same result
    add64 = _only_kernel(relax.op.add, (128, 512), (128, 512), target=capped_target(TARGET, 64))
    assert func_key(add64) != func_key(add)
    device = CudaDevice(gpu, TARGET)
    try:
        right, other, wrong = device.measure_kernels(
            [KernelJob(func_key(add), "add:dlight", add, add, func_key(add), 1),
             KernelJob(func_key(add64), "add:t64", add64, add, func_key(add), 1),
             KernelJob(func_key(sub), "add:sub", sub, add, func_key(add), 1)], lambda n: None)
        built = device._count
    finally:
        device.close()
    assert built == 3  # add (the right version is its reference: one build), add64 and sub
    assert right["valid"] is True and right["error"] == 0.0 and right["kernel_us"] > 0
    assert right["default_us"] == right["kernel_us"]  # the default kernel, timed once
    assert other["valid"] is True and other["error"] <= other["tolerance"]  # compared for real
    assert wrong["default_us"] == right["default_us"]  # and not again as sub's reference
    assert wrong["valid"] is False and "relative error" in wrong["reason"]


@pytest.mark.gpu
def test_the_cache_of_a_gpu_compile_is_reused_by_the_next(tmp_path):
    """Two compiles of one model on the GPU: the second measures nothing (records from the cache)."""
    from tvm_rammer.driver.backend import make_profiler
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.target import resolve_target

    mod = import_onnx(get_model("alexnet", **REDUCED["alexnet"]))
    config = RammerConfig(profile_db=os.path.join(tmp_path, "cache.sqlite"))
    target = resolve_target("rammer/nvidia-h100")
    first = make_profiler(target, config)
    lower(mod, target, config, first)
    assert first.counts["profiled"] > 0
    second = make_profiler(target, config)
    lower(mod, target, config, second)
    assert second.counts["profiled"] == 0 and second.counts["database"] > 0
