"""Per-kernel resource usage (registers, static shared memory, spills) from ``nvcc -Xptxas -v``.

TVM 0.27 built without the CUDA runtime keeps only the CUDA *source* in its fallback module
(``tvm.tirx.build`` never calls nvcc/nvrtc here), so resource numbers for the vDevice occupancy
model come from compiling that source ourselves to a cubin for the given arch.
"""
import os
import re
import shutil
import subprocess
import tempfile

_REGISTERS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class CudaCompileError(RuntimeError):
    """nvcc/ptxas failed; the message carries stderr, the source path and a command to reproduce."""


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaCompileError("nvcc not found on PATH; install the CUDA toolkit or add its bin/ to PATH")
    return nvcc


def parse_ptxas_info(log: str) -> dict:
    """Max registers and smem over the entry functions in a ``-Xptxas -v`` log, total spill bytes."""
    regs = [int(m) for m in _REGISTERS.findall(log)]
    if not regs:
        raise CudaCompileError(f"no 'Used N registers' line in ptxas output:\n{log}")
    smem = [int(m) for m in _SMEM.findall(log)]
    spills = sum(int(st) + int(ld) for st, ld in _SPILLS.findall(log))
    return {"registers": max(regs), "shared_bytes": max(smem, default=0), "spills": spills}


def compile_cuda_resources(source: str, arch: str) -> dict:
    """Compile CUDA ``source`` to a cubin for ``arch`` (e.g. "sm_90a") and report its resources.

    Returns ``dict(registers=int, shared_bytes=int, spills=int)``.
    """
    nvcc = _nvcc()
    workdir = tempfile.mkdtemp(prefix="rammer_cuda_")
    src = os.path.join(workdir, "kernel.cu")
    with open(src, "w", encoding="utf-8") as f:
        f.write(source)
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", os.path.join(workdir, "kernel.cubin"), src]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CudaCompileError(f"nvcc failed ({proc.returncode}) on {src}\n{proc.stderr}\n"
                               f"reproduce with: {' '.join(cmd)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return parse_ptxas_info(proc.stderr + proc.stdout)
