"""A lease library's manifest (``NAME.json``, format ``tvm-rammer-lib/1``), read without TVM.

In: the manifest's path. Out: :class:`LibrarySpec`, the fields the runner needs, with the
library's and the weights file's paths resolved beside the manifest. ``tvm_rammer.lease.manifest``
(json and numpy only) writes the format and reads it here; this module adds what running needs
(the device type, tensor entries as tuples) and says which field is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm_rammer.lease.manifest import FORMAT, read_manifest

DEVICE_TYPES = ("cuda", "cpu")

__all__ = ["FORMAT", "TensorSpec", "LibrarySpec", "read_spec"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the calling convention: its name (None where the manifest gives none),
    shape and dtype."""

    name: str | None
    shape: tuple
    dtype: str

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class LibrarySpec:
    """What the manifest says about one library (paths absolute)."""

    manifest: Path
    library: Path
    pipeline: str
    target: str
    arch: str | None
    device_type: str
    inputs: tuple
    raw_weights: tuple
    weights: tuple
    transform: str | None
    outputs: tuple
    fault_page: bool
    model: dict | None
    weights_file: Path | None
    tolerance: float | None = None  # optional: the library's precision's, when the builder wrote it

    @property
    def name(self) -> str:
        """The zoo model's name, or the library's file stem."""
        return self.model["zoo"] if self.model else self.library.stem


def _tensors(raw, field: str, path: Path, named: bool) -> tuple:
    if not isinstance(raw, list):
        raise ValueError(f"{path}: '{field}' must be a list of {{name, shape, dtype}}, not {raw!r}")
    out = []
    for i, entry in enumerate(raw):
        try:
            shape = tuple(int(d) for d in entry["shape"])
            dtype = str(entry["dtype"])
            name = str(entry["name"]) if named else entry.get("name")
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: '{field}'[{i}] = {entry!r} needs "
                             f"{'name, ' if named else ''}shape (integers) and dtype") from None
        out.append(TensorSpec(name, shape, dtype))
    return tuple(out)


def read_spec(path) -> LibrarySpec:
    """Read and check the manifest at ``path`` (``tvm_rammer.lease.manifest.read_manifest``, then
    what running needs); ValueError naming the field and the fix."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"no manifest at {path}: pass the NAME.json written beside the library")
    data = read_manifest(path)
    if data["device_type"] not in DEVICE_TYPES:
        raise ValueError(f"{path}: device_type {data['device_type']!r}, expected one of "
                         f"{DEVICE_TYPES}")
    model = data.get("model")
    if model is not None and (not isinstance(model, dict) or "zoo" not in model):
        raise ValueError(f"{path}: 'model' must be null or {{zoo, params, batch}}, not {model!r}")
    weights_file = data.get("weights_file")
    tolerance = data.get("tolerance")
    return LibrarySpec(
        manifest=path, library=path.parent / data["library"],
        pipeline=str(data.get("pipeline", "")), target=str(data.get("target", "")),
        arch=data.get("arch"), device_type=data["device_type"],
        inputs=_tensors(data["inputs"], "inputs", path, named=True),
        raw_weights=_tensors(data["raw_weights"], "raw_weights", path, named=True),
        weights=_tensors(data["weights"], "weights", path, named=False),
        transform=data.get("transform"),
        outputs=_tensors(data["outputs"], "outputs", path, named=False),
        fault_page=bool(data.get("fault_page", False)), model=model,
        weights_file=None if weights_file is None else path.parent / weights_file,
        tolerance=None if tolerance is None else float(tolerance))
