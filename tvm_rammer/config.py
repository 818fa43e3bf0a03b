"""Explicit configuration of the rammer compilation (a frozen dataclass; no environment reads here)."""

from __future__ import annotations

from dataclasses import dataclass, field

SELECTIONS = ("paper", "fastest", "efficient")
MERGES = ("paper", "always", "never")
POLICIES = ("rammer", "ios", "opara")  # tvm_rammer.policies.POLICIES, by name


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
    spin_limit: polls (each followed by a 64 ns sleep) before a barrier-rTask gives up and traps.
    launch_us / barrier_us: cost-model constants (H100 measurements: 4.06 us per kernel launch of
        TVM's default pipeline, 0.8 us per point-to-point flag wait).
    profile: measure on the local GPU when it has the target's arch (compile-time profiling, paper
        3.2): every rKernel version is checked against TVM's default kernel for its operator and
        timed, candidate rPrograms are timed whole, and an rProgram not faster than its operators
        as TVM's default kernels is dropped for them. Without a GPU (cross-compiling, CI) records
        are read from the profile database (or, where it has none for the arch, a database shipped
        with tvm-rammer). Versions other than TVM's dlight schedule are chosen only on measured
        times. False: nothing is measured, and no database is read unless ``profile_db`` is given.
    profile_db: the profile database (``tvm_rammer.tuning.profile_db``; ``*.json`` a JSON file,
        anything else sqlite3). None: the per-user cache ``$XDG_CACHE_HOME/tvm-rammer/``.
    rprogram_profiles: at most this many candidate rPrograms (P1, P2 of Algorithm 1) are built and
        timed whole per compilation (each is a full nvcc build); the final rPrograms always are.
    tuning_db: MetaSchedule work dir (``tvm-rammer tune``) whose best schedules become rKernel versions.
    versions: give each operator several rKernel versions (dlight variants, templates, tuning
        database) for SelectRKernels; False: the pipeline's dlight schedule only.
    policy: the scheduling policy (``tvm_rammer.policies``): "rammer" (Algorithm 1, wavefront),
        "ios" (IOS's dynamic-programming stage partition) or "opara" (Opara's resource-aware launch
        order); every one places rTasks with the same primitives and feeds the same codegen.
    timeline: build the persistent kernels instrumented (``tvm_rammer.timeline``): each records
        per rTask and barrier-rTask its vEU, SM, start and end into a per-run buffer, and ``main``
        returns ``(its outputs, (one timeline buffer per rProgram, ...))``. A separate build for
        looking inside the kernel; every choice is still made on the uninstrumented kernels.
    """

    max_rtask_threads: int = 256
    num_sms: int | None = None
    veus_per_sm: int | None = None
    selection: str = "paper"
    merge: str = "paper"
    fusion: bool = True
    spin_limit: int = 1 << 26
    launch_us: float = 4.0
    barrier_us: float = 0.8
    measure_resources: bool = False
    max_waits_per_op: int | None = 1 << 20
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    profile: bool = True
    profile_db: str | None = None
    rprogram_profiles: int = 32
    tuning_db: str | None = None
    versions: bool = True
    timeline: bool = False
    policy: str = "rammer"

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
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: choose one of {POLICIES}")
        if self.rprogram_profiles < 0:
            raise ValueError(f"rprogram_profiles={self.rprogram_profiles} must be >= 0")
        if self.spin_limit <= 0:
            raise ValueError(f"spin_limit={self.spin_limit} must be positive")
