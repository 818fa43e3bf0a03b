"""A fake ``MeasureDevice`` for CPU tests: kernel and rProgram times from rules, calls counted, and
(with a fake ``clock``) builds and runs that take time, within the profiler's budget."""
from tvm_rammer.host.gpu import DeviceId
from tvm_rammer.tuning.measure import BudgetSpent


def version_name(job) -> str:
    """The version part of a KernelJob label ("fused_conv2d_add_relu:spatial_t256x1" -> ...)."""
    return job.label.split(":", 1)[1]


class FakeClock:
    """A clock that moves only when told (``advance``): the profiler's ``clock`` in tests."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeDevice:
    """Measures nothing real: ``kernel_us(job)`` is a version's time, ``default_us(job)`` its
    operator's TVM default kernel time, ``wrong(job)`` says which versions compute a wrong result,
    ``rprogram_us(func)`` is a persistent kernel's time. Counts every kernel and rProgram measured.

    With a ``clock`` (:class:`FakeClock`), measuring a kernel takes ``kernel_s`` and timing an
    rProgram ``rprogram_s`` seconds of it, and the ``within_s`` deadline is kept as
    ``CudaDevice`` keeps it: nothing starts past it, a job it cuts short is abandoned (None,
    BudgetSpent). ``started`` lists (what, clock time) of every job started."""

    def __init__(self, kernel_us=None, default_us=None, wrong=None, rprogram_us=None,
                 name="Fake GPU", arch="sm_90", clock=None, kernel_s=0.0, rprogram_s=0.0):
        self.id = DeviceId(name, arch, "1.0")
        self.kernel_us = kernel_us or (lambda job: 10.0)
        self.default_us = default_us or (lambda job: 10.0)
        self.wrong = wrong or (lambda job: False)
        self.rprogram_us = rprogram_us or (lambda func: 5.0)
        self.clock, self.kernel_s, self.rprogram_s = clock, kernel_s, rprogram_s
        self.measured = []
        self.rprograms = 0
        self.started = []

    def _deadline(self, within_s):
        if within_s is None or self.clock is None:
            return None
        return self.clock() + within_s

    def _spend(self, what: str, seconds: float, deadline) -> bool:
        """Start ``what`` (False when the deadline has passed) and let it take ``seconds``; True
        when it finished before the deadline."""
        now = self.clock() if self.clock is not None else 0.0
        if deadline is not None and now >= deadline:
            return False
        self.started.append((what, now))
        if self.clock is not None:
            self.clock.advance(seconds)
        return deadline is None or self.clock() <= deadline

    def measure_kernels(self, jobs, progress, within_s=None):
        deadline = self._deadline(within_s)
        records, spent = [], False
        for job in jobs:
            if spent or not self._spend(job.label, self.kernel_s, deadline):
                spent = True
                records.append(None)
                continue
            self.measured.append(job.label)
            bad = self.wrong(job)
            record = {"kernel_us": self.kernel_us(job), "registers": 32, "shared_bytes": 0,
                      "valid": not bad, "error": 0.5 if bad else 0.0,
                      "default_us": self.default_us(job) if job.reference is not None else None}
            if bad:
                record["reason"] = "output differs from TVM's default kernel: relative error 5.00e-01"
            records.append(record)
            progress(1)
        return records

    def time_kernel(self, func, fixed, within_s=None):
        assert "rammer_program" in fixed  # the table is what makes a placement
        if not self._spend("rprogram", self.rprogram_s, self._deadline(within_s)):
            raise BudgetSpent("the profiling budget ran out (fake device)")
        self.rprograms += 1
        return self.rprogram_us(func)


# --- runner-side stand-ins (module level: a spawned runner process imports them by name) --------

def runner_pid(*_args) -> int:
    """The runner's process id (a fresh one after a restart)."""
    import os

    return os.getpid()


def hang(*_args):
    """A job that never ends (a kernel whose wait never completes, a hung driver call)."""
    import time

    while True:
        time.sleep(1.0)


def dead_context(*_args):
    """A job that fails as a kernel with an illegal address does: the CUDA context is dead."""
    raise RuntimeError("CUDA: an illegal memory access was encountered")
