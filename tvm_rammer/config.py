"""Explicit configuration of the rammer compilation (a frozen dataclass; no environment reads here)."""

from __future__ import annotations

from dataclasses import dataclass, field

SELECTIONS = ("paper", "fastest", "efficient")
MERGES = ("paper", "always", "never")


@dataclass(frozen=True)
class RammerConfig:
    """Options of the rammer pipeline.

    Attributes
    ----------
    max_rtask_threads: threads per rTask that dlight may use when it schedules the operators; it
        bounds the vEU width and so how many vEUs fit on an SM (paper 4.1.2).
    num_sms: SMs of the vDevice; None = the local GPU's, else the target arch's preset.
    veus_per_sm: cap the vEUs per SM; None = the occupancy that the widest rTask's threads, the
        shared-memory pool and a register budget (VDevice.default_registers) allow. The kernel is
        compiled with __launch_bounds__(threads, vEUs per SM), so nvcc keeps its registers within
        that budget and every vEU is resident.
    measure_resources: compile the persistent kernel once with nvcc first and place the rProgram
        for the registers it really uses (slower compiles; needs nvcc).
    max_waits_per_op: an operator whose barrier-rTasks would wait on more <vEU, rTask> pairs than
        this starts a new rProgram (bounds compile time; identical wait lists share table space).
    selection / merge: the policy's rKernel selection and rProgram-merge rules (Algorithm 1 =
        "paper"); the others exist for ablations.
    fusion: run BranchPreservingFusion (elementwise fusion that never joins two branches).
    tail_fusion: with ``fusion``, also run SplitTailFusion: the elementwise tail after a split (an
        LSTM cell's gates and cell update) becomes one dependent step instead of a chain.
    prologue_fusion: with ``fusion``, an elementwise group that only a conv/matmul reads fuses in
        front of it (NASNet's ReLU before each separable conv) when that delays nothing.
    split_concat_matmul: run SplitMatMulOverConcat: ``matmul(concat([x, h]), W)`` with a constant W
        becomes ``x @ W_x + h @ W_h``, taking the input half off an RNN's recurrent critical path.
    batch_shared_matmuls: run BatchSharedWeightMatMuls: GEMVs of one constant weight whose inputs
        are ready in the same wave (an RNN's first-layer input halves) become one GEMM.
    spin_limit: polls (each followed by a 64 ns sleep) before a barrier-rTask gives up and traps.
    launch_us / barrier_us: cost-model constants (H100 measurements: 4.06 us per kernel launch of
        TVM's default pipeline, 0.8 us per point-to-point flag wait).
    profile_db: JSON profile database (``tvm_rammer.tuning.profile_db``): rKernel times are read from
        it, and with a GPU the missing ones are measured and saved to it. None: analytical times.
    tuning_db: MetaSchedule work dir (``tvm-rammer tune``) whose best schedules become rKernel versions.
    versions: give each operator several rKernel versions (dlight variants, templates, tuning
        database) for SelectRKernels; False: the pipeline's dlight schedule only.
    """

    max_rtask_threads: int = 256
    num_sms: int | None = None
    veus_per_sm: int | None = None
    selection: str = "paper"
    merge: str = "paper"
    fusion: bool = True
    tail_fusion: bool = True
    prologue_fusion: bool = True
    split_concat_matmul: bool = True
    batch_shared_matmuls: bool = True
    spin_limit: int = 1 << 26
    launch_us: float = 4.0
    barrier_us: float = 0.8
    measure_resources: bool = False
    max_waits_per_op: int | None = 1 << 20
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    profile_db: str | None = None
    tuning_db: str | None = None
    versions: bool = True

    def __post_init__(self):
        if self.max_rtask_threads not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(
                f"max_rtask_threads={self.max_rtask_threads}: use a power of two in [32, 1024]")
        if self.num_sms is not None and self.num_sms <= 0:
            raise ValueError(f"num_sms={self.num_sms} must be positive")
        if self.veus_per_sm is not None and self.veus_per_sm <= 0:
            raise ValueError(f"veus_per_sm={self.veus_per_sm} must be positive")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: choose one of {SELECTIONS}")
        if self.merge not in MERGES:
            raise ValueError(f"merge={self.merge!r}: choose one of {MERGES}")
        if self.spin_limit <= 0:
            raise ValueError(f"spin_limit={self.spin_limit} must be positive")
