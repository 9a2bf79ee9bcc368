"""Streamed states (`features=stream`), the trainers' side: the stream's plan (every sample the ranks will read, in
the order they read it), the samplers that ask for samples by their position in it, and the stream's life around
`fit`: the store, the supervised engine, a reader per rank. The data side is eaglelab.data.stream."""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import Sampler

from eaglelab.config import RunConfig
from eaglelab.data.store import Sequences
from eaglelab.data.stream import (
    STORE_FILL,
    EngineSupervisor,
    StoreAddress,
    StoreMaster,
    StreamReader,
    StreamSpec,
    connect,
    publish_json,
    read_json,
    sample_bytes,
)
from eaglelab.errors import DataError
from eaglelab.ranks import barrier, broadcast
from eaglelab.ranks import current as current_ranks
from eaglelab.training import EpochBatches

log = logging.getLogger("eaglelab")


class StreamPlan:
    """Every sample of a run, epoch by epoch: the training batches of the epoch's permutation (each global batch
    rank by rank), then the epoch's validation batches (batch j of every rank, rank by rank). `rows`: each position's
    row in the token store."""

    def __init__(self, train: EpochBatches, train_rows: list[int], val_batches: list[list[list[int]]],
                 val_rows: list[int], epochs: int, world: int):  # fmt: skip
        rows: list[int] = []
        self.train_start: dict[tuple[int, int], int] = {}  # (epoch, global batch) -> its first position
        self.val_start: dict[tuple[int, int], int] = {}  # (epoch, validation batch j) -> its first position
        self.epoch_end: list[int] = []
        kept = train.epoch
        for e in range(epochs):
            train.set_epoch(e)
            for b, batch in enumerate(train._global_batches()):
                self.train_start[e, b] = len(rows)
                for r in range(world):
                    rows += [train_rows[i] for i in batch[r::world].tolist()]
            for j in range(max(map(len, val_batches), default=0)):
                self.val_start[e, j] = len(rows)
                for share in val_batches:
                    rows += [val_rows[i] for i in (share[j] if j < len(share) else [])]
            self.epoch_end.append(len(rows))
        train.set_epoch(kept)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.val_batches = val_batches
        self.widest = max([len(b) for b in _each(train, epochs)] + [sum(map(len, r)) for r in zip(*val_batches)] + [1])


def _each(train: EpochBatches, epochs: int):
    kept = train.epoch
    for e in range(min(epochs, 1)):  # (every epoch's batches have the same sizes: the first stands for all)
        train.set_epoch(e)
        yield from train._global_batches()
    train.set_epoch(kept)


class StartMarker:
    """Where this attempt's reading starts (`<stream>-start`, published once by rank 0 with the first batch asked
    for: a resumed run's first unread one), so the engine captures nothing the trainers will not read."""

    def __init__(self):
        self.store, self.name, self.done = None, "", False

    def __call__(self, position: int) -> None:
        if not self.done and self.store is not None:
            publish_json(self.store, f"{self.name}-start", position)
        self.done = True


class PositionedBatches(EpochBatches):
    """EpochBatches whose items carry their position in the stream: (index, position)."""

    plan: StreamPlan
    start_marker: StartMarker

    def _share(self, i: int, batch, rank: int, world: int) -> list:
        start = self.plan.train_start[self.epoch, i]
        self.start_marker(start)
        start += sum(len(batch[q::world]) for q in range(rank))
        return [(index, start + k) for k, index in enumerate(batch[rank::world].tolist())]


class PositionedValidation(Sampler):
    """This rank's validation batches, their items as (index, position) in the current epoch's validation part."""

    def __init__(self, plan: StreamPlan, rank: int, epoch_of, start_marker: StartMarker):
        self.plan, self.rank, self.epoch_of, self.start_marker = plan, rank, epoch_of, start_marker

    def __len__(self) -> int:
        return len(self.plan.val_batches[self.rank])

    def __iter__(self):
        epoch, shares = self.epoch_of(), self.plan.val_batches
        self.start_marker(self.plan.val_start.get((epoch, 0), 0))  # (a run resumed after its epoch's training)
        for j, batch in enumerate(shares[self.rank]):
            start = self.plan.val_start[epoch, j] + sum(len(s[j]) for s in shares[: self.rank] if j < len(s))
            yield [(index, start + k) for k, index in enumerate(batch)]


@dataclass
class Stream:
    reader: StreamReader
    spec: StreamSpec
    store: object | None  # rank 0's client (the window's memory), else None
    metrics: dict = field(default_factory=dict)  # rank 0's, once the stream has ended


@contextlib.contextmanager
def streamed_states(cfg: RunConfig, run_dir: Path, features: Sequences, plan: StreamPlan, engine: dict,
                    aux_width: int, hidden: int, with_final: bool, lookahead_batches: int):  # fmt: skip
    """The stream for this attempt's `fit`: on rank 0 the store (a mooncake_master started here, or the one
    `features.stream.master` names) with the window mounted in this process's memory, and the supervised engine;
    on every rank a reader. -> Stream (its metrics filled on rank 0 when it ends)."""
    s, rank = cfg.features.stream, current_ranks().rank
    master = supervisor = holder = spec = stream = None
    try:
        if rank == 0:
            longest = int(features.tokens.lengths()[np.unique(plan.rows)].max())
            per_sample = sample_bytes(longest, aux_width, hidden, with_final)
            window = int(s.window_gb * 1e9 // per_sample)
            need = lookahead_batches * plan.widest  # samples the loaders read ahead of the step, at most
            if window < need:
                raise DataError(
                    f"features.stream.window_gb={s.window_gb} holds {window} samples of up to {longest} tokens, but "
                    f"the trainers read up to {need} ahead of their step; raise it to at least "
                    f"{need * per_sample / 1e9:.3g}"
                )
            # The window's samples, and a capture batch's raw objects (every captured layer, 4 bytes a value at most)
            raw = 32 * longest * (aux_width + 2 * hidden) * 4
            segment = int((window * per_sample + raw) / STORE_FILL)
            if s.master:
                address = StoreAddress.parse(s.master, s.metadata_port)
            else:
                master = StoreMaster(run_dir / "stream" / "mooncake_master.log")
                address = master.address
            holder = connect(address, segment_bytes=segment)
            spec = StreamSpec(uuid.uuid4().hex[:12], asdict(address), aux_width, hidden, with_final, window,
                              s.wait_s)  # fmt: skip
            plan_file = run_dir / "stream" / "plan.npy"
            np.save(plan_file, plan.rows)
            log.info("streaming states: %d samples through the Mooncake store at %s (window %d samples, %.2f GB)",
                     len(plan.rows), address.master, window, segment / 1e9)  # fmt: skip
            job = {**engine, "mode": "stream", "layer_ids": engine["layer_ids"], "with_final": with_final,
                   "tokens": str(features.tokens.folder), "plan": str(plan_file), "name": spec.name,
                   "address": spec.address, "window": window}  # fmt: skip
            supervisor = EngineSupervisor(job, run_dir / "stream", s.restarts)
        spec = broadcast(spec)
        stream = Stream(StreamReader(spec), spec, holder)
        yield stream
        stream.reader.close()
        barrier()  # every rank's reader has left the store before it goes
    finally:
        if supervisor is not None:
            supervisor.stop(holder)
            result = supervisor.result or {}
            stream.metrics = {
                "stream/engine_restarts": supervisor.deaths,
                # (every engine's, a killed one's too: where the last published up to)
                "stream/samples_streamed": (read_json(holder, f"{spec.name}-produced") or 0)
                - (read_json(holder, f"{spec.name}-start") or 0),
                "stream/engine_tokens_per_s": result.get("tokens", 0) / max(result.get("seconds", 0.0), 1e-9),
                # the engine waiting for room in the window: the trainers are the slower side
                "stream/engine_wait_s": result.get("input_wait_s", 0.0),
                "stream/window_samples": spec.window,
            }
            log.info("stream engine: %s", result)
        if holder is not None:
            holder.close()
        if master is not None:
            master.stop()
