"""Nimble launches each kernel on its stream through TVM's ``Device.set_raw_stream``, which takes
an int in TVM 0.27 (issue 21, defect 7: it was given ``ctypes.c_void_p`` and raised TypeError).
Checked on the CPU: the schedule is issued with a fake cuda-python and TVM's real CPU device,
whose ``set_raw_stream`` has the same signature and type check as the CUDA one."""
import types

import tvm

from tvm_rammer.benchmarks import nimble


class _Stream:
    """What cuda-python's cudaStream_t offers: an object convertible to its address."""

    def __init__(self, address):
        self.address = address

    def __int__(self):
        return self.address


def _executor(launched):
    ex = object.__new__(nimble.NimbleExecutor)
    ex.dev = tvm.cpu(0)
    ex.cudart = types.SimpleNamespace(cudaEventDisableTiming=0)
    node = types.SimpleNamespace(index=0, gvar=types.SimpleNamespace(name_hint="k"), inputs=[],
                                 outputs=[])
    ex.kernels = [node]
    ex.assignment = nimble.stream_assignment([0], {0: []})
    ex.lib = {"k": lambda *args: launched.append(args)}
    return ex


def test_kernels_are_issued_on_their_stream_through_tvms_int_stream_api():
    launched = []
    ex = _executor(launched)
    ex._issue({}, [_Stream(0x1234)])
    assert launched == [()]
    ex.dev.set_raw_stream(0)


def test_stream_handle_is_the_int_address():
    assert nimble.stream_handle(_Stream(0xBEEF)) == 0xBEEF and nimble.stream_handle(7) == 7
