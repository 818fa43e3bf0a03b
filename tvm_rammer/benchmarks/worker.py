"""``python -m tvm_rammer.benchmarks.worker``: runs benchmark jobs for the harness.

Reads one JSON job per line on stdin and writes events as ``@@bench {json}`` lines on stdout (any
other output is ignored by the harness); every job ends with a ``done`` event. The harness kills
this process when a model exceeds its timeout and starts a fresh one for the next model.
"""

from __future__ import annotations

import json
import sys

from .harness import EVENT_PREFIX, handle_job
from .output import to_json


def _emit(event: dict) -> None:
    sys.stdout.write(EVENT_PREFIX + to_json(event, indent=None) + "\n")
    sys.stdout.flush()


def main() -> int:
    for line in sys.stdin:
        if line.strip():
            handle_job(json.loads(line), _emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
