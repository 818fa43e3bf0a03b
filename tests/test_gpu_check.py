"""scripts/gpu_check.sh fits short GPU slots (issue 21): ``--plan`` lists stages of at most 8
minutes each, in order of value, and every stage it names runs (dry: GPU_CHECK_DRY=1 prints each
command instead of running it) with command lines tvm-rammer's CLI accepts."""
import os
import re
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")


def _plan():
    out = subprocess.run(["bash", SCRIPT, "--plan"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    rows = [re.match(r"\s*(\d+)\. (\S+)\s+(\d+) min\s+(.*)", ln) for ln in out.splitlines()]
    return [(m.group(2), int(m.group(3)), m.group(4)) for m in rows if m]


def test_the_plan_has_stages_of_at_most_8_minutes_in_order_of_value():
    stages = _plan()
    names = [name for name, _, _ in stages]
    assert names[:4] == ["smoke", "gpu-tests", "gpu-tests-2", "gpu-dags"]
    assert len(names) == len(set(names))
    assert all(1 <= minutes <= 8 for _, minutes, _ in stages), stages
    assert all(outputs for _, _, outputs in stages)
    first = {kind: min(i for i, n in enumerate(names) if n.startswith(kind))
             for kind in ("rkfunc-", "zoo-", "profile-", "epilogue-", "l2", "sanitize-", "stress-")}
    assert first["rkfunc-"] == 4  # right after the smoke and tests: it decides a default
    assert first["zoo-"] < first["profile-"] < first["epilogue-"] < first["l2"] \
        < first["sanitize-"] < first["stress-"]


def test_every_stage_of_the_plan_runs_and_its_cli_calls_parse(tmp_path):
    from tvm_rammer.cli import build_parser

    env = dict(os.environ, GPU_CHECK_DRY="1")
    parser = build_parser()
    for name, _, _ in _plan():
        proc = subprocess.run(["bash", SCRIPT, name, str(tmp_path)], capture_output=True,
                              text=True, cwd=REPO, env=env, timeout=120)
        assert proc.returncode == 0, (name, proc.stderr)
        assert (tmp_path / name).is_dir()
        printed = proc.stdout + "".join(p.read_text() for p in (tmp_path / name).iterdir())
        for line in printed.splitlines():
            if line.startswith("+ python3 -m tvm_rammer.cli "):
                args = shlex.split(line[len("+ python3 -m tvm_rammer.cli "):])
                if args[0] in ("demo",):
                    continue
                parser.parse_args(args)  # SystemExit on a flag the CLI does not have
    done = (tmp_path / "stages.jsonl").read_text().splitlines()
    assert len(done) == len(_plan())


def test_an_unknown_stage_is_refused_naming_the_stages(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "zoo-nonexistent", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, env=dict(os.environ, GPU_CHECK_DRY="1"))
    assert proc.returncode == 2 and "no stage 'zoo-nonexistent'" in proc.stderr
    assert "smoke" in proc.stderr


@pytest.mark.parametrize("limit", ["1"])
def test_a_stage_past_its_limit_is_stopped_and_recorded(tmp_path, limit):
    """The 8-minute bound is enforced, not hoped for: a stage that overruns exits 124."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text('#!/bin/sh\ncase "$*" in *l2.json*) sleep 30;; esac\n')
    (fake_bin / "python3").chmod(0o755)
    env = dict(os.environ, STAGE_LIMIT_S=limit, PATH=f"{fake_bin}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", SCRIPT, "l2", str(tmp_path / "out")], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 124
    assert '"stage": "l2", "exit": 124' in (tmp_path / "out" / "stages.jsonl").read_text()


def test_the_two_gpu_test_stages_run_every_gpu_test_file_once(tmp_path):
    """Each file its own pytest run and log (a cut stage keeps earlier files' failures in full);
    together the two stages name every test file with -m gpu tests but test_gpu.py exactly once."""
    import glob

    env = dict(os.environ, GPU_CHECK_DRY="1")
    named = []
    for stage in ("gpu-tests", "gpu-tests-2"):
        subprocess.run(["bash", SCRIPT, stage, str(tmp_path)], check=True, capture_output=True,
                       cwd=REPO, env=env, timeout=120)
        logs = sorted(p.name for p in (tmp_path / stage).iterdir())
        assert logs, stage
        for log in logs:
            (line,) = (tmp_path / stage / log).read_text().splitlines()
            assert re.search(rf"pytest -q -m gpu tests/{log[:-4]}\.py ", line), line
            named.append(log[:-4] + ".py")
    expected = sorted(os.path.basename(f) for f in glob.glob(os.path.join(REPO, "tests", "test_*.py"))
                      if "mark.gpu" in open(f).read() and not f.endswith("test_gpu.py"))
    assert sorted(named) == expected and len(expected) >= 4
