"""The emulator's exception, in a module of its own so that ``build.py`` (which runs
``ptx.translate``) and ``ptx.py`` both import it without an import cycle; ``build.py`` re-exports it
(``from .errors import EmulatorError``) as the public ``tvm_rammer.checks.emulator.build.EmulatorError``."""

__all__ = ["EmulatorError"]


class EmulatorError(RuntimeError):
    """The emulator cannot build or run something: the message names what and where (a build
    failure: the compiler's stderr, the kept source path and the command; inline PTX the emulator
    does not know: the asm statement's text)."""
