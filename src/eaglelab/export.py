"""Drafter checkpoints in vLLM's Eagle3 format: config.json + model.safetensors (FIELD_NOTES §2)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglelab.drafter import Eagle3Config, Eagle3Drafter, export_state_dict, import_state_dict
from eaglelab.errors import EaglelabError
from eaglelab.io import atomic_dir


def save_drafter(model: Eagle3Drafter, out: Path) -> Path:
    out = Path(out)
    with atomic_dir(out) as tmp:
        sd = {k: v.float() if v.is_floating_point() else v for k, v in export_state_dict(model).items()}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_vllm_config(), indent=2) + "\n")
    return out


def load_drafter(path: Path, embed_tokens: torch.Tensor | None = None) -> Eagle3Drafter:
    """Load an Eagle3 checkpoint (EAGLE-3 or 3.1). `embed_tokens`: the target's, when not in the file."""
    path = Path(path)
    try:
        cfg = Eagle3Config.from_vllm_config(json.loads((path / "config.json").read_text()))
        sd = import_state_dict(load_file(str(path / "model.safetensors")))
    except FileNotFoundError as e:
        raise EaglelabError(f"{path} is not a drafter checkpoint ({Path(e.filename).name} missing)") from None
    except Exception as e:
        raise EaglelabError(f"cannot read drafter checkpoint {path} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120]}); re-export it") from None
    model = Eagle3Drafter(cfg)
    if "embed_tokens.weight" not in sd:
        if embed_tokens is None:
            raise EaglelabError(f"{path} has no embed_tokens; pass the target's embeddings")
        sd["embed_tokens.weight"] = embed_tokens
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise EaglelabError(f"{path}: weights do not match its config.json (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}); re-export the checkpoint")
    return model
