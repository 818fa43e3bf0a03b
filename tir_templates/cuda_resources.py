"""Per-kernel resource usage (registers, static shared memory, spills) from ``nvcc -Xptxas -v``, and
the SASS of the cubin (``cuobjdump -sass``).

TVM 0.27 built without the CUDA runtime keeps only the CUDA *source* in its fallback module
(``tvm.tirx.build`` never calls nvcc/nvrtc here), so resource numbers for the vDevice occupancy
model come from compiling that source ourselves to a cubin for the given arch. The SASS shows which
machine instructions a kernel really uses (``HMMA`` = tensor cores, ``LDSM`` = ldmatrix,
``LDGSTS`` = asynchronous global-to-shared copies).
"""
import os
import re
import shutil
import subprocess
import tempfile

_REGISTERS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


class CudaCompileError(RuntimeError):
    """nvcc/ptxas failed; the message carries stderr, the source path and a command to reproduce."""


def find_tool(name: str):
    """Path of a CUDA tool: on PATH, else in a pip-installed NVIDIA package (``nvidia-cuda-cuobjdump``
    puts ``cuobjdump`` under ``site-packages/nvidia/cu*/bin``); None when neither has it."""
    path = shutil.which(name)
    if path is not None:
        return path
    try:
        import nvidia  # pylint: disable=import-outside-toplevel  (namespace package of the NVIDIA wheels)
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for sub in sorted(os.listdir(root)):
            candidate = os.path.join(root, sub, "bin", name)
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def _tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        hint = f" (pip install nvidia-cuda-{name})" if name in ("cuobjdump", "nvdisasm") else ""
        raise CudaCompileError(f"{name} not found on PATH; install the CUDA toolkit or add its bin/ to PATH{hint}")
    return path


def _nvcc() -> str:
    return _tool("nvcc")


def parse_ptxas_info(log: str) -> dict:
    """Max registers and smem over the entry functions in a ``-Xptxas -v`` log, total spill bytes and
    the largest stack frame (local-memory arrays that did not become registers)."""
    regs = [int(m) for m in _REGISTERS.findall(log)]
    if not regs:
        raise CudaCompileError(f"no 'Used N registers' line in ptxas output:\n{log}")
    smem = [int(m) for m in _SMEM.findall(log)]
    spills = sum(int(st) + int(ld) for st, ld in _SPILLS.findall(log))
    stack = [int(m) for m in _STACK.findall(log)]
    return {"registers": max(regs), "shared_bytes": max(smem, default=0), "spills": spills,
            "stack_bytes": max(stack, default=0)}


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def parse_ptxas_functions(log: str) -> dict:
    """{entry function: :func:`parse_ptxas_info` of its part} of a ``-Xptxas -v`` log of a module
    with several kernels (each part runs from its "Compiling entry function" line to the next)."""
    starts = list(_ENTRY.finditer(log))
    found = {}
    for match, after in zip(starts, starts[1:] + [None]):
        part = log[match.start():after.start() if after is not None else len(log)]
        found[match.group(1)] = parse_ptxas_info(part)
    return found


def _compile(source: str, arch: str, workdir: str) -> tuple:
    """(ptxas log, cubin path) of ``source`` compiled in ``workdir``."""
    src = os.path.join(workdir, "kernel.cu")
    cubin = os.path.join(workdir, "kernel.cubin")
    with open(src, "w", encoding="utf-8") as f:
        f.write(source)
    cmd = [_nvcc(), "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", cubin, src]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CudaCompileError(f"nvcc failed ({proc.returncode}) on {src}\n{proc.stderr}\n"
                               f"reproduce with: {' '.join(cmd)}")
    return proc.stderr + proc.stdout, cubin


def compile_cuda_resources(source: str, arch: str) -> dict:
    """Compile CUDA ``source`` to a cubin for ``arch`` (e.g. "sm_90a") and report its resources.

    Returns ``dict(registers=int, shared_bytes=int, spills=int, stack_bytes=int)``.
    """
    workdir = tempfile.mkdtemp(prefix="rammer_cuda_")
    log, _ = _compile(source, arch, workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    return parse_ptxas_info(log)


def compile_cuda_resources_per_kernel(source: str, arch: str) -> dict:
    """{kernel name: :func:`compile_cuda_resources`' dict} of CUDA ``source`` holding several
    kernels, from one nvcc run."""
    workdir = tempfile.mkdtemp(prefix="rammer_cuda_")
    try:
        log, _ = _compile(source, arch, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return parse_ptxas_functions(log)


def compile_cuda_sass(source: str, arch: str) -> tuple:
    """Compile CUDA ``source`` for ``arch`` and return ``(resources, sass)``: the
    :func:`compile_cuda_resources` dict and the cubin's SASS text (``cuobjdump -sass``)."""
    workdir = tempfile.mkdtemp(prefix="rammer_cuda_")
    try:
        log, cubin = _compile(source, arch, workdir)
        cuobjdump = _tool("cuobjdump")
        # cuobjdump -sass runs nvdisasm: let it find the one beside it (the pip wheels install both)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([os.path.dirname(cuobjdump), env.get("PATH", "")])
        nvdisasm = find_tool("nvdisasm")
        if nvdisasm is not None:
            env.setdefault("NVDISASM_PATH", os.path.dirname(nvdisasm))
        cmd = [cuobjdump, "-sass", cubin]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            raise CudaCompileError(f"cuobjdump failed ({proc.returncode}):\n{proc.stderr}")
        return parse_ptxas_info(log), proc.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def sass_opcodes(sass: str) -> dict:
    """{opcode: count} of a ``cuobjdump -sass`` listing (``HMMA.16816.F32`` counts as ``HMMA``)."""
    counts: dict = {}
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        op = match.group(1)
        counts[op] = counts.get(op, 0) + 1
    return counts


def sass_functions(sass: str) -> dict:
    """{kernel name: its SASS} of a ``cuobjdump -sass`` listing (split at its "Function : " lines)."""
    found, name = {}, None
    for line in sass.splitlines():
        match = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if match:
            name = match.group(1)
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return {k: "\n".join(v) for k, v in found.items()}
