#!/usr/bin/env bash
# The test command of the README: install with the test extra, then run every test.
# GPU tests skip cleanly without a GPU; nvcc tests skip without nvcc. tests/test_install.py also
# builds the wheel, installs it into a fresh virtual environment and runs the installed copy.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]" || exit 1
scripts/install_rocm_toolchain.sh  # LLVM 22 + ROCm bitcode for tests/test_rocm.py (skips if impossible)
# one pytest worker per CPU (pytest-xdist), each test file on one worker (its module fixtures
# built once); PYTEST_WORKERS=0 runs in this process
python3 -m pytest -q -n "${PYTEST_WORKERS:-$(nproc)}" --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
