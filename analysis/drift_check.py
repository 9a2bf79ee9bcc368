"""An independent check of the drift suite: every measure recomputed from the exported drafter alone.

    python analysis/drift_check.py RUN_DIR [--tolerance 1e-4]

The drift suite (eaglelab.evaluate.drift) reads the probabilities of the drafter's training-time-test unroll, the whole
sequence at once. This file shares none of that code: it reads the export (config.json + model.safetensors, vLLM's
names) and the target's embedding, and drafts the way an inference engine does: one position at a time into a
KV cache (the verified context), then a chain of drafts from each verified position t whose keys go in the slots
after the context's, dropped when the chain ends. Every attention is an explicit softmax over the keys the query can
see, in float64. Each measure is then computed from its definition (docs/conventions.md, "Attention-drift
measures"), by the keys' position ids:

    sink_share     probability on the key at position id 0
    context_share  on keys at position ids <= t (the verified context the chain drafts from)
    draft_share    on the chain's own keys (position ids t+1 .. t+j-1, this query's own key included)
    recent_share   on keys at position ids > p - R, p = t + j - 1 the query's own (the R most recent)
    entropy        -Σ p log p over the keys it sees, in nats
    hidden_rms     ‖x‖₂/√d of the state fed to step j (fc's output at j = 1, the previous step's feedback after)

each a mean over heads, then layers, then over the drafts an engine would make (t >= prompt length - 1 and the
draft's target x_{t+j+1} inside the sequence). The sequences are the suite's own (suites/drift_inputs.json names
their stores and rows). Prints the largest gap per measure against suites/drift.csv (hidden_rms and entropy relative to
their values) and exits 1 past the tolerance.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from analysis import cli

MEASURES = ("hidden_rms", "sink_share", "context_share", "draft_share", "recent_share", "entropy")
RELATIVE = ("hidden_rms", "entropy")  # compared relative to their size; the shares (in [0, 1]) absolutely
# The suite runs the drafter in float32, this check in float64: a probability's rounding moves p·log p by
# |log p + 1|·dp, ~20× for the smallest probabilities, so the entropy is held to 10× the shares' tolerance.
TOLERANCE_SCALE = {"entropy": 10.0}


class KVCache:
    """One layer's keys and values in slots, in the order they were written, with their position ids. A chain of
    drafts writes its keys after the context's and is dropped by rewinding (`rewind`), as an engine reuses its
    draft slots: the next verified position overwrites them."""

    def __init__(self, capacity: int, kv: int, d: int, d_v: int | None = None):
        self.pos = torch.zeros(capacity, dtype=torch.long)
        self.k = torch.zeros(capacity, kv, d, dtype=torch.float64)
        self.v = torch.zeros(capacity, kv, d_v or d, dtype=torch.float64)
        self.n = 0

    def append(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pos[self.n], self.k[self.n], self.v[self.n] = pos, k, v
        self.n += 1

    def rewind(self, n: int) -> None:
        self.n = n


class PlainDrafter:
    """The exported drafter in float64, one token at a time; `probs` of each step are kept for the measures."""

    def __init__(self, folder: Path, embed: torch.Tensor):
        self.c = json.loads((folder / "config.json").read_text())
        if self.c.get("rope_scaling"):
            raise SystemExit(f"error: {folder}: rope_scaling is not implemented by this check; use an unscaled RoPE")
        weights = load_file(str(folder / "model.safetensors"))
        self.w = {k.replace("midlayer.", "layers.0."): v.double() for k, v in weights.items() if v.is_floating_point()}
        self.embed = embed
        self.layers = self.c["num_hidden_layers"]
        self.h, self.kv, self.d = self.c["num_attention_heads"], self.c["num_key_value_heads"], self.c["head_dim"]
        extra = self.c.get("eaglelab", {})
        self.window, self.sink = extra.get("attention_window"), extra.get("attention_sink_tokens", 4)
        self.n_aux = len(self.c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        # Qwen3's layer (vLLM's qwen3_eagle3.py): each head's q and k RMS-normed before RoPE
        self.qk_norm = self.c["architectures"][0] == "Eagle3Qwen3ForCausalLM"
        # DeepSeek's latent attention (vLLM's deepseek_eagle3.py): every head has its keys and values of its own
        self.mla = self.c["architectures"][0] in ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
        if self.mla:
            self.kv, self.d = self.h, self.c["qk_nope_head_dim"] + self.c["qk_rope_head_dim"]
        self.d_v = self.c["v_head_dim"] if self.mla else self.d

    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * x / torch.sqrt(x.pow(2).mean() + self.c["rms_norm_eps"])

    def per_head(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x: [heads, d], each head RMS-normed on its own (Qwen3's q_norm, k_norm); as it is, without them."""
        if not self.qk_norm:
            return x
        return self.w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])

    def rotary_pairs(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: [..., r] at `pos`, DeepSeek's RoPE: pairs (2i, 2i + 1) rotated by pos / theta^(2i/r)."""
        r = x.shape[-1]
        angle = pos / self.c["rope_theta"] ** (torch.arange(r // 2, dtype=torch.float64) * 2 / r)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1).flatten(-2)

    def latent_qkv(self, inp: torch.Tensor, pos: int, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k: [heads, nope + rope], v: [heads, v] of one position from its latents."""
        c, w = self.c, lambda n: self.w[p + "self_attn." + n + ".weight"]  # noqa: E731
        nope, r = c["qk_nope_head_dim"], c["kv_lora_rank"]
        q = (
            w("q_proj") @ inp
            if not c.get("q_lora_rank")
            else w("q_b_proj") @ self.rms_norm(w("q_a_proj") @ inp, p + "self_attn.q_a_layernorm.weight")
        )
        q = q.view(self.h, -1)
        q = torch.cat([q[:, :nope], self.rotary_pairs(q[:, nope:], pos)], dim=1)
        a = w("kv_a_proj_with_mqa") @ inp
        kv = (w("kv_b_proj") @ self.rms_norm(a[:r], p + "self_attn.kv_a_layernorm.weight")).view(self.h, -1)
        k_rope = self.rotary_pairs(a[r:], pos).expand(self.h, -1)
        return q, torch.cat([kv[:, :nope], k_rope], dim=1), kv[:, nope:]

    def rotary(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: [heads, d] at integer position `pos`: pairs (i, i + d/2) rotated by pos / theta^(2i/d)."""
        half = self.d // 2
        angle = pos / self.c["rope_theta"] ** (torch.arange(half, dtype=torch.float64) * 2 / self.d)
        cos, sin = angle.cos(), angle.sin()
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=1)

    def fused(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [n_aux·H_t] one position's captured states -> g: [H], what step 1 is fed."""
        if self.c.get("norm_before_fc"):
            aux = self.rms_norm(aux, "input_norm.weight")
        if self.c.get("fc_norm"):
            parts = aux.chunk(self.n_aux)
            aux = torch.cat([self.rms_norm(p, f"fc_norm.{i}.weight") for i, p in enumerate(parts)])
        return self.w["fc.weight"] @ aux

    def step(self, token: int, fed: torch.Tensor, pos: int, caches: list[KVCache]) -> tuple[torch.Tensor, list]:
        """One query through every layer at position id `pos`; appends its (pos, k, v) to each layer's cache.
        -> (the state fed to the next step, per layer its probabilities [heads, keys] and the keys' position ids)."""
        x, seen = fed, []
        for i in range(self.layers):
            p = f"layers.{i}."
            if i == 0:  # [norm(embedding) ; hidden] into attention; the residual is the hidden state
                e = self.rms_norm(self.embed[token], p + "input_layernorm.weight")
                if self.c.get("norm_before_residual"):
                    x = self.rms_norm(x, p + "hidden_norm.weight")
                    inp = torch.cat([e, x])
                else:
                    inp = torch.cat([e, self.rms_norm(x, p + "hidden_norm.weight")])
            else:
                inp = self.rms_norm(x, p + "input_layernorm.weight")
            if self.mla:
                q, k, v = self.latent_qkv(inp, pos, p)
            else:
                q = (self.w[p + "self_attn.q_proj.weight"] @ inp).view(self.h, self.d)
                k = (self.w[p + "self_attn.k_proj.weight"] @ inp).view(self.kv, self.d)
                q = self.rotary(self.per_head(q, p + "self_attn.q_norm.weight"), pos)
                k = self.rotary(self.per_head(k, p + "self_attn.k_norm.weight"), pos)
                v = (self.w[p + "self_attn.v_proj.weight"] @ inp).view(self.kv, self.d)
            cache = caches[i]
            cache.append(pos, k, v)
            key_pos, keys, values = cache.pos[: cache.n], cache.k[: cache.n], cache.v[: cache.n]
            if self.window is not None:  # a sliding window over position ids, the first `sink` tokens kept
                seen_ = (pos - key_pos < self.window) | (key_pos < self.sink)
                key_pos, keys, values = key_pos[seen_], keys[seen_], values[seen_]
            keys = keys.repeat_interleave(self.h // self.kv, 1)  # [n, h, d]
            values = values.repeat_interleave(self.h // self.kv, 1)
            scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(self.d)
            probs = torch.exp(scores - scores.max(1, keepdim=True).values)
            probs = probs / probs.sum(1, keepdim=True)  # [h, n]
            seen.append((probs, key_pos))
            attended = torch.einsum("hn,nhd->hd", probs, values).reshape(-1)
            x = x + self.w[p + "self_attn.o_proj.weight"] @ attended
            y = self.rms_norm(x, p + "post_attention_layernorm.weight")
            gate, up = self.w[p + "mlp.gate_proj.weight"] @ y, self.w[p + "mlp.up_proj.weight"] @ y
            x = x + self.w[p + "mlp.down_proj.weight"] @ (F.silu(gate) * up)
        normed = self.rms_norm(x, "norm.weight")
        return (normed if self.c.get("norm_output") else x), seen


def attention_measures(probs: torch.Tensor, key_pos: torch.Tensor, t: int, pos: int, recent: int) -> dict:
    """One layer's probabilities [heads, keys] for a query at position id `pos` drafting from verified t: each
    measure averaged over heads."""
    p = probs
    return {
        "sink_share": float(p[:, key_pos == 0].sum(1).mean()),
        "context_share": float(p[:, key_pos <= t].sum(1).mean()),
        "draft_share": float(p[:, key_pos > t].sum(1).mean()),
        "recent_share": float(p[:, key_pos > pos - recent].sum(1).mean()),
        "entropy": float(-(p * torch.log(p.clamp_min(1e-300))).sum(1).mean()),
    }


def drafts(drafter: PlainDrafter, ids: list[int], aux: torch.Tensor, prompt_len: int, depth: int):
    """Every draft an engine would make on one sequence (x_0..x_{T-1} = ids, aux [T, n_aux·H_t]), in order:
    (verified position t, depth j, the state fed to it [H], per layer its probabilities [heads, keys] and the keys'
    position ids). A draft is made from t >= prompt_len - 1 while its target x_{t+j+1} is inside the sequence."""
    T = len(ids)
    caches = [KVCache(T + depth, drafter.kv, drafter.d, drafter.d_v) for _ in range(drafter.layers)]
    for t in range(T):
        token = ids[t + 1] if t + 1 < T else 0  # step 1 at t reads x_{t+1} (the engine's next verified token)
        state = drafter.fused(aux[t])
        fed, seen = drafter.step(token, state, t, caches)
        if t < prompt_len - 1:
            continue
        context = caches[0].n  # the chain's keys go after the context's and are dropped after it
        for j in range(1, depth + 1):
            if t + j + 1 >= T:
                break
            if j > 1:
                state = fed
                fed, seen = drafter.step(ids[t + j], state, t + j - 1, caches)
            yield t, j, state, seen
        for c in caches:
            c.rewind(context)


def single_turn(seqs, desc: str, limit: int | None = None):
    """(ids, aux float64, prompt length) of the first `limit` sequences of `seqs` (all by default), with a progress
    bar; multi-turn sequences (spans) are refused: their drafts are not only past the prompt."""
    for i in tqdm(range(min(limit or len(seqs), len(seqs))), desc=desc, unit="sequence", leave=False):
        item = seqs.item(i)
        if "spans" in item:
            raise SystemExit("error: multi-turn sequences (spans) are not covered here; use single-turn ones")
        yield item["input_ids"].tolist(), item["aux"].double(), item["prompt_len"]


def target_embedding(target_path: Path) -> torch.Tensor:
    """The target's input embedding [V, H] (the drafter shares it; the export omits it), by tensor name."""
    for f in sorted(target_path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in (
                "model.embed_tokens.weight",
                "embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            ):
                if name in st.keys():
                    return st.get_tensor(name).double()
    raise SystemExit(f"error: {target_path} holds no embed_tokens.weight in its *.safetensors; point run.json's "
                     f"target_path at the target's Hugging Face folder")  # fmt: skip


def load_run(run_dir: Path):
    """(the exported drafter as PlainDrafter, the drift suite's sequences, its drift_inputs.json) of one run."""
    from eaglelab.data.store import Sequences, StateStore, TokenStore  # the cache's readers: data, not the method

    inputs_file = run_dir / "suites" / "drift_inputs.json"
    if not inputs_file.is_file():
        raise SystemExit(f"error: {inputs_file} not found; evaluate the run with the drift suite on (it writes it)")
    inputs = json.loads(inputs_file.read_text())
    target = Path(json.loads((run_dir / "run.json").read_text())["target_path"])
    drafter = PlainDrafter(run_dir / "drafter", target_embedding(target))
    seqs = Sequences(TokenStore(Path(inputs["tokens"])), StateStore(Path(inputs["states"])), rows=inputs["rows"])
    return drafter, seqs, inputs


def recompute(run_dir: Path) -> list[dict]:
    """The suite's measures per depth, recomputed on its sequences."""
    drafter, seqs, inputs = load_run(run_dir)
    return measures(drafter, seqs, inputs["depth"], inputs["recent_tokens"])


def measures(drafter: PlainDrafter, seqs, depth: int, recent: int) -> list[dict]:
    """Rows per depth j = 1..depth: each measure's mean over every draft of `seqs` (a Sequences view) and the drafts."""
    values = defaultdict(list)
    for ids, aux, prompt_len in single_turn(seqs, "drift check"):
        for t, j, state, layers in drafts(drafter, ids, aux, prompt_len, depth):
            values[(j, "hidden_rms")].append(float(state.pow(2).mean().sqrt()))
            per_layer = [attention_measures(pr, kp, t, t + j - 1, recent) for pr, kp in layers]
            for m in MEASURES[1:]:
                values[(j, m)].append(sum(r[m] for r in per_layer) / len(per_layer))
    return [
        {
            "depth": j,
            **{m: sum(values[(j, m)]) / len(values[(j, m)]) if values[(j, m)] else math.nan for m in MEASURES},
            "drafts": len(values[(j, "hidden_rms")]),
        }
        for j in range(1, depth + 1)
    ]


def gaps(suite: list[dict], check: list[dict]) -> dict[str, tuple[float, int]]:
    """measure -> (largest |suite - check| over depths, the depth it is at); relative for the two that are not shares
    (hidden_rms and the entropy: magnitudes, whose float32 rounding in the suite scales with them)."""
    out = {}
    for m in MEASURES:
        diffs = []
        for a, b in zip(suite, check):
            x, y = float(a[m]), b[m]
            if math.isnan(x) or math.isnan(y):  # no draft at that depth: both sides must say so
                diffs.append((0.0 if math.isnan(x) and math.isnan(y) else math.inf, b["depth"]))
                continue
            d = abs(x - y)
            diffs.append((d / max(abs(y), 1e-12) if m in RELATIVE else d, b["depth"]))
        out[m] = max(diffs)
    return out


def main(argv: list[str] | None = None) -> int:
    import csv

    ap = cli.parser(__doc__, roots=False, out=None)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest gap allowed (hidden_rms, entropy: relative; entropy 10x)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one small matrix-vector product after another: more threads only wait on each other
    check = recompute(args.run_dir)
    with open(args.run_dir / "suites" / "drift.csv") as f:
        suite = list(csv.DictReader(f))
    worst = gaps(suite, check)
    for m, (gap, depth) in worst.items():
        print(f"{m:14s} largest gap {gap:.2e}{' (relative)' if m in RELATIVE else ''} (depth {depth})")
    drafts_equal = all(int(a["drafts"]) == b["drafts"] for a, b in zip(suite, check))
    print(f"drafts per depth {'equal' if drafts_equal else 'DIFFER'}")
    ok = drafts_equal and all(g <= args.tolerance * TOLERANCE_SCALE.get(m, 1.0) for m, (g, _) in worst.items())
    print("agree" if ok else f"DISAGREE beyond {args.tolerance}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
