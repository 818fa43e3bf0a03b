"""What a lease's kernel timing brings back, made the shipped profile of its device (issue 31,
item 5), and how many leases each model still needs.

:func:`import_results` turns the result lines of ``tvm_rammer.runtime.kernel_timing`` into kernel
records of a JSON profile database (``profile_db.JsonProfileDB``'s format) keyed by the device the
lease reports (name, arch, driver: ``gpu.DeviceId``), by default ``tvm_rammer/profiles/<device>.json``:
the database a compile without a GPU reads for the target's arch (``Profiler``'s shipped-database
rule), so the next ``prepare`` compiles with the measured kernels. Records are what
``Profiler._measure_batch`` writes: a version's ``kernel_us``, ``registers``, ``shared_bytes``,
``valid``, ``error``, ``tolerance``, ``default_us`` (its reference's time) and, when invalid, the
``reason``; a reference (TVM's default kernel) ``valid`` with error 0 and ``reference: true``.
An rProgram's line (role "rprogram", ``tvm_rammer.lease.rprograms``) becomes the rProgram record
``{"time_us"}`` under its key, the back end's ``plan_key``: the next compile's keep-or-fall-back
decision reads it (with its operators' default kernels' records) instead of keeping it unmeasured.
Failures (a library that did not load, a run that failed or timed out) are not facts and are not
written (``profiler.is_failure``); the kernel's own ones (run failed, timed out) go to
``timed.json`` with the outcome of every kernel timed, so the next prepare does not ask for them
again (:func:`tvm_rammer.lease.kernels.timed_keys`).

:func:`leases_needed` and :func:`state_table`: per model, its decisive kernels (the jobs the
profiler's decisive rule keeps, with their references, as the lease's prepare recorded them),
how many have records, and how many leases the rest needs at the measured seconds per kernel.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from pathlib import Path
from typing import Sequence

from ..host.gpu import DeviceId
from ..tuning.profile_db import SHIPPED_DIR, JsonProfileDB
from ..tuning.profiler import is_failure
from .kernels import LEASE_KERNEL_S, SECONDS_PER_KERNEL, TIMED
from .rprograms import RPROGRAM_SLOTS

__all__ = ["import_results", "device_id", "profile_path", "seconds_per_kernel",
           "kernels_per_lease", "leases_needed", "state_table", "state_markdown",
           "SECONDS_PER_KERNEL", "LEASE_KERNEL_S", "main"]

OWN_FAILURES = ("run failed", "timed out")  # the kernel's own: not asked again


def device_id(facts) -> DeviceId:
    """The device of a lease's facts: a ``DeviceId``, or a dict with ``name``, ``arch`` (e.g.
    "sm_90") and ``driver`` (also read as ``driver_version``), or the path of such a JSON file."""
    if isinstance(facts, DeviceId):
        return facts
    if isinstance(facts, (str, os.PathLike)):
        with open(facts, encoding="utf-8") as f:
            facts = json.load(f)
    try:
        return DeviceId(str(facts["name"]), str(facts["arch"]),
                        str(facts.get("driver") or facts.get("driver_version") or "unknown"))
    except (KeyError, TypeError):
        raise ValueError(f"device facts {facts!r} need 'name', 'arch' and 'driver' (the lease's "
                         "device step writes them)") from None


def profile_path(device: DeviceId, profiles_dir=SHIPPED_DIR) -> Path:
    """``<profiles_dir>/<device name as a slug>.json`` ("NVIDIA H200" -> nvidia-h200.json)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-") or "gpu"
    return Path(profiles_dir) / f"{slug}.json"


def _read_lines(path) -> list:
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by the end of the lease
    return lines


def _record(result: dict, default_us) -> dict | None:
    """The kernel record of one result line (None for a failure: not a fact)."""
    if result.get("kernel_us") is None or result.get("valid") is None:
        return None
    record = {"kernel_us": float(result["kernel_us"]), "valid": bool(result["valid"]),
              "error": result.get("error"), "registers": result.get("registers"),
              "shared_bytes": result.get("shared_bytes"), "source": "lease"}
    if result.get("tolerance") is not None:
        record["tolerance"] = result["tolerance"]
    if result.get("role") == "reference":
        record.update(default_us=record["kernel_us"], reference=True, error=0.0)
    elif default_us is not None:
        record["default_us"] = float(default_us)
    if not record["valid"]:
        record["reason"] = result.get("reason") or "output differs from TVM's default kernel"
    return record


def import_results(results_jsonl, device_facts, profiles_dir=SHIPPED_DIR,
                   timed_path=None) -> dict:
    """Write the records of ``results_jsonl`` (kernel_timing's lines) for the device of
    ``device_facts`` (:func:`device_id`) into ``profile_path(device, profiles_dir)`` (merged with
    what it holds), and every kernel's outcome into ``timed_path`` (a ``timed.json``; None: not
    written). Returns ``{"path", "device", "written", "invalid", "rprograms", "failed",
    "timed_path"}`` (``rprograms``: of ``written``, the rProgram records)."""
    device = device_id(device_facts)
    if timed_path is not None and Path(timed_path).resolve().parent == Path(profiles_dir).resolve():
        raise ValueError(f"timed_path {timed_path} is in the profiles folder, whose *.json are read "
                         "as profile databases: keep it with the lease's prepare (kernels/timed.json)")
    results = _read_lines(results_jsonl)
    ref_us = {r["key"]: r["kernel_us"] for r in results
              if r.get("role") == "reference" and r.get("kernel_us") is not None}
    path = profile_path(device, profiles_dir)
    db = JsonProfileDB(str(path))
    items, outcomes, failed, invalid = [], {}, 0, 0
    for result in results:
        key = result.get("key")
        if not key:
            continue
        if result.get("role") == "rprogram" and result.get("kernel_us") is not None \
                and result.get("valid"):
            outcomes[key] = "measured"
            items.append(("rprogram", key, device, {"time_us": float(result["kernel_us"]),
                                                     "source": "lease"}))
            continue
        record = _record(result, result.get("default_us") or ref_us.get(result.get("reference")))
        if record is None or is_failure(record):
            failed += 1
            reason = str(result.get("reason") or "")
            if reason.startswith(OWN_FAILURES):
                outcomes[key] = reason[:200]
            continue
        if result.get("role") == "reference" and db.get("kernel", key, device) is not None:
            outcomes[key] = "measured"  # the profiler's rule: a reference's time only when missing
            continue
        invalid += not record["valid"]
        outcomes[key] = "measured" if record["valid"] else "invalid"
        items.append(("kernel", key, device, record))
    db.put_many(items)
    db.flush()
    if timed_path is not None:
        _merge_timed(timed_path, outcomes)
    return {"path": str(path), "device": device.key, "written": len(items), "invalid": invalid,
            "rprograms": sum(1 for item in items if item[0] == "rprogram"),
            "failed": failed, "timed_path": None if timed_path is None else str(timed_path)}


def _merge_timed(path, outcomes: dict) -> None:
    doc = {"kernels": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    doc.setdefault("kernels", {}).update(outcomes)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def timed_file(out_dir) -> str:
    """Where :func:`import_results` keeps what the lease timed for ``prepare_kernels(out_dir)``."""
    return os.path.join(out_dir, TIMED)


def seconds_per_kernel(results_jsonl=None, default: float = SECONDS_PER_KERNEL) -> float:
    """The median seconds one kernel took in a lease's results (load, check, time), or
    ``default`` (an estimate: 0.05-0.2 s on an H200) when there are none."""
    if results_jsonl is None or not os.path.exists(results_jsonl):
        return default
    seconds = [r["seconds"] for r in _read_lines(results_jsonl) if r.get("seconds") is not None]
    return statistics.median(seconds) if seconds else default


def kernels_per_lease(seconds_per: float = SECONDS_PER_KERNEL, lease_kernel_s: float = LEASE_KERNEL_S,
                      size_mib: float | None = None, mib_per_kernel: float | None = None) -> int:
    """Kernels one lease times: its kernel-timing seconds over the seconds per kernel, and, when
    given, the libraries' share of the travel size over the size per kernel."""
    n = lease_kernel_s / max(seconds_per, 1e-6)
    if size_mib is not None and mib_per_kernel:
        n = min(n, size_mib / mib_per_kernel)
    return max(1, int(n))


def leases_needed(decisive: int, measured: int = 0, per_lease: int | None = None) -> int:
    """Leases until a model's decisive kernels are all measured: the ones left over
    ``per_lease`` (:func:`kernels_per_lease`), rounded up; 0 when none is left."""
    left = max(0, decisive - measured)
    return math.ceil(left / (per_lease or kernels_per_lease())) if left else 0


def state_table(manifest: dict, db=None, device: DeviceId | None = None,
                per_lease: int | None = None) -> list:
    """One row per model of a prepare's ``manifest`` (``kernels.json``): ``{"model", "decisive",
    "measured", "left", "leases_left"}`` and, where the prepare formed its rPrograms, ``rprograms``
    (the manifest's counts; ``leases_left`` then adds their candidates' leases, ``rprograms.
    RPROGRAM_SLOTS`` kernels each); measured counts the decisive keys with a record of
    ``device`` in ``db`` (a profile database; None: the counts the prepare found), and moves the
    listed rProgram candidates with a record there from candidates to measured. Models share
    kernels (a key counts for each model that needs it); ``leases_left`` is per model alone."""
    rows = []
    for m in manifest.get("models", []):
        keys = list(m.get("decisive", []))
        if db is not None and device is not None:
            measured = sum(1 for k in keys if _has(db, k, device))
        else:
            measured = int(m.get("measured", 0))
        row = {"model": m["name"], "decisive": len(keys), "measured": measured,
               "left": len(keys) - measured,
               "leases_left": leases_needed(len(keys), measured, per_lease)}
        if "rprograms" in m:  # item 5: the model's rProgram decisions as the prepare found them
            rp = m["rprograms"]
            if rp is not None and db is not None and device is not None:
                # the listed candidates the database has a time for since: measured now
                now = sum(1 for k in manifest.get("kernels", []) if k.get("role") == "rprogram"
                          and k.get("model") == m["name"] and _has(db, k["key"], device, "rprogram"))
                rp = dict(rp, measured=rp["measured"] + now, candidates=rp["candidates"] - now)
            row["rprograms"] = rp
            if rp is not None:
                row["leases_left"] += math.ceil(rp["candidates"] * RPROGRAM_SLOTS
                                                / (per_lease or kernels_per_lease()))
        rows.append(row)
    return rows


def _has(db, key: str, device: DeviceId, kind: str = "kernel") -> bool:
    record = db.get(kind, key, device)
    return record is not None and not is_failure(record)


def state_markdown(rows: Sequence[dict], per_lease: int | None = None) -> str:
    """The per-model state as a markdown table (for benchmarks/README.md)."""
    n = per_lease or kernels_per_lease()
    if any("rprograms" in r for r in rows):  # with the rProgram decisions (lease.rprograms)
        lines = [f"| model | decisive kernels | measured | left | rPrograms formed | measured | "
                 f"candidates | leases left (at {n} kernels/lease) |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            rp = r.get("rprograms") or {}
            lines.append(f"| {r['model']} | {r['decisive']} | {r['measured']} | {r['left']} | "
                         f"{rp.get('formed', '-')} | {rp.get('measured', '-')} | "
                         f"{rp.get('candidates', '-')} | {r['leases_left']} |")
        return "\n".join(lines) + "\n"
    lines = [f"| model | decisive kernels | measured | left | leases left (at {n} kernels/lease) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['decisive']} | {r['measured']} | {r['left']} | {r['leases_left']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python3 -m tvm_rammer.lease.kernel_results import RESULTS FACTS [--profiles DIR]
    [--timed PATH]`` (prints the import's summary) or ``state MANIFEST [--facts FACTS]`` (prints
    the per-model state table, measured counted in the shipped profile of that device)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m tvm_rammer.lease.kernel_results")
    sub = parser.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="a lease's kernel results into the device's shipped profile")
    imp.add_argument("results", help="kernel_results.jsonl of the lease")
    imp.add_argument("facts", help="the lease's device facts (JSON: name, arch, driver)")
    imp.add_argument("--profiles", default=str(SHIPPED_DIR))
    imp.add_argument("--timed", default=None, help="timed.json to update (the prepare's kernels/)")
    state = sub.add_parser("state", help="per model: decisive kernels, measured, leases left")
    state.add_argument("manifest", help="kernels.json of a prepare")
    state.add_argument("--facts", default=None, help="device facts: count its shipped records")
    state.add_argument("--profiles", default=str(SHIPPED_DIR))
    args = parser.parse_args(argv)
    try:
        if args.cmd == "import":
            print(json.dumps(import_results(args.results, args.facts, args.profiles, args.timed)))
            return 0
        with open(args.manifest, encoding="utf-8") as f:
            manifest = json.load(f)
        db = device = None
        if args.facts:
            device = device_id(args.facts)
            path = profile_path(device, args.profiles)
            db = JsonProfileDB(str(path)) if path.exists() else JsonProfileDB()
        print(state_markdown(state_table(manifest, db, device)), end="")
    except (OSError, ValueError) as err:
        print(f"kernel_results: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
