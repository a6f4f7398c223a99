#!/usr/bin/env bash
# Install flopwise into the active Python environment.
#   ./install.sh        the package and its core dependencies (pyproject.toml's
#                       `dependencies`: Hugging Face export's safetensors and transformers too)
#   ./install.sh test   the package and its test dependencies
#
# torch: a machine that already has torch (e.g. a CUDA build) keeps it; otherwise the
# pinned version is installed. On machines with a local CPU wheel of that version (see
# pip's find-links) that is the CPU build; without one, pip takes it from the index.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH_VERSION=${FLOPWISE_TORCH_VERSION:-2.13.0}
extras=""
if [ "${1:-}" = "test" ]; then extras="[test]"; fi

if "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" -m pip install "torch==${TORCH_VERSION}"
fi
"$PY" -m pip install -e ".${extras}"
