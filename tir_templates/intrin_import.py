"""Importing TVM's CUDA tensor intrinsics faster (``know_frozen_import_frames``).

In: nothing. Out: two entries in the standard library's ``inspect.modulesbyfile`` cache, once per
process (idempotent). Used by ``mma_templates`` and ``default_schedule`` before they may import
``tvm.s_tir.tensor_intrin.cuda``.
"""
from __future__ import annotations

import inspect

__all__ = ["know_frozen_import_frames"]


def know_frozen_import_frames() -> None:
    """Makes the import of ``tvm.s_tir.tensor_intrin.cuda`` (``mma_templates._intrinsics``, or
    dlight's tensor-core rule's: ``default_schedule.default_rules``) about 3x faster. It parses
    496 intrinsics with TVMScript, whose ``T.prim_func`` calls ``inspect.stack()`` each time; ``inspect`` resolves every frame's module,
    and for the import machinery's frozen frames (``<frozen importlib._bootstrap>``: no file to
    cache them by) that is a scan of ``sys.modules`` on every call: 85 of the 98 s the import took
    in a profile on this 2-core machine (loaded), ~40 s per process of the test suite. The two
    frame names go into ``inspect.modulesbyfile`` (the file -> module cache its scan fills for
    modules with a file) with the modules they are: 36.4 s -> 11.7 s for a process that imports
    TVM and the intrinsics. What ``inspect`` reports is unchanged (a frozen module has no source:
    no code context either way); an entry already there is kept."""
    for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
        inspect.modulesbyfile.setdefault(f"<frozen {name}>", name)
