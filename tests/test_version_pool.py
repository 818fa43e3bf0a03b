"""Versions made in worker processes are the versions made in process (tuning.version_pool)."""
import concurrent.futures as cf
import multiprocessing

import pytest
import tvm_ffi

from conftest_tir import TARGET
from test_versions import CASES, stashed_and_scheduled
from tvm_rammer.target import plain_target
from tvm_rammer.tuning.version_pool import VersionRequest, make_versions, make_versions_in_pool
from tvm_rammer.tuning.versions import func_key, unscheduled_funcs


def _requests():
    out = []
    for case in ("matmul", "conv2d", "gemv"):
        mod, gv = stashed_and_scheduled(*CASES[case])
        out.append(VersionRequest(f"{case}_{gv.name_hint}", TARGET, mod[gv],
                                  unscheduled_funcs(mod)[gv.name_hint],
                                  reference_target=plain_target(TARGET)))
    return out


def _same(made, here) -> list:
    """The differences between two MadeVersions (empty: the same)."""
    diffs = []
    if [v.name for v in made.versions] != [v.name for v in here.versions]:
        diffs.append("names")
    for a, b in zip(made.versions, here.versions):
        if func_key(a.func) != func_key(b.func) or a.source != b.source:
            diffs.append(f"{a.name}: func")
        la, lb = a.lowered, b.lowered
        if (la.grid, la.block, la.shared_bytes, la.has_sync, la.name) != \
                (lb.grid, lb.block, lb.shared_bytes, lb.has_sync, lb.name):
            diffs.append(f"{a.name}: launch")
        # the lowered body with its parameters and thread variables, as one function of them
        if not tvm_ffi.structural_equal([la.body, list(la.params), list(la.block_vars.values()),
                                         list(la.thread_vars.values())],
                                        [lb.body, list(lb.params), list(lb.block_vars.values()),
                                         list(lb.thread_vars.values())], map_free_vars=True):
            diffs.append(f"{a.name}: body")
        if la.thread_vars and not any(_uses(la.body, t) for t in la.thread_vars.values()):
            diffs.append(f"{a.name}: thread variables not the body's")
    if made.reference_key != here.reference_key:
        diffs.append("reference")
    return diffs


def _uses(body, var) -> bool:
    found = []
    tvm_ffi.structural_walk(body, (type(var), lambda v: found.append(v) if v.same_as(var) else None))
    return bool(found)


@pytest.fixture(scope="module")
def pool():
    workers = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    yield workers
    workers.shutdown(cancel_futures=True)


def test_versions_made_in_workers_are_those_made_here(pool):
    requests = _requests()
    made = make_versions_in_pool(requests, pool)
    for request in requests:
        here = make_versions(request)
        assert len(here.versions) > 1 and here.reference is not None
        assert _same(made[request.name], here) == [], request.name


def test_the_comparison_sees_a_different_version(pool):
    """The control: versions of another operator differ in the checks above."""
    matmul, conv = _requests()[:2]
    assert _same(make_versions(matmul), make_versions(conv)) != []


def test_what_a_failing_pool_did_not_make_is_left_to_the_caller():
    class Broken:
        def submit(self, fn, *args):
            raise RuntimeError("the pool is broken")

    requests = _requests()[:2]
    assert make_versions_in_pool(requests, Broken()) == {}

    def garbled(pool, fn, *args):  # answers that do not load
        future = cf.Future()
        future.set_result({"json": "not json", "versions": [], "reference_key": None})
        return future

    assert make_versions_in_pool(requests, object(), submit=garbled) == {}

    def late(pool, fn, *args):  # answers that never come: left out at the deadline
        return cf.Future()

    assert make_versions_in_pool(requests, object(), submit=late, within_s=0.5) == {}


class LendingDevice:
    """The fake device, lending ``pool`` for making versions (as a CudaDevice with enough build
    processes does); counts the requests it was lent for."""

    def __init__(self, pool, kernel_us):
        from fake_device import FakeDevice

        self.inner, self.pool, self.lent = FakeDevice(kernel_us=kernel_us), pool, 0

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def version_workers(self):
        def submit(pool, fn, *args):
            self.lent += 1
            if self.pool is None:  # a broken pool: every operator made in the compile's process
                raise RuntimeError("the pool is broken")
            return pool.submit(fn, *args)
        return self.pool or object(), submit


@pytest.mark.parametrize("broken", [False, True])
def test_a_compile_that_makes_versions_in_workers_chooses_what_one_making_them_here_does(
        pool, tmp_path, broken):
    from test_operator_records import MARGIN, TARGET as RAMMER, kernel_us
    from fake_device import FakeDevice
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.views.inspection import inspect_model
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.tuning.profile_db import open_profile_db
    from tvm_rammer.tuning.profiler import Profiler

    model = import_onnx(get_model("alexnet", **REDUCED["alexnet"]))
    lending = LendingDevice(None if broken else pool, kernel_us)
    summaries = []
    for i, device in enumerate((FakeDevice(kernel_us=kernel_us), lending)):
        profiler = Profiler(open_profile_db(str(tmp_path / f"db{i}.json")), device, "sm_90a",
                            margin=MARGIN)
        summaries.append(inspect_model(model, RAMMER, RammerConfig(), profiler))
    assert lending.lent == 1 if broken else lending.lent > 1  # asked; made in the workers
    assert summaries[0] == summaries[1]
    # and the same kernels measured: the records of both compiles, keyed by the versions' func_key
    import json
    first, second = (json.loads((tmp_path / f"db{i}.json").read_text()) for i in (0, 1))
    assert first == second and "kernel" in json.dumps(first)


def test_a_device_with_few_build_processes_lends_none():
    from tvm_rammer.host.gpu import DeviceId, LocalGPU
    from tvm_rammer.tuning.measure import VERSION_WORKERS_FROM, CudaDevice

    few = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90a")), TARGET, build_workers=2)
    many = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90a")), TARGET,
                      build_workers=VERSION_WORKERS_FROM)
    try:
        assert few.version_workers() == (None, None)
        assert many.version_workers()[0] is not None
    finally:
        few.close()
        many.close()
