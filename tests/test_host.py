"""tvm_rammer.host: `tvm-rammer doctor`, the CUDA compiler choice and the checks made before a
command starts (no GPU needed: a GPU host is simulated where the check depends on one)."""
import json
import shutil
import subprocess
import sys

import pytest
import tvm
import tvm_ffi

import tvm_rammer  # noqa: F401  (installs the CUDA compile callback)
from tvm_rammer import cli
from tvm_rammer.host import cuda_compile, doctor, packages, preflight

KERNEL = 'extern "C" __global__ void k(float* a) { a[threadIdx.x] += 1.0f; }'


def _choice(monkeypatch, nvrtc: bool, nvcc: bool, env: str | None = None):
    monkeypatch.setattr(cuda_compile, "nvrtc_status",
                        lambda: (True, "NVRTC 12.8") if nvrtc else (False, "cuda-python is not "
                                                                          "installed"))
    monkeypatch.setattr(cuda_compile, "nvcc_status",
                        lambda: ("/x/nvcc", "12.8.1") if nvcc else (None, "nvcc is not on PATH"))
    if env is None:
        monkeypatch.delenv(cuda_compile.ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_compile.ENV, env)


@pytest.mark.parametrize("nvrtc,nvcc,env,expected", [
    (True, True, None, "nvrtc"),     # TVM's default where it works
    (False, True, None, "nvcc"),     # NVRTC unusable: nvcc, without the user setting anything
    (False, False, None, None),      # nothing: a clear error
    (True, True, "nvcc", "nvcc"),    # the user's choice wins
    (False, False, "nvrtc", "nvrtc"),
])
def test_compiler_choice_order(monkeypatch, nvrtc, nvcc, env, expected):
    _choice(monkeypatch, nvrtc, nvcc, env)
    assert cuda_compile.compiler_choice().compiler == expected


def test_the_installed_callback_refuses_with_the_fix_when_no_compiler_works(monkeypatch):
    """Importing tvm_rammer registers host.cuda_compile's callback in TVM's registry: the global
    function TVM's CUDA module calls is ours (it applies the choice)."""
    _choice(monkeypatch, nvrtc=False, nvcc=False)
    callback = tvm_ffi.get_global_func(cuda_compile.CALLBACK)
    with pytest.raises(Exception, match="pip install cuda-python"):
        callback(KERNEL)


def test_the_callback_delegates_to_tvm_where_nvrtc_works_or_the_user_chose(monkeypatch, tmp_path):
    from tvm.support import nvcc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its fake binary is kept there, not shared

    seen = []
    monkeypatch.setattr(nvcc, "tvm_callback_cuda_compile", lambda code: seen.append(code) or b"x")
    _choice(monkeypatch, nvrtc=True, nvcc=False)
    assert cuda_compile.compile_callback(KERNEL) == b"x"
    _choice(monkeypatch, nvrtc=False, nvcc=False, env="nvrtc")
    assert cuda_compile.compile_callback(KERNEL) == b"x"
    assert seen == [KERNEL, KERNEL]


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_registered_callback_compiles_with_nvcc_when_nvrtc_is_unusable(monkeypatch):
    monkeypatch.delenv(cuda_compile.ENV, raising=False)
    monkeypatch.setattr(cuda_compile, "nvrtc_status", lambda: (False, "hidden"))
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        binary = bytes(tvm_ffi.get_global_func(cuda_compile.CALLBACK)(KERNEL))
    assert len(binary) > 100 and b"sm_90" in binary  # a fatbin holding an sm_90a cubin


def test_doctor_lists_every_check_and_its_fix(monkeypatch, capsys):
    for module in ("matplotlib", "torch", "onnxruntime", "cuda", "cuda.bindings"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for name in ("tvm-rammer", "TVM", "CUDA compiler", "nvcc", "GPU", "cuda-python",
                 "onnxruntime", "matplotlib", "torch", "C++ compiler", "profile cache",
                 "binary cache"):
        assert f"] {name} " in out
    assert "pip install matplotlib" in out and "pip install torch onnx2torch" in out
    assert "pip install onnxruntime" in out and "pip install cuda-python" in out
    assert tvm.__version__ in out and out.strip().splitlines()[-1].startswith("this machine can:")


def test_doctor_json_is_one_object_with_statuses(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {c["name"]: c for c in doc["checks"]}
    assert by["TVM"]["status"] == "ok" and tvm.__version__ in by["TVM"]["detail"]
    assert all(c["status"] in ("ok", "missing", "mismatch", "none") for c in doc["checks"])
    assert by["matplotlib"]["status"] == ("missing" if packages.missing("matplotlib") else "ok")
    assert doc["summary"].startswith("this machine can: compile, inspect")


def test_doctor_says_which_tag_matches_a_gpu_and_when_the_default_does_not(monkeypatch):
    from tvm_rammer.host import gpu

    local = gpu.LocalGPU(None, gpu.DeviceId("NVIDIA A100-SXM4-80GB", "sm_80", "550.1"))
    monkeypatch.setattr(gpu, "local_gpu", lambda: local)
    check, arch = doctor._gpu_check("rammer/nvidia-h100")
    assert check.status == "mismatch" and arch == "sm_80"
    assert check.fix == "--target rammer/nvidia-a100"
    check, _ = doctor._gpu_check("rammer/nvidia-a100")
    assert check.status == "ok" and "driver 550.1" in check.detail


def test_version_flag_prints_the_one_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tvm-rammer {tvm_rammer.__version__} (TVM {tvm.__version__})")
    from tvm_rammer.version import __version__
    assert tvm_rammer.__version__ == __version__
    setup_py = subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True,
                              text=True, cwd=cli.__file__.rsplit("/tvm_rammer/", 1)[0])
    assert setup_py.stdout.strip().splitlines()[-1] == __version__


# --- said at the start --------------------------------------------------------------------------

def _gpu_host_without_compiler(monkeypatch):
    monkeypatch.setattr(cuda_compile, "tvm_builds_cuda", lambda: True)
    _choice(monkeypatch, nvrtc=False, nvcc=False)


def test_compile_on_a_gpu_host_without_any_cuda_compiler_fails_before_compiling(
        monkeypatch, tmp_path, capsys):
    from tvm_rammer.driver import frontend

    _gpu_host_without_compiler(monkeypatch)
    monkeypatch.setattr(frontend, "compile", lambda *a, **k: pytest.fail("compiled anyway"))
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")  # never read: the check comes first
    assert cli.main(["compile", str(model), "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA compiler" in err and "pip install cuda-python" in err and "nvcc" in err
    _choice(monkeypatch, nvrtc=False, nvcc=True)  # negative control: nvcc is enough
    assert preflight.check("compile", object()) == []


def test_bench_on_a_gpu_without_onnxruntime_fails_at_the_start(monkeypatch):
    monkeypatch.setattr(preflight, "_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    args = cli.build_parser().parse_args(["bench", "branches"])
    with pytest.raises(ValueError, match="pip install onnxruntime"):
        preflight.check("bench", args)
    monkeypatch.delitem(sys.modules, "onnxruntime")
    monkeypatch.setattr(packages, "missing", lambda module: False)  # negative control
    assert preflight.check("bench", args) == []


def test_fuzz_on_the_gpu_without_onnxruntime_or_a_compiler_fails_at_the_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    gpu = cli.build_parser().parse_args(["fuzz", "--graphs", "1", "--gpu"])
    with pytest.raises(ValueError, match="fuzz --gpu.*pip install onnxruntime"):
        preflight.check("fuzz", gpu)
    assert preflight.check("fuzz", cli.build_parser().parse_args(["fuzz", "--graphs", "1"])) == []
    monkeypatch.delitem(sys.modules, "onnxruntime")
    _gpu_host_without_compiler(monkeypatch)
    with pytest.raises(ValueError, match="no CUDA compiler"):
        preflight.check("fuzz", gpu)


def test_run_without_onnxruntime_warns_before_it_starts(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    cli.main(["run", str(model)])  # no GPU here: fails after the warning
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tvm-rammer:")]
    assert err[0].startswith("tvm-rammer: warning: onnxruntime is not installed: outputs are "
                             "checked against TVM's default pipeline")


def test_emulate_without_a_cxx_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)

    class Args:
        emulate = True

    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        preflight.check("run", Args())


def test_bench_default_torch_systems_are_the_benchmarks_ones():
    from tvm_rammer.benchmarks.systems import SYSTEMS, TORCH_SYSTEMS

    assert preflight.DEFAULT_TORCH_SYSTEMS == TORCH_SYSTEMS
    assert set(TORCH_SYSTEMS) <= set(SYSTEMS)


def test_doctor_reports_the_rocm_toolchain_and_how_to_install_it(monkeypatch):
    """Missing: the fix is the install command (AMD targets only); present: the tools' paths."""
    from tvm_rammer.rocm import toolchain

    real = toolchain.locate
    monkeypatch.setattr(toolchain, "locate", lambda path=None: real("/nonexistent"))
    missing = doctor._rocm_check()
    assert missing.status == "missing" and missing.fix == toolchain.INSTALL_COMMAND
    assert "rammer/amd-" in missing.detail and "ld.lld-22" in missing.detail
    monkeypatch.undo()
    found = toolchain.locate()
    if isinstance(found, str):
        pytest.skip(f"no ROCm toolchain here ({found})")
    present = doctor._rocm_check()
    assert present.status == "ok" and found.ld_lld in present.detail


def test_the_nvcc_command_that_keeps_its_log_is_tvms_own(monkeypatch, tmp_path):
    """cuda_compile.tvm_nvcc_command is the command TVM's nvcc mode runs (captured from
    tvm.support.nvcc with its subprocess replaced), for the same source and output paths."""
    import subprocess

    import tvm
    from tvm.support import nvcc as tvm_nvcc

    from tvm_rammer.host import cuda_compile

    seen = []

    class Recorded:
        def __init__(self, cmd, **kwargs):
            seen.append(list(cmd))
            out = cmd[cmd.index("-o") + 1]
            with open(out, "wb") as f:
                f.write(b"fatbin")
            self.returncode = 0

        def communicate(self):
            return b"", b""

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    out = str(tmp_path / "k.fatbin")
    with target:
        tvm_nvcc.compile_cuda("__global__ void k() {}", target_format="fatbin", compiler="nvcc",
                              path_target=out)
    (tvms,) = seen
    ours = cuda_compile.tvm_nvcc_command(tvms[-1], out, target)
    assert ours == tvms
    monkeypatch.setenv("TVM_CUDA_NVCC_NO_FAST_MATH", "1")  # an option TVM reads: followed too
    with target:
        tvm_nvcc.compile_cuda("__global__ void k() {}", target_format="fatbin", compiler="nvcc",
                              path_target=out)
    assert cuda_compile.tvm_nvcc_command(seen[-1][-1], out, target) == seen[-1] != tvms


def test_the_log_is_kept_only_where_nvcc_compiles_with_tvms_own_command(monkeypatch):
    from tvm_rammer.host import cuda_compile

    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    assert cuda_compile.nvcc_keeps_log()
    monkeypatch.setenv("TVM_KERNEL_DUMP", "/tmp/dump")  # TVM adds -lineinfo and --keep
    assert not cuda_compile.nvcc_keeps_log()
    monkeypatch.delenv("TVM_KERNEL_DUMP")
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvrtc")
    assert not cuda_compile.nvcc_keeps_log()
