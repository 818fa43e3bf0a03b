"""``python3 -m tvm_rammer.runtime LIB.json [...]``: load, run, check, compare and time libraries.

In: manifests. Out: one line per library on stdout and, with ``--json OUT``, the rows as JSON
(written again after each library, so a run that is cut keeps what it did). A library that fails
(a fault, a wrong weight, outputs off the reference) gets an ``error`` row and the exit status 1;
the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m tvm_rammer.runtime",
        description="Run tvm-rammer libraries built elsewhere on TVM's runtime alone "
                    "(set TVM_USE_RUNTIME_LIB=1 to skip loading TVM's compiler).")
    p.add_argument("manifests", nargs="+", metavar="LIB.json",
                   help="the manifest written beside each library")
    p.add_argument("--runs", type=int, default=200, help="timed calls of main (default 200)")
    p.add_argument("--json", metavar="OUT", help="write the rows to OUT as JSON")
    p.add_argument("--no-reference", action="store_true",
                   help="do not compare with onnxruntime")
    p.add_argument("--onnx", metavar="MODEL.onnx",
                   help="the reference model, for a library whose manifest names no zoo model")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    return p


def _line(row: dict) -> str:
    head = f"{row['model']:<16} {row.get('pipeline') or '-':<8}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    err = ("not compared" if row.get("reference") is None else
           f"max_rel_err {row['max_rel_err']:.2e} (tol {row['tolerance']:.0e}) "
           f"{'ok' if row['ok'] else 'MISMATCH'}")
    return f"{head} {row['device']}  median {row['latency_us']:.1f} us  {err}"


def _write(path: str | None, rows: list) -> None:
    if path:
        import tvm

        out = {"format": "tvm-rammer-run/1", "tvm": getattr(tvm, "__version__", None),
               "results": rows}
        Path(path).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.runs < 1:
        _parser().error(f"--runs {args.runs}: give at least 1")
    from .library import Library
    from .spec import read_spec

    rows, failed = [], False
    for manifest in args.manifests:
        name, pipeline = Path(manifest).stem, None
        try:
            spec = read_spec(manifest)
            name, pipeline = spec.name, spec.pipeline
            lib = Library(spec)
            row = lib.evaluate(args.runs, reference=not args.no_reference, seed=args.seed,
                               onnx_model=args.onnx)
            if row.get("reference") and not row["ok"]:
                failed = True
        except Exception as err:  # noqa: BLE001 (one library's failure, TVM's own error types
            # included, is its row: the others still run)
            text = str(err) if isinstance(err, (ValueError, RuntimeError)) else repr(err)
            row = {"model": name, "pipeline": pipeline, "manifest": str(manifest),
                   "error": text}
            failed = True
        rows.append(row)
        print(_line(row), flush=True)
        _write(args.json, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
