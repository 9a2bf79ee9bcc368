"""Where a vLLM engine started beside training runs, and how much of the device it may take
(eaglelab.devices.engine_placement). There is no GPU here: each test substitutes the CUDA memory query
(torch.cuda.mem_get_info, memory_reserved, device_count, is_available) with the figures of the GPU it names."""

import pytest
import torch

from eaglelab.devices import ENGINE_HEADROOM_BYTES, engine_placement
from eaglelab.errors import EaglelabError

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
