"""The L2 bandwidth kernel reads the buffer on every pass (issue 21, defect 5): in the PTX nvcc
makes of it, every global load sits inside the pass loop. Before the fix nvcc hoisted all 15 loads
out of the 32-pass loop and ``l2_read_rate`` reported ~32x the real bandwidth; the negative
control below is that kernel, and the check finds its hoisted loads."""
import re
import shutil
import subprocess

import pytest
import tvm

from tvm_rammer.benchmarks import floor as fl
from tvm_rammer.codegen.resources import cuda_source

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _ptx(func, tmp_path) -> str:
    src = tmp_path / "k.cu"
    src.write_text(cuda_source(func, TARGET))
    out = tmp_path / "k.ptx"
    subprocess.run(["nvcc", "-ptx", "-O3", "-arch=sm_90a", str(src), "-o", str(out)], check=True,
                   capture_output=True)
    return out.read_text()


def loads_by_place(ptx: str) -> tuple:
    """(global loads outside every loop, global loads inside one): a loop is the lines from a
    label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\$\w+):", ln))}
    loops = [(labels[m.group(1)], j) for j, ln in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", ln)) and labels.get(m.group(1), j) < j]
    outside = inside = 0
    for i, ln in enumerate(lines):
        if "ld.global" in ln:
            if any(a < i < b for a, b in loops):
                inside += 1
            else:
                outside += 1
    return outside, inside


def _hoistable_kernel(passes: int = fl.L2_PASSES, blocks: int = 1056, threads: int = 256):
    """The kernel before the fix: pass ``p`` reads the same addresses as every other pass."""
    from tvm.script import tirx as T

    n = fl.L2_MIB * (1 << 20) // 4
    total = blocks * threads
    per_thread = n // total

    @T.prim_func(s_tir=True)
    def read_l2(x: T.Buffer((n,), "float32"), out: T.Buffer((total,), "float32")):
        T.func_attr({"global_symbol": "read_l2", "tirx.noalias": True})
        acc = T.sblock_alloc_buffer((total,), "float32", scope="local")
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for t in T.thread_binding(threads, thread="threadIdx.x"):
                for p, k in T.grid(passes, per_thread):
                    with T.sblock("read"):
                        vb, vt, vp, vk = T.axis.remap("SSRR", [b, t, p, k])
                        with T.init():
                            acc[vb * threads + vt] = T.float32(0)
                        acc[vb * threads + vt] = acc[vb * threads + vt] + x[vk * total + vb * threads + vt]
                with T.sblock("write"):
                    vb, vt = T.axis.remap("SS", [b, t])
                    out[vb * threads + vt] = acc[vb * threads + vt]

    return read_l2


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_every_load_of_the_l2_kernel_is_inside_the_pass_loop(tmp_path):
    outside, inside = loads_by_place(_ptx(fl.l2_read_kernel(), tmp_path))
    assert outside == 0 and inside > 0


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_check_finds_the_hoisted_loads_of_the_old_kernel(tmp_path):
    outside, _ = loads_by_place(_ptx(_hoistable_kernel(), tmp_path))
    assert outside >= 1


def test_the_rate_counts_the_bytes_a_pass_really_reads():
    # 16 MiB over 1056 x 256 threads: 15 whole float32 per thread, the tail never read
    assert fl.l2_bytes_per_pass() == 15 * 1056 * 256 * 4 < fl.L2_MIB * (1 << 20)
    assert fl.l2_bytes_per_pass(mib=1, blocks=4, threads=32) == 1 << 20
