"""Data stages on the tiny target: generation equals HF greedy `generate`, fused capture equals a
separate full-forward capture, the cache is keyed and reused, the draft vocab is frequency-ranked."""

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch

from eaglelab.core.config import TargetConfig
from eaglelab.core.errors import DataError
from eaglelab.data.cache_entry import CaptureSettings, SetRequest
from eaglelab.data.prepare_set import prepare_features
from eaglelab.data.prompts import humaneval_prompts, jsonl_prompts, mix_sources
from eaglelab.data.regenerate import generate
from eaglelab.data.targets import load_target
from eaglelab.data.templates import template_prompt
from eaglelab.data.vocab import draft_vocab


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return load_target(TargetConfig(kind="tiny", dtype="float32"), cache_dir)  # as conf/target/tiny.yaml


@pytest.mark.slow
def test_generation_matches_hf_generate(tiny):
    """Responses are HF's greedy `generate` (each prompt with its own budget: the shortest prompt here gets 12
    tokens although the longest has room for fewer), and each tail continues greedily past the end, as an
    uncached full forward per token computes it."""
    prompts = [template_prompt(tiny.tokenizer, m, None) for m in humaneval_prompts()[:3]]
    max_length = max(map(len, prompts)) + 9  # the longest prompt's budget is 9, the others' 12
    ours = {g.index: g for g in generate(tiny, prompts, 12, max_length, batch_size=3, tail_tokens=5)}
    for i, p in enumerate(prompts):  # one at a time: no padding on the reference side
        budget = min(12, max_length - len(p))
        ref = tiny.model.generate(
            torch.tensor([p]), max_new_tokens=budget, do_sample=False, pad_token_id=tiny.tokenizer.pad_token_id
        )[0, len(p) :].tolist()
        assert ours[i].response == ref
        seq = p + ref
        tail = []
        with torch.no_grad():
            while len(tail) < min(5, max_length - len(seq)):
                tail.append(int(tiny.model(torch.tensor([seq + tail])).logits[0, -1].argmax()))
        assert ours[i].tail == tail
    assert [len(ours[i].response) for i in range(3)] != [9, 9, 9], "every prompt got the batch's smallest budget"


def test_fused_capture_equals_a_separate_forward(tiny, tmp_path):
    prompts = mix_sources(["stdlib_docstrings"], 5, seed=1)
    ask, how = SetRequest("t", max_new_tokens=10), CaptureSettings(tmp_path, [2, 4, 5], None, 512, batch_size=5)
    fused, stats = prepare_features(tiny, prompts, ask, how)
    assert not stats.regen_cached and not stats.capture_cached
    shutil.rmtree(tmp_path / "features")  # force the separate capture pass over the cached regeneration
    separate, stats2 = prepare_features(tiny, prompts, ask, how)
    assert stats2.regen_cached and not stats2.capture_cached
    assert fused["input_ids"] == separate["input_ids"]  # the same rows, in the same (length) order
    for i in range(len(fused)):
        row, other = fused.item(i), separate.item(i)
        a, b = row["aux"].float(), other["aux"].float()
        assert a.shape == b.shape == (len(row["input_ids"]), 3 * 128)
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2)
        p = row["prompt_len"]  # labels start at the last prompt position (the first drafting one)
        assert (row["target_next"][p - 1 :] == other["target_next"][p - 1 :]).float().mean() > 0.95
        # Generated tokens are the target's greedy choice at the previous position.
        assert row["target_next"][p - 1 : -1].tolist() == row["input_ids"][p:].tolist()
        assert "final" not in row and not fused.states.with_final  # stored only when the loss reads it
    _, stats3 = prepare_features(tiny, prompts, ask, how)
    assert stats3.regen_cached and stats3.capture_cached  # third time: all from cache
    _, stats4 = prepare_features(tiny, prompts, replace(ask, max_new_tokens=11), how)
    assert not stats4.regen_cached  # a changed setting never reuses a stale entry


def test_draft_vocab_is_frequency_ranked_over_assistant_tokens():
    seqs = [torch.tensor([9, 9, 9, 1, 1, 2, 5]), torch.tensor([9, 3, 3, 3, 4])]
    ids, coverage = draft_vocab(seqs, prompt_lens=[3, 1], vocab_size=12, draft_vocab_size=3)
    # Assistant tokens: [1,1,2,5] and [3,3,3,4] -> 3 (x3), 1 (x2), then ties 2,4,5 -> lowest id 2.
    assert ids.tolist() == [1, 2, 3]
    assert abs(coverage - 6 / 8) < 1e-9


def test_sharegpt_and_openai_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
        '{"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}, '
        '{"from": "human", "value": "e"}]}\n'
        '{"messages": [{"role": "assistant", "content": "no user turn"}]}\n'
    )
    with pytest.raises(DataError, match=r"d.jsonl:3: empty conversation .*data.skip_empty=true"):
        jsonl_prompts(str(path))  # a row with nothing to answer is bad input by default
    rows = jsonl_prompts(str(path), skip_empty=True)
    assert rows == [
        [{"role": "user", "content": "a"}],
        [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
    ]


def test_a_jsonl_source_is_streamed_and_draws_what_reading_it_whole_drew(tmp_path):
    """A JSONL source stays in its file: a run keeps each drawn conversation's line offset and reads the line when
    the conversation is asked for (so a file changed under the run is noticed, in one line). The draw is the one
    shuffling the conversations themselves made, so the cache keys of runs before streaming are found; so is
    validation's."""
    import random

    from eaglelab.data.prompts import hold_out_for_validation, stdlib_docstring_prompts

    path = tmp_path / "chat.jsonl"
    rows = [[{"role": "user", "content": f"question {i:03d}"}] for i in range(40)]
    lines = [json.dumps({"messages": m}) for m in rows]
    path.write_text("\n".join([*lines[:7], json.dumps({"messages": []}), *lines[7:]]) + "\n")
    sources = [f"jsonl:{path}", "stdlib_docstrings"]
    drawn = mix_sources(sources, 30, seed=2, skip_empty=True)
    pools = [list(rows), stdlib_docstring_prompts()]  # as mix_sources drew before: the conversations shuffled
    for i, (source, pool) in enumerate(zip(sources, pools)):
        random.Random(f"2:{i}:{source}").shuffle(pool)
    expected = [pools[i % 2].pop() for i in range(30)]
    assert list(drawn) == expected
    training, validation = hold_out_for_validation(drawn, 5)
    assert (list(training), list(validation)) == hold_out_for_validation(expected, 5)
    j = next(j for j, p in enumerate(drawn) if p[0]["content"].startswith("question"))
    asked = drawn[j][0]["content"]
    path.write_text(path.read_text().replace(asked, asked.upper()))  # the same length: every offset still holds
    with pytest.raises(DataError, match=r"^.*chat.jsonl changed since this run read it; run again once it stays"):
        drawn[j]


def test_hf_dataset_saved_to_disk(tmp_path):
    import datasets

    from eaglelab.data.prompts import load_source

    ds = datasets.Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": "write a haiku"}],
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
            ]
        }
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    assert load_source(f"hf:{tmp_path / 'ds'}") == [
        [{"role": "user", "content": "write a haiku"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
    ]


# data.regen_backend=vllm against hf: tests/test_gpu_check.py runs benchmarks/engine_beside_target.py, which compares
# the two backends' greedy sequences with memory held beside the engine.


def test_the_weights_training_reads_come_by_name_without_loading_the_model(cache_dir):
    """A run with cached features reads the embedding, final norm, LM head (and the last layers, when the drafter
    starts from them) by tensor name: the very tensors the loaded model holds, and the model stays unloaded."""
    lazy, loaded = (load_target(TargetConfig(kind="tiny", dtype="float32"), cache_dir) for _ in range(2))
    by_name = lazy.weights(last_layers=2)
    assert not lazy.loaded
    loaded.load()
    held = loaded.weights(last_layers=2)
    for key in ("embed", "lm_head", "norm"):
        assert torch.equal(getattr(by_name, key), getattr(held, key)), key
    assert [sorted(layer) for layer in by_name.layers] == [sorted(layer) for layer in held.layers]
    for a, b in zip(by_name.layers, held.layers):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert lazy.generation_config.eos_token_id == loaded.generation_config.eos_token_id


@pytest.mark.slow
def test_vllm_capture_matches_hf_capture(tiny, tmp_path):
    """data.capture_backend=vllm: the real engine (extract_hidden_states, eaglelab's CPU connector) prefills each
    regenerated sequence and its states are the HF capture's, layer by layer, within the store's bf16 rounding (the
    tiny target computes in float32 in both); norm(h_L) and the greedy labels from the target's own head, read by
    tensor name, are HF's too. A different cache entry: the backend is part of its key."""
    prompts = mix_sources(["stdlib_docstrings"], 6, seed=3)
    ask = SetRequest("t", max_new_tokens=16, with_final=True)
    how = CaptureSettings(tmp_path, [4, 2], None, 256, batch_size=6, shard_size=4)
    hf, _ = prepare_features(tiny, prompts, ask, how)  # HF regeneration, capture fused in
    engine, stats = prepare_features(tiny, prompts, ask, replace(how, capture_backend="vllm"))
    assert stats.regen_cached and not stats.capture_cached and engine.states_dir != hf.states_dir
    assert engine["input_ids"] == hf["input_ids"]
    for i in range(len(hf)):
        a, b = hf.item(i, with_final=True), engine.item(i, with_final=True)
        for key in ("aux", "final"):  # aux in the config's order ([4, 2]), whatever order vLLM passes them on
            assert a[key].shape == b[key].shape
            scale = a[key].float().abs().amax(-1, keepdim=True)  # bf16 keeps 8 bits of each value: 2^-8 of it
            assert ((a[key].float() - b[key].float()).abs() <= scale * 2**-7).all(), (i, key)
        assert torch.equal(a["target_next"], b["target_next"])


KILLED_PREPARATION = """
import sys
from eaglelab.core.config import TargetConfig
from eaglelab.data.cache_entry import CaptureSettings, SetRequest
from eaglelab.data.prepare_set import prepare_features
from eaglelab.data.prompts import mix_sources
from eaglelab.data.targets import load_target

tiny = load_target(TargetConfig(kind="tiny", dtype="float32"), sys.argv[1])
prompts = mix_sources(["stdlib_docstrings"], 16, seed=3)
how = CaptureSettings(sys.argv[2], [2, 4, 5], None, 512, batch_size=1, shard_size=1)
prepare_features(tiny, prompts, SetRequest("t", max_new_tokens=48), how)
"""


@pytest.mark.slow
def test_a_killed_regeneration_keeps_its_finished_shards(tiny, cache_dir, tmp_path):
    """SIGKILL in the middle of regeneration: the next attempt regenerates only the shards not yet whole."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from eaglelab.data.prompts import mix_sources

    script = tmp_path / "prepare.py"
    script.write_text(KILLED_PREPARATION)
    proc = subprocess.Popen([sys.executable, str(script), str(cache_dir), str(tmp_path / "data")])
    shards = lambda: list((tmp_path / "data" / "regen").glob("*/shard-*.arrow"))
    deadline = time.time() + 300
    while len(shards()) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(shards())
    assert 3 <= done < 16, f"killed after {done} of 16 shards"
    assert not list((tmp_path / "data" / "regen").glob("*/complete.json"))  # not usable half-done

    prompts = mix_sources(["stdlib_docstrings"], 16, seed=3)
    ask = SetRequest("t", max_new_tokens=48)
    how = CaptureSettings(tmp_path / "data", [2, 4, 5], None, 512, batch_size=1, shard_size=1)
    data, stats = prepare_features(tiny, prompts, ask, how)
    assert stats.shards == 16 and stats.shards_regenerated == 16 - done
    fresh, _ = prepare_features(tiny, prompts, ask, replace(how, cache_dir=tmp_path / "fresh"))
    assert data["input_ids"] == fresh["input_ids"]  # resuming changes nothing
    for i in range(len(data)):  # the states of shards captured before and after the kill
        assert torch.equal(data.item(i)["aux"], fresh.item(i)["aux"])


def test_hybrid_states_survive_a_killed_first_epoch(tiny, tmp_path):
    """Hybrid features: each process writes its states in shards of `shard_sequences`, a shard counting once its
    rows list exists. An attempt killed mid-epoch loses only the shard in flight; the next attempt records the
    batches it sees and, when publishing, computes the sequences no closed shard holds (here: that one shard's).
    The published entry equals the states online features compute, row for row, and a cached preparation of the
    same set then reuses it."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from eaglelab.train.batches import FeatureDataset, HybridStates, OnlineStates, collate

    prompts = mix_sources(["stdlib_docstrings"], 6, seed=4)
    ask, how = SetRequest("t", max_new_tokens=10), CaptureSettings(tmp_path, [2, 4, 5], None, 512, batch_size=6)
    seqs, _ = prepare_features(tiny, prompts, replace(ask, features="hybrid"), how)
    assert seqs.states is None
    online = OnlineStates(tiny.model, [2, 4, 5], with_final=False)
    batches = list(DataLoader(FeatureDataset(seqs, range(len(seqs)), False), batch_size=1, collate_fn=collate))

    killed = HybridStates(seqs, seqs.states_dir, False, run_id="r", shard_sequences=2)
    for batch in batches[:3]:  # a whole shard (closed, its rows list written), then one sequence into the next
        killed.record(online(batch))  # then SIGKILL: that shard's writer is never closed
    resumed = HybridStates(seqs, seqs.states_dir, False, run_id="r", shard_sequences=2)
    for batch in batches[3:]:  # the resumed epoch goes on from the checkpoint after the third batch
        resumed.record(online(batch))
    one_process = SimpleNamespace(barrier=lambda: None, global_rank=0, world_size=1)
    resumed.publish(online, torch.device("cpu"), one_process, batch_size=2)
    assert resumed.published and seqs.states is not None
    meta = json.loads((seqs.states_dir / "complete.json").read_text())
    shards = meta["shards"]
    assert sorted(r for s in shards for r in s["rows"]) == list(range(len(seqs)))
    # killed's closed shard, the resumed attempt's closed one and the one it had open, and the one computed
    assert sorted(len(s["rows"]) for s in shards) == [1, 1, 2, 2]
    assert meta["recomputed"] == 1  # only what the killed attempt had in flight
    assert not list(seqs.states_dir.parent.glob(".*partial*"))
    assert {p.name for p in seqs.states_dir.glob("*.arrow")} == {s["file"] for s in shards}  # no unused shard
    assert not [p for p in seqs.states_dir.iterdir() if ".tmp-" in p.name]  # nor the killed writer's file
    for batch in batches:
        ref = online(batch)
        for b, i in enumerate(batch.index.tolist()):
            n = int(batch.seq_len[b])
            stored = seqs.states.read(i)
            assert torch.equal(stored["aux"], ref.aux[b, :n].to(torch.bfloat16))
            assert torch.equal(stored["target_next"], ref.target_next[b, :n])
    _, stats = prepare_features(tiny, prompts, ask, how)
    assert stats.capture_cached  # cached's entry is the one hybrid published


def test_hybrid_publishing_beside_a_live_capture_keeps_its_shard(tiny, tmp_path):
    """A cached trial captures the same entry while a hybrid run publishes it (the capture holds only its shard's
    lock, not the entry's): the published entry lists the hybrid run's shards, the shard the capture is writing
    (its lock held) stays where it is, and a killed capture's leftover (its lock free) is removed."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from eaglelab.core.io import file_lock
    from eaglelab.data.store import shard_lock, shard_name
    from eaglelab.train.batches import FeatureDataset, HybridStates, OnlineStates, collate

    prompts = mix_sources(["stdlib_docstrings"], 4, seed=5)
    how = CaptureSettings(tmp_path, [2, 4, 5], None, 512, batch_size=4)
    seqs, _ = prepare_features(tiny, prompts, SetRequest("t", max_new_tokens=8, features="hybrid"), how)
    online = OnlineStates(tiny.model, [2, 4, 5], with_final=False)
    hybrid = HybridStates(seqs, seqs.states_dir, False, run_id="h", shard_sequences=8)
    for batch in DataLoader(FeatureDataset(seqs, range(len(seqs)), False), batch_size=2, collate_fn=collate):
        hybrid.record(online(batch))
    seqs.states_dir.mkdir(parents=True)
    live, leftover = (seqs.states_dir / shard_name(i) for i in (0, 1))
    live.write_bytes(b"being written")
    leftover.write_bytes(b"a killed capture's")
    with file_lock(shard_lock(seqs.states_dir, live.name)):  # the capture, mid-shard
        hybrid.publish(
            online, torch.device("cpu"), SimpleNamespace(barrier=lambda: None, global_rank=0, world_size=1), 2
        )
    meta = json.loads((seqs.states_dir / "complete.json").read_text())
    assert live.exists() and not leftover.exists()
    assert [s["file"] for s in meta["shards"]] == list(meta["shard_bytes"]) and live.name not in meta["shard_bytes"]
    assert sorted(r for s in meta["shards"] for r in s["rows"]) == list(range(len(seqs)))
    assert torch.equal(seqs.states.read(0)["target_next"], online(next(iter(DataLoader(
        FeatureDataset(seqs, [0], False), batch_size=1, collate_fn=collate)))).target_next[0])  # fmt: skip


def _conversations(path, rows) -> str:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return f"jsonl:{path}"


def test_original_responses_are_the_sources_own_answers(tiny, tmp_path):
    """data.responses=original: each sequence is the prompt plus the source's assistant turn as the chat template
    writes it (up to its end-of-turn id), with no tail; the same prompts regenerated are another cache entry."""
    from eaglelab.data.prompts import load_source
    from eaglelab.data.regenerate import stop_ids

    answers = ["Paris is the capital of France.", "Four, since two plus two is four.", "Blue, on a clear day."]
    questions = ["What is the capital of France?", "What is 2 + 2?", "What colour is the sky?"]
    source = _conversations(
        tmp_path / "qa.jsonl",
        [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in zip(questions, answers)],
    )
    prompts = load_source(source, with_response=True)
    assert [p[-1]["content"] for p in prompts] == answers
    ask, how = SetRequest("t", max_new_tokens=32), CaptureSettings(tmp_path / "c", [2, 4, 5], None, 512, batch_size=3)
    data, stats = prepare_features(tiny, prompts, replace(ask, tail_tokens=8), how)
    stops = stop_ids(tiny)
    texts = {}
    for i in range(len(data)):
        row = data.item(i)
        ids, p = row["input_ids"].tolist(), int(data.tokens.prompt_len[i])
        assert ids[-1] in stops and not any(t in stops for t in ids[p:-1])  # ends at its own end of turn
        texts[tiny.tokenizer.decode(ids[:p])] = tiny.tokenizer.decode(ids[p:-1]).strip()
        assert len(row["aux"]) == len(ids)  # states captured over the source's text
    assert sorted(texts.values()) == sorted(answers)
    assert all(q in prompt for q, prompt in zip(questions, sorted(texts, key=lambda t: questions.index(
        next(q for q in questions if q in t)))))  # fmt: skip
    regenerated, again = prepare_features(tiny, [p[:-1] for p in prompts], ask, how)
    assert not again.regen_cached and regenerated["input_ids"] != data["input_ids"]


def test_original_responses_need_a_source_with_answers(tmp_path):
    from eaglelab.data.prompts import load_source

    with pytest.raises(DataError, match="stdlib_docstrings has none"):
        load_source("stdlib_docstrings", with_response=True)
    source = _conversations(tmp_path / "q.jsonl", [[{"role": "user", "content": "hi"}]])
    with pytest.raises(DataError, match=r"q.jsonl:1: empty conversation \(no a user turn with text, followed by an"):
        load_source(source, with_response=True)
    assert load_source(source) == [[{"role": "user", "content": "hi"}]]  # regenerate: the user turn is enough


def test_python_docstrings_is_a_larger_pool_of_prose_requests():
    """The standard library's and installed packages' documented API: many times the curated stdlib pool, no
    repeated request, no bare signature standing in for documentation."""
    from eaglelab.data.prompts import python_docstring_prompts, stdlib_docstring_prompts

    pool = [p[0]["content"] for p in python_docstring_prompts()]
    assert len(pool) > 5 * len(stdlib_docstring_prompts()) and len(set(pool)) == len(pool)
    docs = [text.split("\n\n")[1] for text in pool]
    assert not [d for d in docs if re.fullmatch(r"[\w.]+\(.*\)(\s*->.*)?", d)]  # "name(args) -> T": a signature
    assert any("torch." in t for t in pool) and any("the Python standard library" in t for t in pool)


def test_self_chat_keeps_closed_distinct_requests_in_order():
    from eaglelab.core.config import SelfChatSettings
    from eaglelab.data.self_chat import keep

    rows = [
        {"text": "How do I bake sourdough bread at home?", "closed": True},
        {"text": "How do I bake sourdough bread at home?!", "closed": True},  # the same once normalized
        {"text": "An unfinished request that ran out of tok", "closed": False},  # never closed its turn
        {"text": "Hi", "closed": True},  # too short
        {"text": "Plan a three-day trip to Lisbon for two people on a budget.", "closed": True},
        {"text": "Summarize the causes of the First World War in five bullet points.", "closed": True},
    ]
    assert keep(rows, 2, SelfChatSettings()) == [rows[0]["text"], rows[4]["text"]]
    assert len(keep(rows, 10, SelfChatSettings())) == 3


def test_the_chat_evaluation_set_is_held_out_of_every_training_source():
    from eaglelab.data.chat_prompts import CHAT_PROMPTS
    from eaglelab.data.prompts import load_source

    chat = load_source("chat")
    assert len(chat) == 48 and len(CHAT_PROMPTS) == 8 and all(len(v) == 6 for v in CHAT_PROMPTS.values())
    texts = {p[0]["content"] for p in chat}
    for source in ("stdlib_docstrings", "pydoc_topics", "python_docstrings"):
        assert not texts & {p[-1]["content"] for p in load_source(source)}


def test_validation_is_held_out_by_count_at_every_data_size(cache_dir, tmp_path):
    """data.val_prompts prompts from the training sources, on top of data.num_prompts: as many validation sequences
    at 96 training prompts as at 384, none of them trained on, and the same split every time it is drawn."""
    from eaglelab.data.stage import select_prompts

    from conftest import compose

    key = lambda p: json.dumps(p, sort_keys=True)  # noqa: E731
    for size in (96, 384):
        cfg = compose(
            [f"data.num_prompts={size}", "data.sources=[stdlib_docstrings,python_docstrings]"], cache_dir, tmp_path
        )
        prompts = select_prompts(cfg)
        assert (len(prompts.train), len(prompts.validation)) == (size, cfg.data.val_prompts) == (size, 48)
        assert not {key(p) for p in prompts.train} & {key(p) for p in prompts.validation}
        again = select_prompts(cfg)
        assert [key(p) for p in again.validation] == [key(p) for p in prompts.validation]


# A multi-turn JSONL: conversations of 1, 2 and 3 user turns, each answered by the source in words the target would
# never write.
def _chats(turns: list[int]) -> list:
    return [
        [m for t in range(n) for m in ({"role": "user", "content": f"Question {t} of chat {c}: what is {c} + {t}?"},
                                       {"role": "assistant", "content": f"SOURCE ANSWER {c}.{t}"})]
        for c, n in enumerate(turns)
    ]  # fmt: skip


def _multi_turn(tiny, folder, chats, **kw):
    from eaglelab.data.prompts import load_source

    folder.mkdir(parents=True, exist_ok=True)
    source = _conversations(folder / "chats.jsonl", chats)
    prompts = load_source(source, with_response=kw.pop("responses", "regenerate") == "original")
    how = CaptureSettings(folder / "c", [2, 4], None, 512, batch_size=4, shard_size=3, backend=kw.pop("backend", "hf"))
    return prepare_features(tiny, prompts, SetRequest("t", max_new_tokens=10, tail_tokens=3, **kw), how)


def test_every_assistant_turn_is_the_targets_own_answer_and_trained(tiny, tmp_path):
    """data.turns=all: each conversation is answered turn by turn by the target (the source's answers replaced by
    its own, in its history), and every answer is a trained span whose tokens are the target's greedy choices;
    turns=last trains the last answer only, the earlier turns in the source's words. The drafting mask covers the
    spans and never the user turns between them. One-turn prompts keep their cache entry whatever data.turns says."""
    from eaglelab.train.batches import collate

    chats = _chats([1, 2, 3, 3, 2])
    last, last_stats = _multi_turn(tiny, tmp_path, chats, turns="last")
    every, stats = _multi_turn(tiny, tmp_path, chats, turns="all")
    assert every.tokens.folder != last.tokens.folder  # turns are part of the regeneration's key
    assert stats.sequences == last_stats.sequences == len(chats)
    decode = tiny.tokenizer.decode
    for data, turns in ((last, "last"), (every, "all")):
        for i in range(len(data)):
            row = data.item(i)
            ids, p = row["input_ids"], row["prompt_len"]
            spans = row.get("spans", torch.zeros(0, 2, dtype=torch.long)).tolist()
            users = decode(ids).count("<|im_start|>user")
            assert ("SOURCE ANSWER" in decode(ids)) == (turns == "last" and users > 1)
            assert len(spans) == (users - 1 if turns == "all" else 0)
            for s, e in [*spans, (p, len(ids))]:  # each answer: the target's greedy tokens after its own history
                assert 0 < s < e and row["target_next"][s - 1 : e - 1].tolist() == ids[s:e].tolist()
                assert "<|im_start|>" not in decode(ids[s:e])
    assert stats.response_tokens > last_stats.response_tokens  # (the assistant tokens trained)
    assert stats.response_tokens == sum(every.tokens.trained_tokens(r) for r in range(len(every)))
    batch = collate([every.item(i) for i in range(len(every))])
    b = int(batch.spans[:, :, 1].gt(0).sum(-1).argmax())  # a conversation of three turns
    (s0, e0), (s1, e1) = batch.spans[b].tolist()[:2]
    for j in (1, 3):
        drafting = batch.drafting(j)[b].nonzero().flatten().tolist()
        inside = [*range(s0 - 1, e0 - j - 1), *range(s1 - 1, e1 - j - 1)]
        inside += range(int(batch.prompt_len[b]) - 1, int(batch.seq_len[b]) - j - 1)
        assert drafting == inside  # the user turns in between, and the template's tokens, are never drafted
    assert int(batch.first[b]) == s0 - 1
    one_turn = [c[:2] for c in chats]
    a = _multi_turn(tiny, tmp_path / "last", one_turn, turns="last")[0]
    b = _multi_turn(tiny, tmp_path / "all", one_turn, turns="all")[0]
    assert a.tokens.folder.name == b.tokens.folder.name


def test_original_turns_are_each_a_span(tiny, tmp_path):
    """data.responses=original with turns=all: the source's every assistant turn is a trained span, as the chat
    template writes it (its text and end-of-turn id)."""
    data, _ = _multi_turn(tiny, tmp_path, _chats([1, 2, 3]), responses="original", turns="all")
    decode = tiny.tokenizer.decode
    for i in range(len(data)):
        row = data.item(i)
        ids, p = row["input_ids"].tolist(), row["prompt_len"]
        spans = [*row.get("spans", torch.zeros(0, 2, dtype=torch.long)).tolist(), (p, len(ids))]
        said = [decode(ids[s:e]) for s, e in spans]
        chat = int(re.search(r"of chat (\d+)", decode(ids)).group(1))
        assert said == [f"SOURCE ANSWER {chat}.{t}<|im_end|>" for t in range(len(spans))]


@pytest.mark.slow
def test_vllm_answers_every_turn_as_hf_does(tiny, tmp_path):
    """data.regen_backend=vllm with turns=all: one engine answers every round of every conversation (the chat
    template rendered in its process), and the sequences and their spans are the HF backend's."""
    chats = _chats([3, 2, 1])
    hf, _ = _multi_turn(tiny, tmp_path / "hf", chats, turns="all", features="online")
    engine, _ = _multi_turn(tiny, tmp_path / "vllm", chats, turns="all", features="online", backend="vllm")
    assert engine["input_ids"] == hf["input_ids"]
    for i in range(len(hf)):
        assert hf.tokens.spans(i).tolist() == engine.tokens.spans(i).tolist()
        assert hf.tokens.tail(i).tolist() == engine.tokens.tail(i).tolist()
    assert sum(len(hf.tokens.spans(i)) for i in range(len(hf))) == 2 + 1


def test_the_cache_key_streams_the_same_hash_json_would_write():
    """Cache keys are hashed part by part (no string of every token id at once) and equal the hash of json.dumps
    of the whole, as keys were made before: entries already on disk keep their keys. Token ids may be arrays."""
    import hashlib
    from pathlib import Path

    import numpy as np

    from eaglelab.data.cache_entry import cache_key

    parts = dict(v=5, source="a+b", prompts=[[1, 2, 3], [4]], is_val=[False, True], target={"z": 1, "b": [2]},
                 path=Path("/x"), turns=[[{"role": "user", "content": "é"}]], empty=[])  # fmt: skip
    whole = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
    assert cache_key(**parts) == whole
    assert cache_key(**{**parts, "prompts": [np.array(p, np.int32) for p in parts["prompts"]]}) == whole
    assert cache_key(**{**parts, "prompts": [[1, 2, 3], [5]]}) != whole


def test_an_entry_that_keeps_more_serves_every_loss_and_ttt_length(tiny, tmp_path):
    """One prepared entry for a sweep's widest trial (the KL teacher's final state, tails for the deepest TTT) serves
    its CE and shorter-TTT trials: they prepare nothing and read the same sequences; an entry that keeps less is no
    substitute for one that keeps more."""
    prompts = mix_sources(["stdlib_docstrings"], 6, seed=5)
    ask = lambda with_final, tail: SetRequest("t", 24, with_final=with_final, tail_tokens=tail)  # noqa: E731
    how = CaptureSettings(tmp_path, [2, 4, 5], None, 512, batch_size=3, shard_size=3)
    widest, made = prepare_features(tiny, prompts, ask(True, 16), how)
    assert made.shards_regenerated == 2 and widest.keeps_final and widest.tokens.meta["tail_tokens"] == 16
    for with_final, tail in ((False, 8), (True, 8), (False, 16)):
        served, stats = prepare_features(tiny, prompts, ask(with_final, tail), how)
        assert stats.shards_regenerated == stats.shards_captured == 0, (with_final, tail)
        assert served.tokens.folder == widest.tokens.folder and served.states.folder == widest.states.folder
        for i in range(len(served)):  # validation reads the tail asked for, not all the entry keeps
            item = served.item(i, with_states=False, with_tail=True)
            assert len(item["input_ids"]) - item["seq_len"] == min(tail, len(widest.tokens.tail(i)))
    # the other way round: a KL trial after a CE-only entry captures the final state (no new regeneration), and a
    # deeper TTT than the entry's tails regenerates
    narrow_how = replace(how, cache_dir=tmp_path / "narrow")
    narrow, _ = prepare_features(tiny, prompts, ask(False, 8), narrow_how)
    kl, stats = prepare_features(tiny, prompts, ask(True, 8), narrow_how)
    assert (stats.shards_regenerated, stats.shards_captured) == (0, 2) and kl.states.with_final
    assert kl.tokens.folder == narrow.tokens.folder and kl.states.folder != narrow.states.folder
    deeper, stats = prepare_features(tiny, prompts, ask(False, 16), narrow_how)
    assert stats.shards_regenerated == 2 and deeper.tokens.folder != narrow.tokens.folder
    # the sequences a wider entry holds are the same: only the tail is longer
    for i in range(len(narrow)):
        assert narrow.tokens.input_ids(i).tolist() == widest.tokens.input_ids(i).tolist()
        assert narrow.tokens.tail(i).tolist() == widest.tokens.tail(i)[: len(narrow.tokens.tail(i))].tolist()
        assert torch.equal(narrow.item(i)["aux"], widest.item(i)["aux"])


def test_cache_keys_hash_the_shared_parts_once_and_equal_the_keys_entries_have():
    """One key per tail length, each the hash of json.dumps of the whole (how every entry's key was made)."""
    import hashlib

    from eaglelab.data.cache_entry import cache_keys

    parts = dict(v=5, source="a", prompts=[[1, 2, 3], [4]], target={"z": 1}, turns=[])
    whole = lambda p: hashlib.sha256(json.dumps(p, sort_keys=True, default=str).encode()).hexdigest()[:20]  # noqa: E731
    assert cache_keys("tail_tokens", [8, 16], **parts) == [whole({**parts, "tail_tokens": t}) for t in (8, 16)]
    assert cache_keys("", [None], **parts) == [whole(parts)]


def test_benchmark_questions_are_never_training_prompts(cache_dir, tmp_path):
    """A training source that holds MT-Bench's first question (as a user might mix a public chat set in) loses it
    when the benchmarks suite evaluates MT-Bench, by the dedupe that guards the held-out set."""
    from eaglelab.data.prompts import load_source
    from eaglelab.data.stage import select_prompts

    from conftest import compose

    first = load_source("mt_bench")[0]
    others = [[{"role": "user", "content": f"Explain item {i} of the list."}] for i in range(20)]
    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [first, *others]))
    base = [f"data.sources=[jsonl:{path}]", "data.num_prompts=19", "data.val_prompts=2"]  # (every one drawn)
    key = lambda p: json.dumps(p, sort_keys=True)  # noqa: E731
    kept = select_prompts(compose(base, cache_dir, tmp_path / "a"))
    dropped = select_prompts(compose([*base, "+suite=benchmarks"], cache_dir, tmp_path / "b"))
    assert key(first) in {key(p) for p in [*kept.train, *kept.validation]}
    assert key(first) not in {key(p) for p in [*dropped.train, *dropped.validation]}
