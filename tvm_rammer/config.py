"""Explicit configuration of the rammer compilation (a frozen dataclass; no environment reads here)."""

from __future__ import annotations

from dataclasses import dataclass, field

SELECTIONS = ("paper", "fastest", "efficient")
MAX_VEUS_PER_SM = 32   # resident thread blocks per SM, the most any supported GPU holds (sm_70-sm_100)
MAX_SMS = 1024         # several times any GPU's SM count (H100 SXM: 132, B200: 148)
PRECISIONS = ("float32", "float16")
MERGES = ("paper", "always", "never")
POLICIES = ("rammer", "ios", "opara")  # tvm_rammer.scheduling.policies.POLICIES, by name
WEIGHTS = ("embedded", "apart")


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
    wait_timeout_ms: how long (GPU ``%globaltimer``) a barrier-rTask waits before it gives up: the
        kernel then ends normally with the fault recorded, and the host raises an error naming the
        vEU and the rTask (``tvm_rammer.codegen.faults``). Longer than any legitimate wait (a wait never
        outlasts the rProgram, whose rTasks are single thread blocks), short enough to notice.
    tail_fusion: with ``fusion``, also run SplitTailFusion: the elementwise tail after a split (an
        LSTM cell's gates and cell update) becomes one dependent step instead of a chain.
    prologue_fusion: with ``fusion``, an elementwise group that only a conv/matmul reads fuses in
        front of it (NASNet's ReLU before each separable conv) when that delays nothing.
    split_concat_matmul: run SplitMatMulOverConcat: ``matmul(concat([x, h]), W)`` with a constant W
        becomes ``x @ W_x + h @ W_h``, taking the input half off an RNN's recurrent critical path.
    batch_shared_matmuls: run BatchSharedWeightMatMuls: GEMVs of one constant weight whose inputs
        are ready in the same wave (an RNN's first-layer input halves) become one GEMM.
    gemv_epilogue: with ``fusion``, run GEMVEpilogueFusion: an RNN cell's recurrent GEMV and the
        split tail that reads it become one operator (``tir_templates.gemv_epilogue``'s rKernel:
        each rTask computes a few hidden units' gates and their cell update), so a step is one
        dependent rTask instead of two.
    norm_fusion: with ``fusion``, run NormGEMVFusion (``relay_passes.norm_gemv``): a decode step's
        row norm (LayerNorm, M = 1) whose only readers are GEMVs becomes each GEMV's prologue
        (``tir_templates.norm_gemv``: every rTask recomputes the row's statistics), so the norm
        is no dependent step (and barrier) of its own.
    split_k: run SplitKGEMV (``relay_passes.split_k_gemv``): a one-row GEMV with a constant
        weight, alone in its wave, with fewer rTasks than the vEUs (a decode step's: GPT-2
        small's fc2, 48 of 528) becomes a partial GEMV over S row blocks of W (S x the rTasks)
        and a sum that fuses with its epilogue, where the cost model says it pays; with
        ``fusion`` and ``norm_fusion`` a GEMV after a LayerNorm / RMSNorm that NormGEMVFusion
        takes is left to it.
    launch_us / barrier_us: cost-model constants (H100 measurements: 4.06 us per kernel launch of
        TVM's default pipeline, 0.8 us per point-to-point flag wait).
    l2_bw_gbps: the L2 read bandwidth the cost model charges re-read weights at; None = the cost
        model's own figure (``CostModelConfig.l2_bw_gbps``, assumed until a GPU measures it: put
        the measured one here, or compare predictions under several).
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
        timed whole per compilation (each is a full nvcc build); the final rPrograms always are
        (while ``profile_budget_s`` lasts). 32 before the budget; 8 now that only close choices
        are timed.
    profile_budget_s: a deadline for profiling, in seconds from the compile's start: past it no
        build or run starts, those in flight are abandoned (their processes killed), the policy
        stops asking for measured plan times, and every remaining choice is what it would be
        without a GPU (the dlight version, analytical times, the rProgram kept), with one warning
        naming what was not measured. Profiling so adds at most this much to a compile (the final
        build of the chosen kernels, done with or without profiling, is not counted). None: no
        limit.
    profile_margin: measure only what can change a decision: an operator's versions are built and
        timed only when another version's analytical time is within this factor of its dlight
        version's (else dlight, analytical, as without a GPU), and a policy choice between two plans
        (P1 vs Pcurr + P2, fastest vs efficient versions) is timed only when their analytical
        times are within this factor of each other. None: measure every version and every
        candidate rProgram (the behaviour before the budget; ``scripts/profile_cost.py``'s "before").
    tuning_db: MetaSchedule work dir (``tvm-rammer tune``) whose best schedules become rKernel versions.
    versions: give each operator several rKernel versions (dlight variants, templates, tuning
        database) for SelectRKernels; False: the pipeline's dlight schedule only.
    policy: the scheduling policy (``tvm_rammer.scheduling.policies``): "rammer" (Algorithm 1, wavefront),
        "ios" (IOS's dynamic-programming stage partition) or "opara" (Opara's resource-aware launch
        order); every one places rTasks with the same primitives and feeds the same codegen.
    timeline: build the persistent kernels instrumented (``tvm_rammer.scheduling.timeline``): each records
        per rTask and barrier-rTask its vEU, SM, start and end into a per-run buffer, and ``main``
        returns ``(its outputs, (one timeline buffer per rProgram, ...))``. A separate build for
        looking inside the kernel; every choice is still made on the uninstrumented kernels.
    precision: "float32" (default) or "float16": the model is converted with Relax
        ``ToMixedPrecision`` (float16 storage, float32 accumulation in conv2d/matmul), whose GEMMs
        then get tensor-core rKernel versions on sm_80+ targets. A float16 model (a float16
        export) gets the same at "float32" (``relay_passes.float16_accumulate``).
    coarsen_below_veus: False (default): an rKernel version is offered coarsened (several thread
        blocks per rTask, ``rkernels.coarsenings``) only while its rTasks still number at least the
        vEUs the device holds of it (SMs x the vEUs per SM its threads and shared memory allow), so
        coarsening only saves dispatch overhead and never leaves vEUs idle. The cost model times a
        block as its share of the device's peak throughput, so it cannot see that 256 blocks run one
        after another on one vEU take 256 block latencies: with the lower limit alone (16 rTasks)
        it chose e.g. 128 rTasks of 256 blocks for NASNet-CIFAR's 32,768-block convolutions on 528
        vEUs (276 of its 602 operators, 99.7% of its blocks, on under a quarter of the vEUs; that
        build ran 11,207 us vs TVM's default 6,663 us on an H200; how much of it the coarsening
        costs is not measured apart). True: coarsen down to 16 rTasks (the behaviour before; for
        ablations).
    check_unmeasured: when nothing is measured or read (no GPU of the target's arch, no profile
        records: ``--no-profile`` among others), every operator keeps TVM's dlight kernel, so an
        rProgram runs TVM's default kernels as rTasks; it is built only when an estimate that
        counts occupancy and block latency (``tvm_rammer.scheduling.unmeasured_check``) puts it ahead of those
        operators as TVM's default kernels, else they stay ordinary kernels (TVM's default; a
        ``fallbacks`` entry with ``source: "estimate"``). The analytical model alone cannot see
        that an rProgram holds fewer blocks per SM than an ordinary kernel would (the H200 run of
        7f085df: NASNet-CIFAR, SqueezeNet, AlexNet and ResNeXt-29 slower than TVM's default that
        way; LSTM-TC and the 16-branch demo, which the check keeps, 42x and 8x faster). Not
        applied when ``veus_per_sm`` is set: a vDevice pinned by hand (the emulator's 2 SMs x 1
        vEU, ablations) is built as asked. False: build every rProgram the policy makes (the
        behaviour before).
    block_us: the least time (us) one thread block takes in that check (its loads issued and
        awaited, its barriers), whatever its share of peak throughput; 1 us fits the H200 run
        (NASNet-CIFAR: 11,207 us for 4.8 M blocks on 528 vEUs, 1.2 us per block round).
    emulate_versions: check every rKernel version of every placeable operator against TVM's
        default kernel on the CPU emulator (``tvm_rammer.checks.emulator.versions``; needs g++) and never
        use one that is not valid there (CLI ``--emulate`` on inspect/compile). No times: the
        choice stays measured or TVM's default. Off by default (seconds of g++ per compile).
    rkernel_functions: build each dispatch entry's rKernel body of a CUDA persistent kernel as its
        own ``__device__ __noinline__`` function, called from the dispatch loop
        (``codegen.rkernel_functions``), so that nvcc's optimiser works on one body at a time
        instead of one function holding all of them. On by default: nvcc --time on the same
        models' CUDA (this 2-core machine, shared): NVVM (cicc) took 10.6-15.6 s instead of
        24.0-41.8 s on GoogLeNet's persistent kernel and 5.2-8.0 s instead of 12.8-13.5 s on
        SqueezeNet's (AlexNet's 11 bodies: the same either way); outputs checked on the CPU
        emulator (tests/test_rkernel_functions.py). Its runtime cost on a GPU is unmeasured: a
        call and a return around every rTask, one comparison per call (the thread index's range),
        and registers allocated body by body across calls (ptxas: 140 registers instead of 186
        for reduced SqueezeNet's kernel). The pool becomes dynamic shared memory (the same size).
        The ROCm back end ignores it. False: every body inline in the one kernel function (as
        before).
    prefetch_weights: before a vEU of a CUDA persistent kernel polls a barrier-rTask's waits, it
        issues L2 prefetches of the weights (constants, never tensors produced in the rProgram)
        the rTask after the barrier reads, its share of its operator's (``codegen.persistent``),
        and the cost model overlaps that read with the wait: such an rTask is charged
        ``max(wait, weight read) + the rest`` (``scheduling.cost_model``; what Hazy Research's
        megakernel does across its barriers, issue 34). The bandwidth and barrier figures are
        unchanged; the gain is unmeasured until a GPU run. The emulator ignores the prefetches;
        the ROCm back end emits none (and charges none). False: no prefetch, no overlap.
    prefetch_lookahead: with ``prefetch_weights``, how many barrier-rTasks back on its vEU an
        rTask's prefetch may be issued: at the earliest of its last n barrier-rTasks since that
        vEU last ran a prefetching operator (``codegen.persistent.prefetch_points``). A decode
        layer's attention chain (cache write, attention, combine: no weights) then overlaps its
        waits with the read of the output projection's weights; the cost model credits those
        waits only, never the rTasks in between (``PolicyConfig.prefetch_lookahead``). 1: at the
        barrier right before the rTask (as before 2026-11-28). Unmeasured on a GPU: whether the
        lines stay in L2 across the chain (the attention's own reads pass through it too).
    inplace_cache: a KV-cache scatter into a function parameter that nothing else reads becomes
        ``R.call_tir_inplace`` of a kernel over the update only (``relay_passes.cache_write``,
        ``CacheSlotWrite(inplace=True)``), placed as rTasks in the rProgram, whose call then
        aliases that output to the caller's cache tensor: a decode step writes one slot per
        head instead of copying every cache (GPT-2 small fp32: 75.5 MB read and written per
        step). False: the copying form ``select(slot == position, update, cache)`` over the
        whole cache (the caller's caches are left unchanged).
    attention_row: a decode attention whose q, k and v are views of projection rows (GPT-2's
        fused QKV split into heads; Llama's three projections, q and k rotated: the rotation then
        computed in the attention) reads them from those rows, and its KV caches as they were
        beside their one-slot writes (``relay_passes.decode_attention_row``): it waits for the
        projections only, not for the cache writes (one dependent step and barrier-rTask less per
        layer; the writes still happen, in place, beside it). False: it reads the written caches.
    weights: "embedded" (default): the model's weights are constants of the library. "apart": an
        ONNX model is imported with its initializers as parameters, the weight rewrites (batch
        norm folding, W's row blocks, stacked weights, interleaved columns, constant folding) are
        operators on them that ``relay_passes.lift_weights`` moves into a VM function
        ``transform_params(*raw_weights) -> tuple``, and ``main(*inputs, *weights)`` takes its
        result: the library holds code only, the same kernels and rPrograms.
    """

    max_rtask_threads: int = 256
    num_sms: int | None = None
    veus_per_sm: int | None = None
    selection: str = "paper"
    merge: str = "paper"
    fusion: bool = True
    wait_timeout_ms: float = 10_000.0
    tail_fusion: bool = True
    prologue_fusion: bool = True
    split_concat_matmul: bool = True
    batch_shared_matmuls: bool = True
    gemv_epilogue: bool = True
    split_k: bool = True
    norm_fusion: bool = True
    launch_us: float = 4.0
    barrier_us: float = 0.8
    l2_bw_gbps: float | None = None
    measure_resources: bool = False
    max_waits_per_op: int | None = 1 << 20
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    profile: bool = True
    profile_db: str | None = None
    rprogram_profiles: int = 8
    profile_budget_s: float | None = 300.0
    profile_margin: float | None = 1.25
    tuning_db: str | None = None
    versions: bool = True
    timeline: bool = False
    precision: str = "float32"
    policy: str = "rammer"
    emulate_versions: bool = False
    coarsen_below_veus: bool = False
    check_unmeasured: bool = True
    block_us: float = 1.0
    rkernel_functions: bool = True
    weights: str = "embedded"
    prefetch_weights: bool = True
    prefetch_lookahead: int = 4
    inplace_cache: bool = True
    attention_row: bool = True

    def __post_init__(self):
        if self.max_rtask_threads not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(
                f"max_rtask_threads={self.max_rtask_threads}: use a power of two in [32, 1024]")
        for name in ("num_sms", "veus_per_sm", "max_waits_per_op"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}={value!r} must be an integer or None")
        if self.num_sms is not None and not 1 <= self.num_sms <= MAX_SMS:
            raise ValueError(
                f"num_sms={self.num_sms}: use the GPU's SM count (1 to {MAX_SMS}; H100 SXM has 132) "
                "or leave it unset for the local GPU's, else the target arch's preset")
        if self.veus_per_sm is not None and not 1 <= self.veus_per_sm <= MAX_VEUS_PER_SM:
            raise ValueError(
                f"veus_per_sm={self.veus_per_sm}: an SM holds at most {MAX_VEUS_PER_SM} thread "
                f"blocks (vEUs); use 1 to {MAX_VEUS_PER_SM}, or leave it unset for the occupancy "
                "the rKernels allow")
        if self.max_waits_per_op is not None and self.max_waits_per_op < 1:
            raise ValueError(f"max_waits_per_op={self.max_waits_per_op} must be >= 1 (or None: "
                             "no limit)")
        if self.l2_bw_gbps is not None and not self.l2_bw_gbps > 0:
            raise ValueError(f"l2_bw_gbps={self.l2_bw_gbps} must be positive (or None: the cost "
                             "model's own figure)")
        if not self.block_us >= 0:
            raise ValueError(f"block_us={self.block_us}: a block's least time cannot be negative")
        if self.launch_us < 0 or self.barrier_us < 0:
            raise ValueError(f"launch_us={self.launch_us}, barrier_us={self.barrier_us}: "
                             "cost-model times cannot be negative")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: choose one of {SELECTIONS}")
        if self.merge not in MERGES:
            raise ValueError(f"merge={self.merge!r}: choose one of {MERGES}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: choose one of {POLICIES}")
        if self.rprogram_profiles < 0:
            raise ValueError(f"rprogram_profiles={self.rprogram_profiles} must be >= 0")
        if isinstance(self.prefetch_lookahead, bool) or not isinstance(
                self.prefetch_lookahead, int) or self.prefetch_lookahead < 1:
            raise ValueError(f"prefetch_lookahead={self.prefetch_lookahead!r}: use an int >= 1 "
                             "(1: prefetch at the barrier right before the rTask)")
        if self.profile_budget_s is not None and not self.profile_budget_s >= 0:
            raise ValueError(f"profile_budget_s={self.profile_budget_s} must be >= 0 seconds (or "
                             "None: no limit)")
        if self.profile_margin is not None and not self.profile_margin >= 1:
            raise ValueError(f"profile_margin={self.profile_margin} must be >= 1 (a factor between "
                             "analytical times; None: measure everything)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: choose one of {PRECISIONS}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights={self.weights!r}: choose one of {WEIGHTS}")
        if not self.wait_timeout_ms > 0:
            raise ValueError(f"wait_timeout_ms={self.wait_timeout_ms} must be positive")
