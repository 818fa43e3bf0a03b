"""The CPU emulator's runtime (tvm_rammer/checks/emulator/build.py + include/): hand-written CUDA snippets built
with build_module and launched, each checked against numpy; our own persistent-kernel helpers
(codegen/cuda_helpers.py) in a cooperative two-block handshake, their timeout producing the fault
record; negative controls (a named barrier with a wrong count deadlocks with a report naming it,
unknown PTX and compile errors raise EmulatorError with what went wrong)."""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tvm_rammer.codegen import cuda_helpers
from tvm_rammer.checks.emulator.build import (EmulatorDeadlock, EmulatorError, build_module,
                                              kernel_names, rewrite_source)

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                                reason="the emulator needs a C++ compiler")

# TVM's way of writing a named barrier (tir_templates/rtask_rewrite.py before its emulator branch)
BAR = 'asm volatile("bar.sync %0, %1;" :: "r"({id}), "r"({n}) : "memory");'

SNIPPETS = r"""
#define uint unsigned int
#define uchar unsigned char

extern "C" __global__ void __launch_bounds__(128) block_sum(const float* __restrict__ x,
                                                             float* __restrict__ out, int n) {
  __shared__ __align__(16) float buf[128];
  float acc = 0.0f;
  for (int i = blockIdx.x * 128 + threadIdx.x; i < n; i += gridDim.x * 128) acc += x[i];
  buf[threadIdx.x] = acc;
  __syncthreads();
  for (int s = 64; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) buf[threadIdx.x] = buf[threadIdx.x] + buf[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = buf[0];
}

extern "C" __global__ void reverse_dyn(const float* __restrict__ x, float* __restrict__ y) {
  extern __shared__ __align__(16) uchar buf_dyn_shmem[];
  float* tile = (float*)buf_dyn_shmem;
  const int n = blockDim.x;
  tile[threadIdx.x] = x[blockIdx.x * n + threadIdx.x];
  __syncthreads();
  y[blockIdx.x * n + threadIdx.x] = tile[n - 1 - threadIdx.x];
}

extern "C" __global__ void named_halves(const float* __restrict__ x, float* __restrict__ y) {
  // two independent halves of the block, each with its own named barrier over 64 threads
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = x[t];
  if (t < 64) { BAR1 } else { BAR2 }
  y[t] = t < 64 ? s[63 - t] : s[191 - t];
  if (t < 64) { BAR1 } else { BAR2 }
  s[t] = 0.0f;
}

extern "C" __global__ void wrong_count(float* __restrict__ y) {
  if (threadIdx.x < 64) { BAR_WRONG }
  y[threadIdx.x] = 1.0f;
}

extern "C" __global__ void divergent_shuffle(const float* __restrict__ x, float* __restrict__ sums,
                                             uint* __restrict__ masks) {
  // TVM's allreduce inside an early-exit branch: the mask comes from __activemask()
  uint mask[1];
  float t0[1];
  float red_buf0[1];
  red_buf0[0] = x[blockIdx.x * 32 + threadIdx.x];
  if (threadIdx.x < 16) {
    mask[0] = __activemask();
    t0[0] = __shfl_down_sync(mask[0], red_buf0[0], 8, 32);
    red_buf0[0] = (red_buf0[0] + t0[0]);
    t0[0] = __shfl_down_sync(mask[0], red_buf0[0], 4, 32);
    red_buf0[0] = (red_buf0[0] + t0[0]);
    t0[0] = __shfl_down_sync(mask[0], red_buf0[0], 2, 32);
    red_buf0[0] = (red_buf0[0] + t0[0]);
    t0[0] = __shfl_down_sync(mask[0], red_buf0[0], 1, 32);
    red_buf0[0] = (red_buf0[0] + t0[0]);
    red_buf0[0] = __shfl_sync(mask[0], red_buf0[0], 0, 32);
    sums[blockIdx.x * 16 + threadIdx.x] = red_buf0[0];
    masks[blockIdx.x * 16 + threadIdx.x] = mask[0];
  }
  __syncthreads();
}

extern "C" __global__ void votes(const int* __restrict__ p, uint* __restrict__ out) {
  const uint b = __ballot_sync(0xffffffffu, p[threadIdx.x] != 0);
  const int a = __any_sync(0xffffffffu, p[threadIdx.x] > 1);
  const int l = __all_sync(0xffffffffu, p[threadIdx.x] >= 0);
  const float x = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
  if (threadIdx.x == 0) { out[0] = b; out[1] = a; out[2] = l; }
  out[3 + threadIdx.x] = (uint)x;
}

extern "C" __global__ void sync_votes(const int* __restrict__ p, int* __restrict__ out) {
  const int c = __syncthreads_count(p[threadIdx.x] > 0);
  const int a = __syncthreads_and(p[threadIdx.x] >= 0);
  const int o = __syncthreads_or(p[threadIdx.x] > 5);
  out[threadIdx.x] = c * 100 + a * 10 + o;
}

extern "C" __global__ void histogram(const int* __restrict__ keys, int* __restrict__ counts,
                                     float* __restrict__ total, int* __restrict__ biggest, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    atomicAdd(counts + keys[i], 1);
    atomicAdd(total, (float)keys[i]);
    atomicMax(biggest, keys[i] * 3 + (int)blockIdx.x);
  }
}

extern "C" __global__ void halves(const half* __restrict__ a, const half* __restrict__ b,
                                  half* __restrict__ c, float* __restrict__ d) {
  const int i = threadIdx.x;
  const half p = a[i] * b[i];
  c[i] = p + a[i];
  d[i] = __half2float(hexp(a[i])) + (float)__hmax(a[i], b[i]);
}

extern "C" __global__ void grid_ordered(int* __restrict__ first, int* __restrict__ seen) {
  // before the grid sync every block writes its id; after it every block reads all of them
  if (threadIdx.x == 0) first[blockIdx.x] = (int)blockIdx.x + 1;
  cooperative_groups::this_grid().sync();
  int s = 0;
  for (int k = 0; k < (int)gridDim.x; ++k) s += first[k];
  seen[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void out_of_bounds(float* __restrict__ y) {
  if (threadIdx.x == 5) y[-(1ll << 40)] = 1.0f;
}
""".replace("BAR1", BAR.format(id=1, n=64)).replace("BAR2", BAR.format(id=2, n=64)) \
   .replace("BAR_WRONG", BAR.format(id=3, n=128))

# our persistent kernel's helpers: block 1 is a barrier-rTask waiting for <vEU 0, step 1>;
# block 0 writes data and publishes step 1 (or never does: signal = 0)
HANDSHAKE = cuda_helpers.SIGNAL_SOURCE + cuda_helpers.WAIT_SOURCE + cuda_helpers.STOPPED_SOURCE + r"""
extern "C" __global__ void handshake(const int* __restrict__ program, int* __restrict__ state,
                                     int* __restrict__ page, float* __restrict__ data,
                                     int* __restrict__ stopped, int signal, long long timeout_ns) {
  const int tid = threadIdx.x;
  if (blockIdx.x == 0) {
    data[tid] = 2.0f * tid;
    __syncthreads();
    if (tid == 0 && signal) rammer_signal(state, 0, 1);
  } else {
    rammer_wait(program, state, 0, 1, blockDim.x, tid, 1, 2, 5, 2, timeout_ns, page, 7);
    __syncthreads();
    const int stop = rammer_stopped(state, 2, tid);
    stopped[tid] = stop;
    if (!stop) data[blockDim.x + tid] = data[tid] + 1.0f;
  }
}
"""


# the persistent kernel's prologue barrier (cuda_helpers.GRID_SYNC_SOURCE): every block writes its
# id, passes rammer_grid_sync (``expected`` vEUs awaited), says whether it gave up, then reads every
# block's id
GRID = cuda_helpers.GRID_SYNC_SOURCE + r"""
extern "C" __global__ void grid_barrier(int* __restrict__ page, int* __restrict__ state,
                                        int* __restrict__ first, int* __restrict__ seen,
                                        int* __restrict__ stopped, int expected,
                                        long long timeout_ns, long long late_ns) {
  if (threadIdx.x == 0) first[blockIdx.x] = (int)blockIdx.x + 1;
  if (blockIdx.x == gridDim.x - 1 && late_ns > 0) {  // the last block arrives late_ns late
    const unsigned long long t0 = __globaltimer();
    while ((long long)(__globaltimer() - t0) < late_ns) __nanosleep(100);
  }
  const int stop = rammer_grid_sync(page, state, expected, threadIdx.x, timeout_ns, 3);
  stopped[blockIdx.x * blockDim.x + threadIdx.x] = stop;
  if (stop) return;
  int s = 0;
  for (int k = 0; k < (int)gridDim.x; ++k) s += first[k];
  seen[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


@pytest.fixture(scope="module")
def mod():
    return build_module(SNIPPETS)


@pytest.fixture(scope="module")
def grid():
    return build_module(GRID)


@pytest.fixture(scope="module")
def handshake():
    return build_module(HANDSHAKE)


def test_kernel_names_and_signatures(mod):
    assert mod.kernels == kernel_names(SNIPPETS)
    assert mod.kernels[:3] == ("block_sum", "reverse_dyn", "named_halves")
    assert mod.signatures["block_sum"] == "ppi"
    with pytest.raises(TypeError, match="takes 3 arguments"):
        mod.launch("block_sum", [np.zeros(4, np.float32)], 1, 128)
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        mod.launch("nope", [], 1, 1)
    args = [np.zeros(4, np.float32), np.zeros(4, np.float32), np.int32(4)]
    with pytest.raises(ValueError, match="1 to 3 positive extents"):
        mod.launch("block_sum", args, (0,), 128)
    with pytest.raises(ValueError, match="at most 1024 threads"):
        mod.launch("block_sum", args, 1, (64, 32))
    with pytest.raises(TypeError, match="argument 2 must be a int32 scalar"):
        mod.launch("block_sum", args[:2] + [np.float32(4)], 1, 128)
    with pytest.raises(ValueError, match="does not fit int32"):
        mod.launch("block_sum", args[:2] + [np.int64(1 << 40)], 1, 128)
    with pytest.raises(ValueError, match="order='sideways'"):
        mod.launch("block_sum", args, 1, 128, order="sideways")
    with pytest.raises(ValueError, match="opt='-O7'"):
        build_module(SNIPPETS, opt="-O7")


def test_block_reduction_with_syncthreads_and_shared_memory(mod):
    x = np.random.RandomState(0).rand(5000).astype(np.float32)
    out = np.full(3, np.nan, np.float32)
    mod.launch("block_sum", [x, out, np.int32(x.size)], (3,), (128,))
    assert np.allclose(out.sum(), x.sum(), rtol=1e-5)
    expect = [x[np.arange(x.size) // 128 % 3 == b].sum() for b in range(3)]
    assert np.allclose(out, expect, rtol=1e-5)


def test_dynamic_shared_memory(mod):
    x = np.arange(4 * 96, dtype=np.float32)
    y = np.zeros_like(x)
    mod.launch("reverse_dyn", [x, y], 4, 96, dyn_smem=96 * 4)
    assert (y.reshape(4, 96) == x.reshape(4, 96)[:, ::-1]).all()


def test_named_barriers_over_parts_of_a_block(mod):
    x = np.arange(128, dtype=np.float32) * 3
    y = np.zeros_like(x)
    mod.launch("named_halves", [x, y], 1, 128)
    assert (y[:64] == x[:64][::-1]).all() and (y[64:] == x[64:][::-1]).all()


def test_shuffles_in_divergent_code_after_activemask(mod):
    x = np.random.RandomState(1).rand(2 * 32).astype(np.float32)
    sums = np.zeros(32, np.float32)
    masks = np.zeros(32, np.uint32)
    mod.launch("divergent_shuffle", [x, sums, masks], 2, 32)
    assert (masks == 0xFFFF).all()  # the 16 lanes inside the branch
    expect = x.reshape(2, 32)[:, :16].sum(axis=1)
    assert np.allclose(sums.reshape(2, 16), expect[:, None], rtol=1e-6)


def test_votes_and_xor_shuffle(mod):
    p = np.zeros(32, np.int32)
    p[[3, 7, 30]] = [1, 2, 1]
    out = np.zeros(35, np.uint32)
    mod.launch("votes", [p, out], 1, 32)
    assert out[0] == (1 << 3) | (1 << 7) | (1 << 30) and out[1] == 1 and out[2] == 1
    assert (out[3:] == np.arange(32) ^ 1).all()


def test_syncthreads_count_and_or(mod):
    p = np.zeros(96, np.int32)
    p[[1, 40, 90]] = [1, 2, 7]
    out = np.zeros(96, np.int32)
    mod.launch("sync_votes", [p, out], 1, 96)
    assert (out == 3 * 100 + 10 + 1).all()
    p[5] = -1
    mod.launch("sync_votes", [p, out], 1, 96)
    assert (out == 3 * 100 + 0 + 1).all()


def test_atomics_across_blocks(mod):
    keys = np.random.RandomState(2).randint(0, 10, size=1000).astype(np.int32)
    counts = np.zeros(10, np.int32)
    total = np.zeros(1, np.float32)
    biggest = np.full(1, -1, np.int32)
    mod.launch("histogram", [keys, counts, total, biggest, np.int32(keys.size)], 8, 128)
    assert (counts == np.bincount(keys, minlength=10)).all()
    assert total[0] == keys.sum()
    assert biggest[0] == max(3 * k + i // 128 for i, k in enumerate(keys))


def test_half_arithmetic(mod):
    rng = np.random.RandomState(3)
    a = rng.uniform(-2, 2, 64).astype(np.float16)
    b = rng.uniform(-2, 2, 64).astype(np.float16)
    c = np.zeros(64, np.float16)
    d = np.zeros(64, np.float32)
    mod.launch("halves", [a, b, c, d], 1, 64)
    assert (c == (a * b) + a).all()  # each operation rounds to half, as numpy's float16 does
    expect = np.exp(a.astype(np.float32)).astype(np.float16).astype(np.float32) + np.maximum(a, b)
    assert np.allclose(d, expect, rtol=1e-6)


@pytest.mark.parametrize("order", ["forward", "reverse", 7])
def test_cooperative_grid_sync(mod, order):
    first = np.zeros(5, np.int32)
    seen = np.zeros(5 * 32, np.int32)
    mod.launch("grid_ordered", [first, seen], 5, 32, cooperative=True, order=order)
    assert (seen == 15).all()


def test_grid_sync_needs_a_cooperative_launch(mod):
    with pytest.raises(EmulatorError, match="not cooperative"):
        mod.launch("grid_ordered", [np.zeros(2, np.int32), np.zeros(64, np.int32)], 2, 32)


def _grid_run(grid, page, expected, timeout_ns=10 ** 10, order="forward", late_ns=0):
    """One launch of ``grid_barrier`` over 6 blocks of 64 threads: (state, seen, stopped)."""
    state = np.zeros(7 + cuda_helpers.STATE_WORDS, np.int32)
    first = np.zeros(6, np.int32)
    seen = np.zeros(6 * 64, np.int32)
    stopped = np.full(6 * 64, -1, np.int32)
    grid.launch("grid_barrier", [page, state, first, seen, stopped, np.int32(expected),
                                 np.int64(timeout_ns), np.int64(late_ns)], 6, 64,
                cooperative=True, order=order)
    return state, seen, stopped


@pytest.mark.parametrize("order", ["forward", "reverse", 7])
def test_our_grid_barrier_orders_every_block_and_leaves_its_words_ready(grid, order):
    """rammer_grid_sync, in place of cooperative groups: after it every block sees every block's
    store; its count is 0 again after each barrier and the generation advances, so one page serves
    run after run (the module's fault page keeps its contents between runs)."""
    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    for run in range(1, 4):
        state, seen, stopped = _grid_run(grid, page, 6, order=order)
        assert (seen == 21).all() and (stopped == 0).all()
        assert page[cuda_helpers.GRID_COUNT_WORD] == 0
        assert page[cuda_helpers.GRID_GENERATION_WORD] == run
        assert page[0] == 0 and state[6] == 0  # no fault


def test_our_grid_barrier_gives_up_with_a_fault_when_a_veu_never_arrives(grid):
    """Negative control: seven vEUs awaited in a grid of six (as if one were not resident) -> past
    the time limit (the emulator's virtual clock) every waiting vEU gives up: the call returns 1 to
    all its threads (they skip their instructions), the error word stops the others at their next
    barrier-rTask, the page records fault 2 with the kernel id, and the kernel ends."""
    from tvm_rammer.codegen import faults

    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    state, seen, stopped = _grid_run(grid, page, 7, timeout_ns=100 * 10 ** 9)
    assert (stopped == 1).all() and (seen == 0).all()
    assert state[7] == cuda_helpers.FAULT_GRID_TIMEOUT  # the error word: state[num_veus]
    assert page[cuda_helpers.GRID_GAVE_UP_WORD] == 1
    assert page[0] == cuda_helpers.FAULT_GRID_TIMEOUT and page[1] == 3
    assert "grid barrier waited" in faults.message(faults.describe(page))


def test_a_veu_that_passes_the_barrier_after_a_time_out_stops_too(grid):
    """The last block arrives after the others gave up (a vEU late past the time limit): it
    completes the barrier, but the page's gave-up word stops it as well, so no vEU runs on state
    the others never saw zeroed. Control: late by less than the limit, every vEU runs."""
    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    _, seen, stopped = _grid_run(grid, page, 6, timeout_ns=10 ** 6, late_ns=10 ** 8)
    assert (stopped == 1).all() and (seen == 0).all()
    assert page[0] == cuda_helpers.FAULT_GRID_TIMEOUT and page[cuda_helpers.GRID_COUNT_WORD] == 0
    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    _, seen, stopped = _grid_run(grid, page, 6, timeout_ns=10 ** 8, late_ns=10 ** 6)
    assert (stopped == 0).all() and (seen == 21).all() and page[0] == 0


def test_a_grid_barrier_timeout_keeps_an_earlier_fault_in_the_page(grid):
    """The page holds the first fault: a wait's record there already is not overwritten."""
    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    page[:9] = [1, 5, 2, 4, 0, 9, 3, 8, 11]  # a barrier-rTask's timeout, recorded first
    before = page[:9].copy()
    _, _, stopped = _grid_run(grid, page, 7, timeout_ns=100 * 10 ** 9)
    assert (stopped == 1).all() and (page[:9] == before).all()


def test_an_invalid_access_is_an_error_not_a_crash(mod):
    with pytest.raises(EmulatorError, match=r"segmentation fault in block 0 .* thread 5"):
        mod.launch("out_of_bounds", [np.zeros(4, np.float32)], 1, 32)
    y = np.zeros(128, np.float32)  # the module still works afterwards
    mod.launch("named_halves", [np.ones(128, np.float32), y], 1, 128)
    assert (y == 1).all()


def test_our_helpers_handshake_between_two_blocks(handshake):
    program = np.array([0, 1, 9, 3], np.int32)  # wait pair <vEU 0, step 1>; next entry 9, rTask 3
    for order in ("forward", "reverse"):  # reverse: the waiting block runs (and spins) first
        state = np.zeros(2 + cuda_helpers.STATE_WORDS, np.int32)
        page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
        data = np.zeros(128, np.float32)
        stopped = np.full(64, -1, np.int32)
        handshake.launch("handshake", [program, state, page, data, stopped, np.int32(1),
                                       np.int64(10 ** 10)], 2, 64, cooperative=True, order=order)
        assert (stopped == 0).all() and state[0] == 1 and state[2] == 0 and (page == 0).all()
        assert (data[64:] == 2 * np.arange(64) + 1).all()


def test_a_wait_past_its_virtual_time_limit_records_the_fault(handshake):
    program = np.array([0, 1, 9, 3], np.int32)
    state = np.zeros(2 + cuda_helpers.STATE_WORDS, np.int32)
    page = np.zeros(cuda_helpers.PAGE_WORDS, np.int32)
    data = np.zeros(128, np.float32)
    stopped = np.full(64, -1, np.int32)
    # a 100 s limit: reached on the emulator's virtual clock, in a fraction of a real second
    handshake.launch("handshake", [program, state, page, data, stopped, np.int32(0),
                                   np.int64(100 * 10 ** 9)], 2, 64, cooperative=True)
    assert (stopped == 1).all() and (data[64:] == 0).all()
    # state: steps, then code, vEU, instruction, awaited vEU, awaited step, reached step
    assert state.tolist() == [0, 0, 1, 1, 5, 0, 1, 0]
    # page: code, kernel id, vEU, instruction, awaited vEU, step, reached, next entry, its rTask
    assert page[:9].tolist() == [1, 7, 1, 5, 0, 1, 0, 8, 3]


def test_the_warp_collective_api():
    src = r"""
    static void lane_sum(const void* const* ins, void* const* outs, unsigned mask, const void*) {
      int s = 0;
      for (int l = 0; l < 32; ++l) if (ins[l]) s += *static_cast<const int*>(ins[l]);
      for (int l = 0; l < 32; ++l) if (outs[l]) *static_cast<int*>(outs[l]) = s * 1000 + __popc(mask);
    }
    extern "C" __global__ void collective(int* out) {
      const int v = (int)threadIdx.x;
      int r = -1;
      if (threadIdx.x % 2 == 0)
        ::rammer_emu::warp_collective(RAMMER_EMU_SITE, 0x55555555u, &v, &r, &lane_sum, nullptr);
      out[threadIdx.x] = r + (int)::rammer_emu::lane_id() * 0;
    }
    """
    out = np.zeros(64, np.int32)
    build_module(src).launch("collective", [out], 1, 64)
    even = np.arange(64) % 2 == 0
    # each warp's even lanes are one group: the sum of their thread ids, 16 lanes present
    assert (out[:32][even[:32]] == sum(range(0, 32, 2)) * 1000 + 16).all()
    assert (out[32:][even[32:]] == sum(range(32, 64, 2)) * 1000 + 16).all()
    assert (out[~even] == -1).all()


def test_a_shuffle_from_a_lane_outside_the_group_reads_nan():
    """8 lanes of a warp in a branch shuffle down by 4: lanes 4..7 read lanes 8..11, which are not
    there (undefined on the GPU): NaN here, so a result built on it shows; lanes 0..3 read defined
    lanes; with width 8, a source past the segment is the lane's own value (CUDA defines that)."""
    src = r"""
    extern "C" __global__ void partial(const float* __restrict__ x, float* __restrict__ y,
                                       float* __restrict__ z) {
      if (threadIdx.x < 8) {
        const unsigned mask = __activemask();
        y[threadIdx.x] = __shfl_down_sync(mask, x[threadIdx.x], 4, 32);
        z[threadIdx.x] = __shfl_down_sync(mask, x[threadIdx.x], 4, 8);
      }
      __syncthreads();
    }
    """
    x = np.arange(32, dtype=np.float32)
    y, z = np.zeros(8, np.float32), np.zeros(8, np.float32)
    build_module(src).launch("partial", [x, y, z], 1, 32)
    assert (y[:4] == x[4:8]).all() and np.isnan(y[4:]).all()
    assert (z == np.concatenate([x[4:8], x[4:8]])).all()


# ---------------------------------------------------------------------------- negative controls
def test_a_named_barrier_with_a_wrong_count_deadlocks_with_a_report(mod):
    with pytest.raises(EmulatorDeadlock) as info:
        mod.launch("wrong_count", [np.zeros(128, np.float32)], 1, 128)
    err = info.value
    assert "bar.sync 3, 128 (64 of 128 arrived)" in str(err)
    (row,) = err.report
    assert row["block"] == 0 and row["threads"] == (0, 63)
    assert row["what"].startswith("bar.sync 3, 128")
    line = Path(mod.source_path).read_text().splitlines()[row["line"] - 1]
    assert "wrong_count" not in line and "bar_sync(" in line  # the rewritten barrier's own line


def test_unknown_ptx_is_an_error_quoting_it():
    src = r"""
    extern "C" __global__ void odd(int* y) {
      int v;
      asm volatile("prmt.b32 %0, %1, %2, 0x3210;" : "=r"(v) : "r"(y[0]), "r"(y[1]));
      y[2] = v;
    }
    """
    with pytest.raises(EmulatorError, match=re.escape("prmt.b32 %0, %1, %2, 0x3210;")):
        build_module(src)


def test_a_compile_error_reports_stderr_source_and_command():
    src = 'extern "C" __global__ void broken(float* y) { y[0] = undeclared_name; }\n'
    with pytest.raises(EmulatorError) as info:
        build_module(src)
    text = str(info.value)
    assert "undeclared_name" in text and "was not declared" in text
    kept = re.search(r"kept source: (\S+)", text).group(1)
    assert "broken" in Path(kept).read_text()
    assert re.search(r"command: \S*(g\+\+|clang\+\+) .*-std=c\+\+17", text)


def test_source_rewriting_of_shared_declarations():
    src = ('#define uchar unsigned char\n'
           'extern "C" __global__ void k(float* y) {\n'
           '  __shared__ alignas(64) uchar pool[1024];\n'
           '  __shared__ int flag;\n'
           '  __shared__ float grid[4][8];\n'
           '  extern __shared__ __align__(16) uchar buf_dyn_shmem[];\n'
           '}\n')
    out, kernels = rewrite_source(src)
    assert kernels == ("k",)
    assert "__shared__" not in out.split("// ---- emulator entry points")[0]
    assert "uchar* pool = static_cast<uchar*>(::rammer_emu::shared_static(0, sizeof(uchar) * (1024), (64)));" in out
    assert "int& flag = *static_cast<int*>(::rammer_emu::shared_static(1, sizeof(int), alignof(int)));" in out
    assert "float (*grid)[8]" in out
    assert "uchar* buf_dyn_shmem = static_cast<uchar*>(::rammer_emu::shared_dynamic());" in out
    assert out.count("\n") >= src.count("\n")  # line numbers kept
    with pytest.raises(EmulatorError, match="no __global__"):
        rewrite_source("int x;")


def test_a_wait_that_never_ends_is_a_livelock_naming_the_wait(handshake):
    program = np.array([0, 1, 9, 3], np.int32)
    state = np.zeros(2 + cuda_helpers.STATE_WORDS, np.int32)
    args = [program, state, np.zeros(cuda_helpers.PAGE_WORDS, np.int32), np.zeros(128, np.float32),
            np.zeros(64, np.int32), np.int32(0), np.int64(10 ** 15)]  # a limit of 11 days
    with pytest.raises(EmulatorDeadlock, match="livelock") as info:
        handshake.launch("handshake", args, 2, 64, cooperative=True)
    rows = {row["threads"]: row["what"] for row in info.value.report}
    assert rows[(0, 0)].startswith("spinning (rammer_wait: vEU 1 waits for state[0] >= 1 (now 0))")
    assert rows[(1, 63)].startswith("__syncthreads")  # the rest of the vEU at the closing barrier
    assert state[2] == 0  # no fault recorded: the emulator, not the kernel, ended it


def test_shared_in_comments_and_strings_is_left_alone():
    src = ('extern "C" __global__ void k(float* y) {\n'
           '  // a __shared__ buffer would go here; it does not\n'
           '  const char* s = "__shared__ int x;";\n'
           '  __shared__ float t[4];\n'
           '}\n')
    out, _ = rewrite_source(src)
    assert "// a __shared__ buffer would go here; it does not" in out
    assert '"__shared__ int x;"' in out and "float* t = static_cast<float*>" in out
    with pytest.raises(EmulatorError, match="file-scope __shared__"):
        rewrite_source('__shared__ int g;\nextern "C" __global__ void k(int* y) { y[0] = g; }\n')
