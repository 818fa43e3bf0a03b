"""TVM's default Relax pipeline, the baseline, or one line saying why it cannot compile a model.

TVM's default pipeline is never patched: what it cannot compile it cannot compile (dlight's GEMV
rule asserts on some broadcast reductions, ``s_tir/dlight/analysis/gemv.py: normalize``). Every
place that runs it whole (``pipeline._fewer_launches``, ``inspection.lower_default``, the
symbolic-shape path, ``run``, ``bench``, the fuzzer, the node suite) goes through :func:`run_default`
and reports the baseline as unavailable with :class:`DefaultPipelineFailed`'s one-line reason
instead of crashing: which pass failed, and for a dlight rule, which rule on which function.

- :func:`run_default`: a Relax pass (TVM's default pipeline, or a part of it) on a module; raises
  :class:`DefaultPipelineFailed` with the reason.
- :func:`lower_default`: TVM's default pipeline of a target's plain CUDA/ROCm target.
- :func:`default_pipeline`: the same as a Relax pipeline for ``tvm.compile(relax_pipeline=...)``;
  :func:`reason_of` reads the reason back from what ``tvm.compile`` raises (TVM's FFI turns the
  exception into a RuntimeError with the same message).
- :func:`failure_reason`: the reason line of any exception TVM's default pipeline raised.
"""
from __future__ import annotations

import traceback

import tvm
from tvm import relax, tirx

__all__ = ["DefaultPipelineFailed", "run_default", "lower_default", "failure_reason",
           "default_pipeline", "reason_of", "UNAVAILABLE"]

UNAVAILABLE = "TVM's default pipeline cannot compile this model"


class DefaultPipelineFailed(RuntimeError):
    """TVM's default pipeline raised on a model; ``reason`` is one line (no traceback)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _last_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _where(err: BaseException) -> str:
    """``file: function`` of the innermost Python frame that raised (an assert has no message)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename.replace("\\", "/")
    short = path.split("/tvm/", 1)[-1] if "/tvm/" in path else path.rsplit("/", 1)[-1]
    return f"{short}: {frame.name}"


def _error_text(err: BaseException) -> str:
    text = _last_line(err)
    where = _where(err) if not text or isinstance(err, AssertionError) else ""
    return f"{type(err).__name__}" + (f": {text}" if text else "") + (f" in {where}" if where else "")


def _failing_rule(mod: tvm.IRModule, target) -> str | None:
    """``dlight's RULE rule fails on FUNC (error)`` for the first PrimFunc of ``mod`` (the module
    dlight's ApplyDefaultSchedule received) on which a default rule raises, as TVM applies them."""
    from tir_templates.default_schedule import default_rules, is_scheduled  # pylint: disable=import-outside-toplevel

    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        tgt = (func.attrs.get("target", None) if func.attrs is not None else None) or target
        for rule in default_rules():
            try:
                with tgt:
                    if rule.apply(func, tgt, False) is not None:
                        break  # TVM takes this rule: no failure on this function
            except Exception as err:  # pylint: disable=broad-except  (the failure being named)
                return (f"dlight's {type(rule).__name__} rule fails on {gv.name_hint} "
                        f"({_error_text(err)})")
    return None


def failure_reason(err: BaseException, failed_pass: str | None = None,
                   received: tvm.IRModule | None = None, target=None) -> str:
    """One line: ``TVM's default pipeline cannot compile this model: <what failed>``.
    ``failed_pass`` / ``received``: the pass that raised and the module it was given (named from
    them when it is dlight's ApplyDefaultSchedule: which rule on which function)."""
    what = None
    if received is not None and failed_pass == "ApplyDefaultSchedule":
        try:
            what = _failing_rule(received, target)
        except Exception:  # pylint: disable=broad-except  (the diagnosis must not fail itself)
            what = None
    if what is None:
        what = _error_text(err) + (f" (in {failed_pass})" if failed_pass else "")
    return f"{UNAVAILABLE}: {what}"[:500]


@tvm.instrument.pass_instrument
class _LastPass:
    """Keeps the name of the innermost pass that started last, and the module it received."""

    def __init__(self):
        self.pass_name, self.module = None, None

    def run_before_pass(self, mod, info):
        self.pass_name, self.module = info.name, mod


def run_default(pass_: tvm.transform.Pass, mod: tvm.IRModule, target) -> tvm.IRModule:
    """``pass_(mod)`` under ``target`` (TVM's default pipeline or part of it); any exception it
    raises becomes :class:`DefaultPipelineFailed` with :func:`failure_reason`. The pass context in
    scope (options, instruments such as the progress bar) is kept."""
    last = _LastPass()
    current = tvm.transform.PassContext.current()
    try:
        with tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                       required_pass=list(current.required_pass),
                                       disabled_pass=list(current.disabled_pass),
                                       instruments=[*current.instruments, last]):
            with target:
                return pass_(mod)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # pylint: disable=broad-except  (TVM's own pipeline failed)
        raise DefaultPipelineFailed(failure_reason(err, last.pass_name, last.module, target)) from None


def lower_default(mod: tvm.IRModule, target) -> tvm.IRModule:
    """TVM's default Relax pipeline for ``target``'s plain CUDA/ROCm target (the baseline
    "RammerBase"), Relax part only; :class:`DefaultPipelineFailed` when TVM cannot compile it."""
    from ..target import plain_target, resolve_target  # pylint: disable=import-outside-toplevel

    plain = plain_target(resolve_target(target))
    return run_default(relax.get_default_pipeline(plain), mod, plain)


def default_pipeline(target) -> tvm.transform.Pass:
    """TVM's default Relax pipeline for ``target``'s plain target, as one pass for
    ``tvm.compile(mod, target=plain, relax_pipeline=default_pipeline(target))``: the same module,
    and on a failure an exception whose message is the one-line reason (:func:`reason_of`)."""
    from ..target import plain_target  # pylint: disable=import-outside-toplevel

    plain = plain_target(target)

    @tvm.transform.module_pass(opt_level=0, name="TVMDefaultPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return run_default(relax.get_default_pipeline(plain), mod, plain)

    return _pipeline


def reason_of(err: BaseException) -> str:
    """The one-line reason of a failure of TVM's default pipeline: a
    :class:`DefaultPipelineFailed`'s, the message of one that crossed TVM's FFI, or
    :func:`failure_reason` of any other exception."""
    if isinstance(err, DefaultPipelineFailed):
        return err.reason
    for line in reversed(str(err).strip().splitlines()):
        if UNAVAILABLE in line:
            return line[line.index(UNAVAILABLE):].strip()
    return failure_reason(err)
