"""CUDA device helpers of the persistent kernel: barrier-rTask wait and rTask completion signal.

Rammer section 4.1.3: "R AMMER introduces a step array, where each element is an integer tracking the
number of finished rTasks in each vEU. When finished, an rTask will use its first thread to increase
the corresponding element ... a barrier-rTask uses its first N threads to poll on the corresponding
elements in the step array until the steps are larger than the orders of those rTasks. After that,
the barrier-rTask calls __syncthreads".

Memory ordering (PTX memory model): the finishing rTask runs ``__syncthreads`` (every thread of the
vEU is done with its stores), then its first thread publishes with a *release* store at GPU scope.
A waiting thread polls with *acquire* loads at GPU scope; the barrier-rTask ends with
``__syncthreads`` so that every thread of the waiting vEU is ordered after the acquire.

Spins are bounded: a wait that does not complete within ``spin_limit`` polls (with ``__nanosleep``
back-off, seconds in total) records which vEU got stuck in the state array, prints it and traps, so a
scheduling bug surfaces as a CUDA error ("unspecified launch failure") instead of a silent hang.

These are emitted with ``tvm.backend.cuda.op.cuda_func_call``, which places the source below into
the generated ``.cu`` file once per kernel.
"""

SIGNAL_NAME = "rammer_signal"
COUNT_NAME = "rammer_count"
WAIT_NAME = "rammer_wait"

SIGNAL_SOURCE = r"""
__device__ __forceinline__ void rammer_signal(int* __restrict__ state, int veu, int step) {
  // caller: __syncthreads() first, then thread 0 only
  asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(state + veu), "r"(step) : "memory");
}
"""

COUNT_SOURCE = r"""
__device__ __forceinline__ void rammer_count(int* __restrict__ state, int slot) {
  // caller: __syncthreads() first, then thread 0 only: one more rTask of the operator finished
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(state + slot) : "memory");
}
"""

WAIT_SOURCE = r"""
__device__ __forceinline__ int rammer_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void rammer_wait(const int* __restrict__ program, int* __restrict__ state,
                                            int first, int count, int nthreads, int tid, int veu,
                                            int error_slot, long long spin_limit) {
  // barrier-rTask: thread i polls wait entries i, i + nthreads, ...; an entry <vEU, step> waits for
  // state[vEU] >= step, an entry <-(k+1), n> for operator counter k (state[error_slot + 1 + k]) >= n
  for (int i = tid; i < count; i += nthreads) {
    const int other = program[first + 2 * i];
    const int step = program[first + 2 * i + 1];
    const int slot = other >= 0 ? other : error_slot - other;
    long long spins = 0;
    while (rammer_ld_acquire(state + slot) < step) {
      __nanosleep(64);
      if (++spins > spin_limit) {
        atomicExch(state + error_slot, veu + 1);
        printf("tvm-rammer: vEU %d waited too long for state[%d] to reach %d (has %d); aborting\n",
               veu, slot, step, rammer_ld_acquire(state + slot));
        __trap();
      }
    }
  }
}
"""

# --- timeline instrumentation (RammerConfig(timeline=True) only; see tvm_rammer.timeline) ----------
# Per instruction of a vEU, its first thread records (start, end, SM) in ns of %globaltimer, the
# GPU's global nanosecond timer (one clock for all SMs, so slices of different vEUs compare). The
# end is read after the instruction's __syncthreads and before its step is published, so a waiting
# vEU can never start before the rTask it waited for has recorded its end.

TIMER_NAME = "rammer_globaltimer"
RECORD_NAME = "rammer_record"
TIMELINE_WORDS = 3  # int64 words per instruction: start ns, end ns, SM id

TIMER_SOURCE = r"""
__device__ __forceinline__ int64_t rammer_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  return (int64_t)t;
}
"""

RECORD_SOURCE = r"""
__device__ __forceinline__ void rammer_record(int64_t* __restrict__ timeline, int index,
                                             int64_t start) {
  // caller: thread 0, after the instruction's __syncthreads, before it publishes its step
  unsigned long long end;
  unsigned int sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end) :: "memory");
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  int64_t* slot = timeline + 3 * (int64_t)index;
  slot[0] = start;
  slot[1] = (int64_t)end;
  slot[2] = (int64_t)sm;
}
"""
