"""Predicted times of the scheduling policies side by side, on the CPU (no GPU needed).

``python -m tvm_rammer.benchmarks.policy_table [--reduced[=MODEL,...]] [--policies NAME,...]
[--out FILE.json] [MODEL ...]``

For each model: the rammer pipeline up to the back end (import, SplitToSlices, legalisation,
fusion, dlight), then the back end's rOperators and policy input (``backend.collect_operators``,
``backend.op_graph_of``) built ONCE, and every policy of ``tvm_rammer.scheduling.policies`` run on that same
input. Each policy's rPrograms go through the invariant checker (``RProgram.validate``) before they
are counted. Reported per policy: the sum of the rPrograms' ``predicted_us`` (the analytical model
with ``RammerConfig(profile=False)``: launch, barriers, grid sync and per-rTask times), the number
of rPrograms, the kernel launches per inference (rPrograms plus the operators left as TVM's default
kernels, the same for every policy), the rTasks and barrier-rTasks, the seconds the policy took,
and where the time of the chain that ends last goes (``critical_path.last_chain``, summed over the
rPrograms): its rounds of rTasks, its barrier waits, and the time its operators, once ready, waited
for vEUs busy with other rTasks (what a better placement could win back).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .harness import TABLE1_MODELS

IOS_MODELS = ("inception_v3", "randwire", "nasnet_cifar", "squeezenet")
MODELS = IOS_MODELS + tuple(m for m in TABLE1_MODELS if m not in IOS_MODELS)

__all__ = ["IOS_MODELS", "MODELS", "policy_input", "compare_policies", "format_markdown"]


def policy_input(model: str, target: str = "rammer/nvidia-h100", config=None, reduced: bool = False,
                 batch: int = 1) -> dict:
    """The policy's input for a model of the zoo: ``op_graph``, ``vdevice``, ``policy_config`` and
    ``ordinary`` (kernels left outside every rProgram)."""
    import tvm

    from relay_passes.dataflow_graph import DataflowGraph

    from ..scheduling import rkernels
    from ..driver.backend import collect_operators, make_profiler, op_graph_of
    from ..config import RammerConfig
    from ..driver.frontend import import_onnx
    from ..models import REDUCED, get_model
    from ..driver.pipeline import rammer_passes
    from ..target import resolve_target

    config = config or RammerConfig(profile=False)
    target = resolve_target(target)
    mod = import_onnx(get_model(model, batch=batch, **(REDUCED.get(model, {}) if reduced else {})))
    with target:
        passes = rammer_passes(target, config)
        cut = next(i for i, p in enumerate(passes) if p.info.name == "WithTarget(RammerBackend)")
        mod = tvm.transform.Sequential(passes[:cut])(mod)
        graph = DataflowGraph.from_function(mod["main"], mod)
        vdevice = rkernels.vdevice_for(target, config)
        profiler = make_profiler(target, config)
        ops, skipped = collect_operators(graph, mod, target, config, vdevice, profiler)
    ordinary = sum(1 for i in skipped if graph.nodes[i].kind != "alias")
    return {"op_graph": op_graph_of(graph, ops, skipped), "vdevice": vdevice,
            "policy_config": rkernels.policy_config(config, vdevice), "ordinary": ordinary}


def compare_policies(inputs: dict, policies=None) -> dict:
    """policy name -> its row (module docstring) on one model's ``policy_input``."""
    from ..scheduling.policies import POLICIES

    graph, vdevice, config = inputs["op_graph"], inputs["vdevice"], inputs["policy_config"]
    rows = {}
    for name in policies or POLICIES:
        start = time.perf_counter()
        plans = POLICIES[name](graph, vdevice, config)
        seconds = time.perf_counter() - start
        for plan in plans:
            kernels = plan.kernels(graph)
            plan.program.validate({op: k.num_rtasks for op, k in kernels.items()}, graph.preds)
        rows[name] = {"predicted_us": sum(p.predicted_us for p in plans), "rprograms": len(plans),
                      "launches": len(plans) + inputs["ordinary"],
                      "rtasks": sum(p.program.num_rtasks for p in plans),
                      "barriers": sum(p.program.num_barriers for p in plans),
                      "operators": len(graph.ops), "policy_s": seconds,
                      "last_chain": _last_chains(plans, graph, config)}
    return rows


def _last_chains(plans, graph, config) -> dict:
    """The last-ending chain of each rProgram (``critical_path.last_chain``), summed over the
    rPrograms (they run one after another): operators, rTask rounds, barrier waits and the time
    its operators waited for a vEU, in us."""
    from ..scheduling.critical_path import last_chain, rounds_us

    total = {"operators": 0, "rtask_us": 0.0, "barrier_us": 0.0, "waiting_us": 0.0}
    for plan in plans:
        # an operator waiting at a barrier-rTask inside the rProgram has its weights prefetched
        # during the wait (policy.select_veus): its rounds take up to prefetch_us less after it
        op_us = {op: rounds_us(k.time_us, k.num_rtasks, plan.num_veus)
                 - (k.prefetch_us if any(p in plan.op_finish for p in graph.preds.get(op, ()))
                    else 0.0)
                 for op, k in plan.kernels(graph).items()}
        chain = last_chain(plan.op_finish, graph.preds, op_us, config.cost.barrier_us)
        total["operators"] += len(chain.operators)
        for key in ("rtask_us", "barrier_us", "waiting_us"):
            total[key] += getattr(chain, key)
    # + 0.0: a sum that rounds to -0.0 prints as 0.0
    return {k: round(v, 1) + 0.0 if isinstance(v, float) else v for k, v in total.items()}


def format_markdown(results: dict) -> str:
    """A markdown table: one line per model, predicted us / rPrograms / launches per policy."""
    policies = list(next(iter(results.values())))
    head = "| model | operators | " + " | ".join(
        f"{p}: predicted us (rPrograms, launches)" for p in policies) + " | policy seconds |"
    lines = [head, "|" + "---|" * (len(policies) + 3)]
    for model, rows in results.items():
        first = rows[policies[0]]
        cells = [f"{rows[p]['predicted_us']:.1f} ({rows[p]['rprograms']}, {rows[p]['launches']})"
                 for p in policies]
        seconds = " / ".join(f"{rows[p]['policy_s']:.1f}" for p in policies)
        lines.append(f"| {model} | {first['operators']} | " + " | ".join(cells) + f" | {seconds} |")
    lines += ["", "| model | " + " | ".join(
        f"{p}: last chain ops, rTask + barrier + waiting us" for p in policies) + " |",
        "|" + "---|" * (len(policies) + 1)]
    for model, rows in results.items():
        cells = []
        for p in policies:
            c = rows[p]["last_chain"]
            cells.append(f"{c['operators']}, {c['rtask_us']:.1f} + {c['barrier_us']:.1f} + "
                         f"{c['waiting_us']:.1f}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--reduced", nargs="?", const="*", default="", metavar="MODEL,...",
                        help="use the reduced size (tvm_rammer.models.REDUCED) for these models "
                             "(comma-separated), or for all when none is named")
    parser.add_argument("--target", default="rammer/nvidia-h100")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--policies", default=None, metavar="NAME,...",
                        help="only these policies (comma-separated; default: all of "
                             "tvm_rammer.scheduling.policies)")
    args = parser.parse_args(argv)
    from ..scheduling.policies import POLICIES

    policies = args.policies.split(",") if args.policies else None
    unknown = [p for p in policies or () if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    results = {}
    for model in args.models:
        reduced = args.reduced == "*" or model in args.reduced.split(",")
        start = time.perf_counter()
        inputs = policy_input(model, args.target, reduced=reduced)
        label = f"{model} (reduced)" if reduced else model
        results[label] = compare_policies(inputs, policies)
        print(f"{label}: {time.perf_counter() - start:.0f} s "
              + json.dumps({p: round(r["predicted_us"], 1) for p, r in results[label].items()}),
              file=sys.stderr, flush=True)
    print(format_markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
