"""MetaSchedule: a tuning database's distinct schedules become rKernel versions; `tune` needs a device."""
import pytest
from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from conftest import GPU
from conftest_tir import TARGET
from test_versions import CASES, stashed_and_scheduled
from tvm_rammer.cli import main
from tvm_rammer.tuning.tune import NO_DEVICE, RPCTracker
from tvm_rammer.tuning.versions import open_database
from tvm_rammer.tuning.versions import VersionOptions, _MatmulWith, kernel_versions, unscheduled_funcs

CONFIGS = [dict(block_size_x=8, block_size_y=8, micro_size_x=4, micro_size_y=4),
           dict(block_size_x=16, block_size_y=16, micro_size_x=2, micro_size_y=2),
           dict(block_size_x=8, block_size_y=16, micro_size_x=4, micro_size_y=4)]


def write_database(work_dir, unscheduled):
    """A JSON database with three records (dlight traces, fake run times) for ``unscheduled``."""
    db = ms.database.JSONDatabase(work_dir=work_dir)
    workload = db.commit_workload(_normalize_mod(unscheduled))
    base = dl.gpu.Matmul().get_configs(TARGET)
    for k, overrides in enumerate(CONFIGS):
        config = dl.gpu.Matmul.Config(**{**base.__dict__, **overrides})
        sch = _MatmulWith(config).apply(workload.mod["main"], TARGET, False)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, run_secs=[1e-5 * (k + 1)],
                                                         target=TARGET))
    return db


def test_every_distinct_schedule_of_the_tuning_database_becomes_a_version(tmp_path):
    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    unscheduled = unscheduled_funcs(mod)[gv.name_hint]
    write_database(str(tmp_path), unscheduled)
    database = open_database(str(tmp_path))  # a fresh load from the files
    found = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv], unscheduled=unscheduled,
                            database=database,
                            options=VersionOptions(dlight_variants=False, templates=False))
    tuned = [v for v in found if v.source == "metaschedule"]
    assert [v.name for v in tuned] == ["metaschedule_top0", "metaschedule_top1", "metaschedule_top2"]
    assert len({(v.lowered.grid, v.lowered.block) for v in tuned}) == 3
    assert all(isinstance(v.func, tirx.PrimFunc) for v in tuned)


def test_the_pipeline_dlight_version_survives_the_cap_and_same_shape_tuned_versions(tmp_path):
    """TVM's default kernel is what every choice falls back to: a tuned record with its launch shape,
    or a cap on the version count, never drops it."""
    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    unscheduled = unscheduled_funcs(mod)[gv.name_hint]
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    workload = db.commit_workload(_normalize_mod(unscheduled))
    sch = dl.gpu.Matmul().apply(workload.mod["main"], TARGET, False)  # dlight's own tiles
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, run_secs=[1e-5], target=TARGET))
    for cap in (1, 2, 8):
        found = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv], unscheduled=unscheduled,
                                database=open_database(str(tmp_path)),
                                options=VersionOptions(max_versions=cap))
        assert "dlight" in [v.name for v in found], (cap, [v.name for v in found])
        assert len(found) <= cap
    tuned, default = found[0], next(v for v in found if v.name == "dlight")
    assert tuned.source == "metaschedule"
    assert (tuned.lowered.grid, tuned.lowered.block) == (default.lowered.grid, default.lowered.block)


def test_an_operator_missing_from_the_database_gets_no_tuned_version(tmp_path):
    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    write_database(str(tmp_path), unscheduled_funcs(mod)[gv.name_hint])
    other, ogv = stashed_and_scheduled(*CASES["gemv"])
    found = kernel_versions(ogv.name_hint, TARGET, scheduled=other[ogv],
                            unscheduled=unscheduled_funcs(other)[ogv.name_hint],
                            database=open_database(str(tmp_path)), options=VersionOptions(templates=False))
    assert found and all(v.source != "metaschedule" for v in found)


def test_a_missing_tuning_database_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="tvm-rammer tune MODEL --work-dir DIR"):
        open_database(str(tmp_path / "nothing"))


@pytest.mark.skipif(GPU, reason="checks the no-GPU message")
def test_tune_without_gpu_or_rpc_fails_fast_with_a_clear_message(tmp_path, capsys):
    import onnx

    from tvm_rammer.models import two_branch

    model = tmp_path / "model.onnx"  # a readable model: the file is checked before the GPU
    onnx.save(two_branch(), model)
    code = main(["tune", str(model), "--trials", "8", "--work-dir", str(tmp_path)])
    assert code == 2
    assert NO_DEVICE in capsys.readouterr().err
    assert "--rpc-tracker HOST:PORT --rpc-key KEY" in NO_DEVICE


def test_rpc_tracker_flags_are_checked():
    assert RPCTracker.parse("10.0.0.1:9190", "h100") == RPCTracker("10.0.0.1", 9190, "h100")
    with pytest.raises(ValueError, match="use HOST:PORT"):
        RPCTracker.parse("10.0.0.1", "h100")
    with pytest.raises(ValueError, match="needs --rpc-key"):
        RPCTracker.parse("10.0.0.1:9190", None)
