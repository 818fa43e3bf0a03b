"""Persistent kernels lowered by TVM's whole TIR pipeline and by ours: SASS here, latency on a GPU.

    python3 scripts/relower_check.py                        # every zoo model, full size (minutes)
    python3 scripts/relower_check.py --reduced lstm_tc squeezenet --out rows.json

``tvm.compile`` lowers a persistent kernel with TVM's s_tir pipeline less the passes in
``tvm_rammer.codegen.tir_pipeline.SKIPPED`` (no-ops on it: the TIR is TVM's) and
``REDONE_BY_NVCC`` (optimisations that ran on every rKernel body in prelower; run again over the
assembled kernel they rewrite its TIR, and nvcc's optimiser does that work anyway). For each model
this builds the rammer pipeline's persistent kernels both ways: "tvm" (only SKIPPED left out, which
gives TVM's own TIR: tests/test_tir_pipeline.py) and "ours", compiles each with nvcc for the
target's arch, and records the build's seconds (TIR passes and CUDA codegen) and the SASS:
instructions, registers, spill bytes and whether the two listings are the same. With a CUDA GPU it
also builds the whole module both ways, runs both on the same random inputs and records their
largest relative difference and median latencies (us), one model at a time. One JSON line per
model, then a Markdown table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import tvm
from tvm.tirx import compilation_pipeline

from tir_templates.cuda_resources import compile_cuda_sass, sass_opcodes
from tvm_rammer.codegen import tir_pipeline
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.host.gpu import gpu_available
from tvm_rammer.models import MODELS, REDUCED, get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.codegen.resources import module_cuda_source
from tvm_rammer.run.runner import execute, random_inputs, resolve_target
from tvm_rammer.target import plain_target, target_arch

TVM_PIPELINE = "rammer_check_tvm"  # TVM's s_tir pipeline (SKIPPED left out: the same TIR)


def _register_tvm_pipeline() -> str:
    """Register, once, the TIR pipeline that lowers persistent kernels as TVM's does: only the
    SKIPPED passes left out (tests/test_tir_pipeline.py: the same TIR as TVM's whole pipeline, in
    seconds instead of minutes on the larger models)."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    def factory(**kwargs):
        _, finalize_host, finalize_device = default_s_tir_pipeline(**kwargs)

        @tvm.transform.module_pass(opt_level=0, name=TVM_PIPELINE)
        def _run(mod, _ctx):
            passes = tir_pipeline.prelowered_passes(skipped=tir_pipeline.SKIPPED)
            return tvm.transform.Sequential(passes)(mod)

        return _run, finalize_host, finalize_device

    if TVM_PIPELINE not in compilation_pipeline.PIPELINE_MAP:
        compilation_pipeline.register_tir_pipeline(TVM_PIPELINE, factory)
    return TVM_PIPELINE


def _sass(persistent: tvm.IRModule, target, pipeline: str) -> dict:
    """Build ``persistent`` with the TIR pipeline named ``pipeline``, compile it with nvcc, and
    count its SASS."""
    start = time.perf_counter()
    built = tvm.tirx.build(persistent, target, pipeline=pipeline)
    build_s = time.perf_counter() - start
    resources, sass = compile_cuda_sass(module_cuda_source(built), target_arch(target))
    body = "\n".join(line for line in sass.splitlines() if "/*" in line)
    return {"build_s": round(build_s, 2), "sass_instructions": sum(sass_opcodes(sass).values()),
            "registers": resources["registers"], "spill_bytes": resources.get("spills", 0),
            "sass_sha1": hashlib.sha1(body.encode()).hexdigest()[:12]}


def _on_gpu(lowered: tvm.IRModule, proto, target) -> dict:
    """Both builds of the whole module run on the same inputs: outputs compared, latency timed."""
    feeds = random_inputs(proto)
    inputs = [feeds[v.name] for v in proto.graph.input if v.name in feeds]
    dev = tvm.cuda(0)
    outs, row = {}, {}
    for label, pipeline in (("tvm", _register_tvm_pipeline()), ("ours", "default")):
        ex = tvm.compile(lowered, target=target, relax_pipeline=None, tir_pipeline=pipeline)
        outs[label], row[f"{label}_latency_us"] = execute(ex, inputs, dev)
    row["max_rel_diff"] = max((relative_error(a, b) for a, b in zip(outs["ours"], outs["tvm"])),
                              default=0.0)
    return row


def check(name: str, reduced: bool, target_name: str, gpu: bool) -> dict:
    """One row: the model's persistent kernels lowered both ways."""
    proto = get_model(name, **(REDUCED.get(name, {}) if reduced else {}))
    # bodies inline: the outlining of rkernel_functions is a step of our pipeline TVM's has not
    lowered = lower(import_onnx(proto), target_name, RammerConfig(profile=False,
                                                                rkernel_functions=False))
    persistent = tvm.IRModule({gv: f for gv, f in lowered.functions_items()
                               if tir_pipeline.is_prelowered(f)})
    row = {"model": name, "reduced": reduced, "persistent_kernels": len(persistent.functions)}
    if not persistent.functions:
        return row
    target = plain_target(resolve_target(target_name))
    row["tvm"] = _sass(persistent, target, _register_tvm_pipeline())
    row["ours"] = _sass(persistent, target, "default")
    row["same_sass"] = row["tvm"]["sass_sha1"] == row["ours"]["sass_sha1"]
    if gpu:
        row.update(_on_gpu(lowered, proto, resolve_target(target_name)))
    return row


def table(rows: list) -> str:
    """Markdown: one line per model."""
    lines = ["| model | build s: tvm / ours | SASS instructions: tvm / ours | same SASS | registers "
             "| spill bytes | GPU us: tvm / ours (max rel diff) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tvm" not in r:
            lines.append(f"| {r['model']} | no persistent kernel | | | | | |")
            continue
        t, o = r["tvm"], r["ours"]
        gpu = (f"{r['tvm_latency_us']:,.1f} / {r['ours_latency_us']:,.1f} ({r['max_rel_diff']:.1e})"
               if "tvm_latency_us" in r else "not measured: no GPU")
        lines.append(f"| {r['model']} | {t['build_s']} / {o['build_s']} | {t['sass_instructions']:,} / "
                     f"{o['sass_instructions']:,} | {'yes' if r['same_sass'] else 'no'} | "
                     f"{t['registers']} / {o['registers']} | "
                     f"{t['spill_bytes']} / {o['spill_bytes']} | {gpu} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="zoo models (default: all of them)")
    parser.add_argument("--reduced", action="store_true", help="tvm_rammer.models.REDUCED sizes")
    parser.add_argument("--target", default="rammer/nvidia-h100")
    parser.add_argument("--out", help="also write the rows to this JSON file")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(sorted(MODELS))}")
    gpu = gpu_available()
    rows = []
    for name in args.models or sorted(MODELS):
        rows.append(check(name, args.reduced, args.target, gpu))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "target": args.target, "gpu": gpu,
                       "rows": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
