"""eaglelab.evaluate.over_ranks: the evaluation's engine jobs dealt to a trial's ranks. The real two-rank evaluation
(two engine processes, gloo, rank 0 tabulating both) is
tests/test_vllm.py::test_evaluate_a_checkpoint_on_its_own_over_two_ranks; here, the dealing itself on the jobs a
default run makes."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eaglelab.core.errors import EaglelabError
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.evaluate.over_ranks import Evaluation, cpu_share, deal, evaluators, merged, part_of

GROUP = {"prompts": [[1, 2]], "max_tokens": [4]}


def job(name="held_out", ks=(1, 3, 8), concurrencies=(1, 4, 16), timed_groups=None) -> Evaluation:
    """An engine job shaped as eaglelab.evaluate.held_out.held_out_job and .suites.suites_job make them."""
    j = EvaluateJob(target="/t", drafter="/d", dtype="float32", max_model_len=64, groups={"": GROUP}, ks=list(ks),
                    concurrencies=list(concurrencies), throughput_ks=[3], repeats=3, waves=1,
                    along_vllm={"layer_ids": [1, 2]}, timed_groups=timed_groups)  # fmt: skip
    return Evaluation(name, j, Path("/runs/r") / name, name, batch_size=4, beside_engine_bytes=10)


JOBS = [job(), job("suites", ks=(3,), concurrencies=(1,), timed_groups={"512": GROUP, "1024": GROUP})]


def test_one_process_runs_each_job_whole_in_its_own_folder():
    shares = deal(JOBS, [0])
    assert [(s.evaluation, s.ks, s.concurrencies) for s in shares] == [
        ("held_out", [1, 3, 8], [1, 4, 16]),
        ("suites", [3], [1]),
    ]
    engine_job, steps = part_of(JOBS[0], shares[0], JOBS[0].workdir)
    assert engine_job == replace(
        JOBS[0].job,
        log_dir="/runs/r/held_out",
        along_vllm={"layer_ids": [1, 2], "folder": "/runs/r/held_out/along_vllm"},
    )
    assert steps == 3 + 1 + 2 * 3  # three acceptance engines, the capture along them, 2 methods × 3 concurrencies


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_every_depth_and_concurrency_is_measured_once_and_the_load_balanced(ranks):
    shares = deal(JOBS, list(range(ranks)))
    for j in JOBS:
        mine = [s for s in shares if s.evaluation == j.name]
        assert sorted(k for s in mine for k in s.ks) == sorted(j.job.ks)
        assert sorted(c for s in mine for c in s.concurrencies) == sorted(j.job.concurrencies)
    cost = {(j.name, kind, value): c for j in JOBS for kind, value, c in j.units()}
    load = [1.0 if r == 0 else 0.0 for r in range(ranks)]  # (rank 0's head start: its simulated evaluator)
    for s in shares:
        load[s.rank] += sum(cost[s.evaluation, "k", k] for k in s.ks) + sum(
            cost[s.evaluation, "c", c] for c in s.concurrencies
        )
    # Greedy to the least loaded: no rank ends more than one unit above the least loaded one.
    assert max(load) - min(load) <= max(cost.values()) + 1.0, load
    if ranks == 2:  # the costliest unit goes to rank 1, as rank 0 starts loaded (its simulated evaluator)
        name, kind, value = max(cost, key=cost.get)
        (costliest,) = [
            s for s in shares if s.evaluation == name and value in (s.ks if kind == "k" else s.concurrencies)
        ]
        assert costliest.rank == 1


def test_a_part_without_depths_captures_nothing_and_one_without_concurrencies_serves_nothing():
    (served,) = [s for s in deal([job(ks=(), concurrencies=(4,))], [0])]
    engine_job, steps = part_of(job(), served, Path("/w"))
    assert engine_job.along_vllm is None and steps == 2 and engine_job.ks == []
    (counted,) = deal([job(concurrencies=())], [0])
    engine_job, steps = part_of(job(), counted, Path("/w"))
    assert engine_job.throughput_ks == [] and steps == 3 + 1


def test_an_engine_job_fails_where_it_is_built():
    """A misspelled field, a missing one or a value of the wrong type fails in the parent, naming the field, not
    minutes later in an engine process; what is sent is read back as the same typed job."""
    with pytest.raises(TypeError, match="max_tokens"):
        EvaluateJob(target="/t", drafter="/d", dtype="float32", max_model_len=64, ks=[1], groups={}, max_tokens=[3])
    with pytest.raises(TypeError, match="drafter"):
        EvaluateJob(target="/t", dtype="float32", max_model_len=64, ks=[1], groups={})
    with pytest.raises(TypeError, match="ks"):
        EvaluateJob(target="/t", drafter="/d", dtype="float32", max_model_len=64, ks="1 3", groups={})
    with pytest.raises(TypeError, match="dtype"):
        EvaluateJob(target="/t", drafter="/d", dtype="fp32", max_model_len=64, ks=[1], groups={})
    j = JOBS[1].job
    assert EvaluateJob.from_json(json.loads(json.dumps(j.to_json()))) == j


def test_tensor_parallel_engines_take_groups_of_a_nodes_devices():
    placements = [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert evaluators(placements, 1) == list(range(8))
    assert evaluators(placements, 2) == [0, 2, 4, 6]
    assert evaluators(placements, 4) == [0, 4]


def test_ranks_sharing_a_cpu_host_split_its_cores():
    cpus = sorted(os.sched_getaffinity(0))
    placements = [("a", 0), ("a", 1), ("b", 0)]
    shares = [cpu_share(placements, [0, 1, 2], r) for r in range(3)]
    assert shares[2] is None  # alone on its host: the engine binds as vLLM would
    if len(cpus) < 2 or torch.cuda.is_available():  # fewer cores than engines (they share them), or a GPU's devices
        assert shares[0] is None and shares[1] is None
    else:
        assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
        assert set(shares[0]) | set(shares[1]) <= set(cpus)


def test_rank_zero_merges_the_ranks_rows_and_names_a_rank_that_failed():
    a = {"acceptance": [{"k": 8, "group": ""}], "throughput": [{"c": 4}], "along": {("", 8): "x"}}
    b = {"acceptance": [{"k": 1, "group": ""}, {"k": 3, "group": ""}], "throughput": [{"c": 1}], "along": {}}
    out = merged([{"held_out": b}, {"held_out": a}])["held_out"]
    assert [r["k"] for r in out["acceptance"]] == [1, 3, 8]
    assert out["throughput"] == [{"c": 1}, {"c": 4}] and out["along"] == {("", 8): "x"}
    with pytest.raises(EaglelabError, match="rank 1's share of the suites evaluation: vLLM engine failed"):
        merged([{"held_out": b}, {"suites": {"error": "vLLM engine failed (exit 1)"}}])


def test_with_engines_over_several_devices_only_each_groups_first_rank_starts_them():
    """eval.vllm.tensor_parallel_size = p: local ranks 0, p, 2p, ... start engines over their p devices; the others
    keep their drafter on the CPU and let go of their device memory first (eaglelab.pipeline.execute: on a GPU
    only, which this box has not: what is checked here is who does which)."""
    from eaglelab.evaluate.over_ranks import evaluators, runs_engines

    assert [runs_engines(local, 1) for local in range(4)] == [True] * 4
    assert [runs_engines(local, 2) for local in range(4)] == [True, False, True, False]
    placements = [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert evaluators(placements, 4) == [0, 4]
