"""Kernel versions checked and timed on the GPU host of a lease (issue 31, item 4).

Reads the manifest ``tvm_rammer.lease.kernels`` wrote (``kernels.json``, format :data:`FORMAT`) and
the libraries beside it; for each kernel, in the manifest's order: seeded random inputs (the same
for an operator's reference and its versions), TVM's default kernel (the reference) run once for
its outputs, the version run on outputs filled with NaN (an output it does not write fails the
check) and compared with the reference's (``valid`` when the relative error is within the
tolerance of the outputs' dtype), then timed with the runtime's ``time_evaluator`` (median of
``repeat`` measurements of ``number`` calls, after a warm-up). One JSON line per kernel is appended
to the results file as it finishes, so a cut run keeps what it did; a second run skips the keys
already there (it continues).

Runtime-only: this file imports numpy, the standard library and TVM's runtime, nothing of TVM's
compiler nor of the rest of tvm_rammer, and runs as a script under ``TVM_USE_RUNTIME_LIB=1``::

    python3 tvm_rammer/runtime/kernel_timing.py DIR/kernels.json --out results.jsonl --budget-s 120

Bounded: the kernels are run by a child process (this script again, ``--child``) that a supervisor
watches; past ``--budget-s`` it is stopped, a kernel that runs longer than ``--kernel-timeout-s`` is
killed and recorded as timed out, and a kernel that fails (an illegal address leaves the CUDA
context dead) ends its child: the next child, in a fresh context, continues after it. Without the
manifest's device here (no GPU) it lists what it would time and exits 0.

An rProgram (role "rprogram", ``tvm_rammer.lease.rprograms``): its persistent kernel run with the
manifest's fixed arguments (``fixed``: param -> .npy file beside the manifest: the program table,
the fault page) and seeded data for the rest, as the profiler times one (``measure.
_time_kernel_worker``): a warm-up run, its fault page checked (a barrier wait that gave up is a
failed run, not a time), timed, the page checked again. Nothing is compared: its result is its
time (``valid`` true), which ``kernel_results`` records under its key, the back end's.

A result line: ``{"key", "label", "operator", "role", "reference", "library", "function",
"kernel_us", "default_us", "valid", "error", "tolerance", "registers", "shared_bytes", "seconds",
"reason"}`` (``reason`` only for a failure: "load failed: ...", "run failed: ...", "timed out: ...",
"reference failed: ...", or an invalid version's error).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

FORMAT = "tvm-rammer-kernels/1"
TOLERANCES = {"float16": 1e-2, "bfloat16": 2e-2}  # float32 and others: KERNEL_TOLERANCE
KERNEL_TOLERANCE = 1e-4
STOPPED = 3  # a child's exit status after a failed kernel: the supervisor starts the next one
RESULTS = "kernel_results.jsonl"  # the results file in an output folder given as --out
CURRENT = ".current"  # beside the results: the key the child is running (the supervisor reads it)


def seeded_array(shape, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Kernel input: floats uniform in [-1, 1), booleans 0/1, integers 0 (an index in range for
    every axis), as ``tvm_rammer.numerics.seeded_array``."""
    shape = [int(d) for d in shape]
    if dtype.startswith(("float", "bfloat")):
        return rng.uniform(-1, 1, size=shape).astype("float32").astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; infinite for another shape or any NaN/inf in ``out``."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tolerance_for(dtypes) -> float:
    return max([KERNEL_TOLERANCE, *(TOLERANCES.get(str(d), KERNEL_TOLERANCE) for d in dtypes)])


def read_manifest(path: str) -> dict:
    """The manifest at ``path`` (ValueError naming the problem when it is not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"kernel manifest {path!r} is not readable JSON ({err}); run the lease's "
                         "prepare again") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a kernel manifest ({FORMAT}); pass the kernels.json "
                         "that tvm_rammer.lease.kernels.prepare_kernels wrote")
    return doc


def read_results(path: str) -> list:
    """The result lines of ``path`` ([] when absent; a line cut by a kill is skipped)."""
    if not os.path.exists(path):
        return []
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return lines


def _device(device_type: str):
    """The TVM device of the manifest here, or None (no such device on this host)."""
    import tvm

    if device_type == "cpu":
        return tvm.cpu(0)
    if device_type != "cuda":
        return None
    try:
        import tvm_ffi

        if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is None:
            import ctypes  # under TVM_USE_RUNTIME_LIB=1 TVM's CUDA runtime is not loaded itself

            lib = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except (OSError, RuntimeError, AttributeError):
        return None


def _append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


class _Runner:
    """Runs a manifest's kernels on ``dev`` (the child's work)."""

    def __init__(self, manifest: dict, directory: str, dev, number: int, repeat: int, seed: int):
        self.manifest, self.dir, self.dev = manifest, directory, dev
        self.number, self.repeat, self.seed = number, repeat, seed
        self.by_key = {k["key"]: k for k in manifest["kernels"]}
        self._libs: dict = {}
        self._ref_out: dict = {}  # reference key -> its outputs (numpy)
        self.ref_us: dict = {}  # reference key -> its time (us)
        self._fixed: dict = {}  # .npy path -> its array

    def lib(self, name: str):
        import tvm

        if name not in self._libs:
            self._libs[name] = tvm.runtime.load_module(os.path.join(self.dir, name))
        return self._libs[name]

    def _args(self, kernel: dict, fill) -> tuple:
        import tvm

        params, n_out = kernel["params"], kernel["num_outputs"]
        rng = np.random.default_rng(self.seed)
        inputs = [seeded_array(shape, dtype, rng) for _, shape, dtype in params[:len(params) - n_out]]
        outputs = [np.full(shape, fill if dtype.startswith(("float", "bfloat")) else 0, dtype=dtype)
                   for _, shape, dtype in params[len(params) - n_out:]]
        return [tvm.runtime.tensor(a, self.dev) for a in inputs + outputs], len(inputs)

    def _run(self, kernel: dict, fill) -> tuple:
        func = self.lib(kernel["library"])[kernel["function"]]
        args, first_out = self._args(kernel, fill)
        func(*args)
        self.dev.sync()
        return args, [a.numpy() for a in args[first_out:]]

    def _time(self, kernel: dict, args) -> float:
        timer = self.lib(kernel["library"]).time_evaluator(kernel["function"], self.dev,
                                                           number=self.number, repeat=self.repeat,
                                                           min_repeat_ms=1)
        return float(np.median(timer(*args).results)) * 1e6

    def fixed(self, path: str) -> np.ndarray:
        """A fixed argument's array (a .npy file, relative to the manifest's folder)."""
        if path not in self._fixed:
            self._fixed[path] = np.load(os.path.join(self.dir, path), allow_pickle=False)
        return self._fixed[path]

    def _check_fault_page(self, kernel: dict, args: list) -> None:
        """Raise when the kernel recorded a fault in its page (word 0 not zero)."""
        name = kernel.get("fault_page")
        for (param, _, _), arg in zip(kernel["params"], args):
            if name and param == name and int(arg.numpy()[0]) != 0:
                raise RuntimeError(f"fault page: a barrier wait or the grid barrier gave up "
                                   f"({arg.numpy()[:9].tolist()})")

    def measure_rprogram(self, kernel: dict) -> dict:
        """An rProgram's time: fixed arguments as given, seeded data for the rest (outputs
        included), a warm-up run, the fault page checked before and after the timing."""
        import tvm

        rng = np.random.default_rng(self.seed)
        fixed = kernel.get("fixed") or {}
        arrays = [self.fixed(fixed[name]) if name in fixed else seeded_array(shape, dtype, rng)
                  for name, shape, dtype in kernel["params"]]
        args = [tvm.runtime.tensor(a, self.dev) for a in arrays]
        self.lib(kernel["library"])[kernel["function"]](*args)
        self.dev.sync()
        self._check_fault_page(kernel, args)
        us = self._time(kernel, args)
        self._check_fault_page(kernel, args)
        return {"kernel_us": us, "default_us": None, "valid": True, "error": None,
                "tolerance": None}

    def reference_outputs(self, key: str) -> list:
        if key not in self._ref_out:
            self._ref_out[key] = self._run(self.by_key[key], 0.0)[1]
        return self._ref_out[key]

    def measure(self, kernel: dict) -> dict:
        """One kernel's result (without the fields copied from the manifest)."""
        if kernel["role"] == "rprogram":
            return self.measure_rprogram(kernel)
        dtypes = [d for _, _, d in kernel["params"][len(kernel["params"]) - kernel["num_outputs"]:]]
        tolerance = tolerance_for(dtypes)
        if kernel["role"] == "reference":
            args, outs = self._run(kernel, 0.0)
            self._ref_out[kernel["key"]] = outs
            us = self._time(kernel, args)
            self.ref_us[kernel["key"]] = us
            return {"kernel_us": us, "default_us": us, "valid": True, "error": 0.0,
                    "tolerance": tolerance}
        try:
            ref = self.reference_outputs(kernel["reference"])
        except Exception as err:  # pylint: disable=broad-except  (nothing to check it against)
            return {"kernel_us": None, "valid": None, "error": None,
                    "reason": f"reference failed: {_first_line(err)}"}
        args, outs = self._run(kernel, np.nan)
        error = max((relative_error(o, r) for o, r in zip(outs, ref)), default=0.0)
        record = {"kernel_us": self._time(kernel, args), "default_us": self.ref_us.get(kernel["reference"]),
                  "valid": bool(error <= tolerance), "error": error, "tolerance": tolerance}
        if not record["valid"]:
            record["reason"] = (f"output differs from TVM's default kernel: relative error "
                                f"{error:.2e} > {tolerance:.0e}")
        return record


def _fields(kernel: dict) -> dict:
    return {k: kernel.get(k) for k in ("key", "label", "operator", "role", "reference", "library",
                                       "function", "registers", "shared_bytes", "model",
                                       "references")}


def pending(manifest: dict, out_path: str) -> list:
    """The manifest's kernels without a result line in ``out_path`` yet, in order."""
    done = {r.get("key") for r in read_results(out_path)}
    return [k for k in manifest["kernels"] if k["key"] not in done]


def run_child(manifest_path: str, out_path: str, deadline: float | None, number: int = 10,
              repeat: int = 5, seed: int = 0) -> int:
    """Check and time the pending kernels until ``deadline`` (``time.time()``); 0 when done or
    out of time, :data:`STOPPED` after a failed run (the CUDA context may be dead)."""
    manifest = read_manifest(manifest_path)
    dev = _device(manifest["device_type"])
    runner = _Runner(manifest, os.path.dirname(os.path.abspath(manifest_path)), dev, number, repeat, seed)
    current = out_path + CURRENT
    for kernel in pending(manifest, out_path):
        if deadline is not None and time.time() >= deadline:
            return 0
        with open(current, "w", encoding="utf-8") as f:
            f.write(kernel["key"])
        start = time.perf_counter()
        try:
            runner.lib(kernel["library"])
            for path in (kernel.get("fixed") or {}).values():  # an rProgram's: a missing file is
                runner.fixed(path)                             # the lease's fault, not the kernel's
        except Exception as err:  # pylint: disable=broad-except  (each of its kernels says so)
            _append(out_path, {**_fields(kernel), "kernel_us": None, "valid": None, "error": None,
                               "reason": f"load failed: {_first_line(err)}",
                               "seconds": round(time.perf_counter() - start, 3)})
            continue
        try:
            record = runner.measure(kernel)
        except Exception as err:  # pylint: disable=broad-except
            _append(out_path, {**_fields(kernel), "kernel_us": None, "valid": None, "error": None,
                               "reason": f"run failed: {_first_line(err)}",
                               "seconds": round(time.perf_counter() - start, 3)})
            if manifest["device_type"] == "cuda":  # the context may be dead: a fresh process
                os.remove(current)
                return STOPPED
            continue
        _append(out_path, {**_fields(kernel), **record, "seconds": round(time.perf_counter() - start, 3)})
    if os.path.exists(current):
        os.remove(current)
    return 0


def listing(manifest: dict, out_path: str) -> str:
    """What a run would time: per library its pending kernels (a host without the device)."""
    todo = pending(manifest, out_path)
    libs: dict = {}
    for k in todo:
        libs.setdefault(k["library"], []).append(k["label"])
    lines = [f"kernel timing: no {manifest['device_type']} device here; would time {len(todo)} "
             f"kernel(s) in {len(libs)} librar{'y' if len(libs) == 1 else 'ies'}"]
    for name, labels in libs.items():
        lines.append(f"  {name}: {len(labels)}: {', '.join(labels[:4])}"
                     + (f" and {len(labels) - 4} more" if len(labels) > 4 else ""))
    return "\n".join(lines)


def time_kernels(manifest_path: str, out_path: str, budget_s: float | None = None,
                 kernel_timeout_s: float = 60.0, number: int = 10, repeat: int = 5,
                 seed: int = 0, poll_s: float = 0.2) -> dict:
    """Time the manifest's pending kernels in child processes (module docstring) within
    ``budget_s`` seconds; returns ``{"timed", "left", "failed", "stopped"}`` (``stopped``: why it
    ended early: "budget", or None). Without the device here nothing runs (``left`` says what)."""
    manifest = read_manifest(manifest_path)
    before = len(read_results(out_path))
    if _device(manifest["device_type"]) is None:
        print(listing(manifest, out_path))
        return {"timed": 0, "left": len(pending(manifest, out_path)), "failed": 0, "stopped": "no device"}
    start = time.time()
    deadline = None if budget_s is None else start + budget_s
    stopped = None
    while pending(manifest, out_path):
        if deadline is not None and time.time() >= deadline:
            stopped = "budget"
            break
        cmd = [sys.executable, os.path.abspath(__file__), manifest_path, "--out", out_path,
               "--child", "--number", str(number), "--repeat", str(repeat), "--seed", str(seed)]
        if deadline is not None:
            cmd += ["--deadline", repr(deadline)]
        code = _supervise(cmd, out_path, deadline, kernel_timeout_s, poll_s)
        if code not in (0, STOPPED, None):
            stopped = f"child exit status {code}"
            break
        if code == 0 and deadline is not None and time.time() >= deadline and pending(manifest, out_path):
            stopped = "budget"
            break
    results = read_results(out_path)[before:]
    return {"timed": len(results), "left": len(pending(manifest, out_path)),
            "failed": sum(1 for r in results if r.get("kernel_us") is None), "stopped": stopped}


def _supervise(cmd: list, out_path: str, deadline: float | None, kernel_timeout_s: float,
               poll_s: float):
    """Run one child; kill it when a kernel runs past ``kernel_timeout_s`` (recorded as timed
    out: the next child goes on after it) or past ``deadline`` (its kernel stays pending).
    Returns the child's exit status (None when it was killed)."""
    current = out_path + CURRENT
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    seen, since = None, time.time()
    while proc.poll() is None:
        time.sleep(poll_s)
        key = open(current, encoding="utf-8").read().strip() if os.path.exists(current) else None
        if key != seen:
            seen, since = key, time.time()
        past_deadline = deadline is not None and time.time() >= deadline + poll_s
        if (key is not None and time.time() - since > kernel_timeout_s) or past_deadline:
            proc.kill()
            proc.wait()
            if key is not None and not past_deadline:
                _append(out_path, {"key": key, "kernel_us": None, "valid": None, "error": None,
                                   "reason": f"timed out: no result within {kernel_timeout_s:g} s",
                                   "seconds": round(time.time() - since, 3)})
            if os.path.exists(current):
                os.remove(current)
            return None
    return proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check and time a lease's kernel versions.")
    parser.add_argument("manifest", help="kernels.json written by the lease's prepare")
    parser.add_argument("--out", required=True,
                        help=f"results file (JSON lines, appended), or a folder (then its {RESULTS})")
    parser.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--kernel-timeout-s", type=float, default=60.0)
    parser.add_argument("--number", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.path.isdir(args.out):  # the lease step's output folder
        args.out = os.path.join(args.out, RESULTS)
    try:
        if args.child:
            return run_child(args.manifest, args.out, args.deadline, args.number, args.repeat, args.seed)
        summary = time_kernels(args.manifest, args.out, args.budget_s, args.kernel_timeout_s,
                               args.number, args.repeat, args.seed)
    except ValueError as err:
        print(f"kernel timing: {err}", file=sys.stderr)
        return 2
    print(f"kernel timing: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
