"""An independent, step-by-step EAGLE-3 drafter with an explicit KV cache, as an inference engine runs it.

It reads only a vLLM-format state dict and config.json (not eaglelab's modules), processes one token
at a time, and drafts chains from every verified position. The TTT unroll must reproduce its logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class ReferenceDrafter:
    def __init__(self, state_dict: dict[str, torch.Tensor], config: dict, embed: torch.Tensor):
        self.w = {
            k.replace("midlayer.", "layers.0."): v.double() if v.is_floating_point() else v
            for k, v in state_dict.items()
        }
        self.c = config
        self.embed = embed.double()
        self.H = config["hidden_size"]
        self.h, self.kv, self.d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        self.eps = config["rms_norm_eps"]
        extra = config.get("eaglelab", {})
        self.window, self.sink = extra.get("attention_window"), extra.get("attention_sink_tokens", 4)
        self.n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.qwen3 = config["architectures"] == ["Eagle3Qwen3ForCausalLM"]  # per-head q/k RMSNorm before RoPE
        self.mla = config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]  # DeepSeek's latent attention

    def rms(self, x, name):
        return self.w[name] * (x / torch.sqrt((x * x).mean() + self.eps))

    def heads_rms(self, x, name):  # x: [heads, d], each head on its own (Qwen3's q_norm / k_norm)
        return torch.stack([self.w[name] * (row / torch.sqrt((row * row).mean() + self.eps)) for row in x])

    def rotate(self, x, pos):  # x: [heads, d], Llama rotate-half RoPE at integer position `pos`
        d = self.d
        out = torch.empty_like(x)
        for i in range(d // 2):
            angle = pos / (self.c["rope_theta"] ** (2 * i / d))
            c, s = math.cos(angle), math.sin(angle)
            out[:, i] = x[:, i] * c - x[:, i + d // 2] * s
            out[:, i + d // 2] = x[:, i + d // 2] * c + x[:, i] * s
        return out

    def fuse(self, aux):  # aux: [n_aux * H_t]
        if self.c.get("norm_before_fc"):
            aux = self.rms(aux, "input_norm.weight")
        if self.c.get("fc_norm"):
            aux = torch.cat([self.rms(ch, f"fc_norm.{i}.weight") for i, ch in enumerate(aux.chunk(self.n_aux))])
        return self.w["fc.weight"] @ aux

    def rotate_pairs(self, x, pos):  # x: [..., d], DeepSeek's RoPE: pairs (2i, 2i + 1) at integer position `pos`
        d, out = x.shape[-1], torch.empty_like(x)
        for i in range(d // 2):
            angle = pos / (self.c["rope_theta"] ** (2 * i / d))
            c, s = math.cos(angle), math.sin(angle)
            out[..., 2 * i] = x[..., 2 * i] * c - x[..., 2 * i + 1] * s
            out[..., 2 * i + 1] = x[..., 2 * i + 1] * c + x[..., 2 * i] * s
        return out

    def latent_attention(self, p, x, pos, cache):
        """MLA as a served engine computes it: the cache holds each position's normed latent and its shared RoPE key
        only, kv_b_proj's key half absorbed into the query and its value half applied after the weighted sum."""
        c, w = self.c, lambda n: self.w[p + "self_attn." + n + ".weight"]  # noqa: E731
        nope, rope, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        if c.get("q_lora_rank"):
            q = w("q_b_proj") @ self.rms(w("q_a_proj") @ x, p + "self_attn.q_a_layernorm.weight")
        else:
            q = w("q_proj") @ x
        q = q.view(self.h, nope + rope)
        a = w("kv_a_proj_with_mqa") @ x
        cache.append((self.rms(a[:r], p + "self_attn.kv_a_layernorm.weight"), self.rotate_pairs(a[r:], pos), pos))
        up = w("kv_b_proj").view(self.h, nope + dv, r)  # per head: [key (nope) ; value (dv)] from the latent
        outs = []
        for head in range(self.h):
            q_latent = up[head, :nope].T @ q[head, :nope]  # [r]: the query's no-position part, in latent space
            q_rope = self.rotate_pairs(q[head, nope:], pos)
            keys = [
                (lat, kr) for lat, kr, kp in cache if self.window is None or pos - kp < self.window or kp < self.sink
            ]
            scores = torch.stack([(q_latent @ lat + q_rope @ kr) / math.sqrt(nope + rope) for lat, kr in keys])
            probs = torch.softmax(scores, dim=0)
            outs.append(up[head, nope:] @ sum(pr * lat for pr, (lat, _) in zip(probs, keys)))
        return w("o_proj") @ torch.cat(outs)

    def layer(self, i, token, hidden, pos, cache):
        """One token through decoder layer i; appends (k, v, pos) to `cache` (this layer's list)."""
        p = f"layers.{i}."
        if i == 0:
            e = self.rms(self.embed[token], p + "input_layernorm.weight")
            if self.c.get("norm_before_residual"):
                hidden = self.rms(hidden, p + "hidden_norm.weight")
                residual, normed = hidden, hidden
            else:
                residual, normed = hidden, self.rms(hidden, p + "hidden_norm.weight")
            x = torch.cat([e, normed])
        else:
            residual, x = hidden, self.rms(hidden, p + "input_layernorm.weight")
        if self.mla:
            return self.mlp(p, residual + self.latent_attention(p, x, pos, cache))
        q = (self.w[p + "self_attn.q_proj.weight"] @ x).view(self.h, self.d)
        k = (self.w[p + "self_attn.k_proj.weight"] @ x).view(self.kv, self.d)
        if self.qwen3:
            q, k = self.heads_rms(q, p + "self_attn.q_norm.weight"), self.heads_rms(k, p + "self_attn.k_norm.weight")
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        v = (self.w[p + "self_attn.v_proj.weight"] @ x).view(self.kv, self.d)
        cache.append((k, v, pos))
        outs = []
        for head in range(self.h):
            g = head // (self.h // self.kv)
            keys = [
                (kk[g], vv[g], kp)
                for kk, vv, kp in cache
                if self.window is None or pos - kp < self.window or kp < self.sink
            ]
            scores = torch.stack([q[head] @ kk / math.sqrt(self.d) for kk, _, _ in keys])
            probs = torch.softmax(scores, dim=0)
            outs.append(sum(pr * vv for pr, (_, vv, _) in zip(probs, keys)))
        return self.mlp(p, residual + self.w[p + "self_attn.o_proj.weight"] @ torch.cat(outs))

    def mlp(self, p, h1):
        y = self.rms(h1, p + "post_attention_layernorm.weight")
        mlp = self.w[p + "mlp.down_proj.weight"] @ (
            F.silu(self.w[p + "mlp.gate_proj.weight"] @ y) * (self.w[p + "mlp.up_proj.weight"] @ y)
        )
        return h1 + mlp

    def step(self, token, hidden, pos, caches):
        x = hidden
        for i, cache in enumerate(caches):
            x = self.layer(i, token, x, pos, cache)
        normed = self.rms(x, "norm.weight")
        logits = self.w["lm_head.weight"] @ normed
        return logits, (normed if self.c.get("norm_output") else x)

    def draft_logits(self, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> dict[tuple[int, int], torch.Tensor]:
        """{(s, j): logits of draft j from verified position s}, for all s with x_{s+j} in the sequence."""
        T = len(ids)
        L = self.c["num_hidden_layers"]
        caches: list[list] = [[] for _ in range(L)]
        out = {}
        for s in range(T - 1):  # prefill one position at a time: exactly the engine's draft KV cache
            logits, fed = self.step(int(ids[s + 1]), self.fuse(aux[s].double()), s, caches)
            out[(s, 1)] = logits
            chain = [list(c) for c in caches]  # draft entries live in a copy: the next position discards them
            for j in range(2, steps + 1):
                if s + j >= T:
                    break
                logits, fed = self.step(int(ids[s + j]), fed, s + j - 1, chain)
                out[(s, j)] = logits
        return out
