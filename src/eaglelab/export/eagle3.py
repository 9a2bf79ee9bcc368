"""Drafter checkpoints in vLLM's Eagle3 format: config.json + model.safetensors
(the contract: docs/conventions.md#vllm-eagle3-checkpoint), and in speculators' format beside it
(docs/conventions.md#speculators-format; eaglelab.export.speculators).

Every training run writes one (`<run_dir>/drafter/`; with eval.vllm.drafter_format=speculators also
`<run_dir>/drafter_speculators/`, the one vLLM then serves); any Lightning checkpoint can be exported later:

    python -m eaglelab.export RUN_DIR_OR_CKPT OUT_DIR [--format speculators --verifier TARGET]

Either format is read back (`checkpoint=PATH`), and so is a drafter trained elsewhere in either.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglelab.core.errors import EaglelabError, first_line
from eaglelab.core.io import atomic_dir
from eaglelab.data.targets import default_aux_layer_ids
from eaglelab.engine.llm import model_config
from eaglelab.export.speculators import (
    from_speculators_config,
    is_speculators_config,
    speculators_names,
    to_speculators_config,
)
from eaglelab.models.drafter import Eagle3Config, Eagle3Drafter, export_state_dict, import_state_dict

# The folder of each export format in a run directory (eval.vllm.drafter_format: the one vLLM serves).
FORMAT_DIRS = {"eagle3": "drafter", "speculators": "drafter_speculators"}


def save_drafter(model: Eagle3Drafter, out: Path) -> Path:
    out = Path(out)
    with atomic_dir(out) as tmp:
        sd = {k: v.float() if v.is_floating_point() else v for k, v in export_state_dict(model).items()}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_vllm_config(), indent=2) + "\n")
    return out


def save_speculators(model: Eagle3Drafter, out: Path, verifier: str, speculative_tokens: int = 3) -> Path:
    """`model` in speculators' format, every tensor of the Eagle3 export carried (checked: speculators' own
    converter drops per-layer fc_norm weights), its verifier (the target: a folder or hub name) named."""
    cfg = model.cfg
    if cfg.attention_window is not None:
        raise EaglelabError("a drafter with drafter.attention_window has no speculators (nor vLLM) form; export one "
                            "without a window")  # fmt: skip
    if cfg.layer == "mla":
        raise EaglelabError("drafter.layer=mla: speculators' format has llama and qwen3 layers only (vLLM's "
                            "update_eagle3); export it in vLLM's Eagle3 format")  # fmt: skip
    verifier_config = Path(verifier) / "config.json"
    architectures = json.loads(verifier_config.read_text()).get("architectures") if verifier_config.is_file() else None
    family = {"qwen3": ["Qwen3ForCausalLM"]}.get(cfg.layer, ["LlamaForCausalLM"])  # (a hub name: the layer's family)
    config = to_speculators_config(cfg, str(verifier), architectures or family, speculative_tokens)
    weights = speculators_names(export_state_dict(model))
    # Every tensor the drafter the config describes has, and no other (the config read back as a reader reads it)
    expected = Eagle3Drafter(from_speculators_config(config, None)).state_dict()
    if differ := set(weights) ^ {n for n in expected if not n.startswith("embed_tokens.")}:
        raise EaglelabError(f"speculators export: tensors {sorted(differ)[:3]} do not match its config")
    out = Path(out)
    with atomic_dir(out) as tmp:
        sd = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _build(
    path: Path, cfg: Eagle3Config, sd: dict, embed_tokens: torch.Tensor | None, target: TargetShape | None = None
) -> Eagle3Drafter:
    if target is not None:  # before any weight is touched: a mismatch is the target's, not the file's
        check_compatible(cfg, target, path)
    model = Eagle3Drafter(cfg)
    if "embed_tokens.weight" not in sd:
        if embed_tokens is None:
            raise EaglelabError(f"{path} has no embed_tokens; pass the target's embeddings")
        if embed_tokens.numel() == 0:  # only re-exporting: the export leaves the shared embeddings out anyway
            embed_tokens = torch.zeros_like(model.embed_tokens.weight)
        sd["embed_tokens.weight"] = embed_tokens
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise EaglelabError(
            f"{path}: weights do not fit its config ({str(e).splitlines()[1].strip()[:160]}); re-export the checkpoint"
        ) from None
    if missing or unexpected:
        raise EaglelabError(
            f"{path}: weights do not match its config.json (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); re-export the checkpoint"
        )
    return model


def load_drafter(
    path: Path, embed_tokens: torch.Tensor | None = None, target: TargetShape | None = None
) -> Eagle3Drafter:
    """Load an Eagle3 checkpoint (EAGLE-3 or 3.1) in vLLM's or speculators' format. `embed_tokens`: the target's,
    when not in the file."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        if is_speculators_config(config):  # (null aux ids: the target's defaults, as vLLM takes them)
            cfg = from_speculators_config(config, target.default_aux_layer_ids() if target else None)
        else:
            cfg = Eagle3Config.from_vllm_config(config)
        sd = import_state_dict(load_file(str(path / "model.safetensors")))
    except FileNotFoundError as e:
        raise EaglelabError(f"{path} is not a drafter checkpoint ({Path(e.filename).name} missing)") from None
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError):  # a truncated or broken file
            raise EaglelabError(f"cannot read drafter checkpoint {path} ({first_line(e, 120)}); re-export it") from None
        # a config eaglelab reads but cannot build from (another layer, another method, a missing field)
        raise EaglelabError(f"{path}/config.json: {first_line(e, 240)}") from None
    except Exception as e:
        raise EaglelabError(
            f"cannot read drafter checkpoint {path} ({type(e).__name__}: {first_line(e, 120)}); re-export it"
        ) from None
    return _build(path, cfg, sd, embed_tokens, target)


def load_lightning(
    ckpt: Path, target: TargetShape | None = None, embed_tokens: torch.Tensor | None = None
) -> Eagle3Drafter:
    """The drafter inside a Lightning checkpoint written by training (its hyper-parameters carry the
    model config). The frozen target embeddings are left out of checkpoints: `embed_tokens` supplies them."""
    ckpt = Path(ckpt)
    try:
        state = torch.load(str(ckpt), map_location="cpu", weights_only=False)
        cfg = Eagle3Config(
            **{
                **state["hyper_parameters"]["model"],
                "aux_layer_ids": tuple(state["hyper_parameters"]["model"]["aux_layer_ids"]),
            }
        )
    except FileNotFoundError:
        raise EaglelabError(f"{ckpt} does not exist; pass a run directory, a .ckpt or an exported drafter") from None
    except Exception as e:
        raise EaglelabError(
            f"cannot read Lightning checkpoint {ckpt} ({type(e).__name__}: "
            f"{first_line(e, 120)}); it is not an eaglelab "
            "training checkpoint or it is truncated"
        ) from None
    sd = {k[len("drafter.") :]: v for k, v in state["state_dict"].items() if k.startswith("drafter.")}
    return _build(ckpt, cfg, sd, embed_tokens, target)


def load_checkpoint(
    path: Path, embed_tokens: torch.Tensor | None = None, target: TargetShape | None = None
) -> Eagle3Drafter:
    """An exported drafter folder, a run directory (its `drafter/`, else its Lightning checkpoint) or a
    .ckpt. With `target`, a drafter trained for another target is refused before its weights load."""
    path = Path(path).expanduser()
    if path.is_file():
        return load_lightning(path, target, embed_tokens)
    if (path / "config.json").exists():
        return load_drafter(path, embed_tokens, target)
    if (path / "drafter" / "config.json").exists():
        return load_drafter(path / "drafter", embed_tokens, target)
    if (path / "lightning" / "last.ckpt").exists():
        return load_lightning(path / "lightning" / "last.ckpt", target, embed_tokens)
    raise EaglelabError(
        f"{path} holds no drafter: expected an exported drafter (config.json + model.safetensors), "
        "a run directory or a Lightning .ckpt"
    )


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree on with its target."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    def default_aux_layer_ids(self) -> list[int]:
        return default_aux_layer_ids(self.num_layers)


def check_compatible(cfg: Eagle3Config, target: TargetShape, where) -> None:
    """A drafter drafts only for the target whose states it reads and whose vocabulary it emits."""
    problems = []
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {cfg.target_hidden_size} != {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != {target.vocab_size}")
    if max(cfg.aux_layer_ids) > target.num_layers - 1:
        problems.append(f"aux layer ids {list(cfg.aux_layer_ids)} exceed the target's ids 1..{target.num_layers - 1}")
    if problems:
        raise EaglelabError(
            f"{where} was trained for another target ({'; '.join(problems)}); "
            "choose the target it was trained on (target=…)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export a drafter checkpoint in vLLM's Eagle3 or speculators' format.")
    ap.add_argument("checkpoint", help="a run directory, a Lightning .ckpt or an exported drafter folder")
    ap.add_argument("out", help="output folder (config.json + model.safetensors)")
    ap.add_argument("--format", choices=FORMAT_DIRS, default="eagle3", help="vLLM's Eagle3 format or speculators'")
    ap.add_argument("--verifier", help="speculators: the target's folder or hub name (default: a run's target)")
    args = ap.parse_args(argv)
    try:
        if Path(args.out).exists():
            raise EaglelabError(f"{args.out} exists; choose a new output folder")
        verifier = args.verifier or (_run_target(Path(args.checkpoint)) if args.format == "speculators" else None)
        if args.format == "speculators" and not verifier:
            raise EaglelabError(f"{args.checkpoint} names no target; pass --verifier TARGET (its folder or hub name)")
        # (embeddings are not exported; a speculators drafter with null aux ids takes its target's default ids: the
        # target's shape from --verifier's config.json)
        model = load_checkpoint(
            Path(args.checkpoint), embed_tokens=torch.zeros(0, device="cpu"), target=_target_shape(verifier)
        )
        if args.format == "speculators":
            save_speculators(model, Path(args.out), verifier)
        else:
            save_drafter(model, Path(args.out))
    except EaglelabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported: {Path(args.out).resolve()}")
    return 0


def _run_target(checkpoint: Path) -> str | None:
    """The target folder a run directory (or a checkpoint inside one) was trained on, from its run.json."""
    for folder in (checkpoint, *checkpoint.parents[:2]):
        if (folder / "run.json").is_file():
            try:
                return json.loads((folder / "run.json").read_text()).get("target_path")
            except json.JSONDecodeError:
                raise EaglelabError(f"{folder / 'run.json'} is not readable; pass --verifier TARGET") from None
    return None


def _target_shape(verifier: str | None) -> TargetShape | None:
    """The shape of a target folder (its config.json), when `verifier` is one."""
    config = Path(verifier) / "config.json" if verifier else None
    if config is None or not config.is_file():
        return None
    c = model_config(verifier)
    if not all(k in c for k in ("hidden_size", "vocab_size", "num_hidden_layers")):
        return None
    return TargetShape(c["hidden_size"], c["vocab_size"], c["num_hidden_layers"])


if __name__ == "__main__":
    sys.exit(main())
