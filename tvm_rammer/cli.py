"""``tvm-rammer``: compile, inspect, run and demo from the command line.

Environment variables are read here only (the edge), never in the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import RammerConfig

DEFAULT_TARGET = "rammer/nvidia-h100"


def _config(args) -> RammerConfig:
    return RammerConfig(max_rtask_threads=args.max_rtask_threads, veus_per_sm=args.veus_per_sm,
                        num_sms=args.num_sms, selection=args.selection, merge=args.merge,
                        profile=not args.no_profile, profile_db=args.profile_db,
                        tuning_db=args.tuning_db, versions=not args.no_versions,
                        policy=getattr(args, "policy", "rammer"))


def _add_common(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", help="ONNX model file")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="rammer target tag or any CUDA target tag (default: %(default)s)")
    p.add_argument("--max-rtask-threads", type=int, default=256)
    p.add_argument("--veus-per-sm", type=int, default=None)
    p.add_argument("--num-sms", type=int, default=None)
    p.add_argument("--selection", default="paper", choices=["paper", "fastest", "efficient"])
    p.add_argument("--merge", default="paper", choices=["paper", "always", "never"])
    p.add_argument("--policy", default="rammer", choices=["rammer", "ios", "opara"],
                   help="scheduling policy: Rammer's Algorithm 1, IOS's stage partition or Opara's "
                        "launch order, all on the same rTask machinery (default: %(default)s)")
    p.add_argument("--profile-db", default=None, metavar="PATH",
                   help="profile database to read and, on a GPU of the target's arch, extend "
                        "(*.json: JSON, else sqlite3); default: the per-user cache under "
                        "$XDG_CACHE_HOME/tvm-rammer/")
    p.add_argument("--no-profile", action="store_true",
                   help="measure nothing and read no cache: every operator keeps TVM's dlight "
                        "schedule, timed by the analytical model")
    p.add_argument("--tuning-db", default=None, metavar="DIR",
                   help="MetaSchedule database directory: its schedules become rKernel versions")
    p.add_argument("--no-versions", action="store_true",
                   help="one rKernel per operator (the pipeline's dlight schedule)")
    p.add_argument("-v", "--verbose", action="store_true", help="log operators left out and why")
    p.add_argument("--timings", action="store_true",
                   help="print the seconds each compilation phase took (to stderr)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown on a terminal once a compilation takes > 2 s)")


def _timed(args, run):
    """``run()`` under the pipeline's progress bar and phase timer; prints the phases with
    --timings. Returns (run's result, extra timing rows it may append to)."""
    import tvm

    from .timings import PipelineProgress, format_timings

    progress = PipelineProgress(show=not args.no_progress and sys.stderr.isatty())
    extra: list = []
    with tvm.transform.PassContext(instruments=[progress]):
        result = run(extra)
    if args.timings:
        print(format_timings(progress, extra), file=sys.stderr)
    return result


def cmd_compile(args) -> int:
    import time

    from . import frontend

    def run(extra):
        ex = frontend.compile(args.model, target=args.target, config=_config(args))
        start = time.perf_counter()
        ex.export_library(args.output)
        extra.append(("export_library (CUDA and host code)", time.perf_counter() - start))

    _timed(args, run)
    print(f"wrote {args.output}")
    return 0


def _timeline_shares(timelines, brief: bool) -> list:
    """Per-rProgram busy / barrier-wait / idle shares for --json (per vEU unless --brief)."""
    from .timeline import shares

    found = [shares(t) for t in timelines]
    return [{k: v for k, v in s.items() if k != "veus"} for s in found] if brief else found


def _format_shares(timelines) -> str:
    from .timeline import shares

    lines = []
    for t in timelines:
        s = shares(t)
        lines.append(f"  {t.source} {t.kernel}: {s['span_us']:.1f} us, vEUs busy {s['busy']:.0%}, "
                     f"in barrier-rTasks {s['wait']:.0%}, idle {s['idle']:.0%}")
    return "\n".join(lines)


def _write_timeline(out: str, timelines, title: str) -> None:
    from .timeline_view import write

    paths = write(out, timelines, title)
    print(f"tvm-rammer: wrote {paths[0]} (open it in ui.perfetto.dev) and {paths[1]}",
          file=sys.stderr)


def cmd_inspect(args) -> int:
    from . import inspection
    summary, lowered = _timed(args, lambda extra: inspection.inspect_lowered(
        args.model, args.target, _config(args), timings=extra))
    timelines = None
    if args.timeline:
        from .timeline import predict_all, schedules_of
        timelines = predict_all(schedules_of(lowered))
        _write_timeline(args.timeline, timelines, f"{args.model}: predicted timeline")
        summary["timeline"] = _timeline_shares(timelines, args.brief)
    if args.json:
        summary = {k: v for k, v in summary.items() if not args.brief or k != "programs"}
        print(json.dumps(summary))
    else:
        from .report import format_schedule
        print(format_schedule(summary))
        if timelines:
            print(_format_shares(timelines))
    return 0


def cmd_run(args) -> int:
    from . import runner
    config = _config(args)
    if args.record_in_context and not args.timeline:
        raise ValueError("--record-in-context records what --timeline measures; add --timeline OUT")
    result = runner.run_model(args.model, args.target, config, runs=args.runs, seed=args.seed)
    timelines = None
    if args.timeline:
        found = runner.run_timeline(args.model, args.target, config, seed=args.seed)
        timelines = found["predicted"] + found["measured"]
        _write_timeline(args.timeline, timelines, f"{args.model}: predicted and measured timeline")
        result["timeline"] = {"max_rel_err": found["max_rel_err"],
                              "rprograms": _timeline_shares(timelines, False)}
        if args.record_in_context:
            result["timeline"]["in_context_records"] = runner.record_in_context(
                found["measured"], found["schedules"], config)
    print(json.dumps(result, indent=1) if args.json else runner.format_result(result))
    if timelines and not args.json:
        print(_format_shares(timelines))
    return 0 if result["ok"] else 1


def cmd_demo(args) -> int:
    from . import runner
    return runner.demo(args.target, _config(args), branches=args.branches)


def cmd_model(args) -> int:
    import onnx

    from .models import get_model
    params = {}
    for item in args.param:
        key, _, value = item.partition("=")
        if not _:
            raise ValueError(f"--param {item!r}: use NAME=VALUE")
        params[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    onnx.save(get_model(args.name, batch=args.batch, **params), args.output)
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-rammer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="compile an ONNX model to a library")
    _add_common(p)
    p.add_argument("-o", "--output", required=True, help="output library (.so)")
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
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("run", help="run on the GPU, compare with onnxruntime, time vs TVM default")
    _add_common(p)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", metavar="OUT", default=None,
                   help="also build the instrumented kernel, run it and write the measured and "
                        "predicted per-vEU timelines: OUT.json (Perfetto) and OUT.png")
    p.add_argument("--record-in-context", action="store_true",
                   help="with --timeline: write the measured in-context rTask times to the profile "
                        "database (--profile-db or the per-user cache), kind 'in_context'")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("demo", help="the main job: compile the bundled 16-branch model, print its "
                                    "schedule, run and check it when a GPU is present")
    _add_common(p, model=False)
    p.add_argument("--branches", type=int, default=16)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("model", help="write a bundled model (tvm_rammer.models) as ONNX")
    p.add_argument("name")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="builder argument, e.g. --param n=16 --param join=sum")
    p.set_defaults(func=cmd_model)
    from .benchmarks.cli import register as register_bench
    from .tuning.cli import register as register_tune

    register_bench(sub, _add_common, _config)
    register_tune(sub, _add_common, _config)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"tvm-rammer: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
