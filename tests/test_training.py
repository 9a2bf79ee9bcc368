"""Training's loss against a hand computation (label shift, prompt and padding masks, step weights), and the
non-finite stops on eaglelab's own Lightning trainer."""

import math
from collections import Counter

import lightning as L
import pytest
import torch
from test_drafter import small_config
from torch.utils._python_dispatch import TorchDispatchMode

from eaglelab.core.config import TrainConfig
from eaglelab.core.errors import ConfigError, TrainingError
from eaglelab.train.batches import Batch, collate
from eaglelab.train.fit import make_trainer
from eaglelab.train.ttt_module import DrafterModule

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


def divergence(loss: str, log_y: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Each distilled objective as the literature writes it, over two distributions y (target) and q (drafter), given
    as log-probabilities (a drafter's tiny probabilities underflow)."""
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1)  # noqa: E731
    log_m = torch.log((log_y.exp() + log_q.exp()) / 2)
    accepted = torch.minimum(log_y, log_q).exp().sum(-1)  # α = Σ min(y, q)
    return {
        "kl": lambda: kl(log_y, log_q),
        "rkl": lambda: kl(log_q, log_y),
        "jsd": lambda: (kl(log_y, log_m) + kl(log_q, log_m)) / 2,
        "tv": lambda: 1 - accepted,  # = ½ Σ|y - q|: 1 - the acceptance rate of sampled drafts
        "nla": lambda: -accepted.log(),
        "lk_hybrid": lambda: (lam := torch.exp(-3 * accepted).detach()) * kl(log_y, log_q) + (1 - lam) * (1 - accepted),
    }[loss]()


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
                    terms.append(float(divergence(module.train_cfg.loss, teacher.log(), logp)))
        losses.append(sum(terms) / len(terms))
    return losses


@pytest.mark.parametrize(
    "loss", ["ce", "kl", "kl-recomputed", "rkl", "jsd", "tv", "nla", "nla-recomputed", "lk_hybrid"]
)
def test_ttt_loss_equals_a_hand_computation(loss, monkeypatch):
    """kl: the teacher's log-probabilities kept once for every draft step (small); kl-recomputed: each step's from
    the target's states, as where they are too large to keep (`draft_loss.keeps_teacher`). The other distilled
    objectives against their textbook forms (`divergence`)."""
    if loss.endswith("-recomputed"):
        monkeypatch.setattr("eaglelab.train.ttt_module.keeps_teacher", lambda positions, vocab: False)
    module, batch = loss_module(loss.split("-")[0], step_decay=0.5), hand_batch()
    with torch.no_grad():
        total, per_step, _, counted = module.ttt(batch, 3)
    expected = expected_losses(module, batch, 3)
    assert [float(x) for x in per_step] == pytest.approx(expected, rel=1e-5)
    # step j weighs train.step_decay**(j-1): 1, 0.5, 0.25
    assert float(total) == pytest.approx(sum(0.5 ** (j - 1) * e for j, e in enumerate(expected, start=1)), rel=1e-5)
    # drafts per step: t = P-1 .. n-j-2 in each sequence, n-P-j of them
    assert counted == [(12 - 5 - j) + (9 - 3 - j) for j in range(1, 4)]


def test_step_weights_replace_the_decay_and_a_wrong_count_is_one_line():
    module, batch = loss_module("ce", step_decay=0.5), hand_batch()
    module.train_cfg = TrainConfig(loss="ce", ttt_steps=3, step_weights=[0.0, 2.0, 1.0])
    with torch.no_grad():
        total, per_step, _, _ = module.ttt(batch, 3)
    assert float(total) == pytest.approx(2 * float(per_step[1]) + float(per_step[2]), rel=1e-6)
    with pytest.raises(ConfigError, match=r"train.step_weights must give each of the 3 TTT steps"):
        TrainConfig(ttt_steps=3, step_weights=[1.0, 1.0])
    with pytest.raises(ConfigError, match="not all 0"):
        TrainConfig(ttt_steps=2, step_weights=[0.0, 0.0])


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
    loss √(w²) at w = 0, itself finite) or non-finite weights (`weights`: a finite loss and gradient, whose step
    × lr overflows)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        if self.where == "gradient":
            return torch.sqrt((self.w**2).sum() + 0.0 * batch.sum())  # step 1: w 1 -> 0; step 2: d√(w²)/dw = 0/0
        scale = 0.0 if self.global_step == 0 else 1e30  # step 2: a finite loss and gradient, 1e30 · lr 1e9 overflows
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
    of the pass with the highest validation τ (epoch 1 of 4 here), with that pass's metrics. They are kept in a file,
    not in memory: the checkpoint written after it names the epoch, and a resumed run restores the same weights."""
    from eaglelab.train.ttt_module import KeepBest

    overrides = ["experiment=smoke", "train.epochs=4", "train.precision=32-true", "train.checkpoint_every_n_steps=1"]
    cfg = compose(overrides, tmp_path / "cache", tmp_path)
    folder = tmp_path / "run" / "lightning"
    module, keep = ScriptedValidation(), KeepBest("val/acceptance_length@k3", folder)
    data, one_batch = (torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=b) for b in (1, 2))
    make_trainer(cfg, tmp_path / "run", False, [keep]).fit(module, data, one_batch)
    assert len(module.seen) == 4 and not torch.equal(module.seen[1], module.drafter.weight)
    assert not hasattr(keep, "weights") and [p.name for p in folder.glob("best-*")] == ["best-epoch1.pt"]
    saved = torch.load(folder / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("KeepBest")]
    assert "weights" not in state and state["epoch"] == 1
    metrics = keep.restore(module)
    assert metrics == {"val/acceptance_length@k3": 2.5, "train/kept_epoch": 1.0}
    assert torch.equal(module.drafter.weight, module.seen[1])
    resumed = KeepBest("val/acceptance_length@k3", folder)
    resumed.load_state_dict(state)
    fresh = ScriptedValidation()
    assert resumed.restore(fresh) == metrics and torch.equal(fresh.drafter.weight, module.seen[1])
    keep.clear()
    assert not list(folder.glob("best-*"))


def test_the_drafter_can_start_at_the_targets_last_layer_and_keep_its_lm_head_frozen():
    """drafter.init_layers_from_target copies the target's last decoder layer (both halves of the 2H q/k/v input
    read the target's q/k/v); train.freeze_lm_head leaves lm_head and the final norm without a gradient, while the
    layer and fc get one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglelab.core.errors import EaglelabError
    from eaglelab.data.targets import Target
    from eaglelab.models.drafter import DrafterFlags, Eagle3Config
    from eaglelab.train.fit import init_from_target, init_layers_from_target

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
    from eaglelab.train.fit import deterministic

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


def plain_head_loss(hidden, weight, index=None, teacher_states=None, teacher_head=None, loss="kl"):
    """The expression `draft_head_loss` replaces, as autograd differentiates it: [N, V_d] log-probabilities kept."""
    logp = torch.nn.functional.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
    if index is not None:
        return -(logp.gather(-1, index.clamp(min=0)[:, None])[:, 0] * (index >= 0)).sum(), logp.argmax(-1)
    log_p = torch.log_softmax((teacher_states @ teacher_head.T).float(), dim=-1)
    return divergence(loss, log_p, logp).sum(), logp.argmax(-1)


@pytest.mark.parametrize("loss", ["ce", "kl", "kl-kept", "rkl", "jsd", "tv", "nla", "lk_hybrid", "jsd-kept"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_chunked_head_loss_equals_the_plain_expression_forward_and_backward(loss, precision):
    """eaglelab.train.loss against the plain log-softmax over the draft vocabulary: the loss, the drafts (argmax)
    and the gradients of the rows' states and of lm_head, over chunks of 7 rows (the last one short), in float32
    and under bf16 autocast (the logits in bf16, the softmax in float32, as training runs them). KL's teacher from
    the target's states at each chunk, or (kl-kept) read from its log-probabilities kept over more positions than
    the rows, in another order; and with few rows, the plain expression the loss then chooses."""
    from eaglelab.train.loss import draft_head_loss, teacher_log_probs

    torch.manual_seed(0)
    N, H, V = 30, 16, 40
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    weight[5], hidden[:4] = weight[3], 3 * weight[3]  # equal maxima in four rows: the draft is the first, as argmax
    hidden.requires_grad_(), weight.requires_grad_()
    index = torch.randint(-1, V, (N,))  # (-1: a label outside the draft vocabulary, weight 0)
    states, head, where = torch.randn(N + 9, 12), torch.randn(V, 12), torch.randperm(N + 9)[:N]
    name = loss.split("-")[0]
    reference = {"index": index} if loss == "ce" else {"teacher_states": states[where], "teacher_head": head}
    kwargs = reference if loss == "ce" else {**reference, "divergence": name}
    if loss.endswith("-kept"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):  # (as the step computes them)
            kwargs = {"teacher": teacher_log_probs(states, head), "teacher_rows": where, "divergence": name}
    if loss != "ce":
        reference = {**reference, "loss": name}
    results = []
    for fn, kw in ((plain_head_loss, reference), (lambda *a, **k: draft_head_loss(*a, **k, rows=7), kwargs)):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            total, drafts = fn(hidden, weight, **kw)
        (2.5 * total).backward()  # a scaled loss: the saved gradients are scaled in the backward pass
        results.append((total.detach(), drafts, hidden.grad.clone(), weight.grad.clone()))
    (plain, plain_drafts, plain_h, plain_w), (chunked, drafts, grad_h, grad_w) = results
    for got, want in ((chunked, plain), (grad_h, plain_h), (grad_w, plain_w)):
        if precision == "fp32":  # (reverse KL's ∂f/∂q is log q - log y, tens where the teacher is sure: each entry
            # carries float32 rounding of that size, so the bound is relative to the largest entry)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(want.abs().max())))
        else:  # bf16 rounds the gradient before the loss's scale is applied here, after it in autograd: one bf16
            # step (2^-8 relative) of the largest term, not of each (small) entry
            torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * float(want.abs().max()))
    assert torch.equal(drafts, plain_drafts) and drafts[:4].eq(3).all()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)  # the loss itself: float32 sums, bf16 or not
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        torch.testing.assert_close(draft_head_loss(hidden, weight, **kwargs, rows=7)[0], chunked)  # (validation)
    total, _ = draft_head_loss(hidden, weight, **kwargs, rows=7)
    total.backward(retain_graph=True)  # its gradients are scaled in place: a second pass would scale them twice
    with pytest.raises(RuntimeError, match="one backward pass"):
        total.backward()
    # Four rows: fewer than the chunks pay off for (`chunks_cost_more`), so the plain expression, the same numbers
    few = {k: v[:4] if k in ("index", "teacher_states", "teacher_rows") else v for k, v in kwargs.items()}
    reference_few = {k: v[:4] if k not in ("teacher_head", "loss") else v for k, v in reference.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        got, want = (
            draft_head_loss(hidden[:4], weight, **few)[0],
            plain_head_loss(hidden[:4], weight, **reference_few)[0],
        )
    torch.testing.assert_close(got, want, rtol=1e-5 if precision == "fp32" else 2**-7, atol=1e-6)


def test_the_non_finite_checks_wait_for_the_device_once_per_step_and_weights_only_before_a_checkpoint():
    """StopOnNonFinite on a drafter's ~20 parameters: the loss and every gradient in one wait before the optimizer
    step; the weights in one wait, at a step whose checkpoint follows (every 50 steps here), none at the others."""
    from types import SimpleNamespace

    from eaglelab.train.ttt_module import StopOnNonFinite

    module = DrafterModule(small_config(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H_T),
                           TrainConfig())  # fmt: skip
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    stop = StopOnNonFinite(checkpoint_every_n_steps=50)
    trainer = SimpleNamespace(global_step=49, precision_plugin=SimpleNamespace(scaler=None))
    with HostSyncs() as syncs:
        stop.on_before_backward(trainer, module, torch.tensor(2.0))
        stop.on_before_optimizer_step(trainer, module, None)
        stop.on_train_batch_end(trainer, module, None, None, 0)  # step 49: no checkpoint follows
    assert sum(syncs.ops.values()) == 1 and len(list(module.parameters())) > 10
    trainer.global_step = 50
    with HostSyncs() as syncs:
        stop.on_train_batch_end(trainer, module, None, None, 0)
    assert sum(syncs.ops.values()) == 1
    module.drafter.fc.weight.grad[0, 0] = float("nan")
    with pytest.raises(TrainingError, match="non-finite gradient at step 50"):
        stop.on_before_optimizer_step(trainer, module, None)


def test_token_budget_batches_group_lengths_cover_each_sequence_once_and_resume_mid_epoch():
    """train.tokens_per_batch: every sequence once per epoch, each batch within the budget (rows × its longest) unless
    it is one sequence longer than the budget, far less padding than batches of a fixed count on a long-tailed mix,
    a seeded order that differs by epoch, and a resumed sampler that continues at the batch after the last taken."""
    from eaglelab.train.ttt_module import EpochBatches

    g = torch.Generator().manual_seed(0)
    lengths = (50 + torch.rand(600, generator=g).pow(3) * 4000).long().tolist()  # 50..4,050 tokens, long-tailed
    budget = 4096

    def padding(batches):
        computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        return 1 - sum(lengths[i] for b in batches for i in b) / computed

    grouped = EpochBatches(600, 2, seed=3, lengths=lengths, tokens_per_batch=budget)
    epoch0 = list(grouped)
    assert sorted(i for b in epoch0 for i in b) == list(range(600))
    assert all(len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1 for b in epoch0)
    assert padding(epoch0) < 0.02 < 0.25 < padding(list(EpochBatches(600, 2, seed=3)))
    assert epoch0 == list(EpochBatches(600, 2, seed=3, lengths=lengths, tokens_per_batch=budget))  # seeded
    grouped.set_epoch(1)
    assert list(grouped) != epoch0
    resumed = EpochBatches(600, 2, seed=3, lengths=lengths, tokens_per_batch=budget)
    resumed._resume = (0, 5)
    taken = iter(resumed)
    assert next(taken) == epoch0[5]
    resumed.batch_taken()
    assert resumed.served == 6  # a checkpoint now resumes at batch 6, whatever a loader's workers read ahead


def test_a_sequences_loss_does_not_depend_on_the_batch_it_is_in():
    """Length-grouped or not, each sequence is its own row: its drafts, labels and losses are the same alone as beside
    a longer (padded) one, so the summed loss of a batch is the sum of its sequences' (float32 tolerance)."""
    module, batch = loss_module("kl", step_decay=0.8), hand_batch()  # (KL: every label counts, as `counted` says)
    with torch.no_grad():
        _, together, _, counts = module.ttt(batch, 3)
        alone = []
        for b, n in enumerate(batch.seq_len.tolist()):
            one = Batch(
                input_ids=batch.input_ids[b : b + 1, :n], prompt_len=batch.prompt_len[b : b + 1],
                seq_len=batch.seq_len[b : b + 1], index=batch.index[b : b + 1],
                target_next=batch.target_next[b : b + 1, :n], aux=batch.aux[b : b + 1, :n],
                final=batch.final[b : b + 1, :n],
            )  # fmt: skip
            _, losses, _, n_j = module.ttt(one, 3)
            alone.append([float(loss) * c for loss, c in zip(losses, n_j)])
    for j in range(3):
        assert float(together[j]) * counts[j] == pytest.approx(sum(a[j] for a in alone), rel=1e-5)


def test_a_resumed_loader_with_workers_reads_the_resumed_epochs_batches_from_its_position():
    """Lightning makes a resumed run's loader iterator before it sets the sampler's epoch; loader workers fetch as soon
    as an iterator exists. The batches must still be those of the resumed epoch, from the one after the last taken
    (read too early, they were epoch 0's from its start: a resumed run with workers trained on other batches)."""
    from eaglelab.train.ttt_module import EpochBatches, ResumableLoader

    sampler = EpochBatches(40, 2, seed=1)
    loader = ResumableLoader(
        list(range(40)), batch_sampler=sampler, collate_fn=list, num_workers=2, prefetch_factor=2,
        persistent_workers=True,
    )  # fmt: skip
    loader.load_state_dict({"epoch": 2, "served": 3})
    batches = iter(loader)  # (Lightning's setup_data)
    sampler.set_epoch(2)  # (then the fit loop, before the first batch)
    expected = EpochBatches(40, 2, seed=1)
    expected.set_epoch(2)
    assert [next(batches) for _ in range(2)] == list(expected)[3:5]


class AdamWStep(L.LightningModule):
    """One weight under `training.adamw` and `training.clip_gradients` (what DrafterModule's hooks call), trained by
    the Trainer `make_trainer` builds."""

    def __init__(self, train_cfg):
        super().__init__()
        self.w, self.train_cfg, self.norms = torch.nn.Parameter(torch.ones(4)), train_cfg, []

    def training_step(self, batch, batch_idx):
        return (self.w * batch).pow(2).sum()  # ∂/∂w = 2·w·batch²: norm 4 at the first step, clipped to 0.5

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        from eaglelab.train.ttt_module import clip_gradients

        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append(float(self.w.grad.norm()))

    def configure_optimizers(self):
        from eaglelab.train.ttt_module import adamw

        return adamw([self.w], self.train_cfg)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_optimizer_is_fused_and_clips_its_gradients_under_every_precision(precision, tmp_path):
    """AdamW fused under 32-true and bf16-mixed, whose clipping Lightning's mixed-precision plugin would refuse for a
    fused optimizer (bf16 has no GradScaler to unscale): both train through the real Trainer, clipped to
    train.grad_clip. Under 16-mixed with clipping it is the multi-tensor AdamW (a fused one would unscale after it)."""
    from eaglelab.train.ttt_module import adamw

    cfg = compose(
        ["experiment=smoke", f"train.precision={precision}", "train.grad_clip=0.5"], tmp_path, tmp_path / "run"
    )
    module = AdamWStep(cfg.train)
    make_trainer(cfg, tmp_path / "run", False).fit(module, torch.utils.data.DataLoader(torch.ones(3, 4), batch_size=1))
    assert module.trainer.optimizers[0].defaults["fused"] and float(module.w.detach().max()) < 1.0  # (it stepped)
    assert module.norms and max(module.norms) == pytest.approx(0.5, rel=1e-3)
    cfg.train.precision = "16-mixed"
    opt = adamw([torch.nn.Parameter(torch.ones(1))], cfg.train)
    assert not opt.defaults["fused"] and opt.defaults["foreach"]


def test_the_loaders_read_ahead_is_sized_in_bytes():
    """An 8B target's batch of 32,768 tokens (~0.8 GB of states): each of 4 workers reads one ahead within the 2 GB
    default (3.2 GB in all, where 4 ahead each held ~13 GB); small batches keep 4 ahead."""
    from eaglelab.core.config import TrainConfig
    from eaglelab.train.fit import loader_options

    gpu = TrainConfig(accelerator="gpu")
    assert loader_options(gpu, 805_000_000)["prefetch_factor"] == 1
    assert loader_options(TrainConfig(accelerator="gpu", prefetch_gb=8.0), 805_000_000)["prefetch_factor"] == 2
    assert loader_options(gpu, 3_000_000)["prefetch_factor"] == 4
    assert "prefetch_factor" not in loader_options(TrainConfig(accelerator="cpu"), 805_000_000)  # no workers


def test_every_loss_the_config_offers_is_one_the_loss_computes():
    import typing

    from eaglelab.train.loss import DIVERGENCES

    offered = typing.get_args(typing.get_type_hints(TrainConfig)["loss"])
    assert set(offered) == {"ce", *DIVERGENCES}
