"""A fake ``MeasureDevice`` for CPU tests: kernel and rProgram times from rules, calls counted."""
from tvm_rammer.gpu import DeviceId


def version_name(job) -> str:
    """The version part of a KernelJob label ("fused_conv2d_add_relu:spatial_t256x1" -> ...)."""
    return job.label.split(":", 1)[1]


class FakeDevice:
    """Measures nothing real: ``kernel_us(job)`` is a version's time, ``default_us(job)`` its
    operator's TVM default kernel time, ``wrong(job)`` says which versions compute a wrong result,
    ``rprogram_us(func)`` is a persistent kernel's time. Counts every kernel and rProgram measured."""

    def __init__(self, kernel_us=None, default_us=None, wrong=None, rprogram_us=None,
                 name="Fake GPU", arch="sm_90"):
        self.id = DeviceId(name, arch, "1.0")
        self.kernel_us = kernel_us or (lambda job: 10.0)
        self.default_us = default_us or (lambda job: 10.0)
        self.wrong = wrong or (lambda job: False)
        self.rprogram_us = rprogram_us or (lambda func: 5.0)
        self.measured = []
        self.rprograms = 0

    def measure_kernels(self, jobs, progress):
        records = []
        for job in jobs:
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

    def time_kernel(self, func, fixed):
        self.rprograms += 1
        assert "rammer_program" in fixed  # the table is what makes a placement
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
