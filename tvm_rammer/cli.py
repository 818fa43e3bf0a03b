"""``tvm-rammer``: compile, inspect, run and demo from the command line.

Environment variables are read here only (the edge), never in the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import POLICIES, RammerConfig
from .host import preflight

DEFAULT_TARGET = "rammer/nvidia-h100"


def _config(args) -> RammerConfig:
    return RammerConfig(max_rtask_threads=args.max_rtask_threads, veus_per_sm=args.veus_per_sm,
                        num_sms=args.num_sms, selection=args.selection, merge=args.merge,
                        profile=not args.no_profile, profile_db=args.profile_db,
                        profile_budget_s=args.profile_budget,
                        tuning_db=args.tuning_db, versions=not args.no_versions,
                        precision=args.precision,
                        tail_fusion=not args.no_tail_fusion,
                        prologue_fusion=not args.no_prologue_fusion,
                        split_concat_matmul=not args.no_split_concat_matmul,
                        batch_shared_matmuls=not args.no_batch_shared_matmuls,
                        gemv_epilogue=not args.no_gemv_epilogue,
                        split_k=not args.no_split_k,
                        norm_fusion=not args.no_norm_fusion,
                        inplace_cache=not args.no_inplace_cache,
                        attention_row=not args.no_attention_row,
                        check_unmeasured=not args.no_unmeasured_check,
                        rkernel_functions=not args.no_rkernel_functions,
                        prefetch_weights=not args.no_prefetch_weights,
                        prefetch_lookahead=args.prefetch_lookahead,
                        policy=getattr(args, "policy", "rammer"),
                        emulate_versions=getattr(args, "emulate_versions", False))


def _lookahead(text: str) -> int:
    """``--prefetch-lookahead``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of barrier-rTasks >= 1 "
                                         "(1: prefetch at the barrier right before the rTask)")
    return value


def _budget_seconds(text: str) -> float | None:
    """``--profile-budget``: seconds >= 0, or "none" (no limit)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give the seconds of measuring allowed "
                                         "(a number >= 0) or 'none'")
    return value


def _add_emulate_versions(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate", dest="emulate_versions", action="store_true",
                   help="check every rKernel version of every operator against TVM's default "
                        "kernel on the CPU emulator (needs a C++ compiler) and use none that is "
                        "wrong there; --json lists them under each operator's versions_checked")


def _add_common(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", help="ONNX model file")
        p.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                       type=_shape_flag,
                       help="static shape of a model input, e.g. --input-shape input=1x3x224x224 "
                            "(repeatable); rPrograms need static shapes")
        p.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                       help="bind every symbolic leading (batch) dimension of the inputs to N")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="a tag (rammer/nvidia-h100, nvidia/nvidia-a100, ...), a JSON dict "
                        "('{\"kind\": \"cuda\", \"arch\": \"sm_80\"}') or the CLI form "
                        "'cuda -arch=sm_80' (default: %(default)s)")
    p.add_argument("--max-rtask-threads", type=int, default=256,
                   choices=[32, 64, 128, 256, 512, 1024],
                   help="threads per rTask that dlight may use; bounds the vEU width "
                        "(default: %(default)s)")
    p.add_argument("--veus-per-sm", type=_positive_int, default=None, metavar="N",
                   help="cap the vEUs (resident thread blocks) per SM, 1 to 32; default: what "
                        "the rKernels' threads, shared memory and registers allow")
    p.add_argument("--num-sms", type=_positive_int, default=None, metavar="N",
                   help="SMs of the vDevice; default: the local GPU's, else the target arch's")
    p.add_argument("--selection", default="paper", choices=["paper", "fastest", "efficient"],
                   help="rKernel selection rule of the policy (paper = Algorithm 1; the others "
                        "are ablations; default: %(default)s)")
    p.add_argument("--merge", default="paper", choices=["paper", "always", "never"],
                   help="rProgram merge rule of the policy (paper = Algorithm 1; default: "
                        "%(default)s)")
    p.add_argument("--policy", default="rammer", choices=list(POLICIES),
                   help="scheduling policy: Rammer's Algorithm 1, IOS's stage partition or Opara's "
                        "launch order, all on the same rTask machinery (default: %(default)s)")
    p.add_argument("--profile-db", default=None, metavar="PATH",
                   help="profile database to read and, on a GPU of the target's arch, extend "
                        "(*.json: JSON, else sqlite3); default: the per-user cache under "
                        "$XDG_CACHE_HOME/tvm-rammer/")
    p.add_argument("--no-profile", action="store_true",
                   help="measure nothing and read no cache: every operator keeps TVM's dlight "
                        "schedule, timed by the analytical model")
    p.add_argument("--profile-budget", type=_budget_seconds, default=300.0, metavar="SECONDS",
                   help="most seconds one compile spends measuring on the GPU; past it the "
                        "remaining choices are made as without a GPU (dlight, analytical), with "
                        "one warning; 'none' for no limit (default: %(default)s)")
    p.add_argument("--tuning-db", default=None, metavar="DIR",
                   help="MetaSchedule database directory: its schedules become rKernel versions")
    p.add_argument("--precision", default="float32", choices=["float32", "float16"],
                   help="float16: ToMixedPrecision (fp16 storage, fp32 accumulation) and "
                        "tensor-core rKernels (default: %(default)s)")
    p.add_argument("--no-versions", action="store_true",
                   help="one rKernel per operator (the pipeline's dlight schedule)")
    p.add_argument("--no-tail-fusion", action="store_true",
                   help="leave the elementwise tail after a split to BranchPreservingFusion")
    p.add_argument("--no-prologue-fusion", action="store_true",
                   help="keep an elementwise op that only a conv/matmul reads as its own kernel")
    p.add_argument("--no-split-concat-matmul", action="store_true",
                   help="keep matmul(concat([x, h]), W) as one MatMul")
    p.add_argument("--no-batch-shared-matmuls", action="store_true",
                   help="keep same-wave GEMVs of one weight apart instead of one GEMM")
    p.add_argument("--no-gemv-epilogue", action="store_true",
                   help="keep an RNN cell's GEMV and its elementwise tail two operators")
    p.add_argument("--no-split-k", action="store_true",
                   help="keep a decode step's narrow GEMVs one operator each instead of a partial "
                        "GEMV over row blocks and a sum (RammerConfig.split_k)")
    p.add_argument("--no-norm-fusion", action="store_true",
                   help="keep a decode step's LayerNorm an operator of its own instead of the "
                        "prologue of each GEMV reading it (RammerConfig.norm_fusion)")
    p.add_argument("--no-inplace-cache", action="store_true",
                   help="copy a decode step's KV caches whole (select over the cache) instead of "
                        "writing the slot in place (RammerConfig.inplace_cache)")
    p.add_argument("--no-attention-row", action="store_true",
                   help="let a decode attention read the written KV caches (waiting for the "
                        "writes) instead of the projection's row beside them "
                        "(RammerConfig.attention_row)")
    p.add_argument("--no-unmeasured-check", action="store_true",
                   help="build every rProgram even when nothing is measured and the estimate says "
                        "TVM's default kernels would be faster (RammerConfig.check_unmeasured)")
    p.add_argument("--no-rkernel-functions", action="store_true",
                   help="keep every rKernel body inline in the persistent kernel's dispatch loop "
                        "instead of a __noinline__ device function each (RammerConfig."
                        "rkernel_functions; the functions halve nvcc's time on large models)")
    p.add_argument("--no-prefetch-weights", action="store_true",
                   help="no prefetch of the next rTask's weights into L2 while a vEU waits at a "
                        "barrier-rTask (RammerConfig.prefetch_weights)")
    p.add_argument("--prefetch-lookahead", type=_lookahead, metavar="N",
                   default=RammerConfig.prefetch_lookahead,
                   help="issue an rTask's weight prefetch up to N barrier-rTasks early on its vEU, "
                        "past operators without weights (an attention chain); 1: at the barrier "
                        "right before it (RammerConfig.prefetch_lookahead; default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="log operators left out and why")
    p.add_argument("--timings", action="store_true",
                   help="print the seconds each compilation phase took (to stderr)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown on a terminal once a compilation takes > 2 s)")


def _timed(args, run):
    """``run()`` under the pipeline's progress bar and phase timer; prints the phases with
    --timings. Returns (run's result, extra timing rows it may append to)."""
    import tvm

    from .driver.timings import PipelineProgress, format_timings

    progress = PipelineProgress(show=not args.no_progress and sys.stderr.isatty())
    extra: list = []
    with tvm.transform.PassContext(instruments=[progress]):
        result = run(extra)
    if args.timings:
        print(format_timings(progress, extra), file=sys.stderr)
    return result


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _shape_flag(text: str) -> tuple:
    """argparse type of --input-shape: NAME=DIMS -> (NAME, dims)."""
    from .onnx_prep.shapes import parse_shape_flag
    try:
        return parse_shape_flag(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bind_model(args) -> None:
    """Load the model argument once, with --input-shape / --batch bound (compile, inspect, run and
    tune take a ModelProto as well as a path): a missing, unreadable or empty model file fails
    here, before anything else (a GPU, a compiler) is looked for."""
    if not hasattr(args, "input_shape"):
        return  # (`model` and `bench` have a --batch of their own: the batch they build)
    from .driver.frontend import load_onnx
    from .onnx_prep.shapes import bind_shapes
    if not args.input_shape and args.batch is None:
        args.model_name, args.model = args.model, load_onnx(args.model)
        return
    shapes = {}
    for name, dims in args.input_shape:
        if name in shapes and shapes[name] != dims:
            raise ValueError(f"--input-shape {name} given twice ({shapes[name]} and {dims})")
        shapes[name] = dims
    args.model_name = args.model
    args.model = bind_shapes(load_onnx(args.model), shapes, args.batch)


def _model_name(args) -> str:
    """The model as the user named it (``args.model`` is a ModelProto once shapes are bound)."""
    return str(getattr(args, "model_name", args.model))


def _output_path(path: str) -> str:
    """argparse type of -o: a file that can be written (checked before anything is compiled)."""
    try:
        check_output(path)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return path


def check_output(path: str) -> None:
    """Fail before compiling when ``path`` cannot be written (ValueError saying why)."""
    import os
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"-o {path!r} is a directory; name the library file, e.g. "
                         f"{os.path.join(path, 'model.so')}")
    if not os.path.isdir(folder):
        raise ValueError(f"-o {path!r}: the directory {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"-o {path!r}: the directory {folder!r} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"-o {path!r} exists and is not writable")


def cmd_compile(args) -> int:
    import time

    from .driver import frontend
    from .host import cross
    from .target import plain_target, resolve_target

    target = resolve_target(args.target)
    built_for = target if args.pipeline == "rammer" else plain_target(target)
    warning = cross.source_warning(built_for)
    if warning:
        print(f"tvm-rammer: warning: {warning}", file=sys.stderr)  # said before the long compile

    if args.weights_apart:  # code only: the manifest and the raw weights beside it
        from .lease.manifest import build_library
        info = _timed(args, lambda extra: build_library(
            args.model, pipeline=args.pipeline, config=_config(args), target=target,
            out=args.output))
        cuda = {True: " (CUDA: binary)", False: " (CUDA: source, compiled by the GPU host when "
                "it loads the library)"}.get(info["binary"], "")
        print(f"wrote {args.output}{cuda}, {info['manifest']} and {info['weights_file']} "
              f"(transform: {info['transform']})")
        return 0

    def run(extra):
        if args.pipeline == "rammer":
            ex = frontend.compile(args.model, target=target, config=_config(args))
        else:  # TVM's default pipeline, built as `bench` builds its tvm-default baseline
            from .benchmarks.systems import TVM_DEFAULT, TVMSystem
            system = TVMSystem(TVM_DEFAULT, target, _config(args))
            ex = system.build(system.lower(frontend.import_onnx(args.model)))
        start = time.perf_counter()
        done = cross.export(ex, args.output, built_for)  # written whole (a temporary, renamed)
        extra.append(("export_library (CUDA and host code)", time.perf_counter() - start))
        return done

    done = _timed(args, run)
    what = {cross.BINARY: f" (CUDA: binary for {done.arch})" if done.arch else "",
            cross.SOURCE: " (CUDA: source, compiled by the GPU host when it loads the library)"}
    print(f"wrote {args.output}{what.get(done.cuda, '')}")
    return 0


def _timeline_shares(timelines, brief: bool) -> list:
    """Per-rProgram busy / barrier-wait / idle shares for --json (per vEU unless --brief)."""
    from .scheduling.timeline import shares

    found = [shares(t) for t in timelines]
    return [{k: v for k, v in s.items() if k != "veus"} for s in found] if brief else found


def _format_shares(timelines) -> str:
    from .scheduling.timeline import shares

    lines = []
    for t in timelines:
        s = shares(t)
        lines.append(f"  {t.source} {t.kernel}: {s['span_us']:.1f} us, vEUs busy {s['busy']:.0%}, "
                     f"in barrier-rTasks {s['wait']:.0%}, idle {s['idle']:.0%}")
    return "\n".join(lines)


def _write_timeline(out: str, timelines, title: str) -> None:
    from .host.packages import missing
    from .views.timeline_view import write

    paths = write(out, timelines, title, png=not missing("matplotlib"))  # (preflight warned)
    print(f"tvm-rammer: wrote {paths[0]} (open it in ui.perfetto.dev)"
          + (f" and {paths[1]}" if paths[1] else ", no PNG (matplotlib is not installed)"),
          file=sys.stderr)


def _bench_floor(mod, target) -> dict:
    """``bench``'s floor of an imported model (benchmarks.floor, the target's nominal peaks: inspect
    needs no GPU), handed in to ``inspect`` (a later stage than views)."""
    from .benchmarks import floor
    peaks = floor.nominal_peaks(target)
    return {**floor.floor(floor.op_costs(mod), peaks), "peaks": peaks.source}


def cmd_inspect(args) -> int:
    from .views import inspection
    summary, lowered = _timed(args, lambda extra: inspection.inspect_lowered(
        args.model, args.target, _config(args), timings=extra, floor_of=_bench_floor))
    timelines = None
    if args.timeline:
        from .scheduling.timeline import predict_all, schedules_of
        timelines = predict_all(schedules_of(lowered))
        _write_timeline(args.timeline, timelines, f"{_model_name(args)}: predicted timeline")
        summary["timeline"] = _timeline_shares(timelines, args.brief)
    if args.json:
        summary = {k: v for k, v in summary.items() if not args.brief or k != "programs"}
        print(json.dumps(summary))
    else:
        from .driver.report import format_schedule
        print(format_schedule(summary))
        if timelines:
            print(_format_shares(timelines))
    return 0


def cmd_run(args) -> int:
    from .run import runner
    config = _config(args)
    if args.record_in_context and not args.timeline:
        raise ValueError("--record-in-context records what --timeline measures; add --timeline OUT")
    if args.emulate:
        return _run_emulated(args, config)
    result = runner.run_model(args.model, args.target, config, runs=args.runs, seed=args.seed)
    timelines = None
    if args.timeline:
        found = runner.run_timeline(args.model, args.target, config, seed=args.seed)
        timelines = found["predicted"] + found["measured"]
        _write_timeline(args.timeline, timelines, f"{_model_name(args)}: predicted and measured timeline")
        result["timeline"] = {"max_rel_err": found["max_rel_err"],
                              "rprograms": _timeline_shares(timelines, False)}
        if args.record_in_context:
            result["timeline"]["in_context_records"] = runner.record_in_context(
                found["measured"], found["schedules"], config)
    print(json.dumps(result, indent=1) if args.json else runner.format_result(result))
    if timelines and not args.json:
        print(_format_shares(timelines))
    return 0 if result["ok"] else 1


def _run_emulated(args, config) -> int:
    """``run --emulate``: both pipelines on the CPU emulator, checked (tvm_rammer.checks.emulator.run)."""
    from .codegen import faults
    from .checks.emulator import run as emulated
    from .checks.emulator.errors import EmulatorError

    if args.timeline:
        raise ValueError("--timeline measures on a GPU; --emulate runs on the CPU emulator, whose "
                         "times are not GPU times: drop one of them")
    try:
        result = emulated.run_model(args.model, args.target, config, seed=args.seed)
    except (faults.KernelFault, EmulatorError) as err:  # a fault, a deadlock, a failed build
        print(f"tvm-rammer: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else emulated.format_result(result))
    return 0 if result["ok"] else 1


def cmd_demo(args) -> int:
    from .checks.emulator import run as emulated
    from .run import runner
    return runner.demo(args.target, _config(args), branches=args.branches, emulate=emulated.demo)


def cmd_generate(args) -> int:
    """``generate``: greedy decoding with the decode step (tvm_rammer.run.generate); --emulate hands
    in the CPU emulator's step (checks.emulator.generate)."""
    from .codegen import faults
    from .checks.emulator import generate as emulated
    from .checks.emulator.errors import EmulatorError
    from .run import generate

    try:
        result = generate.generate(args.model, args.tokens, args.target, _config(args),
                                   prompt_token=args.prompt_token, name=_model_name(args),
                                   emulate=emulated.emulated_step if args.emulate else None)
    except (faults.KernelFault, EmulatorError) as err:  # a fault, a deadlock, a failed build
        print(f"tvm-rammer: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else generate.format_result(result))
    return 0 if result["ok"] else 1


def cmd_model(args) -> int:
    from .models import get_model, save_model
    params = {}
    for item in args.param:
        key, _, value = item.partition("=")
        if not _ or not key.strip():
            raise ValueError(f"--param {item!r}: use NAME=VALUE, e.g. --param n=16")
        params[key.strip()] = _param_value(value.strip())
    _check_params(args.name, params)
    data = save_model(get_model(args.name, batch=args.batch, **params), args.output)
    print(f"wrote {args.output}" + (f" and its weights {data} (external data: past ONNX's 2 GiB "
                                    f"protobuf limit; keep the two files together)" if data else ""))
    return 0


def _param_value(text: str):
    """A --param value: an int, a float, a boolean (true/false), a JSON list or dict, else the
    string itself (``activation=tanh``)."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--param value {text!r} is not valid JSON: {err}") from None
    return text


def _check_params(name: str, params: dict) -> None:
    """ValueError naming the builder's arguments when --param names one it does not take."""
    import inspect

    from .models import MODELS
    if name not in MODELS:
        return  # get_model names the valid models
    signature = inspect.signature(MODELS[name]).parameters
    known = [p for p in signature if p != "batch"]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"model {name!r} has no argument {', '.join(map(repr, unknown))}; "
                         f"its arguments: {', '.join(known)} (see `tvm-rammer model --help`)")
    for key, value in params.items():  # the type of the builder's default, when it has one
        default = signature[key].default
        kind = type(default)
        fits = (default in (None, inspect.Parameter.empty) or isinstance(value, kind)
                and not (isinstance(value, bool) and kind is not bool)
                or kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise ValueError(f"--param {key}={value!r}: model {name!r} takes {kind.__name__} for "
                             f"{key} (default {default!r}); e.g. --param {key}={default}")


def _model_list() -> str:
    """One line per bundled model: its name and builder arguments (for ``model --help``)."""
    import inspect

    from .models import MODELS
    lines = []
    for name in sorted(MODELS):
        params = [f"{p.name}={p.default!r}" for p in inspect.signature(MODELS[name]).parameters
                  .values() if p.default is not inspect.Parameter.empty and p.name != "batch"]
        lines.append(f"  {name}: {', '.join(params)}")
    return "models and their --param arguments:\n" + "\n".join(lines)


def _version_line() -> str:
    """``tvm-rammer X (TVM Y) at PATH``: what ``--version`` prints (the path tells an installed copy
    from a checkout)."""
    import os

    import tvm

    from .version import __version__
    return (f"tvm-rammer {__version__} (TVM {tvm.__version__}) at "
            f"{os.path.dirname(os.path.abspath(__file__))}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-rammer", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="compile an ONNX model to a library")
    _add_common(p)
    p.add_argument("-o", "--output", required=True, type=_output_path,
                   help="output library (.so; .tar for an archive); its directory must exist")
    p.add_argument("--pipeline", default="rammer", choices=["rammer", "default"],
                   help="rammer (default), or TVM's default pipeline for the same target (the "
                        "baseline, built alike)")
    p.add_argument("--weights-apart", action="store_true",
                   help="the library holds code only: main takes the weights as arguments, the "
                        "weight rewrites become its transform_params function; writes NAME.json "
                        "(manifest) and NAME.weights.npz beside it (tvm_rammer.lease.manifest)")
    _add_emulate_versions(p)
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("inspect", help="print the schedule (needs no GPU)")
    _add_common(p)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--brief", action="store_true",
                   help="with --json: leave out the per-rProgram details (operators, versions, "
                        "why each version was chosen, predicted and profiled times) and the "
                        "per-vEU timeline shares")
    p.add_argument("--timeline", metavar="OUT", default=None,
                   help="write the predicted per-vEU timeline: OUT.json (Perfetto / Chrome trace) "
                        "and OUT.png (needs matplotlib); --json gets per-vEU busy/wait/idle shares")
    _add_emulate_versions(p)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("run", help="run on the GPU, compare with onnxruntime, time vs TVM default")
    _add_common(p)
    p.add_argument("--runs", type=_positive_int, default=200,
                   help="timed runs per pipeline; the median is reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--timeline", metavar="OUT", default=None,
                   help="also build the instrumented kernel, run it and write the measured and "
                        "predicted per-vEU timelines: OUT.json (Perfetto) and OUT.png")
    p.add_argument("--record-in-context", action="store_true",
                   help="with --timeline: write the measured in-context rTask times to the profile "
                        "database (--profile-db or the per-user cache), kind 'in_context'")
    p.add_argument("--emulate", action="store_true",
                   help="run the generated CUDA on the CPU emulator instead of a GPU (needs a C++ "
                        "compiler; reports errors and emulated wall seconds, not GPU latencies)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("demo", help="the main job: compile the bundled 16-branch model, print its "
                                    "schedule, run and check it when a GPU is present")
    _add_common(p, model=False)
    p.add_argument("--branches", type=_positive_int, default=16,
                   help="parallel GEMV branches of the demo model (default: %(default)s)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="greedy decoding with a decode-step model (gpt2_decode, "
                                        "llama_decode), every step checked against onnxruntime")
    _add_common(p)
    p.add_argument("--tokens", type=int, required=True, metavar="N",
                   help="decode steps (1 to the caches' max_len)")
    p.add_argument("--prompt-token", type=int, default=0, metavar="ID",
                   help="the token fed at position 0 (default: %(default)s)")
    p.add_argument("--emulate", action="store_true",
                   help="run the decode step on the CPU emulator instead of a GPU (needs a C++ "
                        "compiler; reports emulated wall seconds, not GPU latencies)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_generate)
    from .models import MODELS
    p = sub.add_parser("model", help="write a bundled model (tvm_rammer.models) as ONNX",
                       epilog=_model_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    p.add_argument("-o", "--output", required=True, type=_output_path, help="ONNX file to write")
    p.add_argument("--batch", type=_positive_int, default=1,
                   help="batch size built into the model (default: %(default)s)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="builder argument, e.g. --param n=16 --param join=sum")
    p.set_defaults(func=cmd_model)
    from .benchmarks.cli import register as register_bench
    from .tuning.cli import register as register_tune

    register_bench(sub, _add_common, _config)
    register_tune(sub, _add_common, _config)
    from .checks.fuzz import register as register_fuzz

    register_fuzz(sub)
    from .host.doctor import register as register_doctor

    register_doctor(sub, DEFAULT_TARGET)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    try:
        if hasattr(args, "max_rtask_threads"):
            _config(args)  # bad option values fail before any model is loaded
        for warning in preflight.check(args.command, args):  # what is missing, said at the start
            print(f"tvm-rammer: warning: {warning}", file=sys.stderr)
        _bind_model(args)  # --input-shape / --batch, for every command that takes a model file
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"tvm-rammer: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # TVM's default pipeline failing where it was asked for by name
        from .codegen.tvm_default import DefaultPipelineFailed
        if not isinstance(err, DefaultPipelineFailed):
            raise
        print(f"tvm-rammer: error: TVM's default pipeline cannot compile this model: {err.reason}; "
              f"compile it with tvm-rammer's pipeline (without --pipeline default)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
