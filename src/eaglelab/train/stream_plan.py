"""Streamed states (`features=stream`), the trainers' side: the stream's plan (every sample the ranks will read, in
the order they read it), the samplers that ask for samples by their position in it, and the stream's life around
`fit`: the store, the supervised engine, a reader per rank. The data side is eaglelab.data.stream."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shlex
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from torch.utils.data import Sampler

from eaglelab.core.config import RunConfig
from eaglelab.core.errors import DataError
from eaglelab.core.io import atomic_write_json, file_lock
from eaglelab.core.ranks import barrier, broadcast
from eaglelab.core.ranks import current as current_ranks
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
from eaglelab.engine.jobs import StreamJob
from eaglelab.train.ttt_module import EpochBatches

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
        self.widest = max([sum(map(len, r)) for r in zip(*val_batches)], default=1)  # the most samples of one batch
        kept = train.epoch
        for e in range(epochs):
            train.set_epoch(e)  # (a token budget's batches differ from epoch to epoch)
            for b, batch in enumerate(train._global_batches()):
                self.train_start[e, b] = len(rows)
                self.widest = max(self.widest, len(batch))
                for r in range(world):
                    rows += [train_rows[i] for i in batch[r::world].tolist()]
            for j in range(max(map(len, val_batches), default=0)):
                self.val_start[e, j] = len(rows)
                for share in val_batches:
                    rows += [val_rows[i] for i in (share[j] if j < len(share) else [])]
        train.set_epoch(kept)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.val_batches = val_batches


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
    store: object | None  # rank 0's client (the hosting trial's: the window's memory), else None
    metrics: dict = field(default_factory=dict)  # rank 0's, once the stream has ended


@dataclass(frozen=True)
class Window:
    """The store memory one trial's copies take: `samples` in flight of at most `sample_bytes` each, and a capture
    batch's raw objects (every captured layer, 4 bytes a value at most) passing through."""

    samples: int
    sample_bytes: int
    raw_bytes: int

    def segment_bytes(self, subscribers: int) -> int:
        return int((subscribers * self.samples * self.sample_bytes + self.raw_bytes) / STORE_FILL)


def window_for(cfg: RunConfig, features: Sequences, plan: StreamPlan, aux_width: int, hidden: int, with_final: bool,
               lookahead_batches: int) -> Window:  # fmt: skip
    """features.stream.window_gb in samples, refused when it cannot hold what the loaders read ahead of the step (the
    engine would wait for a sample the trainers read only after the one they wait for)."""
    s = cfg.features.stream
    longest = int(features.tokens.lengths()[np.unique(plan.rows)].max())
    per_sample = sample_bytes(longest, aux_width, hidden, with_final)
    window = int(s.window_gb * 1e9 // per_sample)
    need = lookahead_batches * plan.widest
    if window < need:
        raise DataError(
            f"features.stream.window_gb={s.window_gb} holds {window} samples of up to {longest} tokens, but the "
            f"trainers read up to {need} ahead of their step; raise it to at least {need * per_sample / 1e9:.3g}"
        )
    return Window(window, per_sample, BATCH_RAW * longest * (aux_width + 2 * hidden) * 4)


BATCH_RAW = 32  # sequences a capture batch holds in the store as the engine's raw objects (vllm_capture.BATCH)


class StreamHost:
    """Trainer rank 0 of the trial hosting a stream: the store (a mooncake_master started here, or the one
    `features.stream.master` names) with every subscriber's window mounted in this process's memory, and the
    supervised engine. With `rendezvous` (a folder under the shared cache, one per stream key), trials of a sweep that
    arrive within `features.stream.join_s` subscribe to it (`subscribe`) instead of starting their own."""

    def __init__(self, cfg: RunConfig, run_dir: Path, window: Window, spec_fields: dict, job: StreamJob,
                 plan_rows: np.ndarray, rendezvous: Path | None):  # fmt: skip
        s = cfg.features.stream
        self.master = self.supervisor = self.store = None
        self.rendezvous, self.join_until = rendezvous, time.time() + (s.join_s if rendezvous else 0)
        self.stall_s = s.stall_s
        if s.master:
            address = StoreAddress.parse(s.master, s.metadata_port)
        else:
            self.master = StoreMaster(run_dir / "stream" / "mooncake_master.log")
            address = self.master.address
        self.spec = StreamSpec(uuid.uuid4().hex[:12], asdict(address), window=window.samples, **spec_fields)
        self.window = window
        if rendezvous is not None:  # (under the rendezvous lock: see `streamed_states`)
            shutil.rmtree(rendezvous / "subscribers", ignore_errors=True)  # an earlier stream's of this key
            atomic_write_json(rendezvous / "host.json", {**asdict(self.spec), "join_until": self.join_until})
        plan_file = run_dir / "stream" / "plan.npy"
        plan_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(plan_file, plan_rows)
        job = replace(job, plan=str(plan_file), name=self.spec.name, address=self.spec.address, window=window.samples,
                      stall_s=s.stall_s)  # fmt: skip
        launcher = shlex.split(s.engine_launcher) if s.engine_launcher else None
        self.supervisor = EngineSupervisor(job, run_dir / "stream", s.restarts, launcher)  # (loads while trials join)

    def open(self) -> None:
        """Once the joining time is over: the subscribers known, their windows mounted, the engine told."""
        time.sleep(max(self.join_until - time.time(), 0.0))
        subscribers = [0]
        if self.rendezvous is not None:
            with file_lock(self.rendezvous / "lock"):
                subscribers += sorted(int(p.name) for p in (self.rendezvous / "subscribers").glob("*"))
                (self.rendezvous / "host.json").unlink(missing_ok=True)  # (no trial joins after this)
        self.subscribers = subscribers
        self.store = connect(self.spec.store, segment_bytes=self.window.segment_bytes(len(subscribers)))
        self.store_peak, self._watching = 0, threading.Event()
        if self.master is not None:  # the store's memory in use, sampled: its peak against the window
            threading.Thread(target=self._watch_store, daemon=True).start()
        publish_json(self.store, f"{self.spec.name}-subscribers", subscribers)
        log.info("streaming states: %d samples to %d trial(s) through the Mooncake store at %s (window %d samples, "
                 "%.2f GB)", len(np.load(self.supervisor.job.plan)), len(subscribers), self.spec.store.master,
                 self.window.samples, self.window.segment_bytes(len(subscribers)) / 1e9)  # fmt: skip

    def _watch_store(self) -> None:
        while not self._watching.wait(0.2):
            self.store_peak = max(self.store_peak, self.master.allocated_bytes() or 0)

    def close(self) -> dict:
        """The stream ended for this trial: the others sharing it read to their end (or are dropped) first; then
        the engine, the memory and the master go. -> what the stream cost."""
        name, until = self.spec.name, time.time() + self.stall_s
        for i in getattr(self, "subscribers", [0])[1:]:
            done = lambda i=i: any(read_json(self.store, f"{name}-{w}-{i}") is not None for w in ("done", "dropped"))  # noqa: E731
            while not done() and time.time() < until and self.supervisor.error is None:
                time.sleep(0.1)
        try:
            self.supervisor.stop(self.store)
        except DataError as e:  # (the store already gone: the engine dies with this process anyway)
            log.warning("could not ask the stream's engine to stop: %s", e)
        result, metrics = self.supervisor.result or {}, {}
        if self.store is not None:
            metrics = {
                "stream/engine_restarts": self.supervisor.deaths,
                # target forward passes, every engine's (a killed one's too: where the last published up to)
                "stream/samples_streamed": (read_json(self.store, f"{name}-produced") or 0)
                - (read_json(self.store, f"{name}-start") or 0),
                "stream/subscribers": len(self.subscribers),
                "stream/engine_tokens_per_s": result.get("tokens", 0) / max(result.get("seconds", 0.0), 1e-9),
                # the engine waiting for room in the window: the trainers are the slower side
                "stream/engine_wait_s": result.get("input_wait_s", 0.0),
                "stream/window_samples": self.spec.window,
                "stream/store_bytes": self.window.segment_bytes(len(self.subscribers)),  # mounted by rank 0
                # the most of it samples held at once (sampled every 0.2 s; a master this run started)
                "stream/store_peak_bytes": self.store_peak,
            }
            self._watching.set()
            self.store.close()
        log.info("stream engine: %s", result)
        if self.master is not None:
            self.master.stop()
        return metrics


def subscribe(rendezvous: Path) -> StreamSpec | None:
    """A place in the stream being hosted for this key, if one is still open for joining (called under the
    rendezvous lock). None: no such stream."""
    host = rendezvous / "host.json"
    if not host.is_file():
        return None
    fields = json.loads(host.read_text())
    if fields.pop("join_until") < time.time() + 1.0:
        return None
    (rendezvous / "subscribers").mkdir(parents=True, exist_ok=True)
    index = max([int(p.name) for p in (rendezvous / "subscribers").glob("*")], default=0) + 1
    (rendezvous / "subscribers" / str(index)).touch()
    return StreamSpec(**{**fields, "subscriber": index})


def admitted(spec: StreamSpec, timeout_s: float) -> bool:
    """Whether the host counted this trial among its subscribers when it opened the stream."""
    try:
        store = connect(spec.store)
    except DataError:
        return False
    until = time.time() + timeout_s
    try:
        while (subscribers := read_json(store, f"{spec.name}-subscribers")) is None and time.time() < until:
            time.sleep(0.1)
    finally:
        store.close()
    return bool(subscribers) and spec.subscriber in subscribers


def stream_key(features: Sequences, plan: StreamPlan, job: StreamJob, world: int) -> str:
    """Trials whose streams would carry the same samples in the same order: one target, token entry, captured
    layers and final state, and the same plan (data order, batches, epochs, ranks)."""
    digest = hashlib.sha256(plan.rows.tobytes())
    for part in (str(features.tokens.folder), job.target, job.dtype, job.layer_ids, job.with_final, world):
        digest.update(repr(part).encode())
    return digest.hexdigest()[:20]


@contextlib.contextmanager
def streamed_states(cfg: RunConfig, run_dir: Path, features: Sequences, plan: StreamPlan, engine: StreamJob,
                    aux_width: int, hidden: int, with_final: bool, lookahead_batches: int, resumed: bool):  # fmt: skip
    """The stream for this attempt's `fit`: hosted by this trial's rank 0 (`StreamHost`), or, with
    features.stream.share, the stream another trial of the sweep hosts for the same key (a resumed trial always
    hosts its own: the others' stream has moved on); a reader on every rank. -> Stream (its metrics filled on the
    host's rank 0 when it ends)."""
    s, ranks = cfg.features.stream, current_ranks()
    host = spec = stream = None
    try:
        if ranks.rank == 0:
            window = window_for(cfg, features, plan, aux_width, hidden, with_final, lookahead_batches)
            job = replace(engine, with_final=with_final, tokens=str(features.tokens.folder))
            fields = {"aux_width": aux_width, "hidden": hidden, "with_final": with_final, "wait_s": s.wait_s}
            if s.share and not resumed:  # the stream another trial hosts for this key, or one this trial hosts
                key = stream_key(features, plan, job, ranks.world_size)
                rendezvous = Path(cfg.paths.cache_dir).expanduser() / "streams" / key
                with file_lock(rendezvous / "lock"):
                    if (spec := subscribe(rendezvous)) is None:
                        host = StreamHost(cfg, run_dir, window, fields, job, plan.rows, rendezvous)
                if spec is not None and not admitted(spec, s.join_s + 300):
                    log.warning("the shared stream %s closed before this trial joined it: hosting its own", spec.name)
                    spec = None
                if spec is not None:
                    log.info("streaming states: subscribed to stream %s (trial %d of it)", spec.name, spec.subscriber)
            if spec is None and host is None:
                host = StreamHost(cfg, run_dir, window, fields, job, plan.rows, None)
            if host is not None:
                host.open()
                spec = host.spec
        spec = broadcast(spec)
        stream = Stream(StreamReader(spec), spec, host.store if host else None)
        yield stream
        stream.reader.close()
        barrier()  # every rank's reader has left the store before it goes
        if ranks.rank == 0 and host is None:  # the host may end its stream now
            client = connect(spec.store)
            publish_json(client, f"{spec.name}-done-{spec.subscriber}", True)
            client.close()
    finally:
        if host is not None:
            metrics = host.close()
            if stream is not None:
                stream.metrics = metrics
