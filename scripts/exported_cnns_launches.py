"""Launches per inference of exported CNNs: tvm-rammer vs TVM's default pipeline (no GPU needed).

    python3 scripts/exported_cnns_launches.py [--source torch|mirror] [--opsets 7,13,17]
                                              [--models resnet50,densenet121] [--reduced]

``torch``: the torchvision-style networks of tests/exported_cnns.py exported by ``torch.onnx``
(symbolic batch ``N``, BatchNormalization kept); ``mirror``: their onnx.helper mirrors. Every model
is compiled with ``--batch 1`` (``tvm-rammer inspect``'s summary); prints a Markdown table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from exported_cnns import FULL, REDUCED_CNN, export, mirror, torch_model  # noqa: E402

from tvm_rammer.views.inspection import inspect_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["torch", "mirror"], default="torch",
                        help="torch.onnx exports or onnx.helper mirrors (default: %(default)s)")
    parser.add_argument("--opsets", default="7,13,17", help="comma-separated opsets")
    parser.add_argument("--models", default=",".join(FULL), help="comma-separated networks")
    parser.add_argument("--reduced", action="store_true", help="the tests' reduced sizes")
    parser.add_argument("--target", default="rammer/nvidia-h100", help="target tag")
    args = parser.parse_args(argv)
    sizes = REDUCED_CNN if args.reduced else FULL
    print("| model | source | opset | rPrograms | launches (rammer) | launches (TVM default) "
          "| ordinary kernels | inspect s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for opset in (int(o) for o in args.opsets.split(",")):
            if args.source == "torch":
                net, shape = torch_model(name, **sizes[name])
                model = export(net, shape, opset)
            else:
                model = mirror(name, opset, **sizes[name])
            start = time.time()
            s = inspect_model(model, args.target, batch=1)
            unplaced = ", ".join(sorted({u["kernel"] for u in s["unplaced"]})) or "-"
            print(f"| {name} | {args.source} | {opset} | {s['rprograms']} | {s['launches']} | "
                  f"{s['default_launches']} | {unplaced} | {time.time() - start:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
