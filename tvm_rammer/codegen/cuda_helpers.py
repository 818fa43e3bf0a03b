"""CUDA device helpers of the persistent kernel: barrier-rTask wait and rTask completion signal.

Rammer section 4.1.3: "R AMMER introduces a step array, where each element is an integer tracking the
number of finished rTasks in each vEU. When finished, an rTask will use its first thread to increase
the corresponding element ... a barrier-rTask uses its first N threads to poll on the corresponding
elements in the step array until the steps are larger than the orders of those rTasks. After that,
the barrier-rTask calls __syncthreads".

Memory ordering (PTX memory model): the finishing rTask runs ``__syncthreads`` (every thread of the
vEU is done with its stores; ``bar.sync`` orders them before thread 0's later operations), then its
first thread publishes with a *release* store at GPU scope (cumulative: it releases what the barrier
ordered before it). A waiting thread polls with *acquire* loads at GPU scope; the barrier-rTask ends
with ``__syncthreads`` so that every thread of the waiting vEU is ordered after the acquire, and
then with the ``__syncthreads_or`` of :data:`STOPPED_SOURCE` (``bar.red`` has ``bar.sync``'s memory
ordering).

Fast path (issue 21, defect 8): an entry whose step is already reached costs one acquire load and
nothing else: no ``%globaltimer`` read, no read of the error word, no sleep. Only a wait that is
not satisfied at once enters the slow path: it sleeps 16 ns, doubling up to 128 ns, between polls
of the awaited word alone, and every 8th poll reads the error word (another vEU gave up: stop) and
the clock (past ``timeout_ns``: record the fault). The agreement after the barrier-rTask is one
``__syncthreads_or`` whose only global read is thread 0's relaxed load of the error word, placed
after the closing ``__syncthreads`` (so every give-up of this vEU's threads, which set or saw that
word before the barrier, is seen; relaxed suffices: stopping consumes no data of other vEUs); it
replaces a shared flag and two ``__syncthreads``. Before, a barrier-rTask cost a clock read and an
acquire per entry plus an acquire and three barriers, and a slow poll two serialized acquires; now
one acquire per entry, two barriers and thread 0's load. Folding the closing ``__syncthreads`` into
the ``__syncthreads_or`` would need ``rammer_wait`` to return its thread's give-up (a change of the
helpers' signatures, which the AMDGPU helpers of ``tvm_rammer.rocm.helpers`` share).

Operator-completion counters follow the fault record in the state (``state[num_veus +
STATE_WORDS + k]``): each rTask of a counted operator adds 1 with a *release* reduction after its
``__syncthreads`` (:data:`COUNT_SOURCE`); a wait entry ``<-(k+1), n>`` polls counter ``k`` until it
reaches ``n`` (acquire), like a step.

Waits are bounded in *time*: a poll loop reads ``%globaltimer`` (nanoseconds) and gives up after
``timeout_ns``. The first vEU that gives up records the fault in the step array's extra words
(:data:`STATE_WORDS` past the vEUs' steps: code, vEU, instruction, awaited vEU, awaited step,
step reached) and, when the kernel has one, in the host-mapped fault page (``tvm_rammer.codegen.faults``:
the same record plus the kernel's id and the rTask the barrier guarded, written with system-scope
ordering and the code word last). Every other waiting vEU sees the code (within 8 polls) and stops
waiting; after each barrier-rTask the whole vEU agrees (:data:`STOPPED_NAME`, ``__syncthreads_or``)
whether to skip the rest of its instructions. So a wait that can never complete ends the kernel
normally, the CUDA context stays usable, and the host raises an error naming the vEU and the rTask;
no ``__trap``.

These are emitted with ``tvm.backend.cuda.op.cuda_func_call``, which places the source below into
the generated ``.cu`` file once per kernel.

CPU emulation (``tvm_rammer.checks.emulator``, issue 23): every helper has a portable branch under
``#ifdef RAMMER_EMULATE`` (the emulator's build defines it), so the emulator never rewrites our
inline PTX: acquire loads / release stores / the release add are ``__atomic`` builtins
(``rammer_emu::load_acquire``, ``store_release``, ``red_add_release``), ``%globaltimer`` is the
emulator's virtual clock (``rammer_emu::globaltimer``), ``%smid`` a virtual SM id, and a sleep in a
poll loop is a yield to the emulator's scheduler naming what the thread waits for.
"""

SIGNAL_NAME = "rammer_signal"
COUNT_NAME = "rammer_count"
WAIT_NAME = "rammer_wait"
STOPPED_NAME = "rammer_stopped"

FAULT_WAIT_TIMEOUT = 1  # fault code: a barrier-rTask's wait ran past its time limit
FAULT_GRID_TIMEOUT = 2  # fault code: the software grid barrier ran past its time limit
# step-array words past the vEUs' steps: code, vEU, instruction, awaited vEU, step, reached step
STATE_WORDS = 6
# fault page: code, kernel id, vEU, instruction, awaited vEU, step, reached, next entry, next rTask
PAGE_WORDS = 16
GRID_SYNC_NAME = "rammer_grid_sync"
GRID_COUNT_WORD = 12       # fault page words of the software grid barrier (CUDA and AMDGPU;
GRID_GENERATION_WORD = 13  # faults.py: 0-8 the record, 15 the magic); 14: set by a vEU whose
GRID_GAVE_UP_WORD = 14     # barrier timed out, so that the vEUs that pass it after stop too

SIGNAL_SOURCE = r"""
__device__ __forceinline__ void rammer_signal(int* __restrict__ state, int veu, int step) {
  // caller: __syncthreads() first, then thread 0 only
#ifdef RAMMER_EMULATE
  ::rammer_emu::store_release(state + veu, step);
#else
  asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(state + veu), "r"(step) : "memory");
#endif
}
"""

COUNT_SOURCE = r"""
__device__ __forceinline__ void rammer_count(int* __restrict__ state, int slot) {
  // caller: __syncthreads() first, then thread 0 only: one more rTask of the operator finished
#ifdef RAMMER_EMULATE
  ::rammer_emu::red_add_release(state + slot, 1);
#else
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(state + slot) : "memory");
#endif
}
"""

# An acquire load at GPU scope and the %globaltimer clock, for the helpers that poll: each helper
# source that needs them carries its own copy under its own names (TVM places a helper's source
# once per function name, in no set order, so one source cannot call another's).
_POLL_PRIMITIVES = r"""
__device__ __forceinline__ int ACQUIRE(const int* p) {
#ifdef RAMMER_EMULATE
  return ::rammer_emu::load_acquire(p);
#else
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}
__device__ __forceinline__ unsigned long long NOW_NS() {
#ifdef RAMMER_EMULATE
  return ::rammer_emu::globaltimer();
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}
"""


def _poll_primitives(acquire: str, now_ns: str) -> str:
    """:data:`_POLL_PRIMITIVES` under the names ``acquire`` and ``now_ns``."""
    return _POLL_PRIMITIVES.replace("ACQUIRE", acquire).replace("NOW_NS", now_ns)


WAIT_SOURCE = _poll_primitives("rammer_ld_acquire", "rammer_now_ns") + r"""__device__ __forceinline__ void rammer_record_fault(const int* __restrict__ program,
                                                    int* __restrict__ state, int* fault_page,
                                                    int kernel_id, int num_veus, int veu, int pc,
                                                    int next_at, int other, int slot, int step) {
  // the first vEU to give up owns the record (other < 0: operator counter -other-1)
  if (atomicCAS(state + num_veus, 0, 1) != 0) return;
  const int reached = rammer_ld_acquire(state + slot);
  state[num_veus + 1] = veu;
  state[num_veus + 2] = pc;
  state[num_veus + 3] = other;
  state[num_veus + 4] = step;
  state[num_veus + 5] = reached;
  volatile int* page = fault_page;
  if (page != nullptr && page[0] == 0) {  // the first fault keeps the page
    page[1] = kernel_id;
    page[2] = veu;
    page[3] = pc;
    page[4] = other;
    page[5] = step;
    page[6] = reached;
    page[7] = program[next_at] - 1;   // dispatch entry of the rTask this barrier guards
    page[8] = program[next_at + 1];   // its rtask_id
    __threadfence_system();
#ifdef RAMMER_EMULATE
    ::rammer_emu::store_release(fault_page, 1);
#else
    asm volatile("st.release.sys.global.s32 [%0], %1;" :: "l"(fault_page), "r"(1) : "memory");
#endif
  }
}
__device__ __noinline__ int rammer_wait_slow(const int* __restrict__ program, int* __restrict__ state,
                                             int veu, int num_veus, int pc, int next_at,
                                             long long timeout_ns, int* fault_page, int kernel_id,
                                             int other, int slot, int step) {
  // the awaited step is not there yet: poll it alone, sleeping 16..128 ns; every 8th poll check
  // whether another vEU gave up and whether this wait ran past its time limit. 1: gave up.
  const unsigned long long start = rammer_now_ns();
  unsigned int pause = 16;
  for (unsigned int polls = 1;; ++polls) {
#ifdef RAMMER_EMULATE
    ::rammer_emu::spin_yield_for("rammer_wait: vEU %lld waits for state[%lld] >= %lld (now %lld)",
                                 veu, slot, step, state[slot], __LINE__);
#else
    __nanosleep(pause);
    if (pause < 128) pause *= 2;
#endif
    if (rammer_ld_acquire(state + slot) >= step) return 0;
    if ((polls & 7) == 0) {
      if (rammer_ld_acquire(state + num_veus) != 0) return 1;  // another vEU gave up: stop too
      if ((long long)(rammer_now_ns() - start) > timeout_ns) {
        rammer_record_fault(program, state, fault_page, kernel_id, num_veus, veu, pc, next_at,
                            other, slot, step);
        return 1;
      }
    }
  }
}
__device__ __forceinline__ void rammer_wait(const int* __restrict__ program, int* __restrict__ state,
                                            int first, int count, int nthreads, int tid, int veu,
                                            int num_veus, int pc, int next_at, long long timeout_ns,
                                            int* fault_page, int kernel_id) {
  // barrier-rTask: thread i polls wait entries i, i + nthreads, ...; an entry <vEU, step> waits for
  // state[vEU] >= step, an entry <-(k+1), n> for operator counter k (after the fault record) >= n.
  // Fast path: one acquire load per entry whose step is reached.
  for (int i = tid; i < count; i += nthreads) {
    const int other = program[first + 2 * i];
    const int step = program[first + 2 * i + 1];
    const int slot = other >= 0 ? other : num_veus + RAMMER_STATE_WORDS - other - 1;
    if (rammer_ld_acquire(state + slot) < step &&
        rammer_wait_slow(program, state, veu, num_veus, pc, next_at, timeout_ns, fault_page,
                         kernel_id, other, slot, step)) {
      return;
    }
  }
}
""".replace("RAMMER_STATE_WORDS", str(STATE_WORDS))

# sources are placed once per function name, in no set order: this one stands alone
STOPPED_SOURCE = r"""
__device__ __forceinline__ int rammer_stopped(const int* __restrict__ state, int num_veus, int tid) {
  // after a barrier-rTask's closing __syncthreads: the whole vEU agrees whether the kernel gave up.
  // One barrier-reduction; thread 0 alone reads the error word (relaxed: no data is consumed).
  int gave_up = 0;
  if (tid == 0) {
#ifdef RAMMER_EMULATE
    gave_up = ::rammer_emu::load_relaxed(state + num_veus) != 0;
#else
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(state + num_veus) : "memory");
    gave_up = v != 0;
#endif
  }
  return __syncthreads_or(gave_up);
}
"""

# The prologue's grid barrier (after every vEU has zeroed its step and the counters). TVM's own
# ``cuda_grid_sync`` is cooperative groups' ``this_grid().sync()``, whose two headers
# (<cooperative_groups.h>, <cuda/barrier>: TVM's header generator adds both for it) cost nvcc
# ~0.7-0.9 s of front-end time per persistent-kernel build: alone they took AlexNet's nvcc from
# 1.55 to 2.5 s (sm_90a, 2026-11-27) where the barrier is one call per run. This one is a software
# barrier (sense reversal, the AMDGPU helper's algorithm) on words of the module's fault page,
# which keeps its contents between runs (zero when the module is loaded, reset by faults.clear):
# thread 0 of each vEU reads the generation (acquire), adds 1 to the count (acq_rel, after the
# vEU's __syncthreads, so the zeroing stores of all its threads are released with it); the last of
# ``num_veus`` to arrive resets the count and advances the generation (release), the others poll
# the generation (acquire) and the closing barrier orders the vEU after it. The count is 0 again
# after every barrier, so consecutive kernels of one module reuse the words; two runs of one VM at
# the same time on two streams would share them (not supported: one VM per stream). The kernel is
# still launched cooperatively, so CUDA refuses a grid whose vEUs cannot all be resident; a vEU
# whose wait runs past ``timeout_ns`` anyway sets the error word (``state[num_veus]``: the other
# vEUs stop at their next barrier-rTask, and no later wait overwrites the record) and the page's
# gave-up word (:data:`GRID_GAVE_UP_WORD`: a late vEU 0 zeroes the error word in its prologue, the
# page it does not), records :data:`FAULT_GRID_TIMEOUT` in the page unless a fault is there already,
# and the call returns 1 to the whole vEU (``__syncthreads_or``): its instructions are skipped. A
# vEU that passes the barrier reads the gave-up word and returns 1 too when it is set (one acquire
# load per run), so after a time-out no vEU runs rTasks, except one that had passed before it. The
# word stays set until the page is reset (``faults.check`` / ``clear``): until then every run of
# that VM stops at once (its outputs invalid, word 0 still saying fault 2).
GRID_SYNC_SOURCE = _poll_primitives("rammer_grid_acquire", "rammer_grid_now_ns") + r"""
__device__ __noinline__ int rammer_grid_sync(int* __restrict__ page, int* __restrict__ state,
                                             int num_veus, int tid, long long timeout_ns,
                                             int kernel_id) {
  __syncthreads();
  int timed_out = 0;
  if (tid == 0) {
    int* count = page + RAMMER_GRID_COUNT_WORD;
    int* generation = page + RAMMER_GRID_GENERATION_WORD;
    const int gen = rammer_grid_acquire(generation);
    int arrived;
#ifdef RAMMER_EMULATE
    arrived = ::rammer_emu::fetch_add_acq_rel(count, 1);
#else
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(arrived) : "l"(count)
                 : "memory");
#endif
    if (arrived == num_veus - 1) {
      const int next = (int)((unsigned)gen + 1u);  // wraps after 2^32 runs: only != is tested
#ifdef RAMMER_EMULATE
      ::rammer_emu::store_release(count, 0);
      ::rammer_emu::store_release(generation, next);
#else
      asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(count), "r"(0) : "memory");
      asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(generation), "r"(next)
                   : "memory");
#endif
      timed_out = rammer_grid_acquire(page + RAMMER_GRID_GAVE_UP_WORD) != 0;
    } else {
      const unsigned long long start = rammer_grid_now_ns();
#ifndef RAMMER_EMULATE
      unsigned int pause = 16;
#endif
      for (;;) {
        if (rammer_grid_acquire(generation) != gen) {
          timed_out = rammer_grid_acquire(page + RAMMER_GRID_GAVE_UP_WORD) != 0;
          break;
        }
#ifdef RAMMER_EMULATE
        ::rammer_emu::spin_yield_for(
            "rammer_grid_sync: vEU %lld waits, %lld of %lld vEUs arrived (generation %lld)",
            blockIdx.x, ::rammer_emu::load_relaxed(count), num_veus, gen, __LINE__);
#else
        __nanosleep(pause);
        if (pause < 128) pause *= 2;
#endif
        if ((long long)(rammer_grid_now_ns() - start) > timeout_ns) {
          timed_out = 1;
          atomicExch(page + RAMMER_GRID_GAVE_UP_WORD, 1);
          __threadfence();
          atomicCAS(state + num_veus, 0, RAMMER_FAULT_GRID_TIMEOUT);
          volatile int* words = page;
          if (words[0] == 0) {  // the first fault keeps the page
            words[1] = kernel_id;
            __threadfence_system();
#ifdef RAMMER_EMULATE
            ::rammer_emu::store_release(page, RAMMER_FAULT_GRID_TIMEOUT);
#else
            asm volatile("st.release.sys.global.s32 [%0], %1;" :: "l"(page),
                         "r"(RAMMER_FAULT_GRID_TIMEOUT) : "memory");
#endif
          }
          break;
        }
      }
    }
  }
  return __syncthreads_or(timed_out);
}
""".replace("RAMMER_GRID_GAVE_UP_WORD", str(GRID_GAVE_UP_WORD)).replace(
    "RAMMER_GRID_COUNT_WORD", str(GRID_COUNT_WORD)).replace(
    "RAMMER_GRID_GENERATION_WORD", str(GRID_GENERATION_WORD)).replace(
    "RAMMER_FAULT_GRID_TIMEOUT", str(FAULT_GRID_TIMEOUT))

# --- timeline instrumentation (RammerConfig(timeline=True) only; see tvm_rammer.scheduling.timeline) ----------
# Per instruction of a vEU, its first thread records (start, end, SM) in ns of %globaltimer, the
# GPU's global nanosecond timer (one clock for all SMs, so slices of different vEUs compare). The
# end is read after the instruction's __syncthreads and before its step is published, so a waiting
# vEU can never start before the rTask it waited for has recorded its end.

TIMER_NAME = "rammer_globaltimer"
RECORD_NAME = "rammer_record"
TIMELINE_WORDS = 3  # int64 words per instruction: start ns, end ns, SM id

TIMER_SOURCE = r"""
__device__ __forceinline__ int64_t rammer_globaltimer() {
#ifdef RAMMER_EMULATE
  return (int64_t)::rammer_emu::globaltimer();
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  return (int64_t)t;
#endif
}
"""

RECORD_SOURCE = r"""
__device__ __forceinline__ void rammer_record(int64_t* __restrict__ timeline, int index,
                                             int64_t start) {
  // caller: thread 0, after the instruction's __syncthreads, before it publishes its step
  unsigned long long end;
  unsigned int sm;
#ifdef RAMMER_EMULATE
  end = ::rammer_emu::globaltimer();
  sm = ::rammer_emu::smid();
#else
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end) :: "memory");
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
#endif
  int64_t* slot = timeline + 3 * (int64_t)index;
  slot[0] = start;
  slot[1] = (int64_t)end;
  slot[2] = (int64_t)sm;
}
"""

# --- weights prefetched across a barrier (RammerConfig(prefetch_weights=True); issue 34) ------------
# Before a vEU polls a barrier-rTask's wait list, its threads issue L2 prefetches of the weight
# ranges the rTask after the barrier reads (its share of its operator's constants in the weights
# blob), so the wait overlaps that memory traffic (Hazy Research's megakernel does the same). The
# record at ``program[at]``: the number of ranges, then <first 128-byte line, lines> per range,
# lines counted from the blob's start. Only constants are ever named (codegen.persistent): never a
# tensor an rTask of the rProgram writes, which a prefetch could read before it is written (a
# prefetch is only a hint, but it must not name memory being written). ``prefetch.global.L2`` has
# no architectural effect; the emulator (a CPU) has no L2 to warm: there it does nothing.

PREFETCH_NAME = "rammer_prefetch_l2"
PREFETCH_LINE_BYTES = 128

PREFETCH_SOURCE = r"""
__device__ __forceinline__ void rammer_prefetch_l2(const unsigned char* __restrict__ weights,
                                                  const int* __restrict__ program, int at, int tid,
                                                  int nthreads) {
#ifndef RAMMER_EMULATE
  const int ranges = program[at];
  for (int r = 0; r < ranges; ++r) {
    const long long first = (long long)program[at + 1 + 2 * r];
    const int lines = program[at + 2 + 2 * r];
    for (int i = tid; i < lines; i += nthreads) {
      asm volatile("prefetch.global.L2 [%0];" :: "l"(weights + (first + i) * RAMMER_LINE_BYTES));
    }
  }
#endif
}
""".replace("RAMMER_LINE_BYTES", str(PREFETCH_LINE_BYTES))
