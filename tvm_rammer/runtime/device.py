"""The device a library runs on, with TVM's CUDA runtime library loaded when it is needed.

In: the manifest's ``device_type`` ("cuda" or "cpu"). Out: a ``tvm.runtime.Device`` that exists.
Under ``TVM_USE_RUNTIME_LIB=1`` TVM loads ``libtvm_runtime`` only and skips its backend hooks, so
``libtvm_runtime_cuda`` (the CUDA device API and module loader) is loaded here, as
``tvm.backend.cuda.register_backend`` loads it (``tvm_ffi.libinfo.load_lib_ctypes``, beside
libtvm_runtime, RTLD_LOCAL: it registers its functions when loaded) but without that hook's
TVMScript and target registrations, which need the compiler.
"""

from __future__ import annotations

from pathlib import Path

import tvm
import tvm_ffi

__all__ = ["load_cuda_runtime", "load_runtime_extra", "load_runtime_for", "device_for"]


def _load_sidecar(name: str):
    """``lib<name>.so`` beside libtvm_runtime, loaded once as TVM's backend hooks load it."""
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    if name not in _LOADED_LIBS:
        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        _LOADED_LIBS[name] = load_lib_ctypes(package="tvm", target_name=name,
                                             extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
    return _LOADED_LIBS[name]


def load_runtime_extra() -> None:
    """Load ``libtvm_runtime_extra`` where it exists (TVM's CPU sort/top-k and random kernels,
    which an llvm library may call; ``import tvm`` loads it only with the compiler)."""
    try:
        _load_sidecar("tvm_runtime_extra")
    except (OSError, RuntimeError):
        pass  # a TVM without it: libraries that need none of it still run


def load_cuda_runtime() -> None:
    """Load ``libtvm_runtime_cuda`` once; ValueError saying why when it cannot load (no CUDA
    driver's libcuda.so.1, or a TVM built without CUDA)."""
    if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    try:
        _load_sidecar("tvm_runtime_cuda")
    except (OSError, RuntimeError) as err:
        from tvm.base import _LOADED_LIBS

        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        raise ValueError(f"TVM's CUDA runtime library (libtvm_runtime_cuda beside {runtime_dir}) "
                         f"does not load: {err}. Run CUDA libraries on a host with a CUDA driver "
                         "and a TVM built with CUDA (libraries built for llvm run on the CPU)"
                         ) from None


def load_runtime_for(device_type: str) -> None:
    """TVM's runtime libraries that a library for ``device_type`` may need: the extra one, and
    for "cuda" the CUDA one (ValueError when it cannot load)."""
    load_runtime_extra()
    if device_type == "cuda":
        load_cuda_runtime()


def device_for(device_type: str, index: int = 0):
    """``tvm.cuda(index)`` (loading the CUDA runtime first) or ``tvm.cpu(index)``; ValueError
    when no such device is visible. TVM's runtime sidecar libraries are loaded first."""
    load_runtime_for(device_type)
    if device_type == "cuda":
        dev = tvm.cuda(index)
    elif device_type == "cpu":
        dev = tvm.cpu(index)
    else:
        raise ValueError(f"device type {device_type!r}: a library runs on 'cuda' or 'cpu'")
    if not dev.exist:
        raise ValueError(f"no {device_type} device {index} is visible: run the library on a host "
                         f"that has one (nvidia-smi lists the GPUs)")
    return dev
