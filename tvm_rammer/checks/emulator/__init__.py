"""Run a compiled model's CUDA on the CPU: ``tvm_rammer.emulate(model, inputs)``.

The pieces (EMU_DESIGN in issue 23): :mod:`.compile` compiles as ``tvm.compile`` does and keeps the
final Relax ``main``, the host launches and the CUDA source; :mod:`.launches` describes every
launch (kernel, grid, block, shared memory, cooperative, each parameter's role, size and constant
contents); :mod:`.build` (the C++ runtime) builds the CUDA source with the system C++ compiler into
an ``EmulatedModule`` whose ``launch`` runs one kernel launch, every CUDA thread a fiber; and
:mod:`.interpret` executes ``main`` in Python with numpy buffers, each PrimFunc call as its
launches. :func:`emulate` puts them together and raises ``tvm_rammer.codegen.faults.KernelFault`` when a
persistent kernel recorded a fault in the module's fault page, as ``tvm-rammer run`` does on a GPU.
:mod:`.run` and :mod:`.generate` are the emulator's side of ``run --emulate`` / ``demo`` and of
``generate --emulate`` (a decode step compiled once, run once per token).
"""

from .compile import EmulationBuild, emulation_build
from .emulation import EmulationResult, emulate, model_inputs, read_fault
from .launches import Launch, LaunchParam
from .versions import EmulatedValidator  # and, importing it, its check registered with the back end

__all__ = ["emulate", "emulation_build", "EmulationBuild", "EmulationResult", "EmulatedValidator",
           "Launch", "LaunchParam", "read_fault", "model_inputs"]
