"""The vLLM evaluation spread over a trial's ranks: each rank's devices measure a share, rank 0 tabulates it.

After training, every rank of a trial holds the same drafter and a device of its own, and the vLLM evaluation is
a few engine jobs (`Evaluation`s: the held-out set's, the long-context and template suites') whose parts need nothing
from each other until their rows are tabulated:

    acceptance at depth k   one engine drafting k tokens, its greedy outputs then captured for the parity along
                            vLLM's own continuation
    served at concurrency c the timed passes without the drafter, then with it at each timed k, on one device:
                            each speedup is two timings of the same hardware

Those units are dealt to the ranks that own devices (`evaluators`: every rank; with eval.vllm.tensor_parallel_size
= p, the first of each p consecutive local ranks, over its p devices), the costliest first to the least loaded
(rank 0 starts loaded with the simulated evaluator it runs first). Each rank runs its units of a job as one engine
process on its own devices (on a CPU box: its share of the node's cores), and rank 0 gathers the rows over a
process group of its own on gloo (eaglelab.core.ranks.host_group), whose timeout is the evaluation's bound, not the
training backend's: NCCL's 30 minutes would end a rank that waits longer than that for the others' engines.
In one process nothing is cut: each job runs whole, in its own folder, as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from eaglelab.core.errors import EaglelabError
from eaglelab.core.ranks import current as current_ranks
from eaglelab.core.ranks import gather, host_group
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.engine.process import cpu_groups, run_engine
from eaglelab.evaluate.held_out import ALONG, along_vllm, along_vllm_room, held_out_job
from eaglelab.evaluate.suites import suites_job


@dataclass(frozen=True)
class Evaluation:
    """One engine job of the evaluation (an EvaluateJob), as one process would run it, before it is dealt out."""

    name: str  # "held_out", "suites": the key its merged rows come back under
    job: EvaluateJob  # its parts' own folders (`log_dir`, `along_vllm.folder`) are set where they run
    workdir: Path
    desc: str  # its progress bar
    batch_size: int  # the simulated evaluator's, along vLLM's outputs
    beside_engine_bytes: int = 0  # what its process holds beside its engines on a GPU (the capture along its outputs)

    def units(self) -> list[tuple[str, int, float]]:
        """(kind, value, cost) of each separable part: ("k", k) an acceptance engine over all the job's prompts (and
        the capture along its outputs), ("c", c) the served passes at concurrency c (a server per method, then its
        passes). Cost in in-process engine starts, calibrated on SmolLM2 on the 2-core box (2026-12-05, one
        process): an engine start ~15 s, its generation ~1/40 of that a prompt, the capture along it ~5 s + 1/130 a
        sequence; a server start ~30 s (2), and a pass ~5 s (0.35) at c = 1 and twice that at c = 16, whatever the
        prompt length up to 2k tokens."""
        j = self.job
        prompts = sum(len(g["prompts"]) for g in j.groups.values())
        capture = 0.3 + prompts / 130 if j.along_vllm else 0.0
        units = [("k", k, 1.0 + prompts / 40 + capture) for k in sorted(j.ks)]
        if j.served:
            methods, groups = 1 + len(j.throughput_ks), len(j.timed_groups or j.groups)
            passes = j.repeats * j.waves * groups
            units += [("c", c, methods * (2.0 + 0.35 * passes * (1 + c / 16))) for c in sorted(j.concurrencies)]
        return units


@dataclass
class Share:
    """What one rank runs of one job: its depths and its concurrencies."""

    rank: int
    evaluation: str  # its Evaluation's name
    ks: list[int] = field(default_factory=list)
    concurrencies: list[int] = field(default_factory=list)


def evaluations(cfg, run_dir: Path, drafter, serving, held_out, suites) -> list[Evaluation]:
    """A run's vLLM evaluation: the held-out set's engine job and, with the long-context or template suite, theirs."""
    job = held_out_job(cfg, run_dir, drafter, serving, held_out)
    out = [Evaluation("held_out", job, run_dir / "vllm", "evaluate (vLLM)", 4, along_vllm_room(job, drafter))]
    if (job := suites_job(cfg, drafter, suites, run_dir, serving)) is not None:
        out.append(Evaluation("suites", job, run_dir / "suites" / "vllm", "suites (vLLM)", cfg.train.batch_size,
                              along_vllm_room(job, drafter)))  # fmt: skip
    return out


def runs_engines(local_rank: int, tensor_parallel_size: int) -> bool:
    """Whether the rank of this local rank starts engines: every rank, or with p devices per engine the first of each
    p consecutive local ranks (its engine over them; the others' devices are its)."""
    return local_rank % tensor_parallel_size == 0


def evaluators(placements: list[tuple[str, int]], tensor_parallel_size: int) -> list[int]:
    """The ranks whose devices run engines (`runs_engines`). `placements`: each rank's (host, local rank)."""
    return [r for r, (_, local) in enumerate(placements) if runs_engines(local, tensor_parallel_size)]


def deal(jobs: list[Evaluation], ranks: list[int], head_start: float = 1.0) -> list[Share]:
    """Every job's units to `ranks`: the costliest first, each to the least loaded rank (ties: the lowest);
    rank 0 starts `head_start` engine starts behind (its simulated evaluator). -> one Share per rank and job
    that got any unit, in job order."""
    load = {r: (head_start if r == 0 else 0.0) for r in ranks}
    shares: dict[tuple[int, str], Share] = {}
    units = [(cost, i, kind, value) for i, job in enumerate(jobs) for kind, value, cost in job.units()]
    for cost, i, kind, value in sorted(units, key=lambda u: (-u[0], u[1], u[2], u[3])):
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += cost
        share = shares.setdefault((rank, jobs[i].name), Share(rank, jobs[i].name))
        (share.ks if kind == "k" else share.concurrencies).append(value)
    order = {job.name: i for i, job in enumerate(jobs)}
    out = sorted(shares.values(), key=lambda s: (order[s.evaluation], s.rank))
    for s in out:
        s.ks.sort()
        s.concurrencies.sort()
    return out


def part_of(evaluation: Evaluation, share: Share, workdir: Path) -> tuple[EvaluateJob, int]:
    """The engine job of `share` (its depths and, only where it has any, the capture along their outputs; its
    concurrencies; its folders) and its progress steps."""
    j = evaluation.job
    along = {**j.along_vllm, "folder": str(workdir / ALONG)} if j.along_vllm and share.ks else None
    part = replace(j, ks=share.ks, concurrencies=share.concurrencies, log_dir=str(workdir), along_vllm=along,
                   throughput_ks=j.throughput_ks if share.concurrencies else [])  # fmt: skip
    served = (1 + len(part.throughput_ks)) * len(share.concurrencies) * len(part.timed_groups or part.groups)
    return part, len(share.ks) + bool(along) + (served if part.throughput_ks else 0)


def cpu_share(placements: list[tuple[str, int]], mine: list[int], rank: int) -> list[int] | None:
    """On a CPU box where several evaluating ranks share a host: this rank's contiguous share of its cores (one
    engine's threads per core, not every engine's on every core). None: a GPU, or alone on its host, or fewer
    cores than engines (they share them)."""
    import torch

    host = placements[rank][0]
    here = [r for r in mine if placements[r][0] == host]
    cpus = sorted(os.sched_getaffinity(0))
    if torch.cuda.is_available() or len(here) < 2 or len(cpus) < len(here):
        return None
    return cpu_groups(cpus, len(here))[here.index(rank)]


def run_share(evaluation: Evaluation, share: Share, workdir: Path, drafter, timeout: int, cpus, dealt: bool) -> dict:
    """One rank's part of an evaluation: the engine's rows, and the simulated evaluator along its greedy outputs."""
    part, steps = part_of(evaluation, share, workdir)
    beside = evaluation.beside_engine_bytes if part.along_vllm else 0
    result = run_engine(part, workdir, timeout, evaluation.desc, cpus=cpus, dealt=dealt, engines=steps,
                        beside_engine_bytes=beside)  # fmt: skip
    along = {}
    if part.along_vllm:
        greedy = [r for r in result["acceptance"] if r.get("temperature", 0.0) == 0]
        along = along_vllm(drafter, workdir / ALONG, greedy, evaluation.batch_size)
        shutil.rmtree(workdir / ALONG, ignore_errors=True)  # (its states: GBs at scale; the rows hold the result)
    return {"acceptance": result["acceptance"], "throughput": result["throughput"], "along": along}


class Spread:
    """The evaluation's engine jobs over the trial's ranks, for the block: every rank enters it with the same `jobs`
    (creating its process group is collective), rank 0 may first run what only it runs (the simulated evaluator),
    then each calls `run`. No jobs, or one process: nothing is created, and `run` runs every job whole."""

    def __init__(self, jobs: list[Evaluation], tensor_parallel_size: int, timeout: int):
        self.jobs, self.tensor_parallel_size, self.timeout = jobs, tensor_parallel_size, timeout
        self._group = contextlib.nullcontext() if not jobs else host_group(timeout * len(jobs) + 3600)
        # (the bound: each rank runs at most one engine process per job, each within `timeout`; rank 0 its simulated
        # evaluation besides)

    def __enter__(self) -> Spread:
        """The group, and each rank's share dealt (before rank 0's own first work: the others start at once)."""
        self.group = self._group.__enter__()
        if self.jobs:
            self.placements = gather((socket.gethostname(), current_ranks().local_rank), self.group)
            self.evaluators = evaluators(self.placements, self.tensor_parallel_size)
            self.shares = deal(self.jobs, self.evaluators)
        return self

    def __exit__(self, *exc):
        return self._group.__exit__(*exc)

    def run(self, drafter) -> tuple[dict[str, dict], list[dict]]:
        """This rank's share. -> on rank 0: ({job name: {"acceptance", "throughput", "along"}} merged over the ranks,
        one row per rank and job saying what it ran and for how long); elsewhere ({}, []). A rank's failure is raised
        on rank 0, naming the rank."""
        if not self.jobs:
            return {}, []
        me, placements, mine, shares = current_ranks(), self.placements, self.evaluators, self.shares
        several = len(mine) > 1
        cpus = cpu_share(placements, mine, me.rank) if me.rank in mine else None
        by_name, done = {job.name: job for job in self.jobs}, {}
        for share in (s for s in shares if s.rank == me.rank):
            job = by_name[share.evaluation]
            workdir = job.workdir / f"rank{me.rank}" if several else job.workdir
            t0 = time.perf_counter()
            try:
                done[share.evaluation] = run_share(job, share, workdir, drafter, self.timeout, cpus, me.world_size > 1)
            except Exception as e:  # (the rank stays in the trial: rank 0 raises it, naming the rank)
                done[share.evaluation] = {
                    "error": str(e) if isinstance(e, EaglelabError) else f"{type(e).__name__}: {e}"
                }
            done[share.evaluation]["seconds"] = time.perf_counter() - t0
        every = gather(done, self.group)
        if not me.primary:
            return {}, []
        return merged(every), [
            {
                "rank": share.rank,
                "host": placements[share.rank][0],
                "job": share.evaluation,  # (the CSV column keeps its name)
                "ks": " ".join(map(str, share.ks)),
                "concurrencies": " ".join(map(str, share.concurrencies)),
                "seconds": round(every[share.rank][share.evaluation]["seconds"], 1),
            }
            for share in shares
        ]


def merged(every: list[dict]) -> dict[str, dict]:
    """Each rank's results per job -> one result per job, as one engine would have returned it."""
    out = {}
    for rank, results in enumerate(every):
        for name, result in results.items():
            if "error" in result:
                raise EaglelabError(f"rank {rank}'s share of the {name} evaluation: {result['error']}")
            m = out.setdefault(name, {"acceptance": [], "throughput": [], "along": {}})
            m["acceptance"] += result["acceptance"]
            m["throughput"] += result["throughput"]
            m["along"].update(result["along"])
    for m in out.values():  # (stable: each depth's groups in their job's order)
        m["acceptance"].sort(key=lambda r: (r["k"], r.get("temperature", 0.0)))
    return out


def rank_seconds(shares: list[dict]) -> dict[str, float]:
    """`Spread.run`'s record -> metrics.json's `time/evaluate_vllm_rank{r}_s`: each rank's own engine time."""
    ranks = sorted({s["rank"] for s in shares})
    return {f"time/evaluate_vllm_rank{r}_s": sum(s["seconds"] for s in shares if s["rank"] == r) for r in ranks}
