"""tir_templates.intrin_import: the import machinery's frozen frames known to ``inspect`` (the
tensor intrinsics' import ~3x faster), and what ``inspect`` reports about those frames unchanged.
Each case runs in a fresh interpreter: the cache is per process."""
import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import importlib, inspect, json, pathlib, sys, tempfile
    if sys.argv[1] == "known":
        from tir_templates.intrin_import import know_frozen_import_frames
        know_frozen_import_frames()
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "probe_mod.py").write_text(
        "import inspect\\n"
        "STACK = [(f.filename, f.code_context) for f in inspect.stack()]\\n")
    sys.path.insert(0, str(folder))
    stack = importlib.import_module("probe_mod").STACK
    frozen = [ctx for name, ctx in stack if name.startswith("<frozen importlib")]
    module = inspect.getmodule(sys._getframe(), "<frozen importlib._bootstrap>")
    print(json.dumps({"frozen": frozen, "module": getattr(module, "__name__", None),
                      "own": [ctx for name, ctx in stack if name.endswith("probe_mod.py")]}))
""")


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_frozen_import_frames_resolve_from_the_cache_and_report_the_same():
    known, plain = _probe("known"), _probe("plain")
    # the cache answers for the frozen frames (control: without it, inspect finds no module)
    assert known["module"] == "importlib._bootstrap"
    assert plain["module"] is None
    # what inspect.stack() reports is the same: frozen frames have no source either way, a
    # module's own frame keeps its line
    assert known["frozen"] and known["frozen"] == plain["frozen"]
    assert all(ctx is None for ctx in known["frozen"])
    assert known["own"] == plain["own"] and "inspect.stack()" in known["own"][0][0]
