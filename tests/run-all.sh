#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need, then lint,
# type check and pytest. Extra arguments go to pytest (e.g. -k table, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[dev]'
python3 -m ruff check pearl_hpc tests
python3 -m mypy
python3 -m pytest "$@"
