"""CI tests what users install: the wheel, installed into a fresh virtual environment.

One module-scoped fixture builds the wheel from a clean copy of the source tree (``pip wheel``, as
``pip install <clone>`` builds it), creates a virtual environment and installs the wheel into it.
The tests then work from a directory outside the source tree, with ``PYTHONPATH`` cleared: every
module of the installed copy imports and is the venv's file, every package-data file is there, and
``tvm-rammer --version``, ``doctor``, ``demo`` and one ``compile`` succeed with the venv's console
script.

The venv is made with ``--system-site-packages`` and the wheel installed with ``--no-index``: its
dependencies (apache-tvm, onnx, ...) are the ones already installed, so the test downloads nothing
but the build backend and takes ~1 min on 2 cores instead of minutes of fetching a 100 MB TVM wheel;
pip still checks that they satisfy the wheel's requirements. The system site may hold the editable
install of this checkout; the venv's own site-packages comes first on ``sys.path`` (and setuptools'
editable finder is appended to ``sys.meta_path``, after the path finder), and every test asserts
that what ran is the venv's copy, so the editable install cannot stand in for the wheel. A from-
scratch install (a venv without system packages, ``pip install <clone>``) is the README's
"Installation" section, measured by hand (a few minutes, mostly downloading TVM).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tvm_rammer", "relay_passes", "tir_templates")
SKIP_COPY = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                   ".pytest_cache", "*.so", ".gpu", "out")

pytestmark = pytest.mark.slow


def _run(cmd, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _data_files(source: Path) -> set:
    """Every file of the packages of a source tree that is not Python (the profile databases, the
    emulator's headers, ...), relative to its root: a data file added anywhere must reach the
    wheel (setup.py's package_data)."""
    return {p.relative_to(source).as_posix() for package in PACKAGES
            for p in (source / package).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}


def _modules(source: Path) -> set:
    """Every ``.py`` file of the packages of a source tree, relative to its root."""
    return {p.relative_to(source).as_posix() for package in PACKAGES
            for p in (source / package).rglob("*.py")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(venv, wheel, outside, source)``: the wheel built from a copy of the tree, installed into a
    fresh venv, an empty directory outside the source tree to run from, and the copy."""
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=SKIP_COPY)  # no stale build/ can leak into the wheel
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, source], cwd=base)
    (wheel,) = dist.glob("tvm_rammer-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=base)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-index", wheel], cwd=base)
    outside = base / "outside"
    outside.mkdir()
    return venv, wheel, outside, source


def _env(venv: Path, outside: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_CACHE_HOME"] = str(outside / "cache")  # the user's profile cache stays untouched
    return env


def test_the_wheel_holds_every_package_and_data_file_and_no_tests(installed):
    _, wheel, _, source = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = _modules(source)
    assert len(modules) > 40 and modules <= names, sorted(modules - names)
    assert _data_files(source) <= names, sorted(_data_files(source) - names)
    assert not any(n.startswith(("tests/", "scripts/", "benchmarks/results")) for n in names)


def test_every_module_of_the_installed_copy_imports_from_the_venv(installed):
    venv, _, outside, source = installed
    script = textwrap.dedent("""
        import importlib, json, pkgutil, sys
        roots = sys.argv[1:]
        files, failed = {}, []
        for root in roots:
            package = importlib.import_module(root)
            files[root] = package.__file__
            for info in pkgutil.walk_packages(package.__path__, root + ".", onerror=failed.append):
                try:
                    files[info.name] = importlib.import_module(info.name).__file__
                except Exception as err:
                    failed.append(f"{info.name}: {type(err).__name__}: {err}")
        # every module loaded on the way too (one the venv lacks would come from the checkout)
        files.update({name: module.__file__ for name, module in list(sys.modules.items())
                      if name.split(".")[0] in roots and getattr(module, "__file__", None)})
        print(json.dumps({"files": files, "failed": failed, "prefix": sys.prefix}))
    """)
    proc = _run([venv / "bin" / "python", "-c", script, *PACKAGES], cwd=outside,
                env=_env(venv, outside))
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["failed"], found["failed"]
    assert Path(found["prefix"]).resolve() == venv.resolve()
    site = (venv / "lib").resolve()
    outside_venv = {m: f for m, f in found["files"].items()
                    if not Path(f).resolve().is_relative_to(site)}
    assert not outside_venv, f"imported from outside the venv (editable install?): {outside_venv}"
    sources = {m.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
               for m in _modules(source)}
    assert sources <= set(found["files"]), sorted(sources - set(found["files"]))
    # the package data is where the installed copy looks for it
    installed_root = Path(found["files"]["tvm_rammer"]).resolve().parents[1]
    missing = {f for f in _data_files(source) if not (installed_root / f).is_file()}
    assert not missing, sorted(missing)


def test_the_console_script_runs_from_outside_the_tree(installed):
    venv, _, outside, _ = installed
    env = _env(venv, outside)
    cli = venv / "bin" / "tvm-rammer"
    version = _run([cli, "--version"], cwd=outside, env=env).stdout
    assert str(venv.resolve()) in str(Path(version.rsplit(" at ", 1)[1].strip()).resolve())
    doctor = _run([cli, "doctor"], cwd=outside, env=env).stdout
    assert "[ok] tvm-rammer" in doctor and str(venv) in doctor
    assert doctor.strip().splitlines()[-1].startswith("this machine can: compile, inspect")
    demo = _run([cli, "demo"], cwd=outside, env=env).stdout
    assert "rPrograms: 1" in demo and "kernel launches per inference: 1" in demo
    _run([cli, "model", "branches", "--param", "n=2", "-o", "b2.onnx"], cwd=outside, env=env)
    _run([cli, "compile", "b2.onnx", "--batch", "1", "-o", "b2.so"], cwd=outside, env=env)
    assert (outside / "b2.so").stat().st_size > 0
