"""``python3 -m tvm_rammer.runtime``: see :mod:`tvm_rammer.runtime.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
