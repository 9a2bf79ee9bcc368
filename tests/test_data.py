"""Data stages on the tiny target: generation equals HF greedy `generate`, fused capture equals a
separate full-forward capture, the cache is keyed and reused, the draft vocab is frequency-ranked."""

import shutil

import pytest
import torch

from eaglelab.config import TargetConfig
from eaglelab.data.prepare import from_bits, prepare_features
from eaglelab.data.prompts import humaneval_prompts, jsonl_prompts, mix_sources
from eaglelab.data.regenerate import generate
from eaglelab.data.templates import template_prompt
from eaglelab.data.vocab import draft_vocab
from eaglelab.errors import DataError
from eaglelab.targets import load_target


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return load_target(TargetConfig(kind="tiny", dtype="float32"), cache_dir)  # as conf/target/tiny.yaml


def test_generation_matches_hf_generate(tiny):
    prompts = [template_prompt(tiny.tokenizer, m, None) for m in humaneval_prompts()[:3]]
    ours = {i: r for i, r, _ in generate(tiny, prompts, 12, 2048, batch_size=3)}
    for i, p in enumerate(prompts):  # one at a time: no padding on the reference side
        ref = tiny.model.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=tiny.tokenizer.pad_token_id
        )[0, len(p) :].tolist()
        assert ours[i] == ref


def test_fused_capture_equals_a_separate_forward(tiny, tmp_path):
    prompts = mix_sources(["stdlib_docstrings"], 5, seed=1)
    kw = dict(name="t", aux_layer_ids=[2, 4, 5], system_prompt=None, max_new_tokens=10, max_length=512, batch_size=5)
    fused, stats = prepare_features(tiny, prompts, cache_dir=tmp_path, **kw)
    assert not stats.regen_cached and not stats.capture_cached
    shutil.rmtree(tmp_path / "features")  # force the separate capture pass over the cached regeneration
    separate, stats2 = prepare_features(tiny, prompts, cache_dir=tmp_path, **kw)
    assert stats2.regen_cached and not stats2.capture_cached
    by_ids = {tuple(r["input_ids"]): r for r in separate.with_format("numpy")}
    for row in fused.with_format("numpy"):
        other = by_ids[tuple(row["input_ids"])]
        a, b = from_bits(row["aux"]).float(), from_bits(other["aux"]).float()
        assert a.shape == b.shape == (len(row["input_ids"]), 3 * 128)
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2)
        p = int(row["prompt_len"])  # labels start at the last prompt position (the first drafting one)
        assert (row["target_next"][p - 1 :] == other["target_next"][p - 1 :]).mean() > 0.95
        # Generated tokens are the target's greedy choice at the previous position.
        assert list(row["target_next"][p - 1 : -1]) == list(row["input_ids"][p:])
    _, stats3 = prepare_features(tiny, prompts, cache_dir=tmp_path, **kw)
    assert stats3.regen_cached and stats3.capture_cached  # third time: all from cache
    _, stats4 = prepare_features(tiny, prompts, cache_dir=tmp_path, **{**kw, "max_new_tokens": 11})
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


def test_vllm_regeneration_backend_matches_hf(tiny, tmp_path):
    """data.regen_backend=vllm: the real engine regenerates the same greedy responses (same stop
    tokens, budget, EOS kept) and the capture pass then fills the same feature layout."""
    prompts = mix_sources(["stdlib_docstrings"], 6, seed=2)
    kw = {
        "name": "t",
        "aux_layer_ids": [2, 4, 5],
        "system_prompt": None,
        "max_new_tokens": 16,
        "max_length": 512,
        "batch_size": 6,
    }
    hf, _ = prepare_features(tiny, prompts, cache_dir=tmp_path / "hf", **kw)
    vl, stats = prepare_features(tiny, prompts, cache_dir=tmp_path / "vllm", backend="vllm", **kw)
    assert stats.seconds["regenerate"] > 0 and stats.seconds["capture"] > 0
    hf_seqs = {tuple(r) for r in hf["input_ids"]}
    same = sum(tuple(r) in hf_seqs for r in vl["input_ids"])
    assert same == len(prompts), f"{same}/{len(prompts)} identical greedy sequences"
    for row in vl.with_format("numpy"):
        assert len(row["aux"]) == len(row["input_ids"]) == len(row["target_next"])
