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
                        profile_db=args.profile_db, tuning_db=args.tuning_db,
                        versions=not args.no_versions,
                        tail_fusion=not args.no_tail_fusion,
                        prologue_fusion=not args.no_prologue_fusion,
                        split_concat_matmul=not args.no_split_concat_matmul,
                        batch_shared_matmuls=not args.no_batch_shared_matmuls)


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
    p.add_argument("--profile-db", default=None, metavar="PATH",
                   help="profile database (JSON) to read and extend; measures only with a GPU")
    p.add_argument("--tuning-db", default=None, metavar="DIR",
                   help="MetaSchedule database directory: its schedules become rKernel versions")
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
    p.add_argument("-v", "--verbose", action="store_true", help="log operators left out and why")


def cmd_compile(args) -> int:
    from . import frontend
    ex = frontend.compile(args.model, target=args.target, config=_config(args))
    ex.export_library(args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_inspect(args) -> int:
    from . import inspection
    summary = inspection.inspect_model(args.model, args.target, _config(args))
    if args.json:
        summary = {k: v for k, v in summary.items() if not args.brief or k != "programs"}
        print(json.dumps(summary))
    else:
        from .report import format_schedule
        print(format_schedule(summary))
    return 0


def cmd_run(args) -> int:
    from . import runner
    result = runner.run_model(args.model, args.target, _config(args), runs=args.runs,
                              seed=args.seed)
    print(json.dumps(result, indent=1) if args.json else runner.format_result(result))
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
                        "why each version was chosen, predicted and profiled times)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("run", help="run on the GPU, compare with onnxruntime, time vs TVM default")
    _add_common(p)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
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
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"tvm-rammer: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
