"""Where compile time goes: the rammer pipeline's passes and the back end's phases, and a progress
bar over them.

:class:`PipelineProgress` is a TVM pass instrument (``tvm.transform.PassContext(instruments=[...])``):
it times every step of the pipeline (the passes of ``pipeline.rammer_passes``, at the nesting depth
they run at) and, after the back end, the phases it recorded in the module attribute
``rammer.timings`` (``backend.TIMINGS_ATTR``). With ``show=True`` a tqdm bar names the running step
once the compilation has taken longer than ``after_s`` seconds.
"""
from __future__ import annotations

import json
import sys
import time

import tvm

__all__ = ["PipelineProgress", "format_timings", "TIMINGS_ATTR"]

TIMINGS_ATTR = "rammer.timings"
_PIPELINE = "RammerPipeline"


@tvm.instrument.pass_instrument
class PipelineProgress:
    """Times the steps of the rammer pipeline (see the module docstring)."""

    def __init__(self, show: bool = False, after_s: float = 2.0, total: int | None = None):
        self.show, self.after_s, self.total = show, after_s, total
        self.steps: list = []  # (name, seconds)
        self.phases: list = []  # back-end phases: (name, seconds)
        self._stack: list = []
        self._depth = None
        self._start = None
        self._bar = None

    def run_before_pass(self, mod, info):
        if info.name == _PIPELINE and self._depth is None:
            self._depth = len(self._stack) + 2  # RammerPipeline -> Sequential -> its steps
            self._start = time.perf_counter()
        self._stack.append((info.name, time.perf_counter()))
        if self._depth is not None and len(self._stack) == self._depth + 1:
            self._progress(info.name)

    def run_after_pass(self, mod, info):
        name, start = self._stack.pop()
        if self._depth is None:
            return
        if len(self._stack) == self._depth:
            self.steps.append((_step_name(name), time.perf_counter() - start))
            attrs = mod.attrs or {}
            if TIMINGS_ATTR in attrs and not self.phases:
                self.phases = [tuple(p) for p in json.loads(str(attrs[TIMINGS_ATTR]))]
        if name == _PIPELINE:
            self._depth = None
            if self._bar:
                self._bar.close()
                self._bar = None

    def _progress(self, name):
        if not self.show or time.perf_counter() - self._start < self.after_s:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.show = False
                return
            self._bar = tqdm(total=self.total, desc="tvm-rammer", unit="step", leave=False,
                             file=sys.stderr)
            self._bar.update(len(self.steps))
        self._bar.set_description(f"tvm-rammer: {_step_name(name)}")
        self._bar.update(1)


def _step_name(name: str) -> str:
    return name[len("WithTarget("):-1] if name.startswith("WithTarget(") else name


def format_timings(progress: PipelineProgress, extra: list | None = None) -> str:
    """The steps, the back end's phases under it, and ``extra`` (name, seconds) rows, in seconds."""
    rows = []
    for name, seconds in progress.steps:
        rows.append(f"  {name:<42} {seconds:8.2f} s")
        if name == "RammerBackend":
            rows += [f"    {phase:<40} {s:8.2f} s" for phase, s in progress.phases]
    rows += [f"  {name:<42} {seconds:8.2f} s" for name, seconds in extra or []]
    total = sum(s for _, s in progress.steps) + sum(s for _, s in extra or [])
    return "\n".join(["compile time by phase:", *rows, f"  {'total':<42} {total:8.2f} s"])
