"""The PyTorch baseline of a lease: an ONNX model through onnx2torch, made fit for a CUDA graph.

In: an ``onnx.ModelProto`` and a device ("cuda", "cpu", or "meta" to find host reads without a
GPU). Out: :func:`convert` gives the ``torch.fx.GraphModule`` on the device with what was changed
(``notes``), ready for eager runs and CUDA-graph capture.

onnx2torch reads shape tensors on the host (Reshape's and Expand's shapes, Split's sizes, Range's
bounds, Slice's starts/ends: ``.tolist()`` / ``.item()``) and ScatterND's indices too
(``indices.T.tolist()``). On a CUDA tensor each is a device-to-host copy, which a CUDA graph
cannot capture ("operation not permitted when stream is capturing"). So:

- int64 initializers read only in such host positions stay on the CPU (the values are constants,
  the device work is the same);
- ScatterND (a static KV cache's write at ``position``) indexes with the index tensor on the
  device (``out[idx.T] = updates``, an ``index_put_`` with no host read) on a clone of the cache,
  as onnx2torch's own does (a copy per step, not an in-place write).

Runtime-only: torch and onnx2torch are imported by the caller's process when present; torchvision
(onnx2torch imports it for NonMaxSuppression and RoiAlign only) is stood in for when missing.
"""

from __future__ import annotations

import sys
import types

__all__ = ["import_convert", "convert", "host_reads"]

# onnx2torch module class -> the argument positions it reads on the host (shapes, sizes, bounds)
HOST_ARGS = {
    "OnnxReshape": {1}, "OnnxExpand": {1}, "OnnxSplit13": {1}, "OnnxRange": {0, 1, 2},
    "OnnxSlice": {1, 2, 3, 4}, "OnnxTile": {1}, "OnnxConstantOfShape": {0},
    "OnnxUnsqueezeDynamicAxes": {1}, "OnnxSqueezeDynamicAxes": {1},
    "OnnxReduceSumDynamicAxes": {1},
}


def import_convert() -> tuple:
    """``(onnx2torch.convert, note)``: the note says what was stood in for ("" when nothing).
    ImportError when torch or onnx2torch is missing."""
    import torch  # noqa: F401 - ImportError here: no PyTorch

    note = ""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: only NMS / RoiAlign need it
        stub, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")

        def missing(*_args, **_kwargs):
            raise NotImplementedError("torchvision is not installed on this host")

        ops.nms = ops.box_convert = ops.roi_align = missing
        stub.ops = ops
        sys.modules.setdefault("torchvision", stub)
        sys.modules.setdefault("torchvision.ops", ops)
        note = "torchvision missing: stood in for (NonMaxSuppression, RoiAlign unavailable)"
    from onnx2torch import convert as onnx_to_torch
    return onnx_to_torch, note


def _scatter_nd_forward(data, indices, updates):
    """ONNX ScatterND (reduction none) without a host read: ``out[idx] = updates`` with the index
    tensor on the device."""
    out = data.clone()
    k = indices.shape[-1]
    flat = indices.reshape(-1, k)
    rows = updates.reshape(-1, *updates.shape[indices.dim() - 1:])
    out[tuple(flat[:, i] for i in range(k))] = rows
    return out


def _host_initializers(gm) -> list:
    """The get_attr targets of the int64 initializers read only in host positions
    (:data:`HOST_ARGS`)."""
    import torch

    keep = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = gm.get_buffer(node.target)
        except AttributeError:
            continue
        if value.dtype != torch.int64 or not node.users:
            continue
        ok = True
        for user in node.users:
            if user.op != "call_module":
                ok = False
                break
            positions = HOST_ARGS.get(type(gm.get_submodule(user.target)).__name__, set())
            if not all(i in positions for i, a in enumerate(user.args) if a is node):
                ok = False
                break
        if ok:
            keep.append(node.target)
    return keep


def convert(proto, device: str, onnx_to_torch=None) -> tuple:
    """``(module, notes)``: ``proto`` converted by onnx2torch, in eval mode on ``device``, host-read
    shape constants kept on the CPU and ScatterND replaced (module docstring); ``notes``: one line
    each of what was changed."""
    import torch

    notes = []
    if onnx_to_torch is None:
        onnx_to_torch, note = import_convert()
        if note:
            notes.append(note)
    gm = onnx_to_torch(proto).eval()
    host = {t: gm.get_buffer(t).clone() for t in _host_initializers(gm)}  # before the move
    gm = gm.to(device)
    for target, value in host.items():
        owner, _, name = target.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        mod._buffers[name] = value  # pylint: disable=protected-access
    scatters = 0
    for mod in gm.modules():
        if type(mod).__name__ == "OnnxScatterND":
            if getattr(getattr(mod, "_reduction", None), "value", "none") != "none":
                raise NotImplementedError("ScatterND with a reduction: no capture-safe form")
            mod.forward = _scatter_nd_forward
            scatters += 1
    if host:
        notes.append(f"{len(host)} shape constants kept on the host")
    if scatters:
        notes.append(f"{scatters} ScatterND as index_put on a clone (a cache copy per step)")
    del torch
    return gm, notes


def host_reads(proto, feeds: dict) -> str | None:
    """Without a GPU: run the converted model on the "meta" device, where any read of a device
    tensor on the host fails as it would break a CUDA graph's capture; returns None when there is
    none, else that failure in one line."""
    import torch

    gm, _ = convert(proto, "meta")
    xs = [torch.from_numpy(v).to("meta") for v in feeds.values()]
    try:
        with torch.inference_mode():
            gm(*xs)
    except Exception as err:  # noqa: BLE001 - the host read, described
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0][:200] if text else ''}"
    return None
