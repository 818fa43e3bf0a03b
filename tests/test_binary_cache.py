"""host.binary_cache and the CUDA compile callback's use of it: a source compiled once for an arch,
compiler and options is read back, anything that changes the binary compiles again, and a cache
that cannot be used never fails a build."""
import os
import shutil

import pytest
import tvm
import tvm_ffi

import tvm_rammer  # noqa: F401  (installs the CUDA compile callback)
from tvm_rammer.host import binary_cache, cuda_compile

KERNEL = 'extern "C" __global__ void k(float* a) { a[threadIdx.x] += 1.0f; }'
SM90 = {"kind": "cuda", "arch": "sm_90a"}


@pytest.fixture
def cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(binary_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for env in ("TVM_KERNEL_DUMP", "TVM_KERNEL_DEBUG", "TVM_CUDA_PTXAS_EXTRA_OPTS"):
        monkeypatch.delenv(env, raising=False)
    return tmp_path


@pytest.fixture
def fake_nvcc(monkeypatch, cache_home):
    """nvcc is the choice (NVRTC unusable) and TVM's compile_cuda a fake: the sources it was given;
    each binary names its source and arch."""
    from tvm.support import nvcc

    compiled = []

    def compile_cuda(code, target_format=None, compiler=None, **_):
        arch = tvm.target.Target.current().arch
        compiled.append(code)
        return bytearray(f"{target_format}:{arch}:{code}".encode())

    monkeypatch.delenv(cuda_compile.ENV, raising=False)
    monkeypatch.setattr(cuda_compile, "nvrtc_status", lambda: (False, "hidden"))
    monkeypatch.setattr(cuda_compile, "nvcc_status", lambda: ("/x/nvcc", "12.8.1"))
    monkeypatch.setattr(nvcc, "compile_cuda", compile_cuda)
    return compiled


def _compile(code=KERNEL, target=SM90):
    with tvm.target.Target(target):
        return bytes(tvm_ffi.get_global_func(cuda_compile.CALLBACK)(code))


def test_a_source_compiled_once_is_read_back_and_others_compile(fake_nvcc, cache_home):
    first = _compile()
    assert _compile() == first and fake_nvcc == [KERNEL]  # read back: no second compile
    assert os.listdir(cache_home / "tvm-rammer" / "cuda")
    other = KERNEL.replace("1.0f", "2.0f")  # negative controls: each changes the binary
    assert _compile(other) != first
    assert _compile(target={"kind": "cuda", "arch": "sm_80"}) != first
    assert fake_nvcc == [KERNEL, other, KERNEL]


def test_the_compiler_and_its_options_are_part_of_the_key(fake_nvcc, monkeypatch):
    _compile()
    monkeypatch.setenv("TVM_CUDA_PTXAS_EXTRA_OPTS", "-O1")  # TVM passes it to ptxas
    _compile()
    monkeypatch.setattr(cuda_compile, "nvcc_status", lambda: ("/x/nvcc", "12.9.0"))  # upgraded
    _compile()
    assert len(fake_nvcc) == 3
    monkeypatch.delenv("TVM_CUDA_PTXAS_EXTRA_OPTS")
    monkeypatch.setattr(cuda_compile, "nvcc_status", lambda: ("/x/nvcc", "12.8.1"))
    _compile()
    assert len(fake_nvcc) == 3  # back to the first compiler and options: compiled already


def test_builds_that_write_files_for_the_user_and_the_off_switch_compile_every_time(
        fake_nvcc, monkeypatch, cache_home):
    monkeypatch.setenv(binary_cache.ENV, "off")
    _compile(), _compile()
    assert len(fake_nvcc) == 2 and not (cache_home / "tvm-rammer").exists()
    monkeypatch.delenv(binary_cache.ENV)
    monkeypatch.setenv("TVM_KERNEL_DUMP", "1")  # the user wants the files nvcc writes
    _compile(), _compile()
    assert len(fake_nvcc) == 4 and not (cache_home / "tvm-rammer").exists()


def test_the_cache_can_be_moved_and_without_an_arch_nothing_is_kept(fake_nvcc, monkeypatch,
                                                                     tmp_path):
    from tvm.support import nvcc

    monkeypatch.setenv(binary_cache.ENV, str(tmp_path / "elsewhere"))
    _compile(), _compile()
    assert len(fake_nvcc) == 1 and os.listdir(tmp_path / "elsewhere" / "cuda")
    monkeypatch.setenv(binary_cache.ENV, "on")  # the default place
    assert binary_cache.cache_root() == str(tmp_path / "tvm-rammer")  # XDG_CACHE_HOME (fixture)
    assert cuda_compile.cache_key(KERNEL, "clang") is None  # not a compiler TVM's callback knows
    monkeypatch.setattr(nvcc, "get_target_compute_version",  # no target in scope, no GPU
                        lambda *_: (_ for _ in ()).throw(RuntimeError("no GPU")))
    assert cuda_compile.cache_key(KERNEL, "nvcc") is None
    monkeypatch.setattr(cuda_compile, "nvcc_status", lambda: (None, "nvcc is not on PATH"))
    with tvm.target.Target(SM90):
        assert cuda_compile.cache_key(KERNEL, "nvcc") is None  # the compiler is not there


def test_nvrtc_builds_are_kept_under_their_own_keys(monkeypatch, cache_home):
    """TVM's default compiler (NVRTC, through TVM's own callback): read back, and its options,
    nvcc's environment and the compiler itself are part of the key."""
    from tvm.support import nvcc

    compiled = []
    monkeypatch.delenv(cuda_compile.ENV, raising=False)
    monkeypatch.setattr(cuda_compile, "nvrtc_status", lambda: (True, "NVRTC 12.8"))
    monkeypatch.setattr(nvcc, "tvm_callback_cuda_compile",
                        lambda code: compiled.append(code) or bytearray(b"cubin:" + code.encode()))
    first = _compile()
    assert _compile() == first and len(compiled) == 1
    for env, value in (("TVM_CUDA_NVRTC_EXTRA_OPTS", "--ftz=false"), ("CUDA_PATH", "/other/cuda"),
                       ("NVCC_PREPEND_FLAGS", "-G")):
        monkeypatch.setenv(env, value)
        _compile()
        monkeypatch.delenv(env)
    assert len(compiled) == 4
    with tvm.target.Target(SM90):
        assert cuda_compile.cache_key(KERNEL, "nvrtc") != cuda_compile.cache_key(KERNEL, "nvcc")


def test_a_damaged_entry_is_compiled_again_never_returned(fake_nvcc, cache_home):
    first = _compile()
    folder = cache_home / "tvm-rammer" / "cuda"
    (entry,) = folder.iterdir()
    entry.write_bytes(entry.read_bytes()[:-7])  # cut short
    assert _compile() == first and len(fake_nvcc) == 2  # compiled again, stored whole
    assert _compile() == first and len(fake_nvcc) == 2
    entry.write_bytes(b"not a cache entry")
    assert _compile() == first and len(fake_nvcc) == 3
    stale = folder / ".left.part"
    stale.write_bytes(b"x")
    os.utime(stale, (1000, 1000))
    _compile(KERNEL.replace("1.0f", "3.0f"))  # a store sweeps what a killed process left
    assert not stale.exists() and len(list(folder.glob("*.bin"))) == 2


def test_an_unwritable_cache_is_no_error(fake_nvcc, cache_home):
    (cache_home / "tvm-rammer").write_text("a file where the cache's directory would be")
    assert _compile() == _compile()  # compiled each time, no error
    assert fake_nvcc == [KERNEL, KERNEL]


def test_the_least_recently_used_entries_go_past_the_size_limit(tmp_path):
    entry = len(binary_cache.MAGIC) + 32 + 100  # the header, then 100 bytes
    cache = binary_cache.BinaryCache(str(tmp_path), ".bin", max_bytes=3 * entry)
    for i, key in enumerate("abc"):
        cache.put(key, bytes(100))
        os.utime(tmp_path / f"{key}.bin", (1000 + i, 1000 + i))
    assert cache.get("a") is not None  # a hit counts as a use: "b" is now the oldest
    cache.put("d", bytes(100))
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "c.bin", "d.bin"] and cache.size() == 3 * entry
    off = binary_cache.BinaryCache(None)
    off.put("x", b"1")
    assert off.get("x") is None and off.entries() == []


def test_the_rocm_code_objects_live_in_the_same_cache(monkeypatch, tmp_path):
    from tvm_rammer.rocm import build as rocm_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(binary_cache.ENV, raising=False)
    assert rocm_build.cache_dir() == str(tmp_path / "tvm-rammer" / "rocm" / "code")
    rocm_build._store("k", b"hsaco")  # pylint: disable=protected-access
    assert rocm_build._cached("k") == b"hsaco"  # pylint: disable=protected-access
    monkeypatch.setenv(binary_cache.ENV, "off")
    assert rocm_build.cache_dir() is None and rocm_build._cached("k") is None  # pylint: disable=protected-access


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_real_nvcc_build_is_compiled_once(monkeypatch, cache_home):
    from tvm.support import nvcc

    monkeypatch.delenv(cuda_compile.ENV, raising=False)
    monkeypatch.setattr(cuda_compile, "nvrtc_status", lambda: (False, "hidden"))
    runs = []
    real = nvcc.compile_cuda
    monkeypatch.setattr(nvcc, "compile_cuda", lambda *a, **k: runs.append(1) or real(*a, **k))
    first = _compile()
    assert len(first) > 100 and b"sm_90" in first  # a fatbin holding an sm_90a cubin
    assert _compile() == first and len(runs) == 1


def test_the_benchmark_worker_times_the_compiler_not_the_cache(monkeypatch):
    """``bench``'s compile_s on a GPU host is the CUDA build: its worker runs with the cache off."""
    import subprocess

    from tvm_rammer.benchmarks import harness

    seen = {}

    class Spawned:
        stdout = iter(())

        def __init__(self, *_, env=None, **__):
            seen.update(env)

    monkeypatch.setattr(subprocess, "Popen", Spawned)
    monkeypatch.setenv(binary_cache.ENV, "/somewhere")
    harness._Worker()  # pylint: disable=protected-access
    assert seen[binary_cache.ENV] == "off"


def test_doctor_says_where_the_cache_is_and_when_it_is_off(monkeypatch, cache_home):
    from tvm_rammer.host import doctor

    by = {c.name: c for c in doctor.diagnose()}
    assert by["binary cache"].status == "ok" and str(cache_home) in by["binary cache"].detail
    monkeypatch.setenv(binary_cache.ENV, "off")
    by = {c.name: c for c in doctor.diagnose()}
    assert by["binary cache"].status == "none" and "off" in by["binary cache"].detail
