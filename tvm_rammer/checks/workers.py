"""Run many small compile jobs in worker subprocesses, each with a time limit.

Used by the node suite and the fuzzer: a job that hangs or kills its worker (a segfault deep in
TVM) is reported as such, the worker is replaced, and the other jobs go on. Each worker imports
TVM once and then serves jobs ``(name, payload)`` by calling ``function(name, payload)``, a
module-level function named ``"package.module:function"`` that returns a JSON-able dict.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import time


def _serve(conn, function: str, quiet: bool) -> None:
    """Worker loop: receive (name, payload), send "started", then the result dict; None stops."""
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    if quiet:  # TVM's frontend and C++ warnings write to fd 1 and 2
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    module, _, name = function.partition(":")
    fn = getattr(importlib.import_module(module), name)
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send("started")  # the time limit counts from here, not from the worker's start-up
        conn.send(fn(*job))


class _Worker:
    """One worker subprocess; replaced when a job hangs it or kills it."""

    def __init__(self, function: str, quiet: bool):
        self.function, self.quiet = function, quiet
        self.ctx = multiprocessing.get_context("spawn")
        self._start()

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child, self.function, self.quiet),
                                     daemon=True)
        self.proc.start()
        child.close()
        self.job, self.started = None, None

    def submit(self, job):
        self.job, self.started = job, None
        self.conn.send(job)

    def poll(self, timeout: float):
        """(name, result dict) of the finished job; (name, None, why) when the worker died or ran
        past ``timeout`` seconds; None while it is still running."""
        name = self.job[0]
        try:
            while self.conn.poll(0.05):
                message = self.conn.recv()
                if isinstance(message, str) and message == "started":
                    self.started = time.monotonic()
                    continue
                self.job = None
                return name, message, ""
        except (EOFError, OSError):
            pass
        else:
            if self.proc.is_alive() and (self.started is None
                                         or time.monotonic() - self.started < timeout):
                return None
        code = self.proc.exitcode
        self.restart()
        why = (f"ran past {timeout:g} s" if code is None else f"worker process died (exit code {code})")
        return name, None, why

    def restart(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self._start()

    def stop(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def run_jobs(function: str, jobs: list, workers: int = 1, timeout: float = 120.0,
             on_result=None, quiet: bool = True) -> dict:
    """{name: (result dict or None, why)} for ``jobs`` (``[(name, payload)]``, names unique),
    run by ``function`` in ``workers`` subprocesses. ``on_result(name, result, why)`` is called as
    each job ends (``result`` None: it hung or crashed, ``why`` says which)."""
    pending = list(reversed(jobs))
    pool = [_Worker(function, quiet) for _ in range(max(1, min(workers, len(jobs))))]
    results = {}
    try:
        while pending or any(w.job is not None for w in pool):
            for worker in pool:
                if worker.job is None and pending:
                    worker.submit(pending.pop())
                if worker.job is not None:
                    done = worker.poll(timeout)
                    if done is not None:
                        name, result, why = done
                        results[name] = (result, why)
                        if on_result is not None:
                            on_result(name, result, why)
    finally:
        for worker in pool:
            worker.stop()
    return results
