"""Streamed states (`features=stream`): the target's states go from a vLLM capture engine to the trainers through a
Mooncake store, and nothing is written to disk per training token.

    token shards (the cache's regen/ entry: ids, 4 bytes a token)
        -> capture engine (eaglelab.data.vllm_capture.stream_samples: one prefill per sequence, vLLM's
           extract_hidden_states, hs_connectors' Mooncake connector)
        -> Mooncake store: one object per sample and trial reading it, `<stream>-<trial>-<position>` (aux [T, n·H]
           and norm(h_L) [T, H] in bf16, the greedy labels [T] int64; laid out by hs_connectors' `packed_layout`)
        -> trainer ranks (StreamReader: read, then removed)

The order is the trainers' own. The trainer lists, before training, every sample it will read, epoch by epoch (the
training batches' permutation, then that epoch's validation batches), each with the rank that reads it: that list is
the stream's plan, and a sample's key is its position in it. The engine produces the plan in order, at most
`window` samples ahead of the oldest one not yet read (flow control: the store holds the window, never the corpus),
so each epoch's states are captured afresh from the same regenerated tokens, and a stream trains on exactly the
data and order a cached run reads (same seed, same batches).

Who holds what. eaglelab starts a `mooncake_master` (or uses the one `features.stream.master` names); trainer rank
0 mounts the store's memory (the window); the engine and the other ranks mount none, so an engine that dies loses
nothing it had published. The engine is supervised (`EngineSupervisor`): killed, it is restarted and resumes at
the position it had published up to (`<stream>-produced`), its in-flight requests issued again; after
`features.stream.restarts` deaths the stream is marked failed and every waiting reader stops with one line.
A preempted trial restarts store, engine and trainers together, the engine from the checkpoint's position.
Conventions: docs/streamed_states.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from eaglelab.core.errors import DataError, EaglelabError
from eaglelab.core.io import atomic_write_json
from eaglelab.engine.jobs import StreamJob
from eaglelab.engine.process import die_with_parent, run_engine, stop_process

log = logging.getLogger("eaglelab")

# The store's memory kept free of samples: Mooncake evicts objects above 90 % of it (its eviction high watermark),
# and a sample evicted before it is read would be lost. The engine's raw per-request objects (all its captured
# layers, in its dtype) pass through the same memory on their way.
STORE_FILL = 0.8


@dataclass(frozen=True)
class StoreAddress:
    """A Mooncake store: its master's RPC address and its HTTP metadata server."""

    host: str
    master_port: int
    metadata_port: int
    protocol: str = "tcp"

    @property
    def master(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @classmethod
    def parse(cls, master: str, metadata_port: int) -> StoreAddress:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise DataError(f"features.stream.master={master!r} is not HOST:PORT; name the mooncake_master's RPC "
                            "address, or leave it null for eaglelab to start one")  # fmt: skip
        return cls(host, int(port), metadata_port)

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """One line when the store cannot be reached (Mooncake's own client retries for ~90 s before it says so)."""
        for what, port in (("master", self.master_port), ("metadata server", self.metadata_port)):
            try:
                socket.create_connection((self.host, port), timeout=timeout_s).close()
            except OSError as e:
                raise DataError(
                    f"cannot reach the Mooncake store's {what} at {self.host}:{port} ({e.strerror or e}); start "
                    "mooncake_master there (see docs/streamed_states.md) or leave features.stream.master null"
                ) from None


def require_mooncake() -> None:
    """Mooncake's store client and master, importable and runnable here (checked before any work)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        if "libibverbs" in str(e):
            raise DataError("features=stream: Mooncake needs Debian's libibverbs1 even over TCP; "
                            "`apt-get install libibverbs1` (root), or use features=cached") from None  # fmt: skip
        raise DataError(
            "features=stream needs Mooncake's store; run scripts/setup.sh (it installs "
            "mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine with CUDA)"
        ) from None
    if shutil.which("mooncake_master") is None:
        raise DataError("features=stream: mooncake_master is not on PATH (it comes with Mooncake's wheel); "
                        "activate the environment scripts/setup.sh installed into")  # fmt: skip


def check_stream(master: str | None, metadata_port: int, engine_launcher: str | None = None) -> None:
    """Before any work: Mooncake installed, the store a run names reachable, the engine's launcher on PATH."""
    require_mooncake()
    if master:
        StoreAddress.parse(master, metadata_port).check_reachable()
    if engine_launcher and shutil.which(program := engine_launcher.split()[0]) is None:
        raise DataError(
            f"features.stream.engine_launcher={engine_launcher!r}: {program} is not on PATH; name a launcher this "
            "node has (srun), or leave it null to run the engine here"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class StoreMaster:
    """A `mooncake_master` process with its HTTP metadata server, on free ports of this host, for one trial."""

    def __init__(self, log_path: Path, host: str | None = None):
        require_mooncake()
        exe = shutil.which("mooncake_master")
        host = host or socket.gethostname()
        self.address, self.metrics_port = StoreAddress(host, _free_port(), _free_port()), _free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 (kept open for the process's life)
        self.process = subprocess.Popen(
            [exe, f"--rpc_port={self.address.master_port}", "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.address.metadata_port}", "--rpc_address=0.0.0.0",
             "--http_metadata_server_host=0.0.0.0", f"--metrics_port={self.metrics_port}"],  # (9003 else)
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,  # (never an orphan master)
        )  # fmt: skip
        until = time.monotonic() + 30
        while True:
            try:
                self.address.check_reachable(timeout_s=0.5)
                break
            except DataError:
                if self.process.poll() is not None or time.monotonic() > until:
                    self.stop()
                    raise DataError(f"mooncake_master did not start (see {log_path})") from None
                time.sleep(0.1)

    def allocated_bytes(self) -> int | None:
        """The store's memory holding objects now (the master's Prometheus `master_allocated_bytes`)."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        return next((int(float(line.split()[1])) for line in text.splitlines()
                     if line.startswith("master_allocated_bytes ")), None)  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_process(self.process, 10)
        self._log.close()


def connect(address: StoreAddress, segment_bytes: int = 0, buffer_bytes: int = 64 << 20):
    """A client of the store (hs_connectors' MooncakeHiddenStatesStore), mounting `segment_bytes` of this process's
    memory into it (0: none, a pure client)."""
    from hs_connectors.mooncake_store import MooncakeStoreConfig

    StoreClient = _store_client()  # noqa: N806
    address.check_reachable()
    config = MooncakeStoreConfig(
        local_hostname=socket.gethostname(),
        metadata_server=address.metadata,
        master_server_address=address.master,
        global_segment_size=segment_bytes,
        local_buffer_size=buffer_bytes,
        protocol=address.protocol,
    )
    logging.getLogger("hs_connectors.mooncake_store").setLevel(logging.ERROR)  # ("pinned memory unavailable" on CPU)
    try:
        return StoreClient(config).setup()
    except RuntimeError as e:
        raise DataError(f"cannot join the Mooncake store at {address.master} ({e}); see its log") from None


def _store_client():
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore

    class StoreClient(MooncakeHiddenStatesStore):
        """hs_connectors' store client, which can leave the store (before its master stops: a client left behind
        retries the master for ~20 s at exit)."""

        def close(self) -> None:
            if self._store is not None:
                self._store.close()
                self._store = None

    return StoreClient


# --- samples --------------------------------------------------------------------------------------------------
def sample_key(stream: str, position: int, subscriber: int = 0) -> str:
    """A sample's key: the copy for `subscriber` (each trial sharing a stream reads and removes its own copy)."""
    return f"{stream}-{subscriber}-{position}"


def sample_manifest(key: str, length: int, aux_width: int, hidden: int, with_final: bool) -> dict:
    """hs_connectors' transfer manifest of one training sample: computed alike by the engine that writes it and the
    reader (from the sequence's length), so no manifest travels beside the data."""
    from hs_connectors.mooncake_store import VERSION, packed_layout

    tensors = {"aux": ((length, aux_width), torch.bfloat16), "target_next": ((length,), torch.int64)}
    if with_final:
        tensors["final"] = ((length, hidden), torch.bfloat16)
    spec, total = packed_layout(tensors)
    return {"handle": key, "version": VERSION, "tensors": spec, "metadata": {"total_aligned_bytes": total}}


def sample_bytes(length: int, aux_width: int, hidden: int, with_final: bool) -> int:
    return sample_manifest("", length, aux_width, hidden, with_final)["metadata"]["total_aligned_bytes"]


@dataclass
class StreamSpec:
    """What every process of a stream agrees on (the engine's job carries it, the readers get it from rank 0)."""

    name: str  # the keys' prefix: unique per trial attempt
    address: dict  # StoreAddress fields
    aux_width: int  # n·H
    hidden: int
    with_final: bool
    window: int  # samples published and not yet read, at most
    wait_s: float  # a reader waiting this long for one sample fails
    subscriber: int = 0  # this trial's index among those sharing the stream (0: the trial hosting it)

    @property
    def store(self) -> StoreAddress:
        return StoreAddress(**self.address)


class StreamReader:
    """A trainer process's end of the stream: sample `position` (a row of the token store, `length` tokens) read from
    the store, then removed (its room is the engine's again). Each process (a loader worker too) joins the store
    once, lazily; a sample that does not come within `wait_s`, or a stream the supervisor marked failed, is one line."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec
        self._client, self._pid = None, None
        self.reads = 0

    def __getstate__(self):  # (a loader worker joins the store itself)
        return {**self.__dict__, "_client": None, "_pid": None}

    def _store(self):
        if self._client is None or self._pid != os.getpid():
            self._client, self._pid = connect(self.spec.store), os.getpid()
        return self._client

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None

    def read(self, position: int, length: int) -> dict[str, torch.Tensor]:
        spec, store = self.spec, self._store()
        key = sample_key(spec.name, position, spec.subscriber)
        manifest = sample_manifest(key, length, spec.aux_width, spec.hidden, spec.with_final)
        until = time.monotonic() + spec.wait_s
        while True:
            try:
                sample = store.get_sample(manifest, timeout=1.0, poll_interval=0.01)
                break
            except TimeoutError:
                if (failed := read_json(store, f"{spec.name}-failed")) is not None:
                    raise EaglelabError(f"the state stream failed: {failed}") from None
                if read_json(store, f"{spec.name}-dropped-{spec.subscriber}") is not None:
                    raise EaglelabError(
                        "this trial fell a whole window behind the stream it shared and was dropped (so the others "
                        "go on); run it again: it resumes from its checkpoint on a stream of its own"
                    ) from None
                if time.monotonic() > until:
                    raise EaglelabError(
                        f"no states for stream sample {position} in {spec.wait_s:.0f} s (the engine's log: vllm.log "
                        "under the run's stream/ folder); raise features.stream.wait_s if the engine is still starting"
                    ) from None
        store.delete_sample(key)
        self.reads += 1
        return sample


def read_json(store, key: str):
    client = store._require_store()
    if client.is_exist(key) != 1:
        return None
    return json.loads(bytes(client.get(key)).decode())


def publish_json(store, key: str, value) -> None:
    """A small control value (`<stream>-produced`, `-failed`, `-stop`), replaced in place."""
    result = store._require_store().upsert(key, json.dumps(value).encode())
    if result != 0:
        raise RuntimeError(f"Mooncake upsert of {key} failed ({result})")


# --- the engine, supervised ---------------------------------------------------------------------------------------
class EngineSupervisor:
    """The stream's capture engine (a StreamJob: eaglelab.data.vllm_capture.stream_samples), run in a thread of trainer
    rank 0 and started again when it dies (`restarts` times): it resumes where it had published up to. `stop()` asks
    it to end (`<stream>-stop`) and waits for it."""

    def __init__(self, job: StreamJob, workdir: Path, restarts: int, launcher: list[str] | None = None):
        self.job, self.workdir, self.restarts, self.launcher = job, workdir, restarts, launcher
        self.deaths, self.error, self.result = 0, None, None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eaglelab-stream-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.result = run_engine(
                    replace(self.job, attempt=self.deaths), self.workdir, timeout=10**7, desc="stream states (vLLM)",
                    launcher=self.launcher,
                )  # fmt: skip
                return
            except EaglelabError as e:
                if self._stopping.is_set():
                    return
                self.deaths += 1
                if self.deaths > self.restarts:
                    self.error = f"its engine died {self.deaths} times, the last: {e}"
                    self._mark_failed()
                    return
                log.warning("the stream's engine died (%s); starting it again (%d of %d)", e, self.deaths,
                            self.restarts)  # fmt: skip

    def _mark_failed(self) -> None:
        try:
            publish_json(connect(StoreAddress(**self.job.address)), f"{self.job.name}-failed", self.error)
        except Exception as e:  # noqa: BLE001 (the readers time out instead, naming the log)
            log.warning("could not mark the stream failed: %s", e)

    def stop(self, store=None) -> None:
        self._stopping.set()
        client = store or connect(StoreAddress(**self.job.address))
        publish_json(client, f"{self.job.name}-stop", True)
        if store is None:
            client.close()
        self._thread.join(timeout=120)


def spec_file(run_dir: Path) -> Path:
    return run_dir / "stream" / "spec.json"


def write_spec(spec: StreamSpec, run_dir: Path) -> None:

    atomic_write_json(spec_file(run_dir), asdict(spec))
