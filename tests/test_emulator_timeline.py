"""The instrumented timeline build (``RammerConfig(timeline=True)``) run on the CPU emulator.

The emulator's ``%globaltimer`` is a virtual clock: +ROUND_NS per scheduling round and +1 ns per
read, so every read is later than the one before and an rTask's recorded end is after its start.
The buffers are decoded with ``tvm_rammer.scheduling.timeline.decode_all`` as ``tvm-rammer run --timeline``
does on a GPU: one record per rTask, and every rTask starts after every rTask of the operators
producing its inputs (``schedule["ops"][op]["preds"]``, in the same rProgram) ended. Negative
control: with the barrier waits removed from the program table, some rTask starts before a producer
of its inputs ended.
"""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from test_emulator import reverse_order_run
from tvm_rammer import RammerConfig
from tvm_rammer.models import get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import onnx_reference, random_inputs

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")

LSTM = dict(seq_len=4, input_size=32, hidden=32, layers=2)  # reduced lstm_tc: barriers between steps


def _instrumented(proto, config):
    """(EmulationBuild of the lowered instrumented module, schedules, timeline kernel names)."""
    from relay_passes.return_timelines import TIMELINE_KERNELS_ATTR

    from tvm_rammer.checks import emulator
    from tvm_rammer.scheduling import timeline
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.target import resolve_target

    target = resolve_target("rammer/nvidia-h100")
    lowered = lower(import_onnx(proto), target, replace(config, timeline=True))
    schedules = timeline.schedules_of(lowered)
    names = json.loads(str(lowered.attrs[TIMELINE_KERNELS_ATTR]))
    return emulator.emulation_build(lowered, target, pipeline=None), schedules, names


def _run(build, proto, names, waits: bool):
    """(model outputs, {kernel name: timeline buffer}) of one emulated run."""
    feeds = random_inputs(proto, 0)
    run, removed = reverse_order_run(build, waits)
    assert waits or removed > 0
    outputs, buffers = run(*[feeds[v.name] for v in proto.graph.input if v.name in feeds])
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    buffers = buffers if isinstance(buffers, tuple) else (buffers,)
    assert len(buffers) == len(names)
    return outputs, {name: np.asarray(b) for name, b in zip(names, buffers)}


def _early_starts(timelines, schedules) -> list:
    """Every (rTask, producer rTask) of one rProgram where the rTask started before the producer ended."""
    early = []
    for tl, schedule in zip(timelines, schedules):
        by_op: dict = {}
        for s in tl.slices:
            if s.kind == "rtask":
                by_op.setdefault(s.op, []).append(s)
        for op, tasks in by_op.items():
            for pred in schedule["ops"][str(op)]["preds"]:
                for task in tasks:
                    early += [(task, p) for p in by_op.get(pred, ()) if task.start_us < p.end_us]
    return early


@pytest.fixture(scope="module")
def lstm():
    proto = get_model("lstm_tc", **LSTM)
    build, schedules, names = _instrumented(proto, RammerConfig(num_sms=2, veus_per_sm=2))
    return proto, build, schedules, names


def test_emulated_timeline_one_record_per_rtask_after_its_producers(lstm):
    from tvm_rammer.scheduling import timeline

    proto, build, schedules, names = lstm
    assert schedules and sorted(names) == sorted(s["kernel"] for s in schedules)
    outputs, buffers = _run(build, proto, names, waits=True)
    ref = onnx_reference(proto, random_inputs(proto, 0))
    assert max(relative_error(o, r) for o, r in zip(outputs, ref)) <= 1e-4
    timelines = timeline.decode_all(schedules, buffers)
    pairs = 0
    for tl, schedule in zip(timelines, schedules):
        tasks = [s for s in tl.slices if s.kind == "rtask"]
        want = sorted((int(op), r) for op, info in schedule["ops"].items()
                      for r in range(info["rtasks"]))
        assert sorted((s.op, s.rtask_id) for s in tasks) == want  # one record per rTask
        assert all(s.end_us > s.start_us for s in tl.slices)  # the virtual clock advances per read
        pairs += sum(len(schedule["ops"][str(s.op)]["preds"]) for s in tasks)
    assert pairs > 0  # there are producers to be after
    assert _early_starts(timelines, schedules) == []
    print(f"\nEMU lstm_tc timeline: {len(timelines)} rPrograms, "
          f"{sum(len(t.slices) for t in timelines)} records, span "
          f"{max(t.end_us for t in timelines):.2f} virtual us")


def test_emulated_timeline_without_waits_starts_before_a_producer(lstm):
    """Negative control: waits removed from the table, the decoded timeline shows it."""
    from tvm_rammer.scheduling import timeline

    proto, build, schedules, names = lstm
    _, buffers = _run(build, proto, names, waits=False)
    early = _early_starts(timeline.decode_all(schedules, buffers), schedules)
    assert early, "with no waits every rTask still started after its producers"
    task, pred = early[0]
    print(f"\nEMU lstm_tc timeline without waits: {len(early)} early starts, e.g. {task.name} "
          f"rTask {task.rtask_id} at {task.start_us:.3f} us before {pred.name} rTask "
          f"{pred.rtask_id} ended at {pred.end_us:.3f} us")
