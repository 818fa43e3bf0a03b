"""``tvm-rammer bench [MODELS...]``: every system side by side, results recorded."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def register(sub, add_common, make_config):
    """Add the ``bench`` subcommand to the ``tvm-rammer`` parser."""
    from ..models import MODELS
    from .harness import TABLE1_MODELS
    from .systems import ALL_SYSTEMS, SYSTEMS

    p = sub.add_parser(
        "bench",
        help="benchmark TVM default, TVM + CUDA graphs, tvm-rammer and PyTorch side by side",
        description="Compile (and, on a GPU, check and time) each model with every system; print a "
                    "table, write JSON (and a PNG chart) under --out.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"models of the zoo (default: the Rammer Table-1 six: "
                        f"{' '.join(TABLE1_MODELS)}); valid: {', '.join(sorted(MODELS))}")
    add_common(p, model=False)
    p.add_argument("--batch", type=_positive_int, default=1,
                   help="batch size the models are built with (default: %(default)s)")
    p.add_argument("--runs", type=int, default=200, help="timed runs per system (median reported)")
    p.add_argument("--out", default="benchmarks/results",
                   help="results folder (default: %(default)s)")
    p.add_argument("--reduced", action="store_true", help="reduced model sizes for quick runs")
    p.add_argument("--build", action="store_true",
                   help="without a GPU, also run the full tvm.compile to CUDA "
                        "(always done on a GPU)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds per model before it is recorded as a timeout; 0 = run in this "
                        "process without a timeout (default: %(default)s)")
    p.add_argument("--systems", default="",
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: "
                        f"{','.join(SYSTEMS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-chart", action="store_true", help="write no PNG chart")
    p.set_defaults(func=lambda args: cmd_bench(args, make_config))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def cmd_bench(args, make_config) -> int:
    from .harness import TABLE1_MODELS, BenchOptions, run_bench
    from .output import format_table, result_stem, write_chart, write_json
    from .progress import Progress

    config = make_config(args)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name != "extra"}
    options = BenchOptions(
        models=tuple(args.models) or TABLE1_MODELS, batch=args.batch, target=args.target,
        config=fields, runs=args.runs, reduced=args.reduced, build=args.build,
        timeout_s=args.timeout, seed=args.seed,
        systems=tuple(s for s in args.systems.split(",") if s))
    steps = len(options.models) * (len(options.selected_systems()) + 1)
    doc = run_bench(options, Progress(steps, enabled=not args.no_progress))
    print(format_table(doc))
    path = write_json(doc, args.out)
    print(f"wrote {path}")
    if not args.no_chart:
        chart, why = write_chart(doc, path.parent / f"{result_stem(doc)}.png")
        print(f"wrote {chart}" if chart else why)
    sys.stdout.flush()
    return 0
