"""AMDGPU device helpers of the persistent kernel, in C, compiled by clang-22 to amdgcn bitcode.

The same helpers as :mod:`tvm_rammer.codegen.cuda_helpers` (same names, arguments and state/page
layout), for the AMDGPU memory model instead of PTX's. TIR has no acquire/release and TVM's ROCm
codegen knows neither ``cuda_func_call`` nor ``cuda_grid_sync``, so the persistent kernel calls
these with ``call_extern`` and TVM links them in: its ROCm build asks the global function
``tvm_callback_rocm_bitcode_path`` for bitcode files to link (:mod:`tvm_rammer.rocm.build` adds
this file's bitcode to ROCm's device libraries).

Memory ordering (LLVM's AMDGPU memory model, "agent" scope = one GPU): a finishing rTask runs the
fenced workgroup barrier (:data:`BARRIER_NAME`), then its first thread publishes with an atomic
*release* store (``rammer_signal``) or release add (``rammer_count``) at agent scope; a waiting
thread polls with atomic *acquire* loads at agent scope and the barrier-rTask ends with the fenced
barrier. On gfx942 a release at agent scope is ``buffer_wbl2 sc1`` + ``s_waitcnt`` before the
store, an acquire is the load with ``sc1`` then ``s_waitcnt vmcnt(0)`` + ``buffer_inv sc1``
(gfx90a: ``buffer_wbinvl1_vol``); ``tvm_rammer.rocm.codeobject.check_ordering`` finds these in the
disassembly.

The fenced barrier (``rammer_amd_barrier``) is what HIP's ``__syncthreads`` is: a workgroup-scope
release fence, ``s_barrier``, a workgroup-scope acquire fence. TVM's own ``tvm_storage_sync
("shared")`` is a bare ``s_barrier``, which does not wait for the wave's outstanding LDS and global
operations; the persistent kernel uses ours everywhere (:mod:`tvm_rammer.rocm.dialect`).

Grid barrier (``rammer_grid_sync``): TVM's ROCm runtime has no cooperative launch, so this is a
software barrier (sense reversal) on three words of the module's fault page
(:data:`GRID_COUNT_WORD`, :data:`GRID_GENERATION_WORD`, :data:`GRID_GAVE_UP_WORD`), the one int32
buffer a module owns that keeps its contents between runs (zero when the module is loaded).
Thread 0 of each vEU reads the generation, adds 1 to the count (acq_rel); the last of the
``num_veus`` to arrive resets the count and advances the generation (release), the others poll
the generation (acquire). The count is 0
again after every barrier, so consecutive kernels of one module reuse the words. Two runs of one
module at the same time (two streams) would share them: not supported. A barrier that waits past
the time limit (vEUs not co-resident) sets the error word (the other vEUs stop at their next
barrier-rTask) and the page's gave-up word (a vEU that passes the barrier after it stops too),
records fault :data:`FAULT_GRID_TIMEOUT` in the page (unless a fault is there already) and returns
1 to the whole vEU, which then skips its instructions (the same as the CUDA helper,
``cuda_helpers.GRID_SYNC_SOURCE``).

Time: the 100 MHz "realtime" counter (``s_memrealtime``, MI200/MI300), in ns. Sleep:
``s_sleep 2`` (about 128 clocks). The hardware id recorded by the timeline is ``HW_REG_HW_ID``
(gfx9: CU, shader array, shader engine), read with ``s_getreg``.

Bitcode linkage: every helper is made ``linkonce_odr`` after compilation (as ROCm's device
libraries are; their ``prepare-builtins`` step does the same): TVM links bitcode with
"link only needed", and a module that calls none of them gets none.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile

from ..codegen.cuda_helpers import (COUNT_NAME, FAULT_GRID_TIMEOUT, GRID_COUNT_WORD,
                                    GRID_GAVE_UP_WORD, GRID_GENERATION_WORD, GRID_SYNC_NAME,
                                    RECORD_NAME, SIGNAL_NAME, STATE_WORDS, STOPPED_NAME,
                                    TIMER_NAME, WAIT_NAME)
from .toolchain import Toolchain

BARRIER_NAME = "rammer_amd_barrier"
OPAQUE_TID_NAME = "rammer_opaque_tid"
HELPER_NAMES = (SIGNAL_NAME, COUNT_NAME, WAIT_NAME, STOPPED_NAME, TIMER_NAME, RECORD_NAME,
                BARRIER_NAME, GRID_SYNC_NAME, OPAQUE_TID_NAME)
REALTIME_NS_PER_TICK = 10  # s_memrealtime runs at 100 MHz on MI200 / MI300

SOURCE = r"""
// tvm-rammer AMDGPU helpers (see tvm_rammer/rocm/helpers.py). Compiled with clang-22 for amdgcn.
#define G __attribute__((address_space(1)))
#define L __attribute__((address_space(3)))
#define AGENT __MEMORY_SCOPE_DEVICE
#define WG __MEMORY_SCOPE_WRKGRP
#define SYS __MEMORY_SCOPE_SYSTEM

static inline int ld_acquire(const G int* p) {
  return __scoped_atomic_load_n(p, __ATOMIC_ACQUIRE, AGENT);
}

static inline long now_ns(void) {
  return (long)__builtin_amdgcn_s_memrealtime() * REALTIME_NS_PER_TICK;
}

void rammer_amd_barrier(void) {
  // HIP's __syncthreads: the wave's LDS/global writes visible to the workgroup, then the barrier
  __scoped_atomic_thread_fence(__ATOMIC_RELEASE, WG);
  __builtin_amdgcn_s_barrier();
  __scoped_atomic_thread_fence(__ATOMIC_ACQUIRE, WG);
}

void rammer_signal(G int* state, int veu, int step) {
  // caller: the fenced barrier first, then thread 0 only
  __scoped_atomic_store_n(state + veu, step, __ATOMIC_RELEASE, AGENT);
}

void rammer_count(G int* state, int slot) {
  // caller: the fenced barrier first, then thread 0 only: one more rTask of the operator finished
  __scoped_atomic_fetch_add(state + slot, 1, __ATOMIC_RELEASE, AGENT);
}

static void record_fault(const G int* program, G int* state, G int* page, int kernel_id,
                         int num_veus, int veu, int pc, int next_at, int other, int slot,
                         int step) {
  int expected = 0;
  if (!__scoped_atomic_compare_exchange_n(state + num_veus, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                          __ATOMIC_RELAXED, AGENT))
    return;  // the first vEU to give up owns the record
  const int reached = ld_acquire(state + slot);
  state[num_veus + 1] = veu;
  state[num_veus + 2] = pc;
  state[num_veus + 3] = other;
  state[num_veus + 4] = step;
  state[num_veus + 5] = reached;
  if (page && ld_acquire(page) == 0) {  // the first fault keeps the page
    page[1] = kernel_id;
    page[2] = veu;
    page[3] = pc;
    page[4] = other;
    page[5] = step;
    page[6] = reached;
    page[7] = program[next_at] - 1;  // dispatch entry of the rTask this barrier guards
    page[8] = program[next_at + 1];  // its rtask_id
    __scoped_atomic_store_n(page, 1, __ATOMIC_RELEASE, SYS);  // the code word last
  }
}

void rammer_wait(const G int* program, G int* state, int first, int count, int nthreads, int tid,
                 int veu, int num_veus, int pc, int next_at, long timeout_ns, G int* page,
                 int kernel_id) {
  // barrier-rTask: thread i polls wait entries i, i + nthreads, ...; <vEU, step> waits for
  // state[vEU] >= step, <-(k+1), n> for operator counter k (after the fault record) >= n
  for (int i = tid; i < count; i += nthreads) {
    const int other = program[first + 2 * i];
    const int step = program[first + 2 * i + 1];
    const int slot = other >= 0 ? other : num_veus + RAMMER_STATE_WORDS - other - 1;
    const long start = now_ns();
    while (ld_acquire(state + slot) < step) {
      if (ld_acquire(state + num_veus) != 0) return;  // another vEU gave up: stop too
      __builtin_amdgcn_s_sleep(2);
      if (now_ns() - start > timeout_ns) {
        record_fault(program, state, page, kernel_id, num_veus, veu, pc, next_at, other, slot,
                     step);
        return;
      }
    }
  }
}

int rammer_stopped(const G int* state, int num_veus, int tid) {
  // after a barrier-rTask: the whole vEU agrees whether the kernel gave up (one LDS word)
  static L int flag __attribute__((loader_uninitialized));
  if (tid == 0) flag = ld_acquire(state + num_veus);
  rammer_amd_barrier();
  const int stop = flag;
  rammer_amd_barrier();
  return stop;
}

int rammer_grid_sync(G int* page, G int* state, int num_veus, int tid, long timeout_ns,
                     int kernel_id) {
  // software grid barrier (sense reversal) on three words of the module's fault page; 1 to the
  // whole vEU when it timed out (the vEU then skips its instructions)
  static L int flag __attribute__((loader_uninitialized));
  rammer_amd_barrier();
  if (tid == 0) {
    flag = 0;
    G int* count = page + GRID_COUNT_WORD;
    G int* generation = page + GRID_GENERATION_WORD;
    const int gen = ld_acquire(generation);
    const int arrived = __scoped_atomic_fetch_add(count, 1, __ATOMIC_ACQ_REL, AGENT);
    if (arrived == num_veus - 1) {
      __scoped_atomic_store_n(count, 0, __ATOMIC_RELEASE, AGENT);  // no relaxed atomic store
      __scoped_atomic_store_n(generation, (int)((unsigned)gen + 1u), __ATOMIC_RELEASE, AGENT);
      flag = ld_acquire(page + GRID_GAVE_UP_WORD) != 0;
    } else {
      const long start = now_ns();
      while (ld_acquire(generation) == gen) {
        __builtin_amdgcn_s_sleep(2);
        if (now_ns() - start > timeout_ns) {
          flag = 1;
          __scoped_atomic_exchange_n(page + GRID_GAVE_UP_WORD, 1, __ATOMIC_RELAXED, AGENT);
          int expected = 0;  // the error word: the other vEUs stop, no wait overwrites the record
          __scoped_atomic_compare_exchange_n(state + num_veus, &expected, FAULT_GRID_TIMEOUT, 0,
                                             __ATOMIC_ACQ_REL, __ATOMIC_RELAXED, AGENT);
          if (ld_acquire(page) == 0) {  // the first fault keeps the page
            page[1] = kernel_id;
            __scoped_atomic_store_n(page, FAULT_GRID_TIMEOUT, __ATOMIC_RELEASE, SYS);
          }
          break;
        }
      }
      if (!flag) flag = ld_acquire(page + GRID_GAVE_UP_WORD) != 0;
    }
  }
  rammer_amd_barrier();
  const int stop = flag;
  rammer_amd_barrier();
  return stop;
}

long rammer_globaltimer(void) { return now_ns(); }

int rammer_opaque_tid(int tid) {
  // the thread index, opaque to the optimizer: an rTask body's thread-derived values cannot be
  // hoisted out of the vEU's instruction loop (kept live across every body, they cost hundreds
  // of VGPRs); the empty volatile asm is not moved out of the loop
  __asm__ volatile("" : "+v"(tid));
  return tid;
}

void rammer_record(G long* timeline, int index, long start) {
  // caller: thread 0, after the instruction's barrier, before it publishes its step
  const long end = now_ns();
  const int hw_id = __builtin_amdgcn_s_getreg(HW_ID_GETREG);
  G long* slot = timeline + 3 * (long)index;
  slot[0] = start;
  slot[1] = end;
  slot[2] = (long)((hw_id >> 8) & 0xff);  // CU id, shader array, shader engine (HW_ID[15:8])
}
"""
# s_getreg immediate: register HW_ID (4), offset 0, 32 bits (size - 1 = 31 in bits 15:11)
_HW_ID_GETREG = 4 | (0 << 6) | (31 << 11)
_DEFINES = {"RAMMER_STATE_WORDS": STATE_WORDS, "GRID_COUNT_WORD": GRID_COUNT_WORD,
            "GRID_GAVE_UP_WORD": GRID_GAVE_UP_WORD,
            "GRID_GENERATION_WORD": GRID_GENERATION_WORD, "FAULT_GRID_TIMEOUT": FAULT_GRID_TIMEOUT,
            "REALTIME_NS_PER_TICK": REALTIME_NS_PER_TICK, "HW_ID_GETREG": _HW_ID_GETREG}
_DEFINE_RE = re.compile(r"^define (?:(?:dso_local|hidden|internal|weak|linkonce_odr) )*", re.M)


def source(**overrides) -> str:
    """The C source with its constants filled in (``overrides`` replace some, for tests)."""
    values = {**_DEFINES, **overrides}
    return "".join(f"#define {k} {v}\n" for k, v in values.items()) + SOURCE


def _linkonce_odr(ir_text: str) -> str:
    """Every function definition of ``ir_text`` made ``linkonce_odr`` (static ones included: TVM
    inlines all linked functions)."""
    return _DEFINE_RE.sub("define linkonce_odr ", ir_text)


def compile_bitcode(toolchain: Toolchain, mcpu: str, out_dir: str | None = None,
                    src: str | None = None) -> str:
    """Path of the helpers' bitcode for ``mcpu`` (``gfx942``...), compiled once per source, mcpu
    and clang (cached under ``out_dir``, default ``$XDG_CACHE_HOME/tvm-rammer/rocm``).

    ``src`` replaces the C source (tests compile deliberately broken helpers). Raises
    RuntimeError with clang's message and the command when compilation fails."""
    text = source() if src is None else src
    key = hashlib.sha256(f"{text}\0{mcpu}\0{toolchain.clang}".encode()).hexdigest()[:16]
    out_dir = out_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tvm-rammer", "rocm")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rammer_helpers_{mcpu}_{key}.bc")
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        c_file, ll_file = os.path.join(tmp, "helpers.c"), os.path.join(tmp, "helpers.ll")
        with open(c_file, "w", encoding="utf-8") as f:
            f.write(text)
        cmd = [toolchain.clang, "-x", "c", "-std=c11", "-target", "amdgcn-amd-amdhsa",
               f"-mcpu={mcpu}", "-O2", "-nogpulib", "-fno-builtin", "-S", "-emit-llvm",
               c_file, "-o", ll_file]
        _run(cmd)
        with open(ll_file, encoding="utf-8") as f:
            ir_text = _linkonce_odr(f.read())
        with open(ll_file, "w", encoding="utf-8") as f:
            f.write(ir_text)
        part = path + f".{os.getpid()}.part"
        _run([toolchain.llvm_as, ll_file, "-o", part])
        os.replace(part, path)  # atomic: concurrent builds never see half a file
    return path


def _run(cmd: list) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}\ncommand: {' '.join(cmd)}")
