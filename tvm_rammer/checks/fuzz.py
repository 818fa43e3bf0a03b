"""Fuzz the whole pipeline: random ONNX DAGs down to the rProgram table, checked by the executor.

``python3 -m tvm_rammer.checks.fuzz --graphs N --seed S`` (or ``tvm-rammer fuzz``) builds N random graphs
(:func:`random_graph`: NASBench-style cells, wide fan-in and fan-out, long chains, shared weights,
multi-output and tuple-output operators, constants, reshape views, varied tensor sizes so that the
kernels' thread counts differ), lowers each with the rammer pipeline under a random configuration
(vEU width, SMs, vEUs per SM, merge rule) and checks every persistent kernel's table with the
reference executor (``tvm_rammer.codegen.executor``) under many interleavings. With ``--gpu`` on a machine
with a CUDA GPU each graph is also compiled, run and compared with onnxruntime. With ``--emulate``
each graph is lowered for a small vDevice (:func:`emulated_options`: at most 2 SMs x 2 vEUs), its
tables checked as above, and its CUDA executed on the CPU emulator (``tvm_rammer.checks.emulator``; a C++
compiler needed) against onnxruntime at ``numerics.model_tolerance``.

A failure is any exception while lowering, any problem the executor reports, a worker that hangs
past the time limit or dies, or (``--gpu``, ``--emulate``) a fault, a deadlock or a wrong result. Each failing graph is shrunk
(:func:`minimise`: nodes dropped while the same kind of failure remains) and saved with its seed as
``OUT/graph-<seed>-<index>.onnx`` plus a ``.json`` with the configuration and the problem. The
last line printed is ``N graphs, K failures``; the exit status is 1 when K > 0. Graphs TVM's
default pipeline cannot compile (``codegen.tvm_default``) and tvm-rammer compiles are listed apart
(``TVM's default fails: N``): TVM's failures, not tvm-rammer's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

OPSET = 17
IR_VERSION = 9
STYLES = ("random", "chain", "fan_out", "fan_in", "cell")
SIZES = (8, 16, 24, 32, 48, 64, 96, 128, 256)
DEFAULT_TIMEOUT_S = 300.0


# --- random graphs ----------------------------------------------------------------------------

class _Builder:
    """ONNX nodes over [rows, width] float32 tensors, with the shapes of every tensor known."""

    def __init__(self, rng, rows: int, width: int):
        from onnx import TensorProto

        self.rng, self.rows, self.width = rng, rows, width
        self.float = TensorProto.FLOAT
        self.nodes, self.inits, self.shapes = [], [], {}
        self.weights = {}  # shape -> initializer names (shared weights reuse them)
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def weight(self, *shape) -> str:
        from onnx import numpy_helper

        shared = self.weights.get(shape, [])
        if shared and self.rng.random() < 0.35:
            return shared[int(self.rng.integers(len(shared)))]
        data = (self.rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32")
        name = self.name("w")
        self.inits.append(numpy_helper.from_array(data, name))
        self.weights.setdefault(shape, []).append(name)
        return name

    def int64s(self, values) -> str:
        from onnx import numpy_helper

        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.array(values, dtype="int64"), name))
        return name

    def op(self, op_type, inputs, shape, outputs=1, **attrs):
        from onnx import helper

        names = [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        for n in names:
            self.shapes[n] = tuple(shape)
        return names[0] if outputs == 1 else names

    def constant(self) -> str:
        from onnx import helper, numpy_helper

        name = self.name("const")
        value = self.rng.standard_normal((self.rows, self.width)).astype("float32")
        self.nodes.append(helper.make_node("Constant", [], [name],
                                           value=numpy_helper.from_array(value, name + "_v")))
        self.shapes[name] = (self.rows, self.width)
        return name


def _step(b: _Builder, pool: list, pick) -> str:
    """One random operator over tensors of ``pool`` (all [rows, width]); returns its output."""
    rows, w = b.rows, b.width
    shape = (rows, w)
    choice = b.rng.choice(["matmul", "gemm", "binary", "unary", "softmax", "reduce", "concat",
                           "split", "reshape", "sum", "constant", "conv"],
                          p=[.17, .06, .16, .16, .05, .06, .07, .07, .06, .05, .03, .06])
    x = pick()
    if choice == "matmul":
        return b.op("MatMul", [x, b.weight(w, w)], shape)
    if choice == "gemm":
        return b.op("Gemm", [x, b.weight(w, w), b.weight(w)], shape)
    if choice == "binary":
        op = str(b.rng.choice(["Add", "Mul", "Sub", "Max"]))
        return b.op(op, [x, pick()], shape)
    if choice == "unary":
        return b.op(str(b.rng.choice(["Relu", "Sigmoid", "Tanh", "Neg", "Abs"])), [x], shape)
    if choice == "softmax":
        return b.op("Softmax", [x], shape, axis=-1)
    if choice == "reduce":
        op = str(b.rng.choice(["ReduceMean", "ReduceMax"]))
        red = b.op(op, [x], (rows, 1), axes=[1], keepdims=1) if op == "ReduceMax" else \
            b.op(op, [x], (rows, 1), axes=[1], keepdims=1)
        return b.op("Sub", [x, red], shape)
    if choice == "concat":
        k = int(b.rng.integers(2, 5))
        parts = [pick() for _ in range(k)]
        cat = b.op("Concat", parts, (rows, w * k), axis=1)
        return b.op("MatMul", [cat, b.weight(w * k, w)], shape)
    if choice == "split" and w % 2 == 0:
        lo, hi = b.op("Split", [x, b.int64s([w // 2, w // 2])], (rows, w // 2), outputs=2, axis=1)
        if b.rng.random() < 0.4:  # one output read only
            return b.op("MatMul", [lo, b.weight(w // 2, w)], shape)
        return b.op("Concat", [b.op("Relu", [hi], (rows, w // 2)), lo], shape, axis=1)
    if choice == "reshape" and w % 2 == 0:
        view = b.op("Reshape", [x, b.int64s([rows, 2, w // 2])], (rows, 2, w // 2))
        back = b.op("Transpose", [view], (rows, w // 2, 2), perm=[0, 2, 1]) \
            if b.rng.random() < 0.5 else view
        return b.op("Reshape", [back, b.int64s([rows, w])], shape)
    if choice == "sum":
        return b.op("Sum", [pick() for _ in range(int(b.rng.integers(2, 5)))], shape)
    if choice == "constant":
        return b.op("Add", [x, b.constant()], shape)
    if choice == "conv" and rows == 1:
        side = int(np.sqrt(w // 4)) if w >= 16 else 0
        if side and 4 * side * side == w:
            img = b.op("Reshape", [x, b.int64s([1, 4, side, side])], (1, 4, side, side))
            k = int(b.rng.choice([1, 3]))
            conv = b.op("Conv", [img, b.weight(4, 4, k, k)], (1, 4, side, side), pads=[k // 2] * 4)
            if b.rng.random() < 0.5:
                conv = b.op("MaxPool", [conv], (1, 4, side, side), kernel_shape=[3, 3], pads=[1] * 4)
            return b.op("Reshape", [conv, b.int64s([1, w])], shape)
    return b.op("Relu", [x], shape)


def random_graph(seed: int, index: int):
    """``(ModelProto, description)`` of graph ``index`` of ``seed`` (deterministic)."""
    from onnx import helper

    rng = np.random.default_rng([seed, index])
    style = str(rng.choice(STYLES))
    width = int(rng.choice([s for s in SIZES if s >= 8]))
    if style == "cell":
        width = int(rng.choice([16, 64, 256]))  # 4 * s * s: the conv steps apply
    rows = 1 if style == "cell" or rng.random() < 0.6 else int(rng.choice([2, 3, 4]))
    num_ops = int(rng.integers(3, 13))
    b = _Builder(rng, rows, width)
    inputs = ["x"] if rng.random() < 0.7 else ["x", "y"]
    for name in inputs:
        b.shapes[name] = (rows, width)
    pool = list(inputs)

    def pick():
        if style == "chain":
            return pool[-1]
        if style == "fan_out":
            return pool[0] if rng.random() < 0.7 else pool[int(rng.integers(len(pool)))]
        if style == "fan_in" or style == "cell":
            return pool[int(rng.integers(len(pool)))]
        return pool[int(rng.integers(max(0, len(pool) - 4), len(pool)))]

    if style == "fan_in":
        heads = [_step(b, pool, lambda: pool[0]) for _ in range(num_ops)]
        pool += heads
        pool.append(b.op("Sum", heads, (rows, width)) if len(heads) > 1 else heads[0])
    else:
        for _ in range(num_ops):
            pool.append(_step(b, pool, pick))
    read = {name for node in b.nodes for name in node.input}
    outputs = [t for t in pool if t not in read and t not in inputs] or [pool[-1]]
    graph = helper.make_graph(
        b.nodes, f"fuzz_{seed}_{index}",
        [helper.make_tensor_value_info(n, b.float, list(b.shapes[n])) for n in inputs],
        [helper.make_tensor_value_info(n, b.float, list(b.shapes[n])) for n in outputs],
        initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model, {"style": style, "rows": rows, "width": width, "ops": len(b.nodes)}


def random_config(seed: int, index: int) -> dict:
    """RammerConfig options of graph ``index``: vEU width, SMs, vEUs per SM, merge rule."""
    rng = np.random.default_rng([seed, index, 1])
    return {"max_rtask_threads": int(rng.choice([64, 128, 256, 512])),
            "num_sms": int(rng.choice([1, 2, 4, 8, 132])),
            "veus_per_sm": None if rng.random() < 0.5 else int(rng.choice([1, 2, 4])),
            "merge": str(rng.choice(["paper", "always", "never"]))}


EMULATED_VDEVICE = (2, 2)  # at most this many SMs x vEUs per SM when a graph is emulated


def emulated_options(options: dict) -> dict:
    """``options`` (:func:`random_config`) on a small vDevice, so the emulator (every CUDA thread a
    fiber) runs the graph in well under a second: at most :data:`EMULATED_VDEVICE` SMs x vEUs."""
    sms, veus = EMULATED_VDEVICE
    return {**options, "num_sms": min(int(options.get("num_sms") or sms), sms),
            "veus_per_sm": min(int(options.get("veus_per_sm") or veus), veus)}


# --- checking one graph -----------------------------------------------------------------------

def check_graph(model_bytes: bytes, options: dict, trials: int = 8, gpu: bool = False,
                seed: int = 0, emulate: bool = False) -> dict:
    """Lower one graph and check its tables: {"status": "ok"/"fail", "stage", "problems", ...};
    ``emulate``: on :func:`emulated_options`' vDevice, then also run on the CPU emulator (stage
    "emulate" on a failure, ``max_rel_err`` and ``gxx_s`` when it matched)."""
    import onnx

    from ..config import RammerConfig
    from ..codegen.executor import check_module
    from ..driver.frontend import import_onnx, lower
    from ..driver.launches import count_launches

    start = time.monotonic()
    proto = onnx.load_from_string(model_bytes)
    out = {"status": "ok", "stage": "", "problems": [], "rprograms": 0, "launches": None}
    try:
        mod = import_onnx(proto)
    except ValueError as err:  # the generator made something TVM's frontend refuses: not ours
        out.update(status="skipped", stage="import", problems=[str(err)])
        return out
    config = RammerConfig(profile=False, **(emulated_options(options) if emulate else options))
    try:
        lowered = lower(mod, "rammer/nvidia-h100", config)
        out["launches"] = count_launches(lowered)
    except Exception as err:  # noqa: BLE001  (any failure to lower is a finding)
        out.update(status="fail", stage="lower", problems=[_first_line(err)])
        return out
    out["default_unavailable"] = _default_unavailable(mod, lowered)
    checked = check_module(lowered, trials=trials, seed=seed)
    out["rprograms"] = len(checked)
    problems = [f"{kernel}: {p}" for kernel, ps in checked.items() for p in ps]
    if problems:
        out.update(status="fail", stage="executor", problems=problems[:5])
    elif gpu:
        out.update(_gpu_check(proto, mod, config))
    elif emulate:
        out.update(_emulator_check(proto, lowered, config))
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


def _default_unavailable(mod, lowered) -> str | None:
    """Why TVM's default pipeline cannot compile the graph (one line), or None when it can: read
    from the rammer pipeline's lowering when it already tried (``_fewer_launches``), else tried
    here. Not a failure of the graph: TVM's own, counted apart."""
    from ..codegen.tvm_default import DefaultPipelineFailed, lower_default
    from ..driver.pipeline import DEFAULT_UNAVAILABLE_ATTR

    attrs = lowered.attrs or {}
    if DEFAULT_UNAVAILABLE_ATTR in attrs:
        return str(attrs[DEFAULT_UNAVAILABLE_ATTR])
    try:
        lower_default(mod, "rammer/nvidia-h100")
    except DefaultPipelineFailed as err:
        return err.reason
    return None


def _gpu_check(proto, mod, config, tolerance: float = 1e-4) -> dict:
    """Compile, run on the local GPU and compare with onnxruntime."""
    import tvm
    from tvm import relax

    from ..codegen import faults
    from ..driver.frontend import compile as rammer_compile
    from ..numerics import relative_error
    from ..run.runner import _flatten, onnx_reference, random_inputs

    try:
        feeds = random_inputs(proto, seed=1)
        names = [v.name for v in proto.graph.input if v.name in feeds]
        reference = onnx_reference(proto, feeds)
        ex = rammer_compile(mod, config=config)
        vm = relax.VirtualMachine(ex, tvm.cuda(0))
        outs = _flatten(vm["main"](*[tvm.runtime.tensor(feeds[n], tvm.cuda(0)) for n in names]))
        faults.check(vm)
    except Exception as err:  # noqa: BLE001
        return {"status": "fail", "stage": "gpu", "problems": [_first_line(err)]}
    worst = max((relative_error(o, r) for o, r in zip(outs, reference)), default=0.0)
    if len(outs) != len(reference) or not worst <= tolerance:
        return {"status": "fail", "stage": "gpu",
                "problems": [f"max relative error {worst:.3g} > {tolerance} vs onnxruntime"]}
    return {"max_rel_err": worst}


def _emulator_check(proto, lowered, config) -> dict:
    """Run the lowered module on the CPU emulator and compare with onnxruntime."""
    from . import emulator
    from ..numerics import relative_error
    from ..run.runner import model_tolerance_of, onnx_reference, random_inputs

    try:
        feeds = random_inputs(proto, seed=1)
        reference = onnx_reference(proto, feeds)
        build = emulator.emulation_build(lowered, "rammer/nvidia-h100", config, pipeline=None)
        run = emulator.emulate(build, [feeds[v.name] for v in proto.graph.input if v.name in feeds],
                               wall_limit_s=120.0)
    except Exception as err:  # noqa: BLE001  (a fault, a deadlock, a failed build: findings)
        return {"status": "fail", "stage": "emulate", "problems": [_first_line(err)]}
    tolerance = model_tolerance_of(proto, config)
    worst = max((relative_error(o, r) for o, r in zip(run.outputs, reference)), default=0.0)
    if len(run.outputs) != len(reference) or not worst <= tolerance:
        return {"status": "fail", "stage": "emulate",
                "problems": [f"max relative error {worst:.3g} > {tolerance} vs onnxruntime "
                             f"({len(run.outputs)} outputs, {len(reference)} expected)"]}
    return {"max_rel_err": worst, "gxx_s": round(run.gxx_seconds, 2),
            "emulated_wall_s": round(run.emulated_wall_s, 3)}


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


def _job(name: str, payload: tuple) -> dict:
    """Worker side: payload = (model bytes, config options, trials, gpu, seed, emulate)."""
    import tvm_rammer  # noqa: F401  (registers the rammer target tags)

    return check_graph(*payload)


# --- shrinking a failing graph ----------------------------------------------------------------

def _without_node(model, drop: int):
    """``model`` with node ``drop`` removed: its outputs become graph inputs (same shapes), and
    nodes nobody needs any more are dropped too. None when nothing would be left."""
    import onnx
    from onnx import helper

    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type for v in [*model.graph.input, *model.graph.value_info,
                                      *model.graph.output]}
    graph = model.graph
    removed = graph.node[drop]
    if any(o not in types for o in removed.output):
        return None
    nodes = [n for i, n in enumerate(graph.node) if i != drop]
    inputs = list(graph.input) + [helper.make_value_info(o, types[o]) for o in removed.output
                                  if o in {x for n in nodes for x in n.input}]
    outputs = [o for o in graph.output if o.name not in removed.output]
    needed = {o.name for o in outputs}
    kept = []
    for node in reversed(nodes):  # keep what the outputs need
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    kept.reverse()
    if not kept or not outputs:
        return None
    inits = [t for t in graph.initializer if t.name in needed]
    inputs = [i for i in inputs if i.name in needed]
    new = helper.make_graph(kept, graph.name, inputs, outputs, initializer=inits)
    out = helper.make_model(new, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    return out


def minimise(model, still_fails, budget: int = 40):
    """Drop nodes one at a time while ``still_fails(model)`` (at most ``budget`` tries)."""
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for i in reversed(range(len(model.graph.node))):
            if tries >= budget:
                break
            smaller = _without_node(model, i)
            if smaller is None:
                continue
            tries += 1
            if still_fails(smaller):
                model, changed = smaller, True
                break
    return model


def _save_failure(out_dir: str, seed: int, index: int, model, record: dict, options: dict,
                  trials: int, gpu: bool, emulate: bool = False) -> str:
    import onnx

    def still_fails(candidate) -> bool:
        again = check_graph(candidate.SerializeToString(), options, trials, gpu, seed, emulate)
        return again["status"] == "fail" and again["stage"] == record["stage"]

    try:
        small = minimise(model, still_fails)
    except Exception:  # noqa: BLE001  (a failure to shrink must not lose the failure)
        small = model
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"graph-{seed}-{index}.onnx")
    onnx.save(small, path)
    with open(path[:-5] + ".json", "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "index": index, "config": options, "nodes": len(small.graph.node),
                   "original_nodes": len(model.graph.node), **record}, f, indent=1)
    return path


# --- the command ------------------------------------------------------------------------------

def fuzz(graphs: int, seed: int, jobs: int = 1, trials: int = 8, gpu: bool = False,
         out_dir: str = "fuzz-failures", timeout: float = DEFAULT_TIMEOUT_S, progress=True,
         minimise_failures: bool = True, emulate: bool = False) -> dict:
    """Run the fuzzer; returns {"graphs", "failures": [...], "skipped", "seconds", ...};
    ``emulate``: every graph also executed on the CPU emulator (``emulated``: how many matched
    onnxruntime, ``max_rel_err``: the largest error among them, ``gxx_s``: C++ build seconds)."""
    from .workers import run_jobs

    start = time.monotonic()
    models, options = {}, {}
    job_list = []
    for i in range(graphs):
        model, _ = random_graph(seed, i)
        models[i], options[i] = model, random_config(seed, i)
        job_list.append((str(i), (model.SerializeToString(), options[i], trials, gpu, seed,
                                  emulate)))
    done_count = [0]
    failures, stats = [], {"ok": 0, "skipped": 0, "rprograms": 0}
    default_fails = []  # graphs TVM's default pipeline cannot compile and tvm-rammer did
    emulated = {"emulated": 0, "max_rel_err": 0.0, "gxx_s": 0.0}

    def on_result(name, result, why):
        done_count[0] += 1
        i = int(name)
        if result is None:
            result = {"status": "fail", "stage": "hang", "problems": [f"worker {why}"]}
        if result["status"] == "fail":
            failures.append({"index": i, **result})
            if progress:
                print(f"[{done_count[0]}/{graphs}] graph {i} FAILED ({result['stage']}): "
                      f"{result['problems'][0]}", flush=True)
        else:
            stats["ok" if result["status"] == "ok" else "skipped"] += 1
            stats["rprograms"] += result.get("rprograms", 0)
            if result.get("default_unavailable"):
                default_fails.append({"index": i, "reason": result["default_unavailable"],
                                      "max_rel_err": result.get("max_rel_err")})
            if "max_rel_err" in result and emulate:
                emulated["emulated"] += 1
                emulated["max_rel_err"] = max(emulated["max_rel_err"], result["max_rel_err"])
                emulated["gxx_s"] += result.get("gxx_s", 0.0)
        if progress and done_count[0] % 100 == 0:
            print(f"[{done_count[0]}/{graphs}] {len(failures)} failures, "
                  f"{time.monotonic() - start:.0f} s", flush=True)

    run_jobs("tvm_rammer.checks.fuzz:_job", job_list, jobs, timeout, on_result)
    saved = []
    for failure in sorted(failures, key=lambda f: f["index"]):
        i = failure["index"]
        if failure["stage"] == "hang" or not minimise_failures:
            import onnx

            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"graph-{seed}-{i}.onnx")
            onnx.save(models[i], path)
            with open(path[:-5] + ".json", "w", encoding="utf-8") as f:
                json.dump({"seed": seed, "index": i, "config": options[i], **failure}, f, indent=1)
        else:
            path = _save_failure(out_dir, seed, i, models[i], failure, options[i], trials, gpu,
                                 emulate)
        saved.append(path)
    return {"graphs": graphs, "seed": seed, "failures": failures, "saved": saved,
            "ok": stats["ok"], "skipped": stats["skipped"], "rprograms": stats["rprograms"],
            "default_fails": sorted(default_fails, key=lambda d: d["index"]),
            "trials_per_rprogram": trials, "gpu": gpu, "emulate": emulate,
            **({**emulated, "gxx_s": round(emulated["gxx_s"], 1)} if emulate else {}),
            "seconds": round(time.monotonic() - start, 1)}


def _at_least(low: int):
    """argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _seconds(text: str) -> float:
    """argparse type: seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 seconds")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graphs", type=_at_least(1), default=200,
                   help="random graphs (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the run: graph k is built from (seed, k) (default: %(default)s)")
    p.add_argument("--jobs", type=_at_least(1), default=1, help="worker processes (default: 1)")
    p.add_argument("--trials", type=_at_least(1), default=8,
                   help="simulated interleavings per rProgram (default: %(default)s)")
    p.add_argument("--gpu", action="store_true",
                   help="also compile, run on the local GPU and compare with onnxruntime")
    p.add_argument("--emulate", action="store_true",
                   help="also run each graph on the CPU emulator (a small vDevice, a C++ compiler "
                        "needed) and compare with onnxruntime")
    p.add_argument("--out", default="fuzz-failures", help="where failing graphs are saved")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S,
                   help="seconds per graph before it counts as a hang (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the summary here")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")


def run(args) -> int:
    if args.gpu:
        from ..host.gpu import gpu_available

        if not gpu_available():
            raise ValueError("--gpu: no CUDA GPU is visible; run without --gpu to check the "
                             "tables only, or with --emulate to run them on the CPU emulator")
    if args.gpu and args.emulate:
        raise ValueError("--gpu and --emulate: choose one device to run the graphs on")
    if args.emulate:
        from .emulator.build import _compiler

        _compiler()  # no C++ compiler: one error naming the fix before any graph is built
    result = fuzz(args.graphs, args.seed, args.jobs, args.trials, args.gpu, args.out,
                  args.timeout, progress=not args.quiet, emulate=args.emulate)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    for failure in result["failures"]:
        print(f"graph {failure['index']}: {failure['stage']}: {failure['problems'][0]}")
    for path in result["saved"]:
        print(f"saved {path}")
    for fail in result["default_fails"]:  # TVM's failures, not tvm-rammer's: listed apart
        checked = "" if fail["max_rel_err"] is None else \
            f"; tvm-rammer's result on the emulator: max rel err {fail['max_rel_err']:.2e}"
        print(f"graph {fail['index']}: compiled by tvm-rammer; {fail['reason']}{checked}")
    print(f"TVM's default fails: {len(result['default_fails'])} (not counted as failures)")
    print(f"{result['ok']} checked, {result['skipped']} skipped (not importable), "
          f"{result['rprograms']} rPrograms, {result['seconds']} s")
    if args.emulate:
        print(f"{result['emulated']} executed on the emulator, max rel err "
              f"{result['max_rel_err']:.2e} vs onnxruntime, C++ builds {result['gxx_s']} s")
    print(f"{result['graphs']} graphs, {len(result['failures'])} failures")
    return 1 if result["failures"] else 0


def register(sub, add_common=None, make_config=None):
    """Add the ``fuzz`` subcommand to the ``tvm-rammer`` parser."""
    p = sub.add_parser("fuzz", help="random ONNX graphs through the pipeline, tables checked by "
                                    "the reference executor (and on a GPU against onnxruntime)")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tvm_rammer.checks.fuzz",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"tvm-rammer fuzz: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
