"""Where a vLLM engine started beside training runs, and how much of the device it may take
(eaglelab.core.devices.engine_placement). There is no GPU here: each test substitutes the CUDA memory query
(torch.cuda.mem_get_info, memory_reserved, device_count, is_available) with the figures of the GPU it names."""

import pytest
import torch

from eaglelab.core.devices import ENGINE_HEADROOM_BYTES, engine_placement
from eaglelab.core.errors import EaglelabError

GiB = 1 << 30


@pytest.fixture
def h100(monkeypatch):
    """Substituted CUDA query: 8 × 80 GiB devices; `free[i]` is what device i has free now."""
    free = {i: 80 * GiB for i in range(8)}
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 80 * GiB - free[device.index])

    def mem_get_info(device):
        asked.append(device)
        return free[device.index], 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    return free, asked


def test_the_engine_takes_what_is_free_beside_the_target_on_the_ranks_own_device(h100, monkeypatch):
    free, asked = h100
    free[3] = 80 * GiB - 17 * GiB  # rank 3 holds an 8B target in bf16 (16 GB) and its CUDA context
    monkeypatch.setenv("LOCAL_RANK", "3")
    job, env = engine_placement()
    assert asked == [torch.device("cuda", 3)]
    assert env == {"CUDA_VISIBLE_DEVICES": "3"}  # not device 0, where rank 0's target is
    share = job["gpu_memory_utilization"]
    assert share * 80 * GiB <= free[3] - ENGINE_HEADROOM_BYTES < (share + 1e-4) * 80 * GiB  # vLLM's check passes
    assert 0.77 < share < 0.78  # vLLM's default (0.92) would ask for 73.6 GiB of the 63 free, and refuse

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")  # the node's numbering, as Slurm hands it out
    assert engine_placement()[1] == {"CUDA_VISIBLE_DEVICES": "7"}


def test_a_device_too_full_for_an_engine_or_a_share_too_large_is_one_clear_line(h100, monkeypatch):
    free, _ = h100
    free[0] = int(2.5 * GiB)
    with pytest.raises(EaglelabError, match=r"needs at least 2 GiB but cuda:0 has 2.5 of 80.0 GiB free .*eval.vllm"):
        engine_placement()
    free[0] = 40 * GiB
    with pytest.raises(EaglelabError, match=r"gpu_memory_utilization=0.9 asks for 72.0 GiB but cuda:0 has 40.0"):
        engine_placement(0.9)
    assert engine_placement(0.4) == ({"gpu_memory_utilization": 0.4}, {"CUDA_VISIBLE_DEVICES": "0"})


def test_on_a_cpu_box_nothing_is_placed():
    if torch.cuda.is_available():
        pytest.skip("this box has CUDA")
    assert engine_placement() == ({}, {})


def test_a_cpu_engines_kv_cache_holds_its_job_and_no_more(tmp_path):
    """vLLM's CPU backend zeroes a fixed-size KV cache at start (~1.5 s per GiB here): each engine gets what its
    requests need at once, in whole 128-token blocks at the target's and drafter's bytes per token, twice over; at
    least one context-window request (vLLM refuses less); at most the 2 GiB every engine got before."""
    import json
    from dataclasses import replace

    from eaglelab.engine.jobs import EvaluateJob, GenerateJob
    from eaglelab.engine.llm import cpu_kv_cache_bytes

    shape = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    for name, layers in (("target", 8), ("drafter", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": layers}))
    per_token = {None: 8 * 2 * 64 * 4, 3: 9 * 2 * 64 * 4}  # K and V, float32; drafting adds the drafter's layer
    models = {"target": str(tmp_path / "target"), "dtype": "float32", "max_model_len": 256}
    job = EvaluateJob(**models, drafter=str(tmp_path / "drafter"), ks=[3],
                      groups={"": {"prompts": [[1] * 100] * 8, "max_tokens": 24}})  # fmt: skip
    # 8 requests of 100 + 24 + 3 + 1 tokens: one block each
    assert cpu_kv_cache_bytes(job, 3) == 2 * 8 * 128 * per_token[3]
    one = replace(job, groups={"": {"prompts": [[1] * 10], "max_tokens": 24}})
    assert cpu_kv_cache_bytes(one, None) == 2 * (256 + 128) * per_token[None]  # one request
    groups = {"a": {"prompts": [[1] * 200] * 3, "max_tokens": [60, 70, 80]}}
    assert cpu_kv_cache_bytes(replace(job, groups=groups), 3) == 2 * 3 * 3 * 128 * per_token[3]
    regen = GenerateJob(**models, shards={"0": [[1] * 100] * 2, "1": [[1] * 120]}, tail_tokens=8, shard_dir="/s",
                        max_tokens={"0": [20, 20], "1": [40]})  # fmt: skip
    # 100 + 20 + 8 tail + 1 = 129 tokens: two blocks each; 120 + 40 + 8 + 1: two blocks
    assert cpu_kv_cache_bytes(regen, None) == 2 * (2 + 2 + 2) * 128 * per_token[None]
    many = replace(job, groups={"": {"prompts": [[1] * 100] * 100_000, "max_tokens": 24}})
    assert cpu_kv_cache_bytes(many, 3) == 2 << 30  # larger jobs queue
    (tmp_path / "target" / "config.json").write_text(json.dumps({"n_layer": 8, "n_embd": 128}))  # GPT-2's names
    assert cpu_kv_cache_bytes(job, 3) == 2 << 30  # what every engine got before


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("bf16", [False, True])
def test_every_draft_step_attends_through_a_fused_kernel(window, bf16):
    """The drafter's attention never falls back to SDPA's math path (which keeps B·h·T² scores): each draft step's
    call is asked of SDPA's own chooser, in float32 and under bf16 autocast, with and without a sliding window (a
    mask). On the H200 every step took cuDNN's kernel (benchmarks/step_scaling.py); here, the CPU's flash."""
    from test_drafter import small_config

    from eaglelab.core.config import TrainConfig
    from eaglelab.core.devices import SdpaKernels
    from eaglelab.train.batches import Batch
    from eaglelab.train.ttt_module import DrafterModule

    module = DrafterModule(small_config(attention_window=window), TrainConfig())
    module.drafter.set_vocab(torch.arange(30))
    ids = torch.randint(0, 50, (2, 40))
    batch = Batch(input_ids=ids, target_next=ids.roll(-1, 1), aux=torch.randn(2, 40, 144),
                  prompt_len=torch.tensor([1, 9]), seq_len=torch.tensor([40, 33]), index=torch.arange(2))  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), SdpaKernels() as kernels:
        module.ttt(batch, 3)[0].backward()
    assert kernels.log == ["flash"] * 3


def test_a_call_sdpa_cannot_fuse_is_reported_as_math():
    from eaglelab.core.devices import SdpaKernels

    q, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 16)  # (value head dim unlike the query's: no fused kernel)
    with SdpaKernels() as kernels:
        torch.nn.functional.scaled_dot_product_attention(q, q, v)
    assert kernels.log == ["math"]


def test_a_data_engine_over_several_devices_takes_the_next_ones_and_the_tightest_share(h100):
    """data.tensor_parallel_size=2 (substituted H100s): this process's device and the next one, at the share the
    fuller of the two allows; more devices than are visible is one line naming stage=prepare."""
    free, _ = h100
    free[1] = 40 * GiB
    job, env = engine_placement(devices=2)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert 0.48 < job["gpu_memory_utilization"] < 0.49  # (40 − 1) / 80: device 1's room, not device 0's
    with pytest.raises(EaglelabError, match=r"an engine over 9 devices .* 8 visible; prepare the data alone first .*"
                                            r"or evaluate in one process \(checkpoint=RUN_DIR\)"):  # fmt: skip
        engine_placement(devices=9)


def test_a_gpu_job_on_a_cpu_only_install_is_one_line_naming_the_fix(tmp_path):
    """torch here is the CPU build, as `make setup` installs it on a machine where nvidia-smi finds no GPU (a login
    node): a job given GPUs (by Slurm, CUDA_VISIBLE_DEVICES, or the driver's device nodes) or asking for one stops
    before any work; a CPU job, or one on a machine without GPUs, goes on."""
    from eaglelab.core.devices import check_torch_build

    assert torch.version.cuda is None, "this test needs the CPU build of torch (the CPU box's)"
    no_gpu = tmp_path / "dev"
    no_gpu.mkdir()
    check_torch_build("auto", environ={}, dev=str(no_gpu))
    check_torch_build("cpu", environ={"SLURM_JOB_GPUS": "0"}, dev=str(no_gpu))
    check_torch_build("auto", environ={"CUDA_VISIBLE_DEVICES": ""}, dev=str(no_gpu))
    for accelerator, environ in [
        ("gpu", {}),
        ("auto", {"SLURM_JOB_GPUS": "0,1"}),
        ("auto", {"SLURM_GPUS_ON_NODE": "8"}),
        ("auto", {"CUDA_VISIBLE_DEVICES": "0"}),
    ]:
        with pytest.raises(EaglelabError, match=r"CPU build of torch .*make setup DEVICE=cuda"):
            check_torch_build(accelerator, environ=environ, dev=str(no_gpu))
    (no_gpu / "nvidia0").touch()  # the driver's device node: a GPU machine
    with pytest.raises(EaglelabError, match="DEVICE=cuda"):
        check_torch_build("auto", environ={}, dev=str(no_gpu))


def test_a_cpu_steps_freed_memory_is_kept_for_the_next_step():
    """eaglelab.core.devices.keep_freed_memory, in a fresh process: a step that makes and frees three 16 MB temporaries
    has their pages faulted in again every time under glibc's initial thresholds (mmap 128 KB, trim 128 KB; pinned
    there, since glibc adapts them to what a process happened to free, which made the "before" differ from run to
    run); once applied, the freed memory is reused and nothing is faulted in."""
    import resource
    import subprocess
    import sys

    code = """
import ctypes, ctypes.util, resource, torch
from eaglelab.core.devices import keep_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallopt(-3, 128 << 10), libc.mallopt(-1, 128 << 10)  # (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD: glibc's initial)
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        temporaries = [torch.ones(4 << 20) for _ in range(3)]  # (a step's: 3 x 16 MB, written)
        del temporaries
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
plain = faults()
applied = keep_freed_memory()
faults()
print(plain, faults(), applied)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    plain, kept, applied = int(out[0]), int(out[1]), out[2] == "True"
    pages = 5 * 3 * (16 << 20) // resource.getpagesize()
    assert applied and plain > pages // 2 and kept < pages // 50, (plain, kept, pages)
