"""Training's loss against a hand computation (label shift, prompt and padding masks, step weights), and the
non-finite stops on eaglelab's own Lightning trainer."""

import math
from collections import Counter

import lightning as L
import pytest
import torch
from test_drafter import small_config
from torch.utils._python_dispatch import TorchDispatchMode

from eaglelab.batches import Batch, collate
from eaglelab.config import TrainConfig
from eaglelab.errors import TrainingError
from eaglelab.trainer import make_trainer
from eaglelab.training import DrafterModule

from conftest import compose

VOCAB, DRAFT_VOCAB, H_T = 50, 40, 48


def loss_module(loss: str, step_decay: float) -> DrafterModule:
    cfg = small_config(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H_T)
    torch.manual_seed(0)
    train = TrainConfig(loss=loss, step_decay=step_decay, ttt_steps=3)
    module = DrafterModule(cfg, train, target_head=torch.randn(DRAFT_VOCAB, H_T))
    # the last target id is in the draft vocabulary: collate pads labels with -1, which would index it
    draft_ids = torch.cat([torch.sort(torch.randperm(VOCAB - 1)[: DRAFT_VOCAB - 1]).values, torch.tensor([VOCAB - 1])])
    module.drafter.set_vocab(draft_ids)
    return module.eval()


def hand_batch():
    """Two sequences of different lengths (the shorter one right-padded) and prompts of different lengths; the
    target's greedy next token is the next token of the sequence, so every position's label differs."""
    torch.manual_seed(1)
    items = []
    for index, (n, prompt) in enumerate([(12, 5), (9, 3)]):
        ids = torch.randint(0, VOCAB, (n + 1,))
        items.append(
            {
                "input_ids": ids[:n],
                "prompt_len": prompt,
                "index": index,
                "target_next": ids[1:],
                "aux": torch.randn(n, 3 * H_T),
                "final": torch.randn(n, H_T),
            }
        )
    return collate(items)


def expected_losses(module: DrafterModule, batch, steps: int) -> list[float]:
    """Per draft step j, by explicit loops: the mean over drafts an engine makes — from verified positions
    t = P-1 .. n-j-2 of each sequence (never from the prompt, never past its end) — of CE on the target's greedy
    token after t+j (draft vocabulary only) or KL(target over the draft vocab ‖ drafter)."""
    d = module.drafter
    with torch.no_grad():
        outs = d.unroll(batch.aux, batch.input_ids, steps, first=batch.first)
    draft_ids = d.draft_ids.tolist()
    losses = []
    for j in range(1, steps + 1):
        terms = []
        for b in range(batch.input_ids.shape[0]):
            n, prompt = int(batch.seq_len[b]), int(batch.prompt_len[b])
            for t in range(prompt - 1, n - j - 1):
                logits = d.lm_head(outs[j - 1].normed[b, t]).double()
                logp = logits - torch.logsumexp(logits, 0)
                if module.train_cfg.loss == "ce":
                    label = int(batch.target_next[b, t + j])
                    if label in draft_ids:  # a token outside the draft vocabulary is not counted
                        terms.append(-float(logp[draft_ids.index(label)]))
                else:
                    teacher = (module.target_head.double() @ batch.final[b, t + j].double()).softmax(0)
                    terms.append(float((teacher * (teacher.log() - logp)).sum()))
        losses.append(sum(terms) / len(terms))
    return losses


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_ttt_loss_equals_a_hand_computation(loss):
    module, batch = loss_module(loss, step_decay=0.5), hand_batch()
    with torch.no_grad():
        total, per_step, _, counted = module.ttt(batch, 3)
    expected = expected_losses(module, batch, 3)
    assert [float(x) for x in per_step] == pytest.approx(expected, rel=1e-5)
    # step j weighs train.step_decay**(j-1): 1, 0.5, 0.25
    assert float(total) == pytest.approx(sum(0.5 ** (j - 1) * e for j, e in enumerate(expected, start=1)), rel=1e-5)
    # drafts per step: t = P-1 .. n-j-2 in each sequence, n-P-j of them
    assert counted == [(12 - 5 - j) + (9 - 3 - j) for j in range(1, 4)]


def test_ttt_loss_ignores_prompt_and_padding_positions():
    """What sits at the prompt's positions (before P-1) and in the padding never reaches the loss."""
    module, batch = loss_module("kl", step_decay=0.8), hand_batch()
    with torch.no_grad():
        before = float(module.ttt(batch, 3)[0])
        # sequence 0 (P = 5): drafts start at t = P-1 = 4, so labels come from positions t+j >= 5
        batch.final[0, :5] = 100 * torch.randn(5, H_T)
        # sequence 1 (n = 9): draft j from t needs x_{t+j+1} in the sequence, so t+j <= 7; 9.. is padding
        batch.final[1, 8:] = 100 * torch.randn(4, H_T)
        assert float(module.ttt(batch, 3)[0]) == pytest.approx(before, rel=1e-6)
        batch.final[0, 5] = 100 * torch.randn(H_T)  # the first label: draft 1 from t = P-1
        assert float(module.ttt(batch, 3)[0]) != pytest.approx(before, rel=1e-3)


# --- the non-finite stops, on the trainer eaglelab builds ------------------------------------------------
class NonFiniteAtStep2(L.LightningModule):
    """One weight; the first optimizer step is finite, the second makes a non-finite gradient (`gradient`: the
    loss √(w²) at w = 0, itself finite) or non-finite weights (`weights`: a finite gradient × lr overflows)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        if self.where == "gradient":
            return torch.sqrt((self.w**2).sum() + 0.0 * batch.sum())  # step 1: w 1 -> 0; step 2: d√(w²)/dw = 0/0
        scale = 1.0 if self.global_step == 0 else 1e30  # step 2: 1e30 · lr 1e9 overflows float32
        return (self.w * scale).sum() + 0.0 * batch.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0 if self.where == "gradient" else 1e9)


@pytest.mark.parametrize("where", ["gradient", "weights"])
def test_a_non_finite_gradient_or_weight_stops_the_real_trainer_and_last_ckpt_stays_finite(where, tmp_path):
    """StopOnNonFinite in the Trainer `make_trainer` builds (precision, clipping off, checkpoint every step): the
    second step fails with the error naming it, and lightning/last.ckpt holds the first step's finite weights."""
    cfg = compose(
        ["experiment=smoke", "train.checkpoint_every_n_steps=1", "train.grad_clip=0", "train.precision=32-true"],
        tmp_path / "cache",
        tmp_path / "run",
    )
    module = NonFiniteAtStep2(where)
    data = torch.utils.data.DataLoader(torch.ones(4, 1), batch_size=1)
    message = "non-finite gradient at step 1" if where == "gradient" else "non-finite weights after step 2"
    with pytest.raises(TrainingError, match=f"{message}; lightning/last.ckpt keeps"):
        make_trainer(cfg, tmp_path / "run", False).fit(module, data)
    state = torch.load(tmp_path / "run" / "lightning" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 1 and math.isfinite(float(state["state_dict"]["w"]))
    if where == "gradient":  # stopped before the optimizer step: the weight is step 1's
        assert float(module.w) == 0.0
    else:  # stopped after the step that broke the weights, before the checkpoint that would have kept them
        assert not torch.isfinite(module.w).all()


class ScriptedValidation(L.LightningModule):
    """One weight that training moves every step, and a validation τ scripted per epoch: 1.5, 2.5, 2.0, 1.8."""

    SCRIPT = [1.5, 2.5, 2.0, 1.8]

    def __init__(self):
        super().__init__()
        self.drafter = torch.nn.Linear(1, 1, bias=False)
        self.seen: list[torch.Tensor] = []  # the weight at each validation pass

    def training_step(self, batch, batch_idx):
        return (self.drafter(batch) - 10.0).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/acceptance_length@k3", self.SCRIPT[self.current_epoch])
        self.seen.append(self.drafter.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_keep_best_restores_the_weights_and_metrics_of_the_best_validation_pass(tmp_path):
    """train.keep=best's callback in the real Trainer: whatever epoch ends training, the weights restored are those
    of the pass with the highest validation τ (epoch 1 of 4 here), with that pass's metrics, and a checkpoint
    written after it carries them for a resumed run."""
    from eaglelab.training import KeepBest

    overrides = ["experiment=smoke", "train.epochs=4", "train.precision=32-true", "train.checkpoint_every_n_steps=1"]
    cfg = compose(overrides, tmp_path / "cache", tmp_path)
    module, keep = ScriptedValidation(), KeepBest("val/acceptance_length@k3")
    data, one_batch = (torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=b) for b in (1, 2))
    make_trainer(cfg, tmp_path / "run", False, [keep]).fit(module, data, one_batch)
    assert len(module.seen) == 4 and not torch.equal(module.seen[1], module.drafter.weight)
    metrics = keep.restore(module)
    assert metrics == {"val/acceptance_length@k3": 2.5, "train/kept_epoch": 1.0}
    assert torch.equal(module.drafter.weight, module.seen[1])
    saved = torch.load(tmp_path / "run" / "lightning" / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("KeepBest")]
    resumed = KeepBest("val/acceptance_length@k3")
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and torch.equal(resumed.weights["weight"], module.seen[1])


def test_the_drafter_can_start_at_the_targets_last_layer_and_keep_its_lm_head_frozen():
    """drafter.init_layers_from_target copies the target's last decoder layer (both halves of the 2H q/k/v input
    read the target's q/k/v); train.freeze_lm_head leaves lm_head and the final norm without a gradient, while the
    layer and fc get one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglelab.drafter import DrafterFlags, Eagle3Config
    from eaglelab.errors import EaglelabError
    from eaglelab.targets import Target
    from eaglelab.trainer import init_from_target, init_layers_from_target

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=H_T,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            vocab_size=VOCAB,
        )
    )
    target = Target(path=None, fingerprint="", model=llama, tokenizer=None)
    model_cfg = Eagle3Config.for_target(
        DrafterFlags(), llama.config, aux_layer_ids=(1, 2, 3), draft_vocab_size=DRAFT_VOCAB, max_context=64
    )
    module = DrafterModule(model_cfg, TrainConfig(freeze_lm_head=True, ttt_steps=2))
    weights = target.weights(last_layers=1)
    init_from_target(module, weights, torch.arange(DRAFT_VOCAB), init_lm_head=True, init_layers=True)
    layer, last = module.drafter.layers[0], llama.model.layers[-1]
    assert torch.equal(layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(layer.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    for half in (slice(0, H_T), slice(H_T, 2 * H_T)):
        assert torch.equal(layer.self_attn.k_proj.weight[:, half], last.self_attn.k_proj.weight)
    assert torch.equal(layer.hidden_norm.weight, last.input_layernorm.weight)
    not_llama = {k: v for k, v in weights.layers[0].items() if not k.startswith("mlp.")}
    with pytest.raises(EaglelabError, match=r"has no mlp\.down_proj\.weight.*init_layers_from_target=false"):
        init_layers_from_target(module.drafter, [not_llama])

    # the optimiser takes the parameters that require a gradient (DrafterModule.configure_optimizers)
    module.train()
    module.ttt(hand_batch(), 2)[0].backward()
    assert module.drafter.lm_head.weight.grad is None and module.drafter.norm.weight.grad is None
    assert layer.mlp.up_proj.weight.grad.abs().sum() > 0 and module.drafter.fc.weight.grad.abs().sum() > 0


class HostSyncs(TorchDispatchMode):
    """Counts the operations that make the host wait for the device on a GPU: reading a value (`.item()`, int(),
    float(), bool() of a tensor: aten._local_scalar_dense), nonzero, and indexing with a boolean mask (forward or
    backward), which sizes its result from the mask's contents. On the CPU nothing waits; the count is the same."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"):
            self.ops[name] += 1
        elif name.startswith("aten::index") and len(args) > 1 and isinstance(args[1], list | tuple):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                self.ops[f"{name} (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("steps", [3, 5])
def test_a_training_step_waits_for_the_device_once_per_draft_step(steps):
    """The forward and backward of one TTT batch: one host sync to size the packed queries, then one per draft step
    (the labelled positions' indices). Boolean masks in the unroll or the loss, or per-step .item() of the
    accuracy, made it 33 at 3 steps."""
    torch.manual_seed(0)
    model_cfg = small_config(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H_T)
    train = TrainConfig(ttt_steps=steps)
    module = DrafterModule(model_cfg, train)
    module.drafter.set_vocab(torch.arange(DRAFT_VOCAB))
    B, T = 2, 16
    batch = Batch(
        input_ids=torch.randint(0, model_cfg.vocab_size, (B, T)),
        prompt_len=torch.tensor([3, 5]),
        seq_len=torch.tensor([16, 12]),
        index=torch.arange(B),
        target_next=torch.randint(0, model_cfg.vocab_size, (B, T)),
        aux=torch.randn(B, T, 3 * H_T),
    )
    with HostSyncs() as syncs:
        loss, _, correct, _ = module.ttt(batch, steps)
        loss.backward()
    assert sum(syncs.ops.values()) == 1 + steps, dict(syncs.ops)
    assert all(isinstance(c, torch.Tensor) for c in correct)  # read when logged, not in the step


def test_deterministic_algorithms_on_a_cpu_not_on_cuda_unless_asked(monkeypatch, tmp_path):
    """train.deterministic=null: on a CPU the trainer keeps torch's deterministic algorithms (free there; the resume
    tests compare weights bit for bit); on CUDA it does not, where they cost cuDNN's attention (1.55x slower steps
    at T = 32k on an H200); true or false is kept wherever the run trains. `train.accelerator=auto` follows torch."""
    from eaglelab.trainer import deterministic

    assert deterministic(TrainConfig(accelerator="cpu")) is True
    assert deterministic(TrainConfig(accelerator="gpu")) is False
    assert deterministic(TrainConfig(accelerator="gpu", deterministic=True)) is True
    assert deterministic(TrainConfig(accelerator="cpu", deterministic=False)) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert deterministic(TrainConfig(accelerator="auto")) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert deterministic(TrainConfig(accelerator="auto")) is True
    cfg = compose(["train.deterministic=true"], tmp_path, tmp_path / "run")  # (the CLI's key, typed)
    assert cfg.train.deterministic is True and compose([], tmp_path, tmp_path / "run").train.deterministic is None
