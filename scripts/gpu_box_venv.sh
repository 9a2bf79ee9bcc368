#!/usr/bin/env bash
# A Python like the GPU boxes within reach, on this machine: torch 2.11, transformers 5.17, Lightning 2.6.6, pyarrow
# and matplotlib (what those boxes come with), then only the wheels scripts/gpu_bundle.sh brings. The stages of
# scripts/gpu_check.sh that such a box can run then run against that stack here, on the CPU:
#
#     bash scripts/gpu_box_venv.sh [VENV]     # default /tmp/eaglelab-gpu-box; ~5 GB (PyPI's torch 2.11 is a CUDA build)
#     EAGLELAB_GPU_BOX_PYTHON=VENV/bin/python python -m pytest tests/test_gpu_check.py -k bundle
#
# Not part of `make test` (5 GB of downloads); the test runs against this repository's own stack without it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/eaglelab-gpu-box}
PY=${PYTHON:-python3}
[[ -f dist/gpu-bundle/smollm2-tokenizer/tokenizer.json ]] || bash scripts/gpu_bundle.sh  # (written after the wheels)
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.11.0" "transformers==5.17.0" "lightning==2.6.6" \
    pyarrow matplotlib
"$VENV/bin/pip" install -q --disable-pip-version-check --no-index --no-deps dist/gpu-bundle/wheels/*.whl
"$VENV/bin/python" -c 'import torch, transformers, lightning, hydra
print(f"{__import__("sys").prefix}: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"lightning {lightning.__version__}, hydra {hydra.__version__}")'
