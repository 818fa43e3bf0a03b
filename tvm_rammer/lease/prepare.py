"""``gpu_lease.sh prepare``: build on this CPU machine everything a GPU lease runs, into ``.lease/``.

In: the lease's selection (:class:`LeaseSpec`: models, sizes, target, what to build). Out: the
folder ``.lease/`` (ignored by git) that travels to the GPU host with the working tree, and
``.lease/index.json`` saying what is in it (:func:`prepare` returns that index):

- ``tvm/``: TVM's runtime without its compiler (the installed ``tvm`` package less
  ``lib/libtvm_compiler.so`` and ``3rdparty``, xz-compressed) and the cp312 apache-tvm-ffi wheel,
  as ``../shared/gpu/make-bundle.sh`` made them; ``wheels/``: onnx2torch (pure Python) for the
  PyTorch baseline;
- ``libs.tar.xz`` of ``libs/NAME.so`` + ``libs/NAME.json`` (built and kept in ``.lease-build/``,
  packed for travel; ``run`` unpacks it into the lease folder): lease libraries (the shared
  contract of issue 31: code,
  the manifest of :mod:`tvm_rammer.lease.manifest`; weights regenerated there from the model's seed)
  for every zoo model (tvm-rammer's default, ``--no-unmeasured-check``, TVM's default pipeline),
  the 16-branch demo, and the instrumented (timeline) builds, whose predicted schedules go to
  ``timelines/MODEL.schedules.json`` for ``report``;
- ``kernels/``: the kernel-version libraries of the "kernels" step (:func:`_kernels_hook`).

Every library is built in a child process of its own (a crash or a leak stays there), keyed by
content (:func:`artifact_key`: the hash of the source files that affect a build, TVM's, the CUDA
compiler's and the spec), so an unchanged build is reused; ``--cpu-check`` builds llvm libraries of
the same form, which ``run`` loads, runs and checks on this machine.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

FORMAT = "tvm-rammer-lease/1"
ROOT = Path(__file__).resolve().parents[2]
DECODERS = ("gpt2_decode", "llama_decode")  # issue 34's decode step: the open question first
ZOO = DECODERS + ("lstm_tc", "nasnet_cifar", "squeezenet", "alexnet", "resnext29", "seq2seq",
                  "googlenet", "inception_v3", "randwire", "deepspeech2")  # in order of value
# a model's lease size where it is not the zoo default (reduced builds keep the dtype): GPT-2 small
# whole in float16; Llama-3.2-1B's width (d 2048, 32/8 heads, d_ff 8192, vocab 128256) in float16
# with 2 of its 16 layers: its 16-layer weights (2.47 GB, external data) would be regenerated,
# transformed three times and read by onnxruntime and PyTorch within one step of the lease
LEASE_PARAMS = {"gpt2_decode": {"dtype": "float16"},
                "llama_decode": {"dtype": "float16", "layers": 2}}
TIMELINE_MODELS = ("nasnet_cifar", "resnext29", "alexnet")
DEMO = {"zoo": "branches", "params": {"n": 16}, "batch": 1}
# what a library's build depends on besides its spec: the compiler's sources (not the lease's,
# the runtime's or the tests')
SOURCE_DIRS = ("tvm_rammer", "relay_passes", "tir_templates")
SOURCE_SKIP = ("tvm_rammer/lease/", "tvm_rammer/runtime/", "tvm_rammer/benchmarks/")
SOURCE_KEEP = ("tvm_rammer/lease/manifest.py",)  # the weights-apart build: it affects libraries
TVM_VERSION = "0.27.0.post1"
FFI_VERSION = "0.1.14.post1"
BUNDLE_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm-rammer" / "lease"
TRAVEL_LIMIT_MIB = 60
PACK_RESERVE_S = 90.0  # of prepare's time limit, kept for packing (xz -3 of the full zoo's 64 MiB:
#                        ~5 s on an idle core, ~60 s on this 2-core machine at load 10)


@dataclass(frozen=True)
class LeaseSpec:
    """What ``prepare`` builds. ``models``: zoo names in order of value; ``reduced``: names built at
    ``tvm_rammer.models.REDUCED`` size (all when True); ``cpu_check``: llvm libraries that ``run``
    can load and run without a GPU (TVM's default pipeline: one library per model, no timelines)."""

    out: str = ".lease"
    target: str = "rammer/nvidia-h200"
    models: tuple = ZOO
    reduced: tuple | bool = ()
    demo: bool = True
    timelines: tuple = TIMELINE_MODELS
    bundle: bool = True  # TVM's runtime and the wheels (not for tests)
    kernels: bool = True
    cpu_check: bool = False
    jobs: int = 2
    build_timeout_s: float = 1200.0
    # prepare's whole wall time: builds stop PACK_RESERVE_S before it (none starts past that, one
    # in flight is stopped there; the rest: the next prepare), then the libraries are packed
    time_limit_s: float | None = 1740.0


@dataclass(frozen=True)
class Artifact:
    """One library to build: ``name`` (file stem), the zoo ``model`` dict ``{"zoo", "params",
    "batch"}``, ``variant`` (a key of :data:`VARIANTS`) and the target."""

    name: str
    model: dict
    variant: str
    target: str
    cpu_check: bool = False
    config: dict = field(default_factory=dict)


VARIANTS = {  # variant -> (pipeline, RammerConfig fields)
    "rammer": ("rammer", {}),
    "rammer_nocheck": ("rammer", {"check_unmeasured": False}),
    "default": ("default", {}),
    "timeline": ("rammer", {"timeline": True, "check_unmeasured": False}),  # rPrograms to look in
    # issue 34's prefetch across barriers, measured: the same rProgram with the prefetch only at
    # the barrier right before its reader, and with none (decoders only: PREFETCH_MODELS)
    "lookahead1": ("rammer", {"prefetch_lookahead": 1, "check_unmeasured": False}),
    "prefetch_off": ("rammer", {"prefetch_weights": False, "check_unmeasured": False}),
    # the decode attention after the caches' one-slot writes, as before RammerConfig.attention_row
    # (ROW_MODELS): beside rammer_nocheck, the gain of reading q, k, v beside the writes, measured
    "after_writes": ("rammer", {"attention_row": False, "check_unmeasured": False}),
}
PREFETCH_VARIANTS = ("lookahead1", "prefetch_off")
PREFETCH_MODELS = DECODERS  # where the model predicts the prefetch matters (weights > one wait)
ROW_VARIANTS = ("after_writes",)
ROW_MODELS = DECODERS  # both read their rows (llama_decode's rotary computed in the attention)


def model_dict(name: str, reduced: bool) -> dict:
    """The manifest's ``model`` entry of a zoo model (its lease size, :data:`LEASE_PARAMS`, unless
    ``reduced``: ``tvm_rammer.models.REDUCED``'s, in the lease's dtype)."""
    from tvm_rammer.models import REDUCED
    params = {**LEASE_PARAMS.get(name, {}), **(REDUCED[name] if reduced else {})}
    return {"zoo": name, "params": params, "batch": 1}


def artifacts(spec: LeaseSpec) -> list[Artifact]:
    """The libraries of ``spec``, in the order ``run`` uses them."""
    out = []

    def add(stem, model, variants):
        for v in variants:
            cfg = VARIANTS[v][1]
            out.append(Artifact(f"{stem}.{v}", model, v, spec.target, spec.cpu_check, cfg))

    # on llvm every variant is TVM's default pipeline (persistent kernels are CUDA): build it once
    demo_variants = ("default",) if spec.cpu_check else ("rammer", "default")
    zoo_variants = ("default",) if spec.cpu_check else ("rammer", "rammer_nocheck", "default")
    if spec.demo:
        add("demo", DEMO, demo_variants)
    # the product's question first, for every model: tvm-rammer's default against TVM's default;
    # then the --no-unmeasured-check builds (every rProgram built: the slowest builds, NASNet-CIFAR's
    # alone ~10 minutes of this machine) and the timelines, so a prepare cut by its time limit has
    # every model's main comparison
    first = [v for v in zoo_variants if v != "rammer_nocheck"]
    for m in spec.models:
        add(m, model_dict(m, _is_reduced(spec, m)), first)
    for m in spec.models:
        add(m, model_dict(m, _is_reduced(spec, m)), [v for v in zoo_variants if v not in first])
    if not spec.cpu_check:  # persistent kernels (and their prefetches) are CUDA only
        for m in spec.models:
            if m in PREFETCH_MODELS:
                add(m, model_dict(m, _is_reduced(spec, m)), PREFETCH_VARIANTS)
        for m in spec.models:  # after the prefetch builds: a cut prepare keeps those
            if m in ROW_MODELS:
                add(m, model_dict(m, _is_reduced(spec, m)), ROW_VARIANTS)
    if not spec.cpu_check:  # the instrumented build reads %globaltimer: CUDA only
        for m in spec.timelines:
            add(m, model_dict(m, _is_reduced(spec, m)), ("timeline",))
    return out


def _is_reduced(spec: LeaseSpec, name: str) -> bool:
    return spec.reduced is True or name in (spec.reduced or ())


# --- content keys -------------------------------------------------------------------------------

def source_hash(root: Path = ROOT) -> str:
    """SHA-256 over the compiler's source files (path and bytes), independent of the commit: the
    same tree gives the same hash on any clone."""
    h = hashlib.sha256()
    for top in SOURCE_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if (not path.is_file() or "__pycache__" in rel or path.suffix in (".pyc", ".so")
                    or (rel.startswith(SOURCE_SKIP) and rel not in SOURCE_KEEP)):
                continue
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def toolchain() -> dict:
    """TVM's and tvm-ffi's versions and the CUDA compiler's version line (part of every key)."""
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for pkg in ("apache-tvm", "apache-tvm-ffi"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = None
    nvcc = shutil.which("nvcc")
    found["nvcc"] = None
    if nvcc:
        try:
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                  timeout=30).stdout.strip().splitlines()
            found["nvcc"] = text[-1] if text else None
        except (OSError, subprocess.SubprocessError):
            pass
    return found


def artifact_key(art: Artifact, sources: str, tools: dict) -> str:
    """The content key of one library: what it is built from, never the commit."""
    blob = json.dumps({"format": FORMAT, "artifact": asdict(art), "sources": sources,
                       "tools": tools}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# --- building one library (in a child process) --------------------------------------------------

def build_one(art: Artifact, libs: Path) -> dict:
    """Build ``art`` into ``libs/NAME.so`` + ``libs/NAME.json`` (and for a timeline build
    ``NAME.schedules.json``); returns what happened: ``{"files", "weights_apart", "binary",
    "seconds"}``. Runs TVM's compiler: call it in a child process (:func:`_build_in_child`)."""
    start = time.perf_counter()
    from tvm_rammer.models import get_model

    model = art.model
    proto = get_model(model["zoo"], batch=model["batch"], **model["params"])
    config = _config(art)
    target = "llvm" if art.cpu_check else art.target
    pipeline = "default" if art.cpu_check else VARIANTS[art.variant][0]
    base = libs / art.name
    info = _build_with_helpers(proto, model, pipeline, config, target, base)
    if art.variant == "timeline":
        info["files"].append(_write_schedules(proto, target, config, base, info["weights_apart"]))
    info["seconds"] = round(time.perf_counter() - start, 2)
    import resource
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # nvcc and the linker
    info["cpu_s"] = round(time.process_time() + kids.ru_utime + kids.ru_stime, 2)
    return info


def _config(art: Artifact):
    """The RammerConfig of a lease build: the product default with the variant's fields; the
    profile is the shipped database's (an empty writable one: nothing measured here, no per-user
    cache read, so the build is the same on any CPU machine)."""
    from tvm_rammer.config import RammerConfig
    empty = BUNDLE_CACHE / "empty-profile.json"
    return replace(RammerConfig(), profile_db=str(empty), profile_budget_s=0.0, **art.config)


def _build_with_helpers(proto, model, pipeline, config, target, base: Path) -> dict:
    """The library with its weights apart (:func:`tvm_rammer.lease.manifest.build_library`: its
    CUDA a binary for the target's arch through :mod:`tvm_rammer.host.cross`) and its manifest."""
    from tvm_rammer.lease.manifest import build_library

    found = build_library(proto, pipeline=pipeline, config=config, target=target,
                          out=str(base) + ".so", model=model)
    files = [p.name for p in (_file(base, ".so"), _file(base, ".json"))]
    return {"files": files, "weights_apart": True, "binary": found["binary"],
            "builder": "manifest.build_library"}


def _file(base: Path, ext: str) -> Path:
    """``base`` + ``ext`` (``base`` is NAME.variant: its last dot is not a suffix)."""
    return base.parent / (base.name + ext)


def _write_schedules(proto, target, config, base: Path, weights_apart: bool) -> str:
    """The predicted schedules of a timeline build (``timeline.schedules_of`` of the module lowered
    as the library was: weights apart or not) and its kernel names, for ``report`` to decode the
    buffers measured there."""
    from relay_passes.return_timelines import TIMELINE_KERNELS_ATTR

    from tvm_rammer.scheduling import timeline
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.target import resolve_target

    if weights_apart:
        mod = import_onnx(proto, weights="apart")
        config = replace(config, weights="apart")
    else:
        mod = import_onnx(proto)
    lowered = lower(mod, resolve_target(target), config)
    attrs = lowered.attrs or {}
    names = json.loads(str(attrs[TIMELINE_KERNELS_ATTR])) if TIMELINE_KERNELS_ATTR in attrs else []
    path = base.parent / (base.name + ".schedules.json")
    path.write_text(json.dumps({"kernels": names, "schedules": timeline.schedules_of(lowered)}))
    return path.name


def _build_in_child(art: Artifact, libs: Path, timeout_s: float, deadline: bool = False) -> dict:
    """:func:`build_one` in a fresh Python process; returns its record or ``{"error": ...}``.
    ``deadline``: ``timeout_s`` is what prepare's time limit leaves, so a build stopped by it is
    recorded "not built" (the next prepare builds it), not as a failed build."""
    cmd = [sys.executable, "-m", "tvm_rammer.lease.prepare", "build-one",
           json.dumps(asdict(art)), str(libs)]
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    from tvm_rammer.runtime.lease_steps import kill_group  # pylint: disable=import-outside-toplevel

    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env=env, start_new_session=True)  # its nvcc runs in its group
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(child)  # the child and the nvcc / linker it started
        if deadline:
            return {"error": "not built: prepare's time limit, reached during its build (run "
                             "prepare again: it continues)", "seconds": round(timeout_s, 1)}
        return {"error": f"build over {timeout_s:.0f} s", "seconds": round(timeout_s, 1)}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if child.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit {child.returncode}",
                "seconds": round(time.perf_counter() - start, 1)}
    return json.loads(lines[-1])


# --- the bundle: TVM's runtime and the wheels ---------------------------------------------------

def bundle(out: Path, log) -> dict:
    """``tvm/tvm-runtime.tar.xz`` (the installed tvm package less its compiler library and
    3rdparty), the cp312 apache-tvm-ffi wheel and the onnx2torch wheel, cached in BUNDLE_CACHE
    (downloads once). Returns their paths relative to ``out``."""
    import tvm
    cache = BUNDLE_CACHE / f"{TVM_VERSION}-{FFI_VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    tar = cache / "tvm-runtime.tar.xz"
    if not tar.exists():
        log(f"packing TVM's runtime into {tar} (xz, once)")
        src = Path(tvm.__file__).resolve().parent
        tmp = tar.with_suffix(".part")

        def keep(info):
            name = info.name
            if ("/3rdparty" in name or name.endswith("libtvm_compiler.so")
                    or "__pycache__" in name):
                return None
            return info

        with tarfile.open(tmp, "w:xz", preset=6) as t:
            t.add(src, arcname="tvm", filter=keep)
        tmp.rename(tar)
    wheels = cache / "wheels"
    wheels.mkdir(exist_ok=True)
    if not list(wheels.glob("apache_tvm_ffi-*cp312*.whl")):
        _pip_download(wheels, [f"apache-tvm-ffi=={FFI_VERSION}"], binary312=True)
    if not list(wheels.glob("onnx2torch-*.whl")):
        _pip_download(wheels, ["onnx2torch==1.5.15"], binary312=False)
    (out / "tvm").mkdir(parents=True, exist_ok=True)
    (out / "wheels").mkdir(exist_ok=True)
    found = {"tvm": "tvm/tvm-runtime.tar.xz"}
    _copy_if_changed(tar, out / found["tvm"])
    for pattern, key, sub in (("apache_tvm_ffi-*cp312*.whl", "ffi_wheel", "tvm"),
                              ("onnx2torch-*.whl", "onnx2torch_wheel", "wheels")):
        whl = sorted(wheels.glob(pattern))[-1]
        _copy_if_changed(whl, out / sub / whl.name)
        found[key] = f"{sub}/{whl.name}"
    return found


def _pip_download(dest: Path, reqs: list, binary312: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "-d", str(dest)]
    if binary312:
        cmd += ["--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
                "--platform", "manylinux_2_17_x86_64"]
    done = subprocess.run(cmd + reqs, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ValueError(f"pip download {' '.join(reqs)} failed ({done.stderr.strip()[-200:]}); "
                         "prepare needs the package index once (then the cache in "
                         f"{BUNDLE_CACHE}), or pass --no-bundle")


def _copy_if_changed(src: Path, dst: Path) -> None:
    if not dst.exists() or dst.stat().st_size != src.stat().st_size:
        shutil.copy2(src, dst)


# --- the hook of the "kernels" step -------------------------------------------------------------

def _kernels_hook(spec: LeaseSpec, out: Path, time_s: float, log,
                  deadline: float | None = None) -> dict | None:
    """KERNELS HOOK (issue 31 item 4, "kernel versions timed"): the kernel-version libraries of the
    lease's models, built here into ``out/kernels/`` by ``tvm_rammer.lease.kernels.prepare`` (the
    "kernels" helper's entry) within what travel and ``time_s`` of the lease leave; returns its
    index entry (``module`` + ``args``: the GPU-side step), None when there is nothing to time."""
    try:
        from tvm_rammer.lease import kernels
    except ImportError:
        log("kernels: tvm_rammer.lease.kernels is not here: no kernel-version libraries")
        return None
    room = TRAVEL_LIMIT_MIB - folder_mib(out) - tree_mib() - 1.0
    if room <= 0 or time_s < 20:
        log(f"kernels: no room left ({room:.1f} MiB, {time_s:.0f} s of the run): none built")
        return None
    models = [model_dict(m, _is_reduced(spec, m)) for m in spec.models]
    start = time.perf_counter()
    entry = kernels.prepare(str(out / "kernels"), target=spec.target, budget_mib=room,
                            models=models, time_s=time_s, deadline=deadline)
    log(f"kernels: {entry.get('kernels')} kernels in {entry.get('libraries')} libraries "
        f"({entry.get('mib')} MiB, {entry.get('left_out')} left for the next lease), "
        f"{time.perf_counter() - start:.0f} s")
    for m in entry.get("models") or []:  # issue 31 item 5: the rProgram decisions, per model
        rp = m.get("rprograms")
        log(f"kernels: {m.get('name')}: " + ("rPrograms not formed (no room or time left in this lease)"
            if rp is None else f"{rp['formed']} rPrograms formed, {rp['measured']} measured, "
            f"{rp['candidates']} candidates, {rp['built']} built, {rp['left']} left for a later "
            f"lease") + (f"; leases needed: {m['leases_needed']}" if m.get("leases_needed")
                         is not None else ""))
    return entry


# --- the whole prepare --------------------------------------------------------------------------

def folder_mib(path: Path) -> float:
    """Size of every file under ``path`` in MiB."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def tree_mib(root: Path = ROOT) -> float:
    """Size of the tracked files of the working tree (they travel with every device command)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                               check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0.0
    total = 0
    for n in names:
        p = root / n.decode()
        if n and p.is_file():
            total += p.stat().st_size
    return total / 2**20


def prepare(spec: LeaseSpec, log=print) -> dict:
    """Build ``spec`` into ``spec.out``, reusing every library whose key is unchanged; write and
    return the index (``index.json``)."""
    out = Path(spec.out)
    if not out.is_absolute():
        out = ROOT / out
    libs = build_dir(out) / "libs"  # the builds (kept for reuse; they do not travel)
    libs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    old = _read_index(out)
    start = time.perf_counter()
    sources, tools = source_hash(), toolchain()
    arts = artifacts(spec)
    index = {"format": FORMAT, "target": spec.target, "cpu_check": spec.cpu_check,
             "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()},
             "sources": sources, "tools": tools, "commit": _commit(), "artifacts": {}}
    todo = []
    for art in arts:
        key = artifact_key(art, sources, tools)
        prev = old.get("artifacts", {}).get(art.name)
        if (prev and prev.get("key") == key and "error" not in prev
                and all((libs / f).exists() for f in prev.get("files", []))):
            index["artifacts"][art.name] = dict(prev, reused=True, **_sizes(libs, art.name, prev))
        else:
            todo.append((art, key))
    log(f"prepare: {len(arts)} libraries, {len(arts) - len(todo)} unchanged, {len(todo)} to build "
        f"(target {'llvm (cpu check)' if spec.cpu_check else spec.target})")
    if spec.bundle:  # first: small, and what every run needs
        index["bundle"] = bundle(out, log)
    deadline = (start + max(spec.time_limit_s - PACK_RESERVE_S, 0.0)
                if spec.time_limit_s else None)
    with concurrent.futures.ThreadPoolExecutor(max(1, spec.jobs)) as pool:
        queue, running = list(todo), {}
        while queue or running:
            while queue and len(running) < max(1, spec.jobs):
                art, key = queue.pop(0)
                if deadline is not None and time.perf_counter() > deadline:
                    index["artifacts"][art.name] = {
                        "error": "not built: prepare's time limit (run prepare again: it "
                                 "continues)", "key": key, "variant": art.variant,
                        "model": art.model, "files": []}
                    continue
                limit = spec.build_timeout_s  # a build in flight at the deadline is stopped there
                if deadline is not None:
                    limit = min(limit, max(1.0, deadline - time.perf_counter()))
                running[pool.submit(_build_in_child, art, libs, limit,
                                    limit < spec.build_timeout_s)] = (art, key)
            if not running:
                break
            done, _ = concurrent.futures.wait(running,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                art, key = running.pop(fut)
                rec = dict(fut.result(), key=key, variant=art.variant, model=art.model)
                rec.update(_sizes(libs, art.name, rec))
                index["artifacts"][art.name] = rec
                status = (f"error: {rec['error']}" if "error" in rec else
                          f"{rec['seconds']} s ({rec.get('cpu_s', '?')} s CPU)")
                log(f"  built {art.name}: {status}")
                _write_index(out, index)  # a prepare cut short keeps what it built
    index["artifacts"] = {a.name: index["artifacts"][a.name] for a in arts}
    _clean_stale(libs, index)
    index["libs"] = pack_libraries(libs, out, index, log, previous=old.get("libs"))
    shutil.rmtree(out / "libs", ignore_errors=True)  # a copy `run` unpacked here: not to travel
    _write_index(out, index)
    late = deadline is not None and time.perf_counter() > deadline
    if late and spec.kernels and not spec.cpu_check:
        log("kernels: prepare's time limit reached: no kernel-version libraries this time")
    if spec.kernels and not spec.cpu_check and not late:
        from tvm_rammer.runtime.lease_steps import BUDGET_S, steps
        from .plan import INSTALL_S
        busy = INSTALL_S + sum(s["estimate_s"] or 0 for s in steps(out))
        index["kernels"] = _kernels_hook(spec, out, BUDGET_S - busy - 15.0, log, deadline)
    index["prepare_s"] = round(time.perf_counter() - start, 1)
    _write_index(out, index)
    lease, tree = folder_mib(out), tree_mib()
    index["travel_mib"] = round(lease + tree, 1)
    _write_index(out, index)
    left = [n for n, r in index["artifacts"].items() if r.get("error", "").startswith("not built")]
    failed = [n for n, r in index["artifacts"].items() if "error" in r and n not in left]
    if left:
        log(f"prepare: {len(left)} not built within the time limit (the next prepare builds "
            f"them): {', '.join(left)}")
    if failed:
        log(f"prepare: {len(failed)} failed (run leaves them out): {', '.join(failed)}")
    log(f"prepare: {index['prepare_s']} s; .lease {lease:.1f} MiB + working tree {tree:.1f} MiB")
    log(f"travel: {int(round(lease + tree))} MiB")
    return index


def _write_index(out: Path, index: dict) -> None:
    tmp = out / "index.json.part"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / "index.json")


def _read_index(out: Path) -> dict:
    try:
        return json.loads((out / "index.json").read_text())
    except (OSError, ValueError):
        return {}


def build_dir(out: Path) -> Path:
    """Where the builds are kept: beside the lease folder (``.lease-build/`` for ``.lease/``),
    so only the packed copy travels."""
    return out.parent / (out.name + "-build")


def _sizes(libs: Path, name: str, rec: dict) -> dict:
    """What ``plan`` needs of a built library without unpacking it: its size, its weights' size,
    its device type."""
    if "error" in rec:
        return {}
    try:
        man = json.loads((libs / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}
    n = 0
    for w in man.get("raw_weights", []):
        size = 2 if w.get("dtype") in ("float16", "bfloat16") else 4
        for d in w["shape"]:
            size *= int(d)
        n += size
    return {"so_mib": round((libs / man["library"]).stat().st_size / 2**20, 3),
            "weights_mib": round(n / 2**20, 2), "device_type": man.get("device_type")}


def pack_libraries(libs: Path, out: Path, index: dict, log, previous: dict | None = None) -> dict:
    """``out/libs.tar.xz``: every built library's files under ``libs/`` (the GPU host unpacks it
    into the lease folder; CUDA binaries compress 10-40x). Packed again only when the set of
    libraries (names and keys) changed. Returns ``{"file", "key", "mib"}``."""
    import hashlib as _h
    files = sorted(f for r in index["artifacts"].values() if "error" not in r
                   for f in r.get("files", []))
    key = _h.sha256(json.dumps(sorted((n, r.get("key")) for n, r in index["artifacts"].items()
                                      if "error" not in r)).encode()).hexdigest()[:24]
    pack = out / "libs.tar.xz"
    # the pack of the index this prepare started from (the index on disk is rewritten as builds
    # finish, without it): a prepare whose builds all failed or were cut keeps the same pack
    old = previous if previous is not None else (_read_index(out).get("libs") or {})
    if pack.exists() and old.get("key") == key:
        return dict(old)
    start = time.perf_counter()
    tmp = out / "libs.tar.xz.part"
    if files and shutil.which("xz") and shutil.which("tar"):
        with open(tmp, "wb") as f:
            tar = subprocess.Popen(["tar", "cf", "-", "-C", str(libs.parent),
                                    *[f"libs/{n}" for n in files]], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T2", "-3"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait() != 0:
                raise ValueError("tar of the libraries failed")
    else:
        with tarfile.open(tmp, "w:xz") as t:
            for n in files:
                t.add(libs / n, arcname=f"libs/{n}")
    tmp.replace(pack)
    raw = sum((libs / n).stat().st_size for n in files) / 2**20
    mib = pack.stat().st_size / 2**20
    log(f"libraries packed: {len(files)} files, {raw:.1f} MiB -> {mib:.1f} MiB "
        f"({time.perf_counter() - start:.0f} s)")
    return {"file": pack.name, "key": key, "mib": round(mib, 2), "raw_mib": round(raw, 2)}


def _clean_stale(libs: Path, index: dict) -> None:
    """Delete library files no artifact of the index names (an older lease's)."""
    keep = {f for r in index["artifacts"].values() for f in r.get("files", [])}
    for p in libs.iterdir():
        if p.is_file() and p.name not in keep:
            p.unlink()


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_lease.sh prepare", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".lease", help="the lease folder (default: %(default)s)")
    p.add_argument("--target", default="rammer/nvidia-h200",
                   help="the lease's GPU: rammer/nvidia-h200 (default) or rammer/nvidia-h100")
    p.add_argument("--models", default=",".join(ZOO), help="zoo models, in order of value")
    p.add_argument("--reduced", default="", help="models built at reduced size ('all' or a list)")
    p.add_argument("--no-demo", action="store_true")
    p.add_argument("--timelines", default=",".join(TIMELINE_MODELS))
    p.add_argument("--no-bundle", action="store_true", help="no TVM runtime, no wheels")
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--cpu-check", action="store_true",
                   help="llvm libraries of the same form, for `run` on this machine")
    p.add_argument("--jobs", type=int, default=2, help="builds at once (default: %(default)s)")
    p.add_argument("--build-timeout", type=float, default=1200.0, metavar="SECONDS",
                   help="one build's wall-clock limit (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=LeaseSpec.time_limit_s, metavar="SECONDS",
                   help="prepare's wall time: builds stop 90 s before it (none starts past "
                        "that, one in flight is stopped), then the libraries are packed; 0: no "
                        "limit. What is left is built by the next prepare, in order of value "
                        "(default: %(default)s)")
    return p.parse_args(argv)


def spec_of(args) -> LeaseSpec:
    def names(text):
        return tuple(n for n in text.split(",") if n)
    from tvm_rammer.models import MODELS
    models = names(args.models)
    for n in models:
        if n not in MODELS:
            raise ValueError(f"--models: unknown model {n!r}; valid: {', '.join(ZOO)}")
    return LeaseSpec(out=args.out, target=args.target, models=models,
                     reduced=True if args.reduced == "all" else names(args.reduced),
                     demo=not args.no_demo, timelines=names(args.timelines),
                     bundle=not args.no_bundle, kernels=not args.no_kernels,
                     cpu_check=args.cpu_check, jobs=args.jobs,
                     time_limit_s=args.time_limit or None, build_timeout_s=args.build_timeout)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-one"]:  # the child of _build_in_child
        art = Artifact(**json.loads(argv[1]))
        print(json.dumps(build_one(art, Path(argv[2]))))
        return 0
    try:
        index = prepare(spec_of(parse_args(argv)))
    except ValueError as err:
        print(f"gpu_lease.sh prepare: error: {err}", file=sys.stderr)
        return 2
    return 1 if any("error" in r and not r["error"].startswith("not built")
                    for r in index["artifacts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
