"""The import graph of tvm_rammer, relay_passes and tir_templates: no circles, stages in order.

Every import counts: module level and inside functions, absolute and relative (resolved from the
importing module's package), ``from pkg import submodule`` as an import of the submodule. A module
importing one of its own parent packages (``from . import x`` names the package) does not count:
the ``__init__`` files re-export. Read from the source with ``ast`` (nothing is imported), so the
test is fast and sees imports that no test executes.

- no circle among the modules (a negative control shows a circle, even one closed by a
  function-level relative import, is found and named);
- every import of one of the three packages names a module that exists;
- the stages of DESIGN.md's map: a module imports from its own stage or earlier ones; the few
  imports from a stage to a later one are :data:`UPWARD` (each listed in DESIGN.md with its reason,
  and each still present: the list does not outlive the code);
- at most 12 ``.py`` files directly in ``tvm_rammer/`` (issue 32).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tvm_rammer", "relay_passes", "tir_templates")

# DESIGN.md's map, in data-flow order: a module's stage is the longest prefix listed here
STAGES = [
    ("foundations", ["tvm_rammer.version", "tvm_rammer.config", "tvm_rammer.numerics",
                     "tvm_rammer.target", "tvm_rammer.host", "tvm_rammer.models"]),
    ("onnx_prep", ["tvm_rammer.onnx_prep"]),
    ("graph and TIR passes", ["relay_passes", "tir_templates"]),
    ("abstractions", ["tvm_rammer.abstractions"]),
    ("codegen", ["tvm_rammer.codegen"]),
    ("rocm", ["tvm_rammer.rocm"]),
    ("tuning", ["tvm_rammer.tuning"]),
    ("scheduling", ["tvm_rammer.scheduling"]),
    ("driver", ["tvm_rammer.driver"]),
    ("views", ["tvm_rammer.views"]),
    ("run", ["tvm_rammer.run", "tvm_rammer.runtime", "tvm_rammer.lease"]),
    ("benchmarks", ["tvm_rammer.benchmarks"]),
    ("checks", ["tvm_rammer.checks"]),
    ("cli", ["tvm_rammer.cli"]),
]

# imports from a stage to a later one, each with its reason in DESIGN.md ("Upward imports")
UPWARD = {
    ("tvm_rammer.target", "tvm_rammer.rocm.targets"),
    ("tvm_rammer.abstractions.vdevice", "tvm_rammer.rocm.targets"),
    ("tvm_rammer.codegen.dialect", "tvm_rammer.rocm.dialect"),
    ("tvm_rammer.codegen.resources", "tvm_rammer.rocm.report"),
    ("tvm_rammer.host.doctor", "tvm_rammer.rocm.toolchain"),
    ("tvm_rammer.host.doctor", "tvm_rammer.tuning.profile_db"),
    ("tvm_rammer.tuning.tune", "tvm_rammer.driver.frontend"),
    ("tvm_rammer.tuning.tune", "tvm_rammer.driver.pipeline"),
}


def find_modules(root: Path, packages) -> dict:
    """{module name: (path, is a package)} for every ``.py`` file under ``root/<package>``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool, known: dict, roots) -> tuple[set, set]:
    """(the known modules ``name`` imports, the names under ``roots`` it imports that do not
    exist). ``from a.b import c`` imports ``a.b.c`` when that is a module, else ``a.b``."""
    package = name if is_package else name.rpartition(".")[0]
    found, missing = set(), set()

    def add(module: str):
        if module in known:
            found.add(module)
            return
        if module.split(".")[0] in roots:
            missing.add(module)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base)
    found.discard(name)
    # importing one's own parent package (its __init__ re-exports) does not count
    found = {m for m in found if not (known[m][1] and name.startswith(m + "."))}
    return found, missing


def import_graph(root: Path, packages) -> tuple[dict, dict]:
    """({module: set of modules it imports}, {module: names it imports that do not exist})."""
    known = find_modules(root, packages)
    graph, missing = {}, {}
    for name, (path, is_package) in known.items():
        graph[name], gone = imports_of(name, path, is_package, known, set(packages))
        if gone:
            missing[name] = gone
    return graph, missing


def find_cycles(graph: dict) -> list:
    """One circle (a list of modules, first repeated last) for every strongly connected component
    of more than one module, or a module importing itself."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # Tarjan, iterative enough for ~200 modules
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(_circle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _circle(graph: dict, component: set) -> list:
    """A shortest circle through the component's first module (breadth-first within it)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return sorted(component)


def stage_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


@pytest.fixture(scope="module")
def graph():
    found, missing = import_graph(ROOT, PACKAGES)
    assert not missing, f"imports of modules that do not exist: {missing}"
    return found


def test_no_import_circles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_circle(tmp_path):
    """Negative control: a synthetic package whose circle is closed by a function-level relative
    import (and one without a circle beside it) is caught, and the circle is named."""
    pkg = tmp_path / "circ"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b.g()\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..c import h\n    return h()\n")
    (pkg / "c.py").write_text("import circ.a\n\ndef h():\n    return 1\n")
    (pkg / "d.py").write_text("from . import a\nfrom .sub.b import g\n")  # no circle through d
    found, missing = import_graph(tmp_path, ("circ",))
    assert not missing
    assert found["circ.d"] == {"circ.a", "circ.sub.b"}
    cycles = find_cycles(found)
    assert cycles == [["circ.a", "circ.sub.b", "circ.c", "circ.a"]]
    # the parent-package exception: a -> circ (its __init__) does not close a -> ... -> circ
    assert "circ" not in found["circ.a"]
    # a missing module is reported, not dropped
    (pkg / "e.py").write_text("from .gone import x\n")
    assert import_graph(tmp_path, ("circ",))[1] == {"circ.e": {"circ.gone"}}


def test_every_module_has_a_stage(graph):
    unplaced = sorted(m for m in graph if m != "tvm_rammer" and stage_of(m) is None)
    assert not unplaced, f"modules in no stage of DESIGN.md's map (add them to STAGES): {unplaced}"


def test_upward_imports_are_the_listed_ones(graph):
    upward = {(a, b) for a in graph if a != "tvm_rammer" for b in graph[a]
              if stage_of(b) > stage_of(a)}
    assert upward - UPWARD == set(), (
        f"imports from a stage to a later one, not listed (pass the service in, or list it with "
        f"its reason in DESIGN.md and here): {sorted(upward - UPWARD)}")
    assert UPWARD - upward == set(), f"listed upward imports that are gone: {sorted(UPWARD - upward)}"


def test_design_lists_the_upward_imports():
    design = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
    section = design[design.index("Upward imports"):]
    for a, b in sorted(UPWARD):
        pattern = rf"`{re.escape(a)}`\s*->\s*`{re.escape(b)}`"
        assert re.search(pattern, section), f"DESIGN.md's upward imports lack `{a}` -> `{b}`"


def test_at_most_12_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "tvm_rammer").glob("*.py"))
    assert len(top) <= 12, f"{len(top)} .py files directly in tvm_rammer/: {top}"
