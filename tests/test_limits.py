"""Limits checked before any work (eaglelab.plan.preflight, its cost model eaglelab.plan.costs): settings out of range
for the data they train on, precisions the device cannot run, runs larger than the memory or the disk they would get,
and a disk that fills up anyway. Each refusal is one line naming the setting and the fix, exit status 2, and nothing
that looks complete."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from eaglelab.core.errors import ConfigError, DiskFull

from conftest import compose, error_line, run_cli

SMOKE = ["experiment=smoke", "eval.suites.drift.enabled=false"]


def assert_nothing_looks_complete(results: Path):
    for run_json in results.rglob("run.json"):
        assert json.loads(run_json.read_text())["status"] == "failed"
    assert not list(results.rglob("metrics.json"))


def cache_entries(cache: Path) -> set[Path]:
    return {p for kind in ("regen", "features") for p in (cache / kind).glob("*")}


# --- settings against what they depend on, at composition --------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["train.ttt_steps=500"],
            "train.ttt_steps=500 must be below data.max_new_tokens=160 (draft step j trains on the response token "
            "j+1 places after the position it drafts from",
        ),
        (["train.ttt_steps=20", "data.max_new_tokens=400", "data.max_length=16"], "must be below data.max_length=16"),
        (["eval.max_k=96"], "eval.max_k=96 must be below eval.max_new_tokens=96"),
        (
            ["train.ttt_steps=60", "data.max_new_tokens=200"],
            "eval.max_k (unset: max(8, 2·train.ttt_steps+2) = 122) must be below eval.max_new_tokens=96",
        ),
        (["drafter.attention_window=1024"], "drafter.attention_window=1024 is not below data.max_length=1024"),
        (["+suite=long_context", "eval.suites.ks=[64]"], "must stay below eval.suites.long_context.max_new_tokens=64"),
        (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
        (["train.weight_decay=-0.1"], "train.weight_decay must be >= 0"),
        (["train.grad_clip=-1"], "train.grad_clip must be >= 0"),
        (["train.max_steps=0"], "train.max_steps must be -1 (no limit) or > 0"),
        (["train.lr=1e39"], "train.lr must be below 3.4e+38 (the float32 range), got 1e+39"),
        (["experiment=smoke", "target.tiny.hidden_size=0"], "target.tiny.hidden_size must be > 0"),
        (["experiment=smoke", "target.tiny.alphabet=1"], "target.tiny.alphabet must be 0 (off) or >= 2"),
    ],
)
def test_a_setting_out_of_range_names_itself_and_the_fix(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        compose(overrides, tmp_path, tmp_path / "run")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_evaluated_checkpoint_is_not_held_to_training_lengths(tmp_path):
    """Evaluating a checkpoint trains nothing: a window for inference only and a training depth beyond this
    command's data settings are fine (the draft depth is checked again once the checkpoint's is adopted)."""
    cfg = compose(
        ["checkpoint=/some/run", "drafter.attention_window=2048", "train.ttt_steps=200", "eval.max_k=8"],
        tmp_path,
        tmp_path / "run",
    )
    assert cfg.drafter.attention_window == 2048


@pytest.mark.slow
def test_a_draft_depth_beyond_the_responses_is_refused_by_the_cli_before_anything_runs(cache_dir, tmp_path):
    """The issue's case: a train.ttt_steps far beyond any sequence used to run until the kernel killed it."""
    proc = run_cli([*SMOKE, "train.ttt_steps=500"], cache_dir, tmp_path)
    line = error_line(proc.returncode, proc.stderr)
    assert "train.ttt_steps=500 must be below data.max_new_tokens=24" in line
    assert "lower train.ttt_steps or raise data.max_new_tokens" in line
    assert not list(tmp_path.rglob("run.json"))


# --- precision against the device ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_float16_autocast_on_the_cpu_is_refused_instead_of_swapped(cache_dir, tmp_path):
    """Lightning would quietly train bf16-mixed and the run would say 16-mixed. (Through what the CLI calls; the
    CLI prints such an error as its one `error:` line: tests/test_bad_input.py.)"""
    from eaglelab.pipeline import run

    with pytest.raises(ConfigError) as e:
        run(compose([*SMOKE, "train.precision=16-mixed"], cache_dir, tmp_path / "run"))
    line = str(e.value)
    assert "train.precision=16-mixed: float16 autocast does not exist on the CPU" in line and "\n" not in line
    assert "use train.precision=bf16-mixed or 32-true" in line
    assert_nothing_looks_complete(tmp_path)


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch, tmp_path):
    from eaglelab.plan.preflight import check_precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"train.precision=bf16-mixed needs bfloat16, which cuda:0 \(Tesla V100\)"):
        check_precision(compose(["target.dtype=float16", "train.precision=bf16-mixed"], tmp_path, tmp_path / "r"), gpu)
    with pytest.raises(ConfigError, match="target.dtype=bfloat16 needs bfloat16.*use target.dtype=float16"):
        check_precision(compose(["train.precision=16-mixed", "target.dtype=bfloat16"], tmp_path, tmp_path / "r"), gpu)
    for fine in (
        ["train.precision=16-mixed", "target.dtype=float16"],
        ["train.precision=64-true", "target.dtype=float32"],
    ):
        check_precision(compose(fine, tmp_path, tmp_path / "r"), gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    check_precision(compose(["train.precision=bf16-mixed", "target.dtype=bfloat16"], tmp_path, tmp_path / "r"), gpu)


# --- memory -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_too_large_for_memory_is_refused_before_any_work(cache_dir, tmp_path):
    """A batch × length × depth no machine holds: refused once the target's shape is known, before regeneration
    (no new cache entry), naming the three settings."""
    before = cache_entries(cache_dir)
    big = ["train.batch_size=4096", "data.max_length=2048", "data.max_new_tokens=2048", "train.ttt_steps=8"]
    proc = run_cli([*SMOKE, *big], cache_dir, tmp_path)
    line = error_line(proc.returncode, proc.stderr)
    assert line.startswith("error: this run needs ~") and " GB at its peak (train: train.batch_size=4096 × " in line
    assert "data.max_length=2048 × train.ttt_steps=8)" in line and "but cpu has " in line
    assert line.endswith("GB free; lower train.batch_size, data.max_length or train.ttt_steps")
    assert cache_entries(cache_dir) == before
    assert_nothing_looks_complete(tmp_path)


@pytest.mark.parametrize(
    "T,checkpointing,layer", [(96, False, "llama"), (512, False, "llama"), (512, True, "llama"), (512, False, "mla")]
)
def test_the_training_estimate_counts_what_autograd_keeps(T, checkpointing, layer):
    """`ttt_kept_bytes` against the bytes autograd really saves for backward over one TTT batch (every saved
    tensor's storage, counted once), on the smoke drafter's shape: the terms are the code's, not a fit. At two
    lengths, so a term growing with T² (attention probabilities, which the fused kernel no longer keeps) would
    show; with activation checkpointing, what is saved is the layers' inputs, and the estimate adds the one
    layer-step rebuilt at a time in the backward pass."""
    from transformers import LlamaConfig

    from eaglelab.core.config import TrainConfig
    from eaglelab.models.drafter import DrafterFlags, Eagle3Config
    from eaglelab.plan.costs import _trainable_parameters, layer_step_bytes, ttt_kept_bytes
    from eaglelab.train.batches import Batch
    from eaglelab.train.ttt_module import DrafterModule

    shape = LlamaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64,
    )  # fmt: skip
    flags = DrafterFlags(layer=layer)  # (mla: its latent shape from the target's head_dim, counted as plain attention)
    d = Eagle3Config.for_target(flags, shape, aux_layer_ids=[2, 4, 5], draft_vocab_size=1024, max_context=512)
    B, steps, prompt = 3, 4, 1  # prompt of 1 token: every position drafts (the estimate's bound)
    train = TrainConfig(ttt_steps=steps, activation_checkpointing=checkpointing)
    module = DrafterModule(d, train, target_head=torch.randn(1024, 128))
    module.drafter.set_vocab(torch.arange(1024))
    batch = Batch(
        input_ids=torch.randint(0, 1024, (B, T)),
        prompt_len=torch.full((B,), prompt),
        seq_len=torch.full((B,), T),
        index=torch.arange(B),
        target_next=torch.randint(0, 1024, (B, T)),
        aux=torch.randn(B, T, 3 * 128),
    )
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        module.ttt(batch, steps)
    trainable = [p for p in module.drafter.parameters() if p.requires_grad]
    assert _trainable_parameters(d) == sum(p.numel() for p in trainable)
    estimate = ttt_kept_bytes(B, T, steps, T - prompt, d, lowp=2, stream=4, checkpointing=checkpointing)
    if checkpointing:  # saved in the forward pass: all but the rebuilt layer-step (and the layers' weight copies)
        assert estimate < 0.7 * ttt_kept_bytes(B, T, steps, T - prompt, d, 2, 4)
        expected = estimate - max(layer_step_bytes(B, T, steps, d, 2, 4))
    else:
        expected = estimate + 2 * _trainable_parameters(d)  # autocast's bf16 copies of the weights, saved too
    if layer == "mla":  # counted as plain attention at the keys' width, the latents' activations left out
        assert abs(sum(saved.values()) - expected) < 0.05 * expected, (sum(saved.values()), expected)
        return
    assert abs(sum(saved.values()) - expected) < 0.02 * expected, (sum(saved.values()), expected)


def test_a_token_budget_is_sized_as_the_rows_of_the_longest_sequences_it_spans(tmp_path):
    """train.tokens_per_batch=N: the training estimate is that of ceil(N / T) rows of the longest sequence T (a
    batch keeps rows × its longest within N), one row where N < T; not train.batch_size's, which a budget ignores."""
    from dataclasses import replace

    from transformers import LlamaConfig

    from eaglelab.models.drafter import DrafterFlags, Eagle3Config
    from eaglelab.plan.costs import PromptSet, TargetShape, batch_rows, train_bytes

    shape = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # fmt: skip
    d = Eagle3Config.for_target(DrafterFlags(), shape, aux_layer_ids=[2, 4, 5], draft_vocab_size=1024, max_context=512)
    t = TargetShape(layers=8, hidden=128, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=4096,
                    dtype_bytes=4, max_context=512)  # fmt: skip
    data = PromptSet("train", batch=4, prompt=100, sequence=300, response=200, bound="up to 300", trained_on=50)
    cfg = compose(["experiment=smoke", "train.batch_size=2"], tmp_path, tmp_path / "run")
    cpu = torch.device("cpu")

    def estimate(**train):
        return train_bytes(replace(cfg, train=replace(cfg.train, **train)), t, d, data, 1.0, cpu)

    assert batch_rows(replace(cfg.train, tokens_per_batch=1000), data) == 4  # 3 rows of 300 fit, 4 are spanned
    assert estimate(tokens_per_batch=1000) == estimate(batch_size=4) > estimate(batch_size=2)
    assert estimate(tokens_per_batch=200) == estimate(batch_size=1)  # a longer sequence is a batch of its own


@pytest.mark.parametrize(
    "flags,level_off",
    [
        ("fpu avx2 fma", 0),  # AVX2 (this box): no 16-bit matmul kernels
        ("fpu avx2 avx512f avx512bw", 0),  # AVX512 without BF16: bfloat16 emulated, nothing kept per shape
        ("fpu avx2 avx512f avx512_bf16", 40),  # Zen 4
        ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", 64),  # an AMX Xeon
    ],
)
def test_the_per_shape_growth_is_counted_by_the_cpus_bfloat16_kernels(flags, level_off, tmp_path, monkeypatch):
    """`kernel_cache_bytes`: what a CPU training process keeps per new batch length under 16-bit autocast, by the
    instructions the CPU computes bfloat16 with (read from a written cpuinfo: no such CPUs here), levelling off at
    that kind's reading; nothing in float32, and no more batches than the run has."""
    import eaglelab.core.devices
    import eaglelab.plan.costs
    from eaglelab.plan.costs import KERNELS_PER_NEW_BATCH, PromptSet, _trainable_parameters, kernel_cache_bytes

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real = eaglelab.core.devices.cpu_bf16_kernels
    monkeypatch.setattr(eaglelab.plan.costs, "cpu_bf16_kernels", lambda: real(str(cpuinfo)))
    cfg = compose(["experiment=smoke", "train.precision=bf16-mixed", "train.epochs=50"], tmp_path, tmp_path / "r")
    d = eaglelab.plan.costs.Eagle3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=512, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    per_batch = 2 * 2 * _trainable_parameters(d) + KERNELS_PER_NEW_BATCH
    data = PromptSet("train", 1, 8, 64, 56, "data.max_length=64", trained_on=500)  # 50 epochs of many batches
    assert kernel_cache_bytes(cfg, d, data) == level_off * per_batch
    few = PromptSet("train", 1, 8, 64, 56, "data.max_length=64", trained_on=3)  # lengths repeat after 3 batches
    assert kernel_cache_bytes(cfg, d, few) == min(level_off, 3) * per_batch
    float32 = compose(["experiment=smoke", "train.precision=32-true", "train.epochs=50"], tmp_path, tmp_path / "r")
    assert kernel_cache_bytes(float32, d, data) == 0


# --- disk: refused up front, and full while writing ---------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, bytes) -> a folder on a tmpfs of that size (unmounted afterwards); mounting needs root."""
    if os.geteuid() != 0:
        pytest.skip("a size-limited filesystem (tmpfs) needs root to mount")
    mounted = []

    def mount(name: str, size: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.slow
def test_a_cache_too_small_for_the_data_is_refused_before_regeneration(cache_dir, tmp_path, tmpfs):
    """paths.cache_dir on a filesystem that holds the target but not the captured states of the training data:
    refused before the target regenerates anything, no cache entry half-made."""
    from eaglelab.data.targets import load_target

    tiny = load_target(compose(SMOKE, cache_dir, tmp_path / "r").target, cache_dir).path
    pages = sum(-(-f.stat().st_size // 4096) * 4096 for f in tiny.iterdir())
    small = tmpfs("cache", pages + (1 << 20))  # the target and 1 MiB: the states need ~3.5 MB
    shutil.copytree(tiny, small / "targets" / tiny.name)
    proc = run_cli(SMOKE, small, tmp_path / "results")
    line = error_line(proc.returncode, proc.stderr)
    assert line.startswith("error: caching the train data needs at least ") and " and up to " in line
    assert f"but {small} has " in line and "free; free space under paths.cache_dir" in line
    assert "lower data.num_prompts or data.max_length, or use features=online (token ids only: " in line
    assert cache_entries(small) == set()
    assert_nothing_looks_complete(tmp_path / "results")


def test_the_disk_check_refuses_what_cannot_fit_and_warns_of_what_may_not(tmp_path, tmpfs, caplog):
    """The cache's disk check against a real 1 MiB file system: an entry whose prompts alone do not fit is refused
    in one line; one that fits unless every response runs to max_new_tokens goes on, saying it may fill up; one
    that fits at its largest goes on silently. (776 bytes of states + 4 of ids a token.)"""
    from eaglelab.core.errors import ResourceError
    from eaglelab.data.cache_entry import Entry
    from eaglelab.data.shard_claims import check_disk_space

    small = tmpfs("cache", 1 << 20)
    entry = lambda n, max_new: Entry(  # noqa: E731  (n prompts of 100 tokens, one shard)
        "train", "", small, "r", "f", [list(range(n))], max_new, limit=2048, tail_tokens=0, with_final=False,
        asked_tail=0, states=True,
    )  # fmt: skip
    check = lambda n, max_new: check_disk_space(entry(n, max_new), [100] * n, "hf", state_bytes=776)  # noqa: E731
    with pytest.raises(ResourceError, match=r"needs at least 1\.6 MB and up to 3\.1 MB .* has 1\.0 MB free"):
        check(20, 100)  # at least 20 × 101 tokens × 780 bytes
    caplog.clear()
    check(10, 900)  # 0.8 MB at least, 7.8 MB at most
    assert [r.getMessage() for r in caplog.records if "may fill up" in r.getMessage()], caplog.text
    caplog.clear()
    check(10, 20)  # 0.95 MB at most
    assert "may fill up" not in caplog.text
    assert not any(small.rglob("*.arrow"))


@pytest.mark.slow
def test_a_results_disk_that_fills_up_fails_clearly_keeps_the_last_checkpoint_and_resumes(cache_dir, tmp_path, tmpfs):
    """The run directory on a filesystem that holds one checkpoint but not the temporary of the next: one
    DiskFull line naming the folder, run.json failed, no metrics.json, no temporary left, last.ckpt whole; with
    room again, the same command resumes from that checkpoint and completes."""
    from eaglelab.data.targets import load_target
    from eaglelab.models.drafter import Eagle3Drafter
    from eaglelab.pipeline import build_model_config

    cfg = compose(SMOKE, cache_dir, tmp_path / "r")
    drafter = Eagle3Drafter(build_model_config(cfg, load_target(cfg.target, cache_dir)))
    trainable = sum(p.numel() for name, p in drafter.named_parameters() if not name.startswith("embed"))
    checkpoint = 12 * trainable  # float32 weights and AdamW's two moments
    results = tmpfs("results", checkpoint * 3 // 2 + (512 << 10))
    run_dir = results / "run"
    args = [*SMOKE, "train.epochs=1", "train.checkpoint_every_n_steps=2", f"hydra.run.dir={run_dir}"]

    proc = run_cli(args, cache_dir, tmp_path / "results")
    line = error_line(proc.returncode, proc.stderr)
    assert line.startswith(f"error: no space left on device (writing under {run_dir}: "), line
    assert line.endswith("free); free space there and run the same command again: the run resumes")
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert not list(run_dir.rglob("metrics.json"))
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]
    assert torch.load(run_dir / "lightning" / "last.ckpt", weights_only=False)["global_step"] == 2

    subprocess.run(["mount", "-o", "remount,size=64M", str(results)], check=True)
    done = run_cli(args, cache_dir, tmp_path / "results")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming training from" in (run_dir / "run.log").read_text()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "complete" and info["attempt"] == 2
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["memory/estimate_gb"] > 0 and metrics["memory/peak_rss_gb"] > 0


def test_a_full_disk_is_recognised_through_the_chain_of_causes(tmp_path):
    """torch's writer reports a full disk as `unexpected pos` (the OSError only in its context), pyarrow in its
    message, quotas as EDQUOT; an I/O error, or an interrupt that torch's writer turned into `unexpected pos`, is
    not a full disk."""
    from eaglelab.core.io import as_disk_full

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as e:
        torch_save = e
    full = as_disk_full(torch_save, tmp_path / "run", tmp_path / "cache")
    assert isinstance(full, DiskFull) and str(full).startswith(f"no space left on device (writing under {tmp_path}")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "cache" / "shard-00000.arrow"))
    assert f"writing under {tmp_path / 'cache'}:" in str(as_disk_full(quota, tmp_path))
    assert as_disk_full(OSError(errno.EIO, "Input/output error"), tmp_path) is None
    try:
        try:
            raise KeyboardInterrupt("signal 15")  # raised inside torch.save's write callback: the same message
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None
    except RuntimeError as e:
        assert as_disk_full(e, tmp_path) is None
    assert as_disk_full(RuntimeError("CUDA out of memory"), tmp_path) is None


def test_the_cublas_workspace_is_counted_on_a_gpu(monkeypatch):
    """What the tiny loop's H200 run was short by (0.206 GB reserved at its peak, 0.174 estimated): torch's cuBLAS
    workspace, by compute capability or as CUBLAS_WORKSPACE_CONFIG sets it; nothing on a CPU."""
    from eaglelab.plan.costs import cublas_workspace_bytes

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert cublas_workspace_bytes(cuda) == 32 * 2**20
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert cublas_workspace_bytes(cuda) == 8 * 2**20 + 128 * 2**10
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (what deterministic cuBLAS asks for)
    assert cublas_workspace_bytes(cuda) == 32 * 2**20
    assert cublas_workspace_bytes(torch.device("cpu")) == 0


def test_a_conversation_answered_turn_by_turn_is_sized_to_the_limit(cache_dir, tmp_path):
    """data.turns=all keeps a multi-turn conversation whose first round fits (eaglelab.data.prepare_set), and its
    sequence grows turn by turn, each earlier answer up to data.max_new_tokens, whatever the source's answers' length:
    the memory check sizes it so (here to data.max_length). With turns=last the whole conversation, as the source wrote
    it, must fit and sizes the sequence; one that does not is skipped."""
    from eaglelab.data.targets import load_target
    from eaglelab.plan.costs import prompt_sets

    def chat(answer: str) -> list:
        turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": answer}]
        return [*turns, *turns, {"role": "user", "content": "Go on."}]

    long, short, one = chat(" ".join(["lorem"] * 300)), chat("Sure."), [{"role": "user", "content": "What is 2 + 2?"}]
    sizes = {}
    for turns in ("all", "last"):
        overrides = [*SMOKE, f"data.turns={turns}", "data.max_length=256", "data.max_new_tokens=100"]
        cfg = compose(overrides, cache_dir, tmp_path / turns)
        target = load_target(cfg.target, cache_dir)
        (train,) = [s for s in prompt_sets(cfg, target, [long, short, one], [one]) if s.name == "train"]
        (brief,) = [s for s in prompt_sets(cfg, target, [short, one], [one]) if s.name == "train"]
        sizes[turns] = (train.sequence, train.trained_on, brief.sequence, train.response)
    assert sizes["all"][:3] == (256, 3, 256)  # (two earlier answers of 100 tokens do not fit beside the last)
    assert sizes["last"][0] < 256 and sizes["last"][1] == 2 and sizes["last"][2] < 200
    # Positions labelled (what sizes the head's logits): every answer, the two earlier ones inside the prompt at their
    # budget, under `all`; the last answer alone under `last`.
    assert 2 * 100 < sizes["all"][3] <= 256 and sizes["last"][3] <= 100, sizes


def test_the_data_plan_of_an_8b_target_at_200k_conversations():
    """benchmarks/data_plan.py's figures, from the preflight's own data_plan: 3 aux states of 4,096 bf16 values, the
    int32 label and id are 24,584 bytes a token; 200,000 × 2,048 tokens of them are 10.1 TB per copy, each epoch
    reads them all, and a step of 32,768 tokens reads 805 MB per rank. KL keeps the final state too (+8,192 bytes)."""
    from benchmarks.data_plan import plan

    p = plan("llama-3.1-8b", 200_000, 2048, [])
    assert (p.bytes_per_token, p.tokens, p.disk) == (24_584, 409_600_000, 409_600_000 * 24_584)
    assert p.epoch_read == 409_600_000 * 24_584 and p.step_tokens * p.bytes_per_token == 32_768 * 24_584
    lines = p.lines(free=2 * 10**12)
    assert lines[0].startswith("the training set holds at most 10.1 TB in the cache (200,000 sequences")
    assert lines[0].endswith("; 2.0 TB free there")
    assert "each GPU reads" in lines[2]
    assert plan("llama-3.1-8b", 200_000, 2048, ["train.loss=kl"]).bytes_per_token == 24_584 + 8_192
    assert plan("llama-3.1-8b", 200_000, 2048, ["features=online"]).disk == 409_600_000 * 4  # token ids only
