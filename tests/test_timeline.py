"""The per-vEU timeline: predicted simulation, decoding of a measured buffer, the Perfetto trace and the
PNG, the instrumented kernel and the run that returns its buffers (GPU)."""

import json
import random
import sys
from collections import defaultdict

import numpy as np
import pytest

from tvm_rammer.scheduling import timeline
from tvm_rammer.views import timeline_view
from tvm_rammer.config import RammerConfig
from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, RProgramPlan, schedule
from tvm_rammer.abstractions.rprogram import RProgram
from tvm_rammer.abstractions.rtask import RKernel, ROperator, RTask
from tvm_rammer.abstractions.vdevice import VDevice

EPS = 1e-6


def _op(uid, rtasks, time_us, name=None):
    return ROperator(uid, name or f"op{uid}", [RKernel(f"{name or f'op{uid}'}:v1#abcd", rtasks, 128,
                                                       32, 0, time_us, "test")])


def figure9_schedule(barrier_us=0.5):
    """Paper Figure 9: Matmul (op 0, 1 us rTasks) on vEU 0, Relu (op 1, 0.5 us) x4 on vEU 1, then
    Conv (op 2, 2 us) rTask 0 on vEU 0 and rTask 1 on vEU 1, each after a barrier-rTask."""
    p = RProgram(2)
    mm = [RTask(0, i) for i in range(2)]
    relu = [RTask(1, i) for i in range(4)]
    for t in mm:
        p.append(t, 0)
    for t in relu:
        p.append(t, 1)
    for veu in (0, 1):
        p.wait(RTask(2, veu), mm + relu)
        p.append(RTask(2, veu), veu)
    graph = OpGraph({0: _op(0, 2, 1.0, "matmul"), 1: _op(1, 4, 0.5, "relu"), 2: _op(2, 2, 2.0, "conv")},
                    {2: [0, 1]}, [[0, 1], [2]])
    plan = RProgramPlan(p, [0, 1, 2], {0: 0, 1: 0, 2: 0}, {}, veus_per_sm=1, num_veus=2,
                        predicted_us=0.0)
    return timeline.schedule_of(0, "rammer_rprogram0", plan, graph, 2, num_sms=2,
                                config=RammerConfig(barrier_us=barrier_us))


def test_predicted_figure9_times_are_the_queue_simulation():
    (t,) = timeline.predict_all([figure9_schedule(barrier_us=0.5)])
    got = {(s.veu, s.order): (s.kind, s.start_us, s.end_us) for s in t.slices}
    assert got[(0, 0)] == ("rtask", 0.0, 1.0) and got[(0, 1)] == ("rtask", 1.0, 2.0)
    assert got[(1, 3)] == ("rtask", 1.5, 2.0)            # the 4th relu ends at 2.0
    assert got[(0, 2)] == ("barrier", 2.0, 2.5)          # vEU 0 waits for it: 2.0 + barrier_us
    assert got[(0, 3)] == ("rtask", 2.5, 4.5)
    assert got[(1, 4)] == ("barrier", 2.0, 2.5)          # vEU 1 waits for matmul 1 (ends 2.0)
    assert got[(1, 5)] == ("rtask", 2.5, 4.5)
    assert t.span_us == pytest.approx(4.5)
    task = next(s for s in t.slices if s.kind == "rtask" and s.op == 2 and s.rtask_id == 1)
    assert (task.name, task.version, task.veu) == ("conv", "v1#abcd", 1)


def test_a_barrier_whose_producers_already_ended_takes_no_time():
    schedule_ = figure9_schedule()
    schedule_["ops"]["1"]["rtask_us"] = 0.1  # relu ends long before vEU 0 reaches its barrier
    (t,) = timeline.predict_all([schedule_])
    barrier = next(s for s in t.slices if (s.veu, s.order) == (0, 2))
    assert barrier.start_us == barrier.end_us == pytest.approx(2.0)


def test_shares_split_the_span_into_busy_wait_and_idle():
    (t,) = timeline.predict_all([figure9_schedule(barrier_us=0.5)])
    found = timeline.shares(t)
    veu0, veu1 = found["veus"]
    assert veu0["busy"] == pytest.approx(4.0 / 4.5, abs=1e-4)   # 2 x 1 us + 2 us
    assert veu0["wait"] == pytest.approx(0.5 / 4.5, abs=1e-4)
    assert veu1["busy"] == pytest.approx(4.0 / 4.5, abs=1e-4)   # 4 x 0.5 us + 2 us
    for v in found["veus"]:
        assert v["busy"] + v["wait"] + v["idle"] == pytest.approx(1.0, abs=1e-3)
    assert (found["rtasks"], found["barriers"]) == (8, 2)


def test_a_cyclic_schedule_is_rejected_not_simulated_forever():
    schedule_ = figure9_schedule()
    schedule_["prog"][0].insert(0, ["barrier", [[1, 5]]])  # vEU 0 waits first for vEU 1's conv
    with pytest.raises(ValueError, match="never complete"):
        timeline.predict(schedule_)


def _random_graph(rng, num_ops):
    ops, preds, waves, wave_of = {}, {}, [], {}
    for uid in range(num_ops):
        candidates = list(range(uid))
        chosen = rng.sample(candidates, k=min(len(candidates), rng.randint(0, 2)))
        level = 1 + max((wave_of[p] for p in chosen), default=-1)
        wave_of[uid] = level
        while len(waves) <= level:
            waves.append([])
        waves[level].append(uid)
        preds[uid] = chosen
        ops[uid] = _op(uid, rng.randint(1, 40), rng.uniform(0.5, 5.0))
    return OpGraph(ops, preds, waves)


@pytest.mark.parametrize("seed", range(6))
def test_predicted_timeline_keeps_the_schedule_invariants_and_the_policy_bound(seed):
    rng = random.Random(seed)
    graph = _random_graph(rng, 12)
    vdevice = VDevice.for_arch("sm_90", num_sms=4)
    config = RammerConfig(barrier_us=0.8)
    plans = schedule(graph, vdevice, PolicyConfig(max_veus=16))
    schedules = [timeline.schedule_of(k, f"rammer_rprogram{k}", plan, graph, plan.num_veus,
                                      vdevice.num_sms, config) for k, plan in enumerate(plans)]
    timelines = timeline.predict_all(schedules)
    for plan, t in zip(plans, timelines):
        # never later than the policy's own (per-operator, pessimistic) timeline
        assert t.span_us <= plan.predicted_us + EPS
    _check_trace(json.loads(json.dumps(timeline_view.trace_events(timelines))), _barriers(schedules))


def _barriers(schedules) -> dict:
    return {s["kernel"]: sum(item[0] == "barrier" for q in s["prog"] for item in q) for s in schedules}


def _check_trace(trace, barriers: dict, source="predicted"):
    """What a trace must show, read from the trace alone (its operator tables in ``otherData``)
    and the barrier-rTask count of each kernel: one slice per rTask and per barrier-rTask, no
    overlap on a vEU, every rTask starting after the rTasks of its predecessor operators ended."""
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["source"] == source]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    kernels = {k["kernel"]: k["operators"] for k in trace["otherData"]["kernels"] if k["source"] == source}
    assert set(kernels) == set(barriers)
    tasks = [e for e in slices if e["cat"] == "rtask"]
    for kernel, ops in kernels.items():
        mine = [e for e in tasks if e["args"]["kernel"] == kernel]
        want = sorted((int(op), i) for op, info in ops.items() for i in range(info["rtasks"]))
        assert sorted((e["args"]["op"], e["args"]["rtask_id"]) for e in mine) == want
        assert sum(e["cat"] == "barrier" and e["args"]["kernel"] == kernel for e in slices) == barriers[kernel]
        for e in mine:
            info = ops[str(e["args"]["op"])]
            assert e["args"]["operator"] == info["name"] and e["args"]["version"] == info["version"]
    tracks = defaultdict(list)
    for e in slices:
        assert names[(e["pid"], None)] == f"{source} SM {e['args']['SM']}"
        assert names[(e["pid"], e["tid"])] == f"vEU {e['args']['vEU']}"
        tracks[(e["args"]["kernel"], e["args"]["vEU"])].append(e)
    for track in tracks.values():
        track.sort(key=lambda e: e["args"]["order"])
        assert [e["args"]["order"] for e in track] == list(range(len(track)))
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{a} overlaps {b}"
    ends = defaultdict(float)
    for e in tasks:
        ends[e["args"]["op"]] = max(ends[e["args"]["op"]], e["ts"] + e["dur"])
    preds = {int(op): info["preds"] for ops in kernels.values() for op, info in ops.items()}
    for e in tasks:
        for p in preds[e["args"]["op"]]:
            assert e["ts"] >= ends[p] - 1e-3, f"op {e['args']['op']} starts before its input op {p} ends"
    return slices


def _synthetic_buffer(schedule_, t0=10_000_000, sm_of=lambda v: 7 * v):
    """What an instrumented run of ``schedule_`` would record: the predicted times, in ns."""
    (t,) = timeline.predict_all([schedule_])
    by_pos = {(s.veu, s.order): s for s in t.slices}
    words = []
    for veu, queue in enumerate(schedule_["prog"]):
        for order in range(len(queue)):
            s = by_pos[(veu, order)]
            words += [t0 + int(s.start_us * 1000) + 1, t0 + int(s.end_us * 1000) + 1, sm_of(veu)]
    return np.array(words, dtype=np.int64)


def test_decode_reads_a_synthetic_buffer_in_table_order():
    schedule_ = figure9_schedule()
    buffer = _synthetic_buffer(schedule_)
    (measured,) = timeline.decode_all([schedule_], {"rammer_rprogram0": buffer})
    assert measured.source == "measured" and len(measured.slices) == 8 + 2
    got = {(s.veu, s.order): s for s in measured.slices}
    assert got[(0, 3)].kind == "rtask" and (got[(0, 3)].op, got[(0, 3)].rtask_id) == (2, 0)
    assert got[(0, 3)].start_us == pytest.approx(2.5) and got[(0, 3)].end_us == pytest.approx(4.5)
    assert got[(1, 4)].kind == "barrier" and got[(1, 4)].waits == ((0, 1),)
    assert {s.sm for s in measured.slices if s.veu == 1} == {7}
    trace = timeline_view.trace_events([measured])
    _check_trace(json.loads(json.dumps(trace)), _barriers([schedule_]), source="measured")


def test_decode_rejects_a_wrong_or_unwritten_buffer():
    schedule_ = figure9_schedule()
    buffer = _synthetic_buffer(schedule_)
    with pytest.raises(ValueError, match="does not match its 10 instructions x 3 words"):
        timeline.decode(schedule_, buffer[:-3])
    buffer[3 * 4: 3 * 4 + 3] = 0  # instruction 4 (vEU 1, order 0) never ran
    with pytest.raises(ValueError, match="instruction 4 .* was not recorded"):
        timeline.decode(schedule_, buffer)
    with pytest.raises(ValueError, match="no timeline buffer for"):
        timeline.decode_all([schedule_], {})
    with pytest.raises(ValueError, match="schedules_of"):
        timeline.predict({"prog": []})


def test_in_context_records_are_per_rkernel_and_marked():
    schedule_ = figure9_schedule()
    measured = timeline.decode_all([schedule_], {"rammer_rprogram0": _synthetic_buffer(schedule_)})
    records = timeline.in_context_records(measured, [schedule_])
    assert set(records) == {"matmul:v1#abcd", "relu:v1#abcd", "conv:v1#abcd"}
    relu = records["relu:v1#abcd"]
    assert relu["in_context"] is True and relu["count"] == 4
    assert relu["rtask_us"] == pytest.approx(0.5, abs=2e-3) and relu["predicted_rtask_us"] == 0.5
    with pytest.raises(ValueError, match="come from measured timelines"):
        timeline.in_context_records(timeline.predict_all([schedule_]), [schedule_])


def test_in_context_records_go_to_the_profile_db_under_their_own_kind(tmp_path):
    from tvm_rammer.host.gpu import DeviceId
    from tvm_rammer.tuning.profile_db import open_profile_db

    schedule_ = figure9_schedule()
    measured = timeline.decode_all([schedule_], {"rammer_rprogram0": _synthetic_buffer(schedule_)})
    device = DeviceId("NVIDIA H100 80GB HBM3", "sm_90", "580.00")
    db = open_profile_db(str(tmp_path / "p.json"))
    db.put_many([("in_context", k, device, r)
                 for k, r in timeline.in_context_records(measured, [schedule_]).items()])
    db.close()
    again = open_profile_db(str(tmp_path / "p.json"), readonly=True)
    assert again.get("in_context", "conv:v1#abcd", device)["in_context"] is True
    assert again.get("kernel", "conv:v1#abcd", device) is None  # kernel records stay per version


def test_trace_groups_veus_by_sm_and_keeps_sources_apart():
    schedule_ = figure9_schedule()
    predicted = timeline.predict_all([schedule_])
    measured = timeline.decode_all([schedule_], {"rammer_rprogram0": _synthetic_buffer(schedule_)})
    trace = json.loads(json.dumps(timeline_view.trace_events(predicted + measured)))
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {"predicted SM 0", "predicted SM 1", "measured SM 0", "measured SM 7"}
    assert trace["displayTimeUnit"] == "ns"
    barrier = next(e for e in trace["traceEvents"] if e.get("cat") == "barrier")
    assert barrier["name"] == "barrier-rTask" and barrier["args"]["waits"]


def test_png_labels_tracks_and_stays_readable_at_528_veus(tmp_path):
    pytest.importorskip("matplotlib")
    rng = random.Random(0)
    graph = _random_graph(rng, 10)
    vdevice = VDevice.for_arch("sm_90")  # 132 SMs x 4 = 528 vEUs
    plans = schedule(graph, vdevice, PolicyConfig(max_veus=528))
    program = RProgram(528)
    for veu in range(528):  # every vEU busy: one rTask each of a wide operator
        program.append(RTask(100, veu), veu)
    wide = OpGraph({100: _op(100, 528, 3.0, "wide")}, {}, [[100]])
    plan = RProgramPlan(program, [100], {100: 0}, {}, veus_per_sm=4, num_veus=528, predicted_us=3.0)
    schedules = [timeline.schedule_of(0, "rammer_rprogram0", plan, wide, 528, 132, RammerConfig())]
    schedules += [timeline.schedule_of(1 + i, f"rammer_rprogram{1 + i}", p, graph, p.num_veus, 132,
                                       RammerConfig()) for i, p in enumerate(plans)]
    timelines = timeline.predict_all(schedules)
    fig = timeline_view.plot(timelines)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels and all(label.startswith("SM ") for label in labels)
    assert len(labels) <= ax.get_window_extent().height / 8  # 6-point labels, no overlap
    small = timeline_view.plot(timeline.predict_all([figure9_schedule()]))
    assert [t.get_text() for t in small.axes[0].get_yticklabels()] == ["vEU 0 (SM 0)", "vEU 1 (SM 1)"]
    png = timeline_view.write_png(str(tmp_path / "t.png"), timelines)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        timeline_view.plot(timeline.predict_all([figure9_schedule()]))


def test_output_paths_drop_a_given_extension():
    assert timeline_view.output_paths("out/t") == ("out/t.json", "out/t.png")
    assert timeline_view.output_paths("t.json") == ("t.json", "t.png")
    assert timeline_view.output_paths("t.v2") == ("t.v2.json", "t.v2.png")
    with pytest.raises(ValueError, match="no rProgram"):
        timeline_view.write("t", [])


# --- on models: inspect --timeline (CPU) ----------------------------------------------------------

@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    from tvm_rammer.cli import main
    from tvm_rammer.models import REDUCED

    folder = tmp_path_factory.mktemp("models")
    params = {"branches": ["n=16"],  # the 16-branch demo model, full size
              "nasbench_cell": [f"{k}={v}" for k, v in REDUCED["nasbench_cell"].items()]}
    paths = {}
    for name, values in params.items():
        paths[name] = folder / f"{name}.onnx"
        args = ["model", name, "-o", str(paths[name])]
        for value in values:
            args += ["--param", value]
        assert main(args) == 0
    return paths


@pytest.mark.parametrize("name", ["branches", "nasbench_cell"])
def test_inspect_timeline_writes_a_trace_that_parses_back_and_a_png(name, model_files, tmp_path,
                                                                    capsys):
    pytest.importorskip("matplotlib")
    from tvm_rammer.cli import main

    out = tmp_path / f"{name}_timeline"
    assert main(["inspect", str(model_files[name]), "--timeline", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert f"wrote {out}.json" in captured.err
    trace = json.loads((tmp_path / f"{name}_timeline.json").read_text())
    barriers = {p["kernel"]: p["barriers"] for p in summary["programs"]}
    slices = _check_trace(trace, barriers)
    assert len(slices) == sum(summary["rtasks"]) + sum(barriers.values())
    assert len(summary["timeline"]) == summary["rprograms"]
    for program, found in zip(summary["programs"], summary["timeline"]):
        assert found["kernel"] == program["kernel"] and found["rtasks"] == program["rtasks"]
        assert len(found["veus"]) == program["num_veus"]
        for veu in found["veus"]:
            assert veu["busy"] + veu["wait"] + veu["idle"] == pytest.approx(1.0, abs=2e-3)
        assert 0 < found["busy"] <= 1
    with open(tmp_path / f"{name}_timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_inspect_timeline_text_mode_prints_the_shares(model_files, tmp_path, capsys):
    from tvm_rammer.cli import main

    pytest.importorskip("matplotlib")
    assert main(["inspect", str(model_files["branches"]), "--timeline", str(tmp_path / "t.png")]) == 0
    text = capsys.readouterr().out
    assert "rPrograms:" in text and "predicted rammer_rprogram0:" in text and "in barrier-rTasks" in text
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.png").exists()


def test_run_timeline_without_a_gpu_says_not_measured(model_files, capsys):
    from tvm_rammer.cli import main
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is visible: the measured timeline is tested in test_measured_timeline_*")
    assert main(["run", str(model_files["nasbench_cell"]), "--timeline", "x"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    from tvm_rammer.run import runner
    with pytest.raises(ValueError, match="not measured"):
        runner.run_timeline(str(model_files["nasbench_cell"]), "rammer/nvidia-h100")
    assert main(["run", str(model_files["nasbench_cell"]), "--record-in-context"]) == 2
    assert "add --timeline" in capsys.readouterr().err


# --- the instrumented build -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def instrumented():
    """The 4-branch model lowered twice: plain and with RammerConfig(timeline=True)."""
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import get_model

    mod = import_onnx(get_model("branches", n=4))
    return {flag: lower(mod, "rammer/nvidia-h100", RammerConfig(timeline=flag, profile=False))
            for flag in (False, True)}


def _persistent(mod):
    import tvm

    ((name, func),) = [(gv.name_hint, f) for gv, f in mod.functions_items()
                       if isinstance(f, tvm.tirx.PrimFunc) and "rammer.report" in (f.attrs or {})]
    return name, func


def _source(mod):
    import tvm_rammer
    from tvm_rammer.codegen.resources import cuda_source

    name, func = _persistent(mod)
    return cuda_source(func.with_attr("global_symbol", name), tvm_rammer.rammer_target("rammer/nvidia-h100"))


def test_instrumentation_only_adds_the_recording(instrumented):
    import difflib

    plain, timed = _source(instrumented[False]), _source(instrumented[True])
    assert "rammer_record(" not in plain and "rammer_timeline" not in plain
    diff = [line for line in difflib.ndiff(plain.splitlines(), timed.splitlines())
            if line[:1] in "+-"]
    removed = [line for line in diff if line.startswith("-")]
    assert len(removed) == 2 and all("__global__" in line for line in removed)  # the signature
    added = "\n".join(line[2:] for line in diff if line.startswith("+"))
    assert "int64_t* __restrict__ rammer_timeline" in added
    assert "%%globaltimer" in added and "%%smid" in added
    kernel = timed[timed.index("extern \"C\" __global__"):]
    kinds = plain.count("if ((kind == ")
    assert kinds >= 2 and kernel.count("rammer_record(") == kinds  # once per instruction kind
    # the end of an awaited rTask is recorded before its step is published
    for case in kernel.split("rammer_signal(")[:-1]:
        assert "rammer_record(" in case[case.rfind("__syncthreads()"):]


@pytest.mark.nvcc
def test_instrumented_kernel_compiles_for_sm90a(instrumented):
    from tir_templates.cuda_resources import compile_cuda_resources

    timed = compile_cuda_resources(_source(instrumented[True]), "sm_90a")
    assert 0 < timed["registers"] <= 255 and timed["spills"] < 1024


def test_main_returns_one_timeline_buffer_per_rprogram(instrumented):
    import tvm
    from relay_passes.return_timelines import TIMELINE_KERNELS_ATTR

    plain, timed = instrumented[False], instrumented[True]
    name, func = _persistent(timed)
    (schedule_,) = timeline.schedules_of(timed)
    words = 3 * sum(len(q) for q in schedule_["prog"])
    assert int(func.attrs["rammer.timeline_words"]) == words
    assert json.loads(str(timed.attrs[TIMELINE_KERNELS_ATTR])) == [name]
    ret = timed["main"].ret_ty
    assert isinstance(ret, tvm.ir.TupleType) and len(ret.fields) == 2
    (buffer,) = ret.fields[1].fields
    assert [int(d) for d in buffer.shape] == [words] and str(buffer.dtype) == "int64"
    tvm.ir.assert_structural_equal(ret.fields[0], plain["main"].ret_ty)
    assert "rammer.timeline_words" not in (_persistent(plain)[1].attrs or {})
    assert timeline.schedules_of(plain) == [schedule_]  # same schedule, instrumented or not


def test_the_instrumented_build_compiles_end_to_end():
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.models import get_model
    from tvm_rammer.run.runner import build_timeline

    executable, schedules, names = build_timeline(import_onnx(get_model("branches", n=4)),
                                                  "rammer/nvidia-h100", RammerConfig(profile=False))
    assert names == [s["kernel"] for s in schedules] == ["rammer_rprogram0"]
    sources = [m.inspect_source() for m in executable.mod.imports[0].imports if m.kind == "cuda"]
    assert sources and "rammer_record(" in sources[0]


def test_return_timelines_before_expected():
    import tvm
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script import tirx as T

    from relay_passes.return_timelines import ReturnTimelines

    @I.ir_module
    class Before:
        @T.prim_func
        def kern(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32"),
                 t: T.Buffer((6,), "int64")):
            T.func_attr({"rammer.timeline_words": 6})
            for i in range(4):
                y[i] = x[i]
            for i in range(6):
                t[i] = T.int64(0)

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            cls = Before
            with R.dataflow():
                lv = R.call_tir(cls.kern, (x,), out_ty=[R.Tensor((4,), "float32"),
                                                         R.Tensor((6,), "int64")])
                y = lv[0]
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @T.prim_func
        def kern(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32"),
                 t: T.Buffer((6,), "int64")):
            T.func_attr({"rammer.timeline_words": 6})
            for i in range(4):
                y[i] = x[i]
            for i in range(6):
                t[i] = T.int64(0)

        @R.function
        def main(x: R.Tensor((4,), "float32")):
            cls = Expected
            with R.dataflow():
                lv = R.call_tir(cls.kern, (x,), out_ty=[R.Tensor((4,), "float32"),
                                                         R.Tensor((6,), "int64")])
                kern_timeline = lv[1]
                y = lv[0]
                R.output(kern_timeline, y)
            return (y, (kern_timeline,))

    after = ReturnTimelines()(Before)
    tvm.ir.assert_structural_equal(tvm.IRModule(dict(after.functions_items())), Expected)
    assert json.loads(str(after.attrs["rammer.timeline_kernels"])) == ["kern"]
    unmarked = Before.with_attr("x", 1)
    unmarked["kern"] = Before["kern"].without_attr("rammer.timeline_words")
    assert ReturnTimelines()(unmarked).same_as(unmarked)  # nothing instrumented: unchanged


# --- on the GPU: the measured timeline ------------------------------------------------------------

@pytest.mark.gpu
def test_measured_timeline_of_the_demo_model(model_files, tmp_path):
    from tvm_rammer.run import runner
    from tvm_rammer.host.gpu import local_gpu

    found = runner.run_timeline(str(model_files["branches"]), "rammer/nvidia-h100")
    assert found["max_rel_err"] <= 1e-4  # the instrumented kernel still computes the model
    measured, schedules = found["measured"], found["schedules"]
    trace = json.loads(json.dumps(timeline_view.trace_events(found["predicted"] + measured)))
    _check_trace(trace, _barriers(schedules), source="measured")
    _check_trace(trace, _barriers(schedules), source="predicted")
    num_sms = int(local_gpu().dev.multi_processor_count)
    for t in measured:
        sms = defaultdict(set)
        for s in t.slices:
            sms[s.veu].add(s.sm)
            assert 0 <= s.sm < num_sms
        assert all(len(v) == 1 for v in sms.values())  # a vEU is a resident block: one SM
    records = timeline.in_context_records(measured, schedules)
    assert records and all(r["in_context"] and r["rtask_us"] >= 0 for r in records.values())
    json_path, png_path = timeline_view.write(str(tmp_path / "demo"), found["predicted"] + measured)
    assert (tmp_path / "demo.json").exists() and (tmp_path / "demo.png").exists()
