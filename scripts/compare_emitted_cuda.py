"""The emitted CUDA of every reduced zoo model, written to a folder; two such folders compared.

    python3 scripts/compare_emitted_cuda.py emit OUT [--models a,b] [--target rammer/nvidia-h100]
                                                     [--built]
    python3 scripts/compare_emitted_cuda.py compare DIR_A DIR_B

``emit`` compiles each model of ``tvm_rammer.models.REDUCED`` (its reduced size, as the tests build
it) with ``tvm_rammer.compile(..., config=RammerConfig(profile=False))``: nothing is measured and no
profile database is read, so the output depends on the source tree only (``--built``: also
``check_unmeasured=False``, so that every rProgram is built even where the occupancy estimate
would leave its operators TVM's default kernels, as it does AlexNet's). It writes every CUDA
module of the executable (``ex.mod.imports[0].imports`` of kind ``cuda``, ``inspect_source()``) as
``OUT/<model>.<i>.cu`` and the seconds each model took as ``OUT/seconds.json``. It uses the public
API only (``tvm_rammer.compile``, ``RammerConfig``, ``tvm_rammer.models``), so the same script runs
against any checkout: point ``PYTHONPATH`` at it.

``compare`` reads two such folders and prints, for every file, whether it is byte-identical; it
exits 1 when a file differs or is missing on one side. Made for issue 32 (the regroup must not
change one byte of emitted CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def emit(out: Path, models: list[str] | None, target: str, built: bool = False) -> int:
    """Compile each reduced model (``models``: a subset by name) and write its CUDA under ``out``."""
    import tvm_rammer
    from tvm_rammer import RammerConfig
    from tvm_rammer.models import REDUCED, get_model

    out.mkdir(parents=True, exist_ok=True)
    names = sorted(REDUCED) if not models else models
    seconds = {}
    for name in names:
        begin = time.perf_counter()
        ex = tvm_rammer.compile(get_model(name, **REDUCED[name]), target=target,
                                config=RammerConfig(profile=False,
                                                    **({"check_unmeasured": False} if built else {})))
        cuda = [m for m in ex.mod.imports[0].imports if m.kind == "cuda"]
        for i, module in enumerate(cuda):
            (out / f"{name}.{i}.cu").write_text(str(module.inspect_source()))
        seconds[name] = round(time.perf_counter() - begin, 1)
        print(f"{name}: {len(cuda)} CUDA module(s), {seconds[name]} s", flush=True)
    (out / "seconds.json").write_text(json.dumps(seconds, indent=1) + "\n")
    print("tvm_rammer from", tvm_rammer.__file__)
    return 0


def compare(a: Path, b: Path) -> int:
    """0 when every ``*.cu`` of ``a`` and ``b`` is byte-identical (and both hold the same files)."""
    names = sorted({p.name for p in a.glob("*.cu")} | {p.name for p in b.glob("*.cu")})
    bad = 0
    for name in names:
        pa, pb = a / name, b / name
        if not (pa.exists() and pb.exists()):
            print(f"MISSING {name} in {b if pa.exists() else a}")
            bad += 1
        elif pa.read_bytes() != pb.read_bytes():
            print(f"DIFFERS {name}")
            bad += 1
        else:
            print(f"same    {name} ({pa.stat().st_size} bytes)")
    print(f"{len(names) - bad} of {len(names)} files byte-identical")
    return 1 if bad or not names else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_emit = sub.add_parser("emit", help="write each reduced model's CUDA to a folder")
    p_emit.add_argument("out", type=Path)
    p_emit.add_argument("--models", default="", help="comma-separated names (default: all)")
    p_emit.add_argument("--target", default="rammer/nvidia-h100")
    p_emit.add_argument("--built", action="store_true", help="every rProgram built (check_unmeasured=False)")
    p_cmp = sub.add_parser("compare", help="compare two folders byte by byte")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "emit":
        return emit(args.out, [m for m in args.models.split(",") if m], args.target, args.built)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
