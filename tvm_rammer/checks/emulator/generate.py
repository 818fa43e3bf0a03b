"""``tvm-rammer generate --emulate``: the decode step compiled once, run on the CPU emulator.

:func:`emulated_step` is the ``emulate=`` service ``run.generate.generate`` takes (handed in by the
CLI): it compiles the step with tvm-rammer's pipeline once (:func:`.compile.emulation_build`),
builds its CUDA for the CPU once, and returns a ``run.generate.DecodeStep`` whose every step is one
:func:`.emulation.emulate` of that build. The caches are numpy arrays handed from step to step as
the emulator returned them; a persistent kernel's fault raises ``faults.KernelFault``.
"""

from __future__ import annotations

from ...run.generate import DecodeStep
from .compile import emulation_build
from .emulation import emulate

__all__ = ["EmulatedStep", "emulated_step"]


class EmulatedStep(DecodeStep):
    """A decode step's :class:`~.compile.EmulationBuild` run once per step on the emulator."""

    device = "emulator"

    def __init__(self, build, order="forward", wall_limit_s: float = 600.0):
        self.build = build
        self.order, self.wall_limit_s = order, wall_limit_s
        self.runs = []  # the EmulationResult of every step (launches, emulated wall seconds)

    def step(self, feeds: dict, caches: list) -> tuple:
        names = self.build.input_names
        inputs = {**feeds, **dict(zip(names[len(feeds):], caches))}
        run = emulate(self.build, inputs, order=self.order, wall_limit_s=self.wall_limit_s)
        self.runs.append(run)
        return run.outputs[0], list(run.outputs[1:])


def emulated_step(proto, target, config) -> EmulatedStep:
    """Compile ``proto`` (a decode step, ONNX ModelProto) for ``target`` with ``config`` and build
    its CUDA for the CPU; the :class:`EmulatedStep` that runs it (needs a C++ compiler:
    ``errors.EmulatorError`` naming the fix without one)."""
    from .build import _compiler

    _compiler()  # no C++ compiler: EmulatorError naming the fix, before compiling the model
    build = emulation_build(proto, target, config)
    build.emulated()  # the C++ build, once
    return EmulatedStep(build)
