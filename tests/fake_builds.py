"""Fake build workers for the tests of CudaDevice's batches (tests/test_measure.py): no TVM and no
nvcc, so a spawned build process starts in a moment. A module whose JSON names :data:`HANG` (an
attribute of one of its PrimFuncs) never finishes building, as a build that hangs. A kernel built
with its resources "has" :data:`REGISTERS` registers."""
import re
import time

HANG = "rammer_test_hang"
REGISTERS = 40


def ready() -> bool:
    """A job that starts the build process (its first job would otherwise pay the start)."""
    return True


def build(mod_json: str, target_spec: dict, path: str, resources: bool,
          compile_source: bool = False) -> dict:
    """measure._build_worker's stand-in: one kernel "built" at ``path``."""
    if HANG in mod_json:
        time.sleep(600)
    return {"path": path, "entry": "rammer_measured", **({"registers": REGISTERS} if resources else {})}


def batch_build(mod_json: str, target_spec: dict, path: str, resources: list,
                compile_source: bool = False) -> list:
    """measure._batch_build_worker's stand-in: each entry of the batch "built" at ``path``."""
    if HANG in mod_json:
        time.sleep(600)
    names = sorted(set(re.findall(r"rammer_measured_\d{4}", mod_json)))
    return [{"path": path, "entry": name, **({"registers": REGISTERS} if name in resources else {})}
            for name in names]
