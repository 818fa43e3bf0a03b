// rammer_emu_runtime.h: the CPU emulator's execution engine (tvm-rammer issue 23).
//
// One OS thread runs a whole launch. Every CUDA thread is a fiber (its own stack, a guard page below
// it while the number of fibers allows, a canary word otherwise) switched by a small x86-64 routine
// (ucontext elsewhere). A fiber runs until it reaches a synchronisation point (a block barrier, a
// named barrier, a warp collective, a grid sync, a spin yield such as __nanosleep, or its end); the
// scheduler then runs the next fiber, so a launch is deterministic. Scheduling is by block: a FIFO of
// blocks, each with a FIFO of its runnable fibers; a block's turn runs its fibers (and those a
// barrier of the block releases meanwhile) until every one is parked, exited or spinning, so a
// block's stacks stay in the caches while it works through its barriers; a spinning fiber waits for
// the block's next turn.
//
// * Non-cooperative launch: blocks run one after another in the launch's block order.
//   Cooperative launch: every block is live at once, the block FIFO starts in block order.
// * Block barriers: 16 ids per block. `count == 0` (__syncthreads, bar.sync id) completes when every
//   thread of the block that has not exited arrived; `count > 0` (bar.sync id, n) when n threads arrived.
// * Warp collectives: lanes arriving at the same SITE (any pointer unique to a call site; the CUDA
//   surface uses RAMMER_EMU_SITE, the address of a static object per source call site) are grouped;
//   the groups of a warp resolve once no lane of that warp can still arrive (every lane is parked
//   somewhere or has exited); the collective's function runs once per group (warp_collective()).
// * Virtual time (%globaltimer, clock64): +ROUND_NS per scheduling round (every queued block had a turn)
//   and +1 ns per read, so every read returns a strictly larger value than the read before it;
//   a round in which only spinning fibers ran and nothing progressed jumps the clock ahead (doubling,
//   from 1 us up to 64 s), so time-bounded spin waits reach their timeout quickly and deterministically.
// * Deadlock: no block has a runnable fiber while fibers are parked, or only spinning fibers remain and the clock
//   jumped more than SPIN_LIMIT_NS without progress: the launch ends with a report of where every
//   waiting thread waits. A wall-clock limit ends a launch the same way (a watchdog thread interrupts
//   a fiber that never yields). SIGSEGV/SIGBUS/SIGFPE inside a fiber end the launch with an error
//   naming the thread instead of killing the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csetjmp>
#include <csignal>
#include <ctime>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
// the fibers' context switch: a few instructions of x86-64 assembly, or ucontext elsewhere (and
// with -DRAMMER_EMU_UCONTEXT, to test that path)
#if defined(__x86_64__) && !defined(RAMMER_EMU_UCONTEXT)
#define RAMMER_EMU_ASM_SWITCH 1
#else
#define RAMMER_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

#define RAMMER_EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace rammer_emu {

struct uint3_t { unsigned int x, y, z; };

using CollectiveFn = void (*)(const void* const* ins, void* const* outs, unsigned mask, const void* ctx);

enum : int { ST_RUNNABLE = 0, ST_BARRIER, ST_ARRIVE, ST_COLLECTIVE, ST_GRID, ST_SPIN, ST_DONE, ST_STUCK };
enum : int { RC_OK = 0, RC_DEADLOCK = 1, RC_ERROR = 2, RC_UNKNOWN_KERNEL = 3 };

constexpr int NUM_BARRIERS = 16;
constexpr int MAX_SHARED_SITES = 64;   // distinct __shared__ declarations one block reaches
constexpr uint64_t ROUND_NS = 100;                 // virtual ns per scheduling round
constexpr uint64_t SPIN_LIMIT_NS = 600ull * 1000000000ull;  // idle spinning before "deadlock"
constexpr size_t SHARED_CAPACITY = 232448;          // 227 KiB: H100's per-block maximum
constexpr size_t ARENA_STRIDE = 256 * 1024;

struct LaunchConfig {            // filled by build.py (ctypes); keep in sync with _LaunchConfig
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t dyn_smem;
  int32_t cooperative;
  const uint32_t* order;         // num_blocks linear block ids (nullptr: forward)
  double wall_limit_s;
  uint64_t stack_bytes;
};

struct Block;

struct Fiber {
  void* sp;
#if !RAMMER_EMU_ASM_SWITCH
  ucontext_t uc;
#endif
  Block* block;
  uint3_t tidx;
  unsigned linear, lane, warp;
  int state;
  // barrier
  int bar_id, bar_count, bar_line, pred;
  int res_or, res_and, res_count;
  // warp collective
  const void* site;
  unsigned cmask;
  const void* cin;
  void* cout;
  CollectiveFn cfn;
  const void* cctx;
  int cline;
  // spin
  const char* spin_what;
  long long spin_args[4];
  bool spin_fmt;
  int spin_line;
  int grid_line;
  char* stack_lo;
};

struct Barrier { int arrived, count, line, acc_or, acc_and, acc_count; };

struct Warp { unsigned nlanes, blocked, pending; };

struct Block {
  uint3_t bidx;
  unsigned linear;
  Fiber* fibers;
  Warp* warps;
  unsigned exited;
  Barrier bars[NUM_BARRIERS];
  unsigned char* smem;
  size_t smem_used;
  Fiber** rq; unsigned rq_head, rq_size;   // runnable fibers of the block
  Fiber** deferred; unsigned ndeferred;   // spinning fibers waiting for the block's next turn
  bool queued;                            // in the block FIFO or having its turn
  int site_key[MAX_SHARED_SITES];        // declaration ids (build.py numbers them), -1 = free
  int64_t site_off[MAX_SHARED_SITES];
};

struct Launch {
  uint3_t gdim, bdim;
  unsigned threads_per_block, warps_per_block, num_blocks;
  uint32_t dyn_smem;
  bool cooperative;
  // live set
  Block* blocks; unsigned nblocks_live;
  Block** bq; size_t bq_cap, bq_head, bq_size;  // the block FIFO
  unsigned long long live, total_threads, exited_total, grid_arrived;
  // fibers
  char* stacks; size_t stack_bytes, stacks_len; bool guards; size_t nstacks;
  unsigned char* arenas; size_t arenas_len;
  void* sched_sp;
#if !RAMMER_EMU_ASM_SWITCH
  ucontext_t sched_uc;
#endif
  void (*run)(void*); void* run_ctx;
  // time
  uint64_t vclock, idle_ns, jump_ns;
  size_t round_left; bool progress;
  unsigned long long resumes, spins, rounds, fibers_started;
  double wall_limit_s; struct timespec t0;
  // result
  int rc; std::string report;
  sigjmp_buf recover; volatile sig_atomic_t in_fiber;
  volatile int sig; void* sig_addr;
};

inline Launch g_launch;
inline Fiber* g_cur = nullptr;

[[noreturn]] void fail(const std::string& msg);

// ---------------------------------------------------------------------------- context switching
#if RAMMER_EMU_ASM_SWITCH
extern "C" void rammer_emu_switch(void** save_sp, void* load_sp);
extern "C" void rammer_emu_trampoline();
asm(R"(
  .text
  .p2align 4
  .globl rammer_emu_switch
  .hidden rammer_emu_switch
  .type rammer_emu_switch,@function
rammer_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rammer_emu_switch, .-rammer_emu_switch
  .p2align 4
  .globl rammer_emu_trampoline
  .hidden rammer_emu_trampoline
  .type rammer_emu_trampoline,@function
rammer_emu_trampoline:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size rammer_emu_trampoline, .-rammer_emu_trampoline
)");
#endif

void fiber_main(Fiber* f);

inline void fiber_prepare(Fiber* f, char* lo, size_t bytes) {
  f->stack_lo = lo;
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + bytes) & ~uintptr_t(15);
#if RAMMER_EMU_ASM_SWITCH
  // the frame rammer_emu_switch pops: r15, r14, r13, r12 (entry), rbx (argument), rbp, return
  // address (the trampoline, entered with rsp 16-byte aligned as a call expects it)
  uint64_t* s = reinterpret_cast<uint64_t*>(top);
  s[-1] = reinterpret_cast<uint64_t>(&rammer_emu_trampoline);
  s[-2] = 0;
  s[-3] = reinterpret_cast<uint64_t>(f);
  s[-4] = reinterpret_cast<uint64_t>(&fiber_main);
  s[-5] = 0; s[-6] = 0; s[-7] = 0;
  f->sp = &s[-7];
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = lo;
  f->uc.uc_stack.ss_size = top - reinterpret_cast<uintptr_t>(lo);
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, reinterpret_cast<void (*)()>(&fiber_main), 1, f);
#endif
}

inline void switch_to_fiber(Fiber* f) {
  g_cur = f;
  g_launch.in_fiber = 1;
#if RAMMER_EMU_ASM_SWITCH
  rammer_emu_switch(&g_launch.sched_sp, f->sp);
#else
  swapcontext(&g_launch.sched_uc, &f->uc);
#endif
  g_launch.in_fiber = 0;
}

inline void switch_to_scheduler(Fiber* f) {
#if RAMMER_EMU_ASM_SWITCH
  rammer_emu_switch(&f->sp, g_launch.sched_sp);
#else
  swapcontext(&f->uc, &g_launch.sched_uc);
#endif
}

inline constexpr uint64_t CANARY = 0x52414d4d4552454dull;

// ---------------------------------------------------------------------------- fiber-side API
inline Fiber* cur() { return g_cur; }
inline void note_progress() { g_launch.progress = true; }
// Every read is strictly later than the one before (+1 ns on top of the round clock; one OS thread runs
// the launch, so the order of reads is deterministic): an instrumented rTask's start and end differ.
inline uint64_t globaltimer() { return ++g_launch.vclock; }
inline unsigned lane_id() { return g_cur->lane; }
inline unsigned char* shared_base() { return g_cur->block->smem; }
inline void* shared_ptr(uint32_t offset) { return g_cur->block->smem + offset; }
inline uint32_t shared_offset(const void* p) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - g_cur->block->smem);
}

// A block barrier: id 0..15; count 0 = every non-exited thread of the block.
inline void bar_wait(int id, int count, int line, int pred) {
  Fiber* f = g_cur;
  if (id < 0 || id >= NUM_BARRIERS) fail("barrier id " + std::to_string(id) + " outside 0..15 (line " + std::to_string(line) + ")");
  if (count < 0 || (count > 0 && count % 32 != 0))
    fail("bar.sync " + std::to_string(id) + ", " + std::to_string(count) + ": the thread count must be a positive multiple of 32 (line " + std::to_string(line) + ")");
  f->state = ST_BARRIER; f->bar_id = id; f->bar_count = count; f->bar_line = line; f->pred = pred != 0;
  switch_to_scheduler(f);
}
inline void bar_sync(int id, int count, int line) { bar_wait(id, count, line, 0); }
inline void bar_arrive(int id, int count, int line) {
  Fiber* f = g_cur;
  if (id < 0 || id >= NUM_BARRIERS) fail("barrier id " + std::to_string(id) + " outside 0..15");
  f->state = ST_ARRIVE; f->bar_id = id; f->bar_count = count; f->bar_line = line; f->pred = 0;
  switch_to_scheduler(f);
}
inline void syncthreads(int line) { bar_wait(0, 0, line, 0); }
inline int syncthreads_or(int p, int line) { bar_wait(0, 0, line, p); return g_cur->res_or; }
inline int syncthreads_and(int p, int line) { bar_wait(0, 0, line, p); return g_cur->res_and; }
inline int syncthreads_count(int p, int line) { bar_wait(0, 0, line, p); return g_cur->res_count; }

inline void grid_sync(int line) {
  Fiber* f = g_cur;
  if (!g_launch.cooperative) fail("grid sync (cooperative_groups::this_grid().sync()) in a launch that is not cooperative (line " + std::to_string(line) + ")");
  f->state = ST_GRID; f->grid_line = line;
  switch_to_scheduler(f);
}

// A spin wait's yield (e.g. __nanosleep in a polling loop): the fiber waits for its block's next turn.
inline void spin_yield(const char* what, int line) {
  Fiber* f = g_cur;
  f->state = ST_SPIN; f->spin_what = what; f->spin_line = line; f->spin_fmt = false;
  switch_to_scheduler(f);
}
// The same with a description for reports: `fmt` is a printf format taking four long longs.
inline void spin_yield_for(const char* fmt, long long a, long long b, long long c, long long d, int line) {
  Fiber* f = g_cur;
  f->state = ST_SPIN; f->spin_what = fmt; f->spin_line = line; f->spin_fmt = true;
  f->spin_args[0] = a; f->spin_args[1] = b; f->spin_args[2] = c; f->spin_args[3] = d;
  switch_to_scheduler(f);
}

// Warp collective (EMU_DESIGN.md): every participating lane of the caller's warp calls this at the
// same `site`; when the group is complete, `fn` runs once (in the scheduler) with ins[l]/outs[l] =
// lane l's pointers (nullptr for absent lanes) and the mask of the lanes present. `mask` is what
// the lanes asked for (a lane named in it that waits elsewhere, not exited, is an error).
inline void warp_collective_at(const void* site, unsigned mask, const void* in, void* out,
                               CollectiveFn fn, const void* ctx, int line) {
  Fiber* f = g_cur;
  f->state = ST_COLLECTIVE; f->site = site; f->cmask = mask; f->cin = in; f->cout = out;
  f->cfn = fn; f->cctx = ctx; f->cline = line;
  switch_to_scheduler(f);
}
inline void warp_collective(const void* site, unsigned mask, const void* in, void* out,
                            CollectiveFn fn, const void* ctx) {
  warp_collective_at(site, mask, in, out, fn, ctx, 0);
}

// Shared memory declared in the kernel (build.py rewrites `__shared__ T x[n];` into this): the
// first thread of the block to reach declaration `site` places it; every thread gets the same
// address. Fresh memory is filled with 0xff (NaN / -1) so reads of unwritten shared memory show.
inline void* shared_static(int site, size_t bytes, size_t align) {
  Block* b = g_cur->block;
  int slot = site % MAX_SHARED_SITES;
  for (int probe = 0; b->site_key[slot] != site; ++probe, slot = (slot + 1) % MAX_SHARED_SITES) {
    if (b->site_key[slot] < 0) { b->site_key[slot] = site; b->site_off[slot] = -1; break; }
    if (probe == MAX_SHARED_SITES) fail("a block reached more than 64 distinct __shared__ declarations");
  }
  site = slot;
  if (b->site_off[site] < 0) {
    if (align < 16) align = 16;
    size_t off = (b->smem_used + align - 1) & ~(align - 1);
    if (off + bytes > SHARED_CAPACITY)
      fail("shared memory of block exceeds " + std::to_string(SHARED_CAPACITY) + " bytes (dynamic " +
           std::to_string(g_launch.dyn_smem) + " + static " + std::to_string(off + bytes - g_launch.dyn_smem) + ")");
    memset(b->smem + off, 0xff, bytes);
    b->site_off[site] = static_cast<int64_t>(off);
    b->smem_used = off + bytes;
  }
  return b->smem + b->site_off[site];
}
inline void* shared_dynamic() { return g_cur->block->smem; }

[[noreturn]] inline void trap(const char* what, int line) {
  Fiber* f = g_cur;
  fail(std::string(what) + " in block " + std::to_string(f->block->linear) + " thread " +
       std::to_string(f->linear) + " (line " + std::to_string(line) + ")");
}

// ---------------------------------------------------------------------------- scheduler
inline void push_block(Block* b) {
  Launch& L = g_launch;
  L.bq[(L.bq_head + L.bq_size) % L.bq_cap] = b;
  ++L.bq_size;
}
inline Block* pop_block() {
  Launch& L = g_launch;
  Block* b = L.bq[L.bq_head];
  L.bq_head = (L.bq_head + 1) % L.bq_cap;
  --L.bq_size;
  return b;
}
inline void push(Fiber* f) {
  Block* b = f->block;
  const unsigned n = g_launch.threads_per_block;
  b->rq[(b->rq_head + b->rq_size) % n] = f;
  ++b->rq_size;
  if (!b->queued) { b->queued = true; push_block(b); }
}
inline Fiber* pop(Block* b) {
  Fiber* f = b->rq[b->rq_head];
  b->rq_head = (b->rq_head + 1) % g_launch.threads_per_block;
  --b->rq_size;
  return f;
}

inline std::string where_of(const Fiber* f);

struct Abort { int rc; };

inline void sched_fail(int rc, const std::string& msg) {
  g_launch.rc = rc;
  g_launch.report = msg;
  throw Abort{rc};
}

// fiber-side failure: the report is set, the fiber never resumes
[[noreturn]] inline void fail(const std::string& msg) {
  Launch& L = g_launch;
  L.rc = RC_ERROR;
  L.report = msg;
  if (L.in_fiber) {
    L.in_fiber = 0;
    siglongjmp(L.recover, 1);
  }
  throw Abort{RC_ERROR};
}

inline void release(Fiber* f) {
  f->state = ST_RUNNABLE;
  --f->block->warps[f->warp].blocked;
  push(f);
}

inline void resolve_warp(Block* b, unsigned w) {
  Warp& wp = b->warps[w];
  if (!wp.pending || wp.blocked < wp.nlanes) return;
  Fiber* lanes = b->fibers + w * 32;
  bool done[32] = {false};
  for (unsigned l = 0; l < wp.nlanes; ++l) {
    if (lanes[l].state != ST_COLLECTIVE || done[l]) continue;
    const void* site = lanes[l].site;
    const void* ins[32] = {nullptr};
    void* outs[32] = {nullptr};
    unsigned present = 0, asked = 0;
    for (unsigned m = l; m < wp.nlanes; ++m) {
      Fiber& g = lanes[m];
      if (g.state == ST_COLLECTIVE && !done[m] && g.site == site) {
        present |= 1u << m; asked |= g.cmask; ins[m] = g.cin; outs[m] = g.cout; done[m] = true;
      }
    }
    for (unsigned m = 0; m < wp.nlanes; ++m) {
      if ((asked >> m & 1u) && !(present >> m & 1u) && lanes[m].state != ST_DONE) {
        char buf[160];
        snprintf(buf, sizeof buf, "warp collective at line %d: mask 0x%08x names lane %u of warp %u (block %u), which waits elsewhere: ",
                 lanes[l].cline, asked, m, w, b->linear);
        sched_fail(RC_ERROR, std::string(buf) + where_of(&lanes[m]));
      }
    }
    lanes[l].cfn(ins, outs, present, lanes[l].cctx);
    for (unsigned m = l; m < wp.nlanes; ++m) {
      if (present >> m & 1u) { --wp.pending; release(&lanes[m]); }
    }
  }
}

inline void check_barrier(Block* b, int id) {
  Barrier& br = b->bars[id];
  if (br.arrived == 0) return;
  unsigned need = br.count > 0 ? unsigned(br.count) : g_launch.threads_per_block - b->exited;
  if (unsigned(br.arrived) < need) return;
  int r_or = br.acc_or, r_and = br.acc_and, r_count = br.acc_count;
  br.arrived = 0; br.count = 0; br.acc_or = 0; br.acc_and = 1; br.acc_count = 0;
  for (unsigned t = 0; t < g_launch.threads_per_block; ++t) {
    Fiber& f = b->fibers[t];
    if (f.state == ST_BARRIER && f.bar_id == id) {
      f.res_or = r_or; f.res_and = r_and; f.res_count = r_count;
      release(&f);
    }
  }
}

inline void check_grid() {
  Launch& L = g_launch;
  if (!L.grid_arrived || L.grid_arrived + L.exited_total < L.total_threads) return;
  L.grid_arrived = 0;
  for (unsigned i = 0; i < L.nblocks_live; ++i) {
    Block* b = &L.blocks[i];
    for (unsigned t = 0; t < L.threads_per_block; ++t)
      if (b->fibers[t].state == ST_GRID) release(&b->fibers[t]);
  }
}

inline void after_yield(Fiber* f) {
  Launch& L = g_launch;
  Block* b = f->block;
  Warp& w = b->warps[f->warp];
  if (f->stack_lo && !L.guards && *reinterpret_cast<uint64_t*>(f->stack_lo) != CANARY)
    sched_fail(RC_ERROR, "stack overflow in block " + std::to_string(b->linear) + " thread " + std::to_string(f->linear) +
               " (stack of " + std::to_string(L.stack_bytes) + " bytes; build.py launch(stack_bytes=...))");
  switch (f->state) {
    case ST_SPIN:
      ++L.spins;
      b->deferred[b->ndeferred++] = f;
      return;
    case ST_DONE:
      L.progress = true;
      ++b->exited; ++L.exited_total; --L.live; ++w.blocked;
      for (int id = 0; id < NUM_BARRIERS; ++id)
        if (b->bars[id].arrived && b->bars[id].count == 0) check_barrier(b, id);
      check_grid();
      resolve_warp(b, f->warp);
      return;
    case ST_BARRIER:
    case ST_ARRIVE: {
      L.progress = true;
      Barrier& br = b->bars[f->bar_id];
      if (br.arrived == 0) { br.count = f->bar_count; br.line = f->bar_line; br.acc_or = 0; br.acc_and = 1; br.acc_count = 0; }
      else if (br.count != f->bar_count)
        sched_fail(RC_ERROR, "barrier " + std::to_string(f->bar_id) + " in block " + std::to_string(b->linear) + ": thread " +
                   std::to_string(f->linear) + " (line " + std::to_string(f->bar_line) + ") arrives with thread count " +
                   std::to_string(f->bar_count) + ", an earlier thread (line " + std::to_string(br.line) + ") with " +
                   std::to_string(br.count) + " (0 = whole block)");
      ++br.arrived; br.acc_or |= f->pred; br.acc_and &= f->pred; br.acc_count += f->pred;
      if (f->state == ST_ARRIVE) { f->state = ST_RUNNABLE; push(f); check_barrier(b, f->bar_id); return; }
      ++w.blocked;
      check_barrier(b, f->bar_id);
      resolve_warp(b, f->warp);
      return;
    }
    case ST_COLLECTIVE:
      L.progress = true;
      ++w.blocked; ++w.pending;
      resolve_warp(b, f->warp);
      return;
    case ST_GRID:
      L.progress = true;
      ++w.blocked; ++L.grid_arrived;
      check_grid();
      resolve_warp(b, f->warp);
      return;
    default:
      sched_fail(RC_ERROR, "internal: fiber yielded in state " + std::to_string(f->state));
  }
}

inline void fiber_main(Fiber* f) {
  g_launch.run(g_launch.run_ctx);
  f->state = ST_DONE;
  switch_to_scheduler(f);
  __builtin_trap();
}

// ---------------------------------------------------------------------------- reports
inline std::string where_of(const Fiber* f) {
  char buf[256];
  switch (f->state) {
    case ST_BARRIER: {
      const Barrier& br = f->block->bars[f->bar_id];
      if (f->bar_count > 0)
        snprintf(buf, sizeof buf, "bar.sync %d, %d (%d of %d arrived) at line %d", f->bar_id, f->bar_count, br.arrived, f->bar_count, f->bar_line);
      else if (f->bar_id == 0)
        snprintf(buf, sizeof buf, "__syncthreads (barrier 0, %d of %u arrived) at line %d", br.arrived,
                 g_launch.threads_per_block - f->block->exited, f->bar_line);
      else
        snprintf(buf, sizeof buf, "bar.sync %d (whole block, %d of %u arrived) at line %d", f->bar_id, br.arrived,
                 g_launch.threads_per_block - f->block->exited, f->bar_line);
      break;
    }
    case ST_COLLECTIVE: snprintf(buf, sizeof buf, "warp collective at line %d", f->cline); break;
    case ST_GRID:
      snprintf(buf, sizeof buf, "grid sync (%llu of %llu threads arrived) at line %d", g_launch.grid_arrived,
               g_launch.total_threads - g_launch.exited_total, f->grid_line);
      break;
    case ST_SPIN: {
      char what[160];
      if (f->spin_fmt) snprintf(what, sizeof what, f->spin_what, f->spin_args[0], f->spin_args[1], f->spin_args[2], f->spin_args[3]);
      else snprintf(what, sizeof what, "%s", f->spin_what ? f->spin_what : "spin");
      snprintf(buf, sizeof buf, "spinning (%s) at line %d", what, f->spin_line);
      break;
    }
    case ST_RUNNABLE: snprintf(buf, sizeof buf, "runnable"); break;
    case ST_DONE: snprintf(buf, sizeof buf, "exited"); break;
    case ST_STUCK: snprintf(buf, sizeof buf, "running without reaching a synchronisation point"); break;
    default: snprintf(buf, sizeof buf, "state %d", f->state);
  }
  return buf;
}

// One line per run of consecutive threads of a block waiting at the same place:
// "block=B threads=T0-T1 what=... "
inline std::string waiting_report() {
  Launch& L = g_launch;
  std::string out;
  int lines = 0, dropped = 0;
  for (unsigned i = 0; i < L.nblocks_live; ++i) {
    Block* b = &L.blocks[i];
    unsigned t = 0;
    while (t < L.threads_per_block) {
      Fiber* f = &b->fibers[t];
      if (f->state == ST_DONE) { ++t; continue; }
      std::string what = where_of(f);
      unsigned e = t + 1;
      while (e < L.threads_per_block && b->fibers[e].state != ST_DONE && where_of(&b->fibers[e]) == what) ++e;
      if (lines < 400) {
        char buf[96];
        if (e - t == 1) snprintf(buf, sizeof buf, "block=%u (%u,%u,%u) threads=%u ", b->linear, b->bidx.x, b->bidx.y, b->bidx.z, t);
        else snprintf(buf, sizeof buf, "block=%u (%u,%u,%u) threads=%u-%u ", b->linear, b->bidx.x, b->bidx.y, b->bidx.z, t, e - 1);
        out += buf; out += "what="; out += what; out += "\n";
        ++lines;
      } else {
        ++dropped;
      }
      t = e;
    }
  }
  if (dropped) out += "... " + std::to_string(dropped) + " more groups of waiting threads\n";
  return out;
}

// ---------------------------------------------------------------------------- signals, watchdog
inline struct sigaction g_old_segv, g_old_bus, g_old_fpe, g_old_wd;
inline stack_t g_old_altstack;
inline void* g_altstack_mem = nullptr;
inline int g_wd_signal = 0;
inline pthread_t g_launch_thread;

inline void on_signal(int sig, siginfo_t* info, void*) {
  Launch& L = g_launch;
  if (sig == g_wd_signal) {
    if (L.in_fiber) { L.in_fiber = 0; L.sig = sig; siglongjmp(L.recover, 2); }
    return;  // in the scheduler: it checks the wall clock itself
  }
  if (L.in_fiber) {
    L.in_fiber = 0;
    L.sig = sig;
    L.sig_addr = info ? info->si_addr : nullptr;
    siglongjmp(L.recover, 3);
  }
  // not ours: restore the previous handler and let the fault happen again
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : &g_old_fpe;
  sigaction(sig, old, nullptr);
}

struct Watchdog {
  pthread_t th{};
  pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t cv;
  bool done = false, started = false;
  double seconds = 0;
  static void* main(void* p) {
    Watchdog* w = static_cast<Watchdog*>(p);
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    double s = w->seconds + 1.0;
    dl.tv_sec += time_t(s);
    dl.tv_nsec += long((s - double(time_t(s))) * 1e9);
    if (dl.tv_nsec >= 1000000000L) { dl.tv_sec += 1; dl.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&w->mu);
    while (!w->done) {
      if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) != 0) {
        if (!w->done) pthread_kill(g_launch_thread, g_wd_signal);
        // keep poking every second until the launch ends
        dl.tv_sec += 1;
      }
    }
    pthread_mutex_unlock(&w->mu);
    return nullptr;
  }
  void start(double s) {
    seconds = s;
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&cv, &a);
    pthread_condattr_destroy(&a);
    started = pthread_create(&th, nullptr, &Watchdog::main, this) == 0;
  }
  void stop() {
    if (!started) return;
    pthread_mutex_lock(&mu);
    done = true;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(th, nullptr);
    pthread_cond_destroy(&cv);
  }
};

inline void install_signals() {
  g_wd_signal = SIGRTMIN + 7;
  g_launch_thread = pthread_self();
  const size_t alt = 256 * 1024;
  if (!g_altstack_mem) g_altstack_mem = malloc(alt);
  stack_t ss{};
  ss.ss_sp = g_altstack_mem; ss.ss_size = alt; ss.ss_flags = 0;
  sigaltstack(&ss, &g_old_altstack);
  struct sigaction sa{};
  sa.sa_sigaction = &on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGFPE, &sa, &g_old_fpe);
  sigaction(g_wd_signal, &sa, &g_old_wd);
}
inline void restore_signals() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaction(SIGFPE, &g_old_fpe, nullptr);
  sigaction(g_wd_signal, &g_old_wd, nullptr);
  sigaltstack(&g_old_altstack, nullptr);
}

inline double wall_elapsed() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec - g_launch.t0.tv_sec) + 1e-9 * double(t.tv_nsec - g_launch.t0.tv_nsec);
}

// ---------------------------------------------------------------------------- memory
inline void free_memory() {
  Launch& L = g_launch;
  if (L.stacks) munmap(L.stacks, L.stacks_len);
  if (L.arenas) munmap(L.arenas, L.arenas_len);
  if (L.blocks) {
    for (unsigned i = 0; i < L.nblocks_live; ++i) {
      free(L.blocks[i].fibers); free(L.blocks[i].warps); free(L.blocks[i].rq); free(L.blocks[i].deferred);
    }
    free(L.blocks);
  }
  free(L.bq);
  L.stacks = nullptr; L.arenas = nullptr; L.blocks = nullptr; L.bq = nullptr;
}

inline void alloc_live(unsigned nblocks) {
  Launch& L = g_launch;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  L.nstacks = size_t(nblocks) * L.threads_per_block;
  L.stack_bytes = (L.stack_bytes + page - 1) / page * page;
  L.guards = L.nstacks <= 8192;
  const size_t per = L.stack_bytes + (L.guards ? page : 0);
  L.stacks_len = per * L.nstacks;
  void* m = mmap(nullptr, L.stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) { L.stacks = nullptr; sched_fail(RC_ERROR, "cannot map " + std::to_string(L.stacks_len >> 20) + " MiB of fiber stacks"); }
  L.stacks = static_cast<char*>(m);
  L.arenas_len = ARENA_STRIDE * nblocks;
  m = mmap(nullptr, L.arenas_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) { L.arenas = nullptr; sched_fail(RC_ERROR, "cannot map shared-memory arenas"); }
  L.arenas = static_cast<unsigned char*>(m);
  L.blocks = static_cast<Block*>(calloc(nblocks, sizeof(Block)));
  L.nblocks_live = nblocks;
  L.bq_cap = nblocks;
  L.bq = static_cast<Block**>(malloc(sizeof(Block*) * L.bq_cap));
  for (unsigned i = 0; i < nblocks; ++i) {
    Block* b = &L.blocks[i];
    b->fibers = static_cast<Fiber*>(calloc(L.threads_per_block, sizeof(Fiber)));
    b->warps = static_cast<Warp*>(calloc(L.warps_per_block, sizeof(Warp)));
    b->rq = static_cast<Fiber**>(malloc(sizeof(Fiber*) * L.threads_per_block));
    b->deferred = static_cast<Fiber**>(malloc(sizeof(Fiber*) * L.threads_per_block));
    b->smem = L.arenas + ARENA_STRIDE * i;
    for (unsigned t = 0; t < L.threads_per_block; ++t) {
      char* lo = L.stacks + per * (size_t(i) * L.threads_per_block + t);
      if (L.guards) { mprotect(lo, page, PROT_NONE); lo += page; }
      b->fibers[t].stack_lo = lo;
    }
  }
}

// (Re)start block slot i as block `linear`.
inline void start_block(unsigned i, unsigned linear) {
  Launch& L = g_launch;
  Block* b = &L.blocks[i];
  b->linear = linear;
  b->bidx = {linear % L.gdim.x, (linear / L.gdim.x) % L.gdim.y, linear / (L.gdim.x * L.gdim.y)};
  b->exited = 0;
  b->rq_head = 0; b->rq_size = 0; b->ndeferred = 0; b->queued = false;
  for (int k = 0; k < NUM_BARRIERS; ++k) b->bars[k] = Barrier{0, 0, 0, 0, 1, 0};
  for (int k = 0; k < MAX_SHARED_SITES; ++k) { b->site_key[k] = -1; b->site_off[k] = -1; }
  b->smem_used = L.dyn_smem;
  if (L.dyn_smem) memset(b->smem, 0xff, L.dyn_smem);
  for (unsigned w = 0; w < L.warps_per_block; ++w) {
    unsigned n = L.threads_per_block - w * 32;
    b->warps[w] = Warp{n < 32 ? n : 32, 0, 0};
  }
  for (unsigned t = 0; t < L.threads_per_block; ++t) {
    Fiber* f = &b->fibers[t];
    char* lo = f->stack_lo;
    memset(static_cast<void*>(f), 0, sizeof(Fiber));
    f->block = b;
    f->linear = t;
    f->tidx = {t % L.bdim.x, (t / L.bdim.x) % L.bdim.y, t / (L.bdim.x * L.bdim.y)};
    f->lane = t % 32; f->warp = t / 32;
    f->state = ST_RUNNABLE;
    if (!L.guards) *reinterpret_cast<uint64_t*>(lo) = CANARY;
    // stack tops 256 KiB apart would share cache sets: shift each by up to 32 KiB (64-byte steps)
    const size_t colour = (size_t(i * L.threads_per_block + t) * 2654435761u >> 17) & 0x7fc0u;
    fiber_prepare(f, lo, L.stack_bytes - colour);
    push(f);
  }
  L.live += L.threads_per_block;
  L.fibers_started += L.threads_per_block;
}

// Run block turns until no block has runnable fibers. Returns normally when every live fiber exited.
inline void pass_end() {
  Launch& L = g_launch;
  ++L.rounds;
  L.vclock += ROUND_NS;
  if (L.progress) {
    L.idle_ns = 0; L.jump_ns = 0;
  } else {
    L.jump_ns = L.jump_ns ? (L.jump_ns < 64000000000ull ? L.jump_ns * 2 : L.jump_ns) : 1000;
    L.vclock += L.jump_ns;
    L.idle_ns += L.jump_ns;
    if (L.idle_ns > SPIN_LIMIT_NS)
      sched_fail(RC_DEADLOCK, "livelock: only spinning threads for " + std::to_string(L.idle_ns / 1000000000ull) +
                 " s of virtual time without progress; where every thread waits:\n" + waiting_report());
  }
  L.progress = false;
  L.round_left = L.bq_size;
}

inline void run_queue() {
  Launch& L = g_launch;
  L.round_left = L.bq_size;
  L.progress = false;
  while (L.bq_size) {
    Block* b = pop_block();
    while (b->rq_size) {
      Fiber* f = pop(b);
      switch_to_fiber(f);
      after_yield(f);
      if ((++L.resumes & 255) == 0 && wall_elapsed() > L.wall_limit_s) {
        char buf[128];
        snprintf(buf, sizeof buf, "wall-clock limit of %.1f s reached; where every thread waits:\n", L.wall_limit_s);
        sched_fail(RC_DEADLOCK, buf + waiting_report());
      }
    }
    if (b->ndeferred) {  // spinning fibers: the block's next turn
      for (unsigned k = 0; k < b->ndeferred; ++k) {
        b->rq[(b->rq_head + b->rq_size) % L.threads_per_block] = b->deferred[k];
        ++b->rq_size;
      }
      b->ndeferred = 0;
      push_block(b);
    } else {
      b->queued = false;
    }
    if (--L.round_left == 0 || L.bq_size == 0) pass_end();
  }
  if (L.live)
    sched_fail(RC_DEADLOCK, "deadlock: no thread can continue; where every thread waits:\n" + waiting_report());
}

inline int run_launch(void (*run)(void*), void* ctx, const LaunchConfig* cfg, char* report, size_t cap) {
  Launch& L = g_launch;
  L.~Launch();
  new (&L) Launch();
  L.rc = RC_OK;
  L.run = run; L.run_ctx = ctx;
  L.gdim = {cfg->grid[0], cfg->grid[1], cfg->grid[2]};
  L.bdim = {cfg->block[0], cfg->block[1], cfg->block[2]};
  L.threads_per_block = cfg->block[0] * cfg->block[1] * cfg->block[2];
  L.warps_per_block = (L.threads_per_block + 31) / 32;
  L.num_blocks = cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
  L.dyn_smem = cfg->dyn_smem;
  L.cooperative = cfg->cooperative != 0;
  L.wall_limit_s = cfg->wall_limit_s;
  L.stack_bytes = cfg->stack_bytes ? cfg->stack_bytes : 256 * 1024;
  L.vclock = 1000000000ull;
  clock_gettime(CLOCK_MONOTONIC, &L.t0);
  auto finish = [&](int rc) {
    if (report && cap) {
      size_t n = L.report.size() < cap - 1 ? L.report.size() : cap - 1;
      memcpy(report, L.report.data(), n);
      report[n] = 0;
    }
    return rc;
  };
  if (L.threads_per_block == 0 || L.threads_per_block > 1024 || L.num_blocks == 0) {
    L.report = "invalid launch: block of " + std::to_string(L.threads_per_block) + " threads (1..1024), grid of " +
               std::to_string(L.num_blocks) + " blocks (>= 1)";
    return finish(RC_ERROR);
  }
  if (L.dyn_smem > SHARED_CAPACITY) {
    L.report = "invalid launch: " + std::to_string(L.dyn_smem) + " bytes of dynamic shared memory (at most " +
               std::to_string(SHARED_CAPACITY) + ")";
    return finish(RC_ERROR);
  }
  Watchdog wd;
  install_signals();
  wd.start(L.wall_limit_s);
  int jumped = sigsetjmp(L.recover, 1);
  if (jumped) {
    if (jumped == 2) {
      char buf[200];
      Fiber* f = g_cur;
      snprintf(buf, sizeof buf, "wall-clock limit of %.1f s reached while block %u thread %u ran without reaching a synchronisation point; where every thread waits:\n",
               L.wall_limit_s, f->block->linear, f->linear);
      f->state = ST_STUCK;
      L.report = buf + waiting_report();
      L.rc = RC_DEADLOCK;
    } else if (jumped == 3) {
      char buf[256];
      Fiber* f = g_cur;
      const char* name = L.sig == SIGSEGV ? "segmentation fault" : L.sig == SIGBUS ? "bus error" : "arithmetic exception (integer division by zero?)";
      snprintf(buf, sizeof buf, "%s in block %u (%u,%u,%u) thread %u (%u,%u,%u) at address %p (an out-of-bounds access, or a stack overflow: stack of %zu bytes)",
               name, f->block->linear, f->block->bidx.x, f->block->bidx.y, f->block->bidx.z, f->linear, f->tidx.x, f->tidx.y, f->tidx.z,
               L.sig_addr, L.stack_bytes);
      L.report = buf;
      L.rc = RC_ERROR;
    }
    // jumped == 1: fail() inside a fiber set rc and report
  } else {
    try {
      if (L.cooperative) {
        alloc_live(L.num_blocks);
        L.total_threads = (unsigned long long)L.num_blocks * L.threads_per_block;
        for (unsigned i = 0; i < L.num_blocks; ++i) start_block(i, cfg->order ? cfg->order[i] : i);
        run_queue();
      } else {
        alloc_live(1);
        L.total_threads = L.threads_per_block;
        for (unsigned i = 0; i < L.num_blocks; ++i) {
          L.exited_total = 0; L.grid_arrived = 0;
          start_block(0, cfg->order ? cfg->order[i] : i);
          run_queue();
        }
      }
    } catch (const Abort&) {
    }
  }
  wd.stop();
  restore_signals();
  g_cur = nullptr;
  free_memory();
  return finish(L.rc);
}

// ---------------------------------------------------------------------------- kernel wrappers
template <class T> constexpr char type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) return 'p';
  else if constexpr (std::is_same_v<U, float>) return 'f';
  else if constexpr (std::is_same_v<U, double>) return 'd';
  else if constexpr (std::is_same_v<U, bool>) return 'b';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 1) return std::is_signed_v<U> ? 'c' : 'C';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 2) return std::is_signed_v<U> ? 's' : 'S';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 4) return std::is_signed_v<U> ? 'i' : 'I';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 8) return std::is_signed_v<U> ? 'l' : 'L';
  else if constexpr (sizeof(U) == 2) return 'h';  // half / bfloat16 by value
  else return '?';
}

template <class... A> struct Invoker {
  void (*fn)(A...);
  std::tuple<std::remove_cv_t<std::remove_reference_t<A>>...> args;
  static void run(void* self) {
    Invoker* s = static_cast<Invoker*>(self);
    std::apply(s->fn, s->args);
  }
};

template <class... A, size_t... I>
inline int launch_impl(void (*fn)(A...), void** args, const LaunchConfig* cfg, char* report, size_t cap,
                       std::index_sequence<I...>) {
  Invoker<A...> inv{fn, {*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...}};
  return run_launch(&Invoker<A...>::run, &inv, cfg, report, cap);
}

template <class... A>
inline int launch_kernel(void (*fn)(A...), void** args, const LaunchConfig* cfg, char* report, size_t cap) {
  return launch_impl(fn, args, cfg, report, cap, std::index_sequence_for<A...>{});
}

template <class... A> inline const char* signature_of(void (*)(A...)) {
  static const char sig[] = {type_code<A>()..., '\0'};
  return sig;
}

}  // namespace rammer_emu

// Counters of the last launch (build.py: EmulatedModule.last_stats).
RAMMER_EMU_EXPORT void rammer_emu_stats(unsigned long long* out) {
  const rammer_emu::Launch& L = rammer_emu::g_launch;
  out[0] = L.fibers_started; out[1] = L.resumes; out[2] = L.spins; out[3] = L.rounds;
  out[4] = L.vclock - 1000000000ull;
}

// build.py appends RAMMER_EMU_KERNELS(k1, k2, ...) after the kernel source: the exported entry points.
#define RAMMER_EMU_KERNEL_CASE(k)                                                                  \
  if (!strcmp(name, #k)) return ::rammer_emu::launch_kernel(&k, args, cfg, report, cap);
#define RAMMER_EMU_SIGNATURE_CASE(k) \
  if (!strcmp(name, #k)) return ::rammer_emu::signature_of(&k);
