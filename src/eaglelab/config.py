"""Typed configs: one small dataclass per concern, mirrored by one Hydra config group in conf/.

Hydra composes YAML; `to_run_config` merges it onto these dataclasses, so a misspelt key or a value of
the wrong type fails at start-up with the key's name, and `validate` checks what types cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from eaglelab.errors import ConfigError, first_line


@dataclass
class TinyTargetConfig:
    """A random-init Llama for tests (head_dim 64: vLLM's CPU attention needs it)."""

    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 256


@dataclass
class TargetConfig:
    kind: str = "smollm2"  # smollm2 | tiny | hf
    name_or_path: str | None = None  # kind=hf: a Hugging Face id, a local folder or a .gguf file (converted once)
    dtype: str = "bfloat16"  # target forward (regeneration and capture)
    seed: int = 0  # kind=tiny: weights are a function of this seed
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)
    local_files_only: bool = True  # no hub downloads at run time


@dataclass
class DrafterConfig:
    fc_norm: bool = True
    norm_before_fc: bool = False
    norm_output: bool = True
    norm_before_residual: bool = False
    aux_layer_ids: list[int] | None = None  # None: vLLM's default (2, L//2, L-3)
    num_layers: int = 1
    draft_vocab_size: int = 8192
    attention_window: int | None = None
    attention_sink_tokens: int = 4
    init_lm_head_from_target: bool = True  # start lm_head at the target's rows for the draft vocab


@dataclass
class DataConfig:
    # "stdlib_docstrings", "pydoc_topics", "jsonl:PATH" (OpenAI messages or ShareGPT), "hf:PATH[:SPLIT]"
    sources: list[str] = field(default_factory=lambda: ["stdlib_docstrings", "pydoc_topics"])
    num_prompts: int = 192
    val_fraction: float = 0.1
    max_new_tokens: int = 160
    max_length: int = 1024  # prompt + response tokens; longer prompts are skipped and counted
    system_prompt: str | None = None  # None: the chat template's own default
    regen_batch_size: int = 32
    # vllm: vLLM generates (~4x HF here), then one capture forward | hf: our KV-cache loop with capture
    # fused in | auto: vllm when installed
    regen_backend: str = "auto"
    seed: int = 0
    skip_empty: bool = False  # jsonl/hf rows without a user turn: an error naming the row, or skipped and counted


@dataclass
class TrainConfig:
    ttt_steps: int = 3
    loss: str = "ce"  # ce: cross-entropy on the target's greedy token | kl: forward KL over the draft vocab
    step_decay: float = 0.8  # weight of draft step j is step_decay**j
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    batch_size: int = 2
    epochs: int = 8
    max_steps: int = -1
    grad_clip: float = 0.5
    seed: int = 0
    precision: str = "bf16-mixed"
    accelerator: str = "cpu"
    devices: int = 1  # per node; with strategy=ddp, batch_size is per process (global = batch_size × processes)
    num_nodes: int = 1
    strategy: str = "auto"
    num_threads: int = 0  # 0: all cores
    checkpoint_every_n_steps: int = 50  # the resume point after a preemption (lightning/last.ckpt)


@dataclass
class VllmEvalConfig:
    """Acceptance and speedup measured by vLLM on an evenly spaced subset of the held-out prompts."""

    enabled: bool | None = None  # None: when vLLM is installed (else a warning); true: required
    method: str = "eagle3"
    num_prompts: int = 16  # acceptance sweep over k (the simulated evaluator reruns on the same subset)
    ks: list[int] | None = None  # None: 1..max_k
    throughput_ks: list[int] | None = None  # None: [ttt_steps]
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16])
    throughput_prompts: int = 4  # prompts timed per concurrency c (at least 2c, at most num_prompts)
    enforce_eager: bool | None = None  # None: eager on CPU (compiling takes minutes), graphs on GPU
    timeout_s: int = 3600


@dataclass
class ExtrapolationSuite:
    """Train->inference extrapolation: τ and per-position acceptance for k = 1..max(8, 2·ttt_steps+2)
    (off: k = 1..ttt_steps only). It is the main held-out evaluation, so it has no prompts of its own."""

    enabled: bool = True


@dataclass
class LongContextSuite:
    """Held-out prompts of `lengths` tokens built from standard-library source, a request at the end."""

    enabled: bool = False
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])  # clipped to the window
    num_prompts: int = 4  # per length
    max_new_tokens: int = 64


@dataclass
class TemplateSuite:
    """The held-out prompts rendered under each condition (eaglelab.data.templates.CONDITIONS)."""

    enabled: bool = False
    conditions: list[str] = field(default_factory=lambda: [
        "native", "no_template", "foreign_llama3", "foreign_mistral", "bos_on", "bos_off",
        "system_empty", "system_long"])
    num_prompts: int = 16
    max_new_tokens: int = 64


@dataclass
class DriftSuite:
    """Attention drift per draft depth, from the drafter's own attention and states (in-house)."""

    enabled: bool = True
    num_prompts: int = 16
    recent_tokens: int = 8  # "most recent tokens": the last R keys by position, drafted ones included


@dataclass
class SuitesConfig:
    extrapolation: ExtrapolationSuite = field(default_factory=ExtrapolationSuite)
    long_context: LongContextSuite = field(default_factory=LongContextSuite)
    templates: TemplateSuite = field(default_factory=TemplateSuite)
    drift: DriftSuite = field(default_factory=DriftSuite)
    ks: list[int] | None = None  # draft depths vLLM measures for long_context/templates; None: [ttt_steps]


@dataclass
class EvalConfig:
    prompts: str = "humaneval"  # humaneval | a data source string as in DataConfig.sources
    num_prompts: int | None = None  # None: all (164 for HumanEval)
    max_new_tokens: int = 96
    max_k: int | None = None  # None: max(8, 2·ttt_steps + 2) (extrapolation suite), ttt_steps without it
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)
    suites: SuitesConfig = field(default_factory=SuitesConfig)


@dataclass
class PathsConfig:
    cache_dir: str = "~/.cache/eaglelab"
    results_dir: str = "results"


@dataclass
class LoggerConfig:
    kind: str = "csv"  # csv | wandb (CSV as well) | none
    project: str = "eaglelab"
    entity: str | None = None
    group: str | None = None  # null: the sweep's folder name in a multirun (runs of one sweep side by side)
    mode: str = "offline"  # offline (sync later with `wandb sync`) | online | disabled
    init_timeout_s: float = 60.0  # online: how long to wait for the server before logging offline instead


@dataclass
class RunConfig:
    variant: str = "eagle3.1"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: str | None = None  # set: evaluate this drafter (export dir, run dir or .ckpt), no training
    # What `python src/run.py` returns to a sweeper (Hydra's Optuna sweeper): metrics.json keys.
    objective: list[str] = field(default_factory=lambda: ["val/acceptance_length@k3"])
    run_dir: str | None = None  # set by the entry point (Hydra's output dir)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Merge a composed Hydra config onto the typed schema (unknown keys and wrong types fail here)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    for key in ("experiment", "ablation", "sweep"):
        plain.pop(key, None)  # group selections, not settings
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), plain)
        run_cfg = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf's messages name the key; keep the first line
        raise ConfigError(f"invalid config: {first_line(e)}") from None
    validate(run_cfg)
    return run_cfg


def validate(cfg: RunConfig) -> None:
    """Checks that need no model: each names the key to fix."""
    d, t, data, ev = cfg.drafter, cfg.train, cfg.data, cfg.eval
    if d.fc_norm and d.norm_before_fc:
        raise ConfigError("drafter.fc_norm and drafter.norm_before_fc are mutually exclusive; "
                          "set one to false (e.g. +ablation=norm_before_fc turns fc_norm off)")
    if cfg.target.kind not in ("smollm2", "tiny", "hf"):
        raise ConfigError(f"target.kind={cfg.target.kind!r} unknown; use smollm2, tiny or hf")
    if cfg.target.kind == "hf" and not cfg.target.name_or_path:
        raise ConfigError("target=hf needs target.name_or_path=<HF id or local folder>")
    if cfg.target.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"target.dtype={cfg.target.dtype!r}; use float32, bfloat16 or float16")
    if t.loss not in ("ce", "kl"):
        raise ConfigError(f"train.loss={t.loss!r}; use ce or kl")
    if cfg.logger.kind not in ("csv", "wandb", "none"):
        raise ConfigError(f"logger.kind={cfg.logger.kind!r}; use csv, wandb or none (logger=wandb)")
    if cfg.logger.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.mode={cfg.logger.mode!r}; use offline, online or disabled")
    positive = {
        "train.ttt_steps": t.ttt_steps, "train.lr": t.lr, "train.batch_size": t.batch_size,
        "train.epochs": t.epochs, "drafter.num_layers": d.num_layers,
        "drafter.draft_vocab_size": d.draft_vocab_size, "data.num_prompts": data.num_prompts,
        "data.max_new_tokens": data.max_new_tokens, "data.max_length": data.max_length,
        "data.regen_batch_size": data.regen_batch_size, "eval.max_new_tokens": ev.max_new_tokens,
        "train.checkpoint_every_n_steps": t.checkpoint_every_n_steps, "train.devices": t.devices,
        "train.num_nodes": t.num_nodes,
    }
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if not cfg.objective:
        raise ConfigError("objective must name at least one metric, e.g. objective=[val/acceptance_length@k3]")
    if not 0.0 < t.step_decay <= 1.0:
        raise ConfigError(f"train.step_decay must be in (0, 1], got {t.step_decay}")
    if not 0.0 <= data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {data.val_fraction}")
    if ev.num_prompts is not None and ev.num_prompts < 1:
        raise ConfigError(f"eval.num_prompts must be >= 1 or null, got {ev.num_prompts}")
    if ev.max_k is not None and ev.max_k < 1:
        raise ConfigError(f"eval.max_k must be >= 1 or null, got {ev.max_k}")
    if d.attention_window is not None and d.attention_window < 1:
        raise ConfigError(f"drafter.attention_window must be >= 1 or null, got {d.attention_window}")
    if d.aux_layer_ids is not None and len(d.aux_layer_ids) == 0:
        raise ConfigError("drafter.aux_layer_ids is empty; give target layer ids or null for the default")
    if not data.sources:
        raise ConfigError("data.sources is empty; e.g. data.sources=[stdlib_docstrings,pydoc_topics]")
    if data.regen_backend not in ("auto", "hf", "vllm"):
        raise ConfigError(f"data.regen_backend={data.regen_backend!r}; use auto, hf or vllm")
    v = ev.vllm
    if v.method not in ("eagle3",):
        raise ConfigError(f"eval.vllm.method={v.method!r} is not a speculative method eaglelab exports; use eagle3")
    lists = {"eval.vllm.ks": v.ks or [], "eval.vllm.throughput_ks": v.throughput_ks or [],
             "eval.vllm.concurrencies": v.concurrencies, "eval.vllm.num_prompts": [v.num_prompts],
             "eval.vllm.throughput_prompts": [v.throughput_prompts], "eval.vllm.timeout_s": [v.timeout_s]}
    for key, values in lists.items():
        if any(x < 1 for x in values):
            raise ConfigError(f"{key} must hold values >= 1, got {values}")
    s = ev.suites
    suite_sizes = {"eval.suites.long_context.num_prompts": s.long_context.num_prompts,
                   "eval.suites.long_context.max_new_tokens": s.long_context.max_new_tokens,
                   "eval.suites.templates.num_prompts": s.templates.num_prompts,
                   "eval.suites.templates.max_new_tokens": s.templates.max_new_tokens,
                   "eval.suites.drift.num_prompts": s.drift.num_prompts,
                   "eval.suites.drift.recent_tokens": s.drift.recent_tokens}
    for key, value in suite_sizes.items():
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if not s.long_context.lengths or min(s.long_context.lengths) < 64:
        raise ConfigError(f"eval.suites.long_context.lengths must be token counts >= 64, got {s.long_context.lengths}")
    if any(k < 1 for k in s.ks or []):
        raise ConfigError(f"eval.suites.ks must hold values >= 1, got {s.ks}")
    from eaglelab.data.templates import CONDITIONS

    from eaglelab.data.long_context import MODULES

    if s.long_context.num_prompts > len(MODULES):
        raise ConfigError(f"eval.suites.long_context.num_prompts={s.long_context.num_prompts}: at most "
                          f"{len(MODULES)} distinct source modules are available")
    if len(set(s.templates.conditions)) < len(s.templates.conditions):
        raise ConfigError(f"eval.suites.templates.conditions lists a condition twice: {s.templates.conditions}")
    unknown = [c for c in s.templates.conditions if c not in CONDITIONS]
    if unknown or "native" not in s.templates.conditions:
        raise ConfigError(f"eval.suites.templates.conditions: {unknown or 'native missing'}; choose from "
                          f"{', '.join(CONDITIONS)} (native is the reference every ratio is taken against)")


def max_k(cfg: RunConfig) -> int:
    """Deepest draft the held-out evaluation measures: past the trained depth when extrapolating."""
    if cfg.eval.max_k:
        return cfg.eval.max_k
    ttt = cfg.train.ttt_steps
    return max(8, 2 * ttt + 2) if cfg.eval.suites.extrapolation.enabled else ttt


def suite_ks(cfg: RunConfig) -> list[int]:
    """Draft depths the long-context and template suites report (vLLM runs one engine per k)."""
    return sorted(set(cfg.eval.suites.ks or [cfg.train.ttt_steps]))
