"""Cross-compiled CUDA libraries (tvm_rammer.host.cross): built here without a GPU, a binary for the
target's arch that a GPU host loads without compiling; the source kept, with a warning, without a
CUDA compiler."""

import ctypes.util
import os
import shutil
import subprocess
import sys
import textwrap

import onnx
import pytest
import tvm
from tvm.script import relax as R

from tvm_rammer.cli import main
from tvm_rammer.host import cross, cuda_compile
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.target import plain_target, resolve_target

H200 = "rammer/nvidia-h200"


@tvm.script.ir_module
class MatmulRelu:  # one CUDA kernel: builds in a fraction of a second
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, w))
            R.output(y)
        return y


def _build(target):
    return tvm.compile(MatmulRelu, target=target, relax_pipeline="default")


@pytest.fixture(scope="module")
def h200():
    return plain_target(resolve_target(H200))


@pytest.fixture(scope="module")
def source_library(h200, tmp_path_factory):
    """What TVM writes here by itself: the CUDA module as source."""
    path = tmp_path_factory.mktemp("src") / "m.so"
    _build(h200).export_library(str(path))
    return path


def _no_compiler(monkeypatch):
    monkeypatch.setattr(cuda_compile, "compiler_choice",
                        lambda: cuda_compile.CompilerChoice(None, cuda_compile.NO_COMPILER))


def test_a_source_library_is_read_as_source(source_library):
    """The negative control: TVM's own library without a GPU holds CUDA source, and the reader
    says so (so the binary checks below can fail)."""
    (module,) = cross.library_cuda_modules(str(source_library))
    assert module.is_source and module.fmt == "cuda"
    assert b"__global__" in module.code and b"fused_matmul_relu" in module.code
    assert cross.binary_arches(module.code) == []


def test_packed_imports_split_and_join_to_the_same_bytes(source_library):
    blob = cross.library_blob(str(source_library))
    tree, modules = cross.split_blob(blob)
    assert [kind for kind, _ in modules] == ["relax.VMExecutable", "_lib", "cuda"]
    assert cross.join_blob(tree, modules) == blob
    cuda = cross.parse_cuda_module(modules[2][1])
    assert cross.cuda_module_bytes(cuda) == modules[2][1]
    with pytest.raises(ValueError, match="packed imports"):
        cross.split_blob(blob[:-3])


def test_without_a_compiler_the_source_is_kept_with_the_reason(h200, tmp_path, monkeypatch):
    _no_compiler(monkeypatch)
    path = tmp_path / "m.so"
    done = cross.export(_build(h200), str(path), h200)
    assert done.cuda == cross.SOURCE and "GPU host compiles it" in done.why
    assert cross.library_cuda_modules(str(path))[0].is_source
    assert cross.source_warning(h200) == done.why
    assert os.listdir(tmp_path) == ["m.so"]


def test_the_rewrite_labels_a_binary_as_tvm_does(h200, tmp_path, monkeypatch):
    """Without nvcc: the callback's binary (a fake fatbin) replaces the source, labelled "cubin" as
    TVM's CUDAModuleNode labels any binary, the function table kept byte for byte."""
    fake = bytes.fromhex("50ed55ba01001000") + bytes(64)
    seen = []

    def callback(code, *args):
        seen.append((code, tvm.target.Target.current().attrs["arch"]))
        return bytearray(fake)

    monkeypatch.setattr(cuda_compile, "compiler_choice",
                        lambda: cuda_compile.CompilerChoice("nvcc", "test"))
    monkeypatch.setattr(cuda_compile, "compile_callback", callback)
    ex = _build(h200)
    done = cross.export(ex, str(tmp_path / "m.so"), h200)
    assert (done.cuda, done.arch, done.compiled) == (cross.BINARY, "sm_90a", 1)
    (module,) = cross.library_cuda_modules(str(tmp_path / "m.so"))
    assert (module.fmt, module.code) == ("cubin", fake)
    (code, arch), = seen
    assert "__global__" in code and arch == "sm_90a"  # the target's arch, current while compiling
    source = cross.parse_cuda_module(cross.split_blob(cross.library_blob(
        str(_export_plain(ex, tmp_path / "plain.so"))))[1][2][1])
    assert source.code.decode() == code and source.table == module.table
    # written under a temporary name, then renamed: the same mode as TVM's own export
    assert (tmp_path / "m.so").stat().st_mode == (tmp_path / "plain.so").stat().st_mode
    assert sorted(os.listdir(tmp_path)) == ["m.so", "plain.so"]


def _export_plain(ex, path):
    ex.export_library(str(path))
    return path


def test_a_failed_compile_leaves_no_file(h200, tmp_path, monkeypatch):
    def broken(code, *args):
        raise RuntimeError("nvcc failed (1)")

    monkeypatch.setattr(cuda_compile, "compiler_choice",
                        lambda: cuda_compile.CompilerChoice("nvcc", "test"))
    monkeypatch.setattr(cuda_compile, "compile_callback", broken)
    (tmp_path / "m.so").write_bytes(b"the previous library")
    with pytest.raises(Exception, match="nvcc failed"):
        cross.export(_build(h200), str(tmp_path / "m.so"), h200)
    assert os.listdir(tmp_path) == ["m.so"]
    assert (tmp_path / "m.so").read_bytes() == b"the previous library"  # untouched


def test_a_library_without_cuda_is_exported_unchanged(tmp_path):
    done = cross.export(_build(tvm.target.Target("llvm")), str(tmp_path / "m.so"), "llvm")
    assert done.cuda == cross.NO_CUDA and (tmp_path / "m.so").stat().st_size > 0
    assert cross.plan(tvm.target.Target("llvm")).compiles is False


def test_an_arch_the_compiler_cannot_build_keeps_its_source(monkeypatch):
    """``cuda`` alone gets TVM's default arch (sm_50 without a GPU), which nvcc 13 dropped: the
    source is kept, as before, with the reason."""
    monkeypatch.setattr(cuda_compile, "compiler_choice",
                        lambda: cuda_compile.CompilerChoice("nvcc", "test"))
    monkeypatch.setattr(cross, "_nvcc_arches", lambda: ("75", "80", "90"))
    how = cross.plan(tvm.target.Target({"kind": "cuda", "arch": "sm_50"}))
    assert not how.compiles and "cannot compile for sm_50" in how.why
    assert cross.plan(tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})).compiles


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "two_branch.onnx"
    onnx.save(get_model("two_branch", **REDUCED["two_branch"]), str(path))
    return path


def test_compile_without_a_compiler_warns_first_and_writes_source(tiny_onnx, tmp_path,
                                                                  monkeypatch, capsys):
    _no_compiler(monkeypatch)
    out = tmp_path / "m.so"
    assert main(["compile", str(tiny_onnx), "--target", H200, "--no-profile", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("tvm-rammer: warning: no CUDA compiler here")
    assert "compiled by the GPU host" in captured.out
    assert all(m.is_source for m in cross.library_cuda_modules(str(out)))


# --- with nvcc: binaries for the target's arch ---------------------------------------------------

@pytest.mark.nvcc
@pytest.mark.parametrize("target,arch", [(H200, "sm_90a"), ("rammer/nvidia-h100", "sm_90a"),
                                         ({"kind": "cuda", "arch": "sm_80"}, "sm_80")])
def test_cross_compiled_library_holds_a_binary_for_the_targets_arch(target, arch, tmp_path):
    tgt = (plain_target(resolve_target(target)) if isinstance(target, str)
           else tvm.target.Target(target))
    path = tmp_path / "m.so"
    done = cross.export(_build(tgt), str(path), tgt)
    assert (done.cuda, done.arch, done.compiled) == (cross.BINARY, arch, 1)
    (module,) = cross.library_cuda_modules(str(path))
    assert module.fmt == "cubin" and not module.is_source
    assert cross.binary_arches(module.code) == [arch]  # one cubin, no PTX to JIT
    assert b"__global__" not in path.read_bytes()  # no CUDA source anywhere in the library


@pytest.fixture(scope="module")
def branch_libraries(tmp_path_factory):
    """Four GEMV branches compiled by `tvm-rammer compile` for the H200 with both pipelines."""
    folder = tmp_path_factory.mktemp("branches")
    onnx.save(get_model("branches", **REDUCED["branches"]), str(folder / "branches.onnx"))
    out = {}
    for pipeline in ("rammer", "default"):
        out[pipeline] = folder / f"{pipeline}.so"
        assert main(["compile", str(folder / "branches.onnx"), "--target", H200, "--no-profile",
                     "--pipeline", pipeline, "-o", str(out[pipeline])]) == 0
    return out


@pytest.mark.nvcc
@pytest.mark.parametrize("pipeline", ["rammer", "default"])
def test_compile_cross_compiles_both_pipelines(branch_libraries, pipeline):
    path = branch_libraries[pipeline]
    (module,) = cross.library_cuda_modules(str(path))
    assert module.fmt == "cubin" and cross.binary_arches(module.code) == ["sm_90a"]
    assert b"__global__" not in path.read_bytes()
    assert [p.name for p in path.parent.iterdir() if ".part" in p.name] == []
    persistent = [n for n in _kernel_names(module) if n.startswith("rammer_rprogram")]
    # rammer's library runs the four branches as one persistent kernel; TVM's default pipeline
    # (`--pipeline default`, as `bench` builds its baseline) has none
    assert len(persistent) == (1 if pipeline == "rammer" else 0)


@pytest.mark.nvcc
def test_a_zoo_models_code_is_small(tmp_path, capsys):
    """Reduced AlexNet for the H200: the CUDA binary is small; the library's size is its weights
    (embedded) and a little host code."""
    proto = get_model("alexnet", **REDUCED["alexnet"])
    onnx.save(proto, str(tmp_path / "alexnet.onnx"))
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in proto.graph.initializer)
    path = tmp_path / "alexnet.so"
    assert main(["compile", str(tmp_path / "alexnet.onnx"), "--target", H200, "--no-profile",
                 "-o", str(path)]) == 0
    modules = cross.library_cuda_modules(str(path))
    assert all(m.fmt == "cubin" and cross.binary_arches(m.code) == ["sm_90a"] for m in modules)
    size, code = path.stat().st_size, sum(len(m.code) for m in modules)
    with capsys.disabled():  # the numbers the lease's note quotes
        print(f"\nreduced alexnet for the H200: library {size} B = CUDA binary {code} B + "
              f"weights {weights} B + the rest {size - weights - code} B")
    assert 0 < code < 1 << 20 and size - weights < 2 << 20


def _kernel_names(module):
    buf = module.table
    count = int.from_bytes(buf[:8], "little")
    pos = 8
    for _ in range(count):
        n = int.from_bytes(buf[pos:pos + 8], "little")
        yield buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        n = int.from_bytes(buf[pos:pos + 8], "little")
        pos += 8 + n
        n = int.from_bytes(buf[pos:pos + 8], "little")
        pos += 8 + 4 * n
        n = int.from_bytes(buf[pos:pos + 8], "little")
        pos += 8
        for _ in range(n):
            pos += 8 + int.from_bytes(buf[pos:pos + 8], "little")
        n = int.from_bytes(buf[pos:pos + 8], "little")
        pos += 8 + 4 * n


# --- TVM's own CUDA runtime reads it: a stub driver, in a child process --------------------------

_CHILD = textwrap.dedent("""
    import ctypes, sys
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the stub, before TVM loads its CUDA runtime
    import tvm, tvm_ffi
    from tvm.script import relax as R
    from tvm.support import nvcc
    assert tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True)
    assert not tvm.cuda(0).exist
    import tvm_rammer
    from tvm_rammer.host import cross
    from tvm_rammer.target import plain_target, resolve_target
    sys.path.insert(0, sys.argv[3])
    from test_cross_compile import MatmulRelu
    target = plain_target(resolve_target("rammer/nvidia-h200"))
    # what a GPU host builds: TVM's runtime compiles at codegen through the project's callback,
    # for the GPU it detects (an H200 here: TVM's detection answers as on one, 9.0 -> sm_90a)
    detect = nvcc.get_target_compute_version
    nvcc.get_target_compute_version = lambda t=None: detect(t) if t is not None else "9.0.a"
    ex = tvm.compile(MatmulRelu, target=target, relax_pipeline="default")
    ex.export_library(sys.argv[2] + "/gpu_host.so")
    def no_compile(code):
        raise AssertionError("the GPU host compiled CUDA at load")
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", no_compile, override=True)
    lib = tvm.runtime.load_module(sys.argv[2] + "/cross.so")
    (cuda,) = [m for m in lib.imports[0].imports if m.kind == "cuda"]
    assert cuda.is_runnable() and cuda.inspect_source("cuda") == ""
    assert cuda.get_function("fused_matmul_relu_kernel") is not None
    print("loaded")
""")


@pytest.mark.nvcc
def test_tvm_cuda_runtime_loads_it_as_a_gpu_hosts_build(h200, tmp_path, monkeypatch):
    """With a stub ``libcuda.so.1`` (every driver call fails: no device), TVM's CUDA runtime loads;
    it reads the cross-compiled library without compiling anything, and a build by TVM's runtime
    itself for an sm_90a GPU writes the same CUDA module, byte for byte."""
    if ctypes.util.find_library("cuda") or shutil.which("nvidia-smi"):
        pytest.skip("a real NVIDIA driver is here: no stub")
    cc, nm = shutil.which("cc"), shutil.which("nm")
    if not (cc and nm):
        pytest.skip("needs cc and nm to build the stub driver")
    runtime = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
    if not os.path.exists(runtime):
        pytest.skip("this TVM has no CUDA runtime library")
    names = subprocess.run([nm, "-D", "--undefined-only", runtime], capture_output=True, text=True,
                           check=True).stdout.split()
    symbols = sorted({n for n in names if n.startswith("cu") and n[2:3].isupper() and "@" not in n})
    (tmp_path / "stub.c").write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in symbols))
    stub = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                    str(tmp_path / "stub.c")], check=True)
    monkeypatch.setenv("TVM_RAMMER_BINARY_CACHE", "off")  # both compile, neither reads the other
    cross.export(_build(h200), str(tmp_path / "cross.so"), h200)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(stub), str(tmp_path),
                            os.path.dirname(__file__)], capture_output=True, text=True,
                           timeout=300, check=False)
    assert child.returncode == 0 and "loaded" in child.stdout, child.stderr[-3000:]
    (ours,) = cross.library_cuda_modules(str(tmp_path / "cross.so"))
    (theirs,) = cross.library_cuda_modules(str(tmp_path / "gpu_host.so"))
    assert (ours.fmt, ours.table, ours.code) == (theirs.fmt, theirs.table, theirs.code)
