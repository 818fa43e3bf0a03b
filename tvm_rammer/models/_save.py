"""`save_model`: write a zoo model to an .onnx file, with its weights as external data when the
model is past ONNX's 2 GiB protobuf limit (Llama-3.2-1B's shape), as real exports do."""

import os

import onnx

PROTOBUF_LIMIT = 2 ** 31 - 1
# Below the limit with a margin for the graph itself (nodes, names, shapes).
EXTERNAL_ABOVE = 1_800_000_000


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes held in the model's initializers (raw_data and typed fields)."""
    total = 0
    for t in model.graph.initializer:
        if t.HasField("raw_data"):
            total += len(t.raw_data)
        else:
            total += onnx.numpy_helper.to_array(t).nbytes
    return total


def save_model(model: onnx.ModelProto, path: str, external_data: bool | None = None) -> str | None:
    """Write ``model`` to ``path``. ``external_data=None``: the weights go to one file beside it,
    ``<name>.data`` (a relative location, so the pair can be moved together), when they exceed
    1.8 GB; True / False force it either way. Returns the data file's path, or None when the
    model is a single file. ``onnx.load(path)`` reads both back (the location is relative to the
    model file's folder). With external data, onnx moves the weights out of ``model`` itself (its
    initializers then point at the file). The model file is written under a temporary name beside
    ``path`` and renamed: it appears only complete (its data file, when there is one, first)."""
    if external_data is None:
        external_data = weight_bytes(model) > EXTERNAL_ABOVE
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.partial")
    data = None
    try:
        if external_data:
            location = name + ".data"  # the final name's: the renamed model file still finds it
            data = os.path.join(folder, location)
            if os.path.exists(data):
                os.remove(data)  # onnx appends to an existing data file
            onnx.save(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                      location=location, size_threshold=1024)
        else:
            onnx.save(model, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return data
