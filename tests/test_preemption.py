"""Signals at any instant (eaglelab.core.preemption): one arriving inside a write is acted on after it; outside a
write at once. The signal is sent from inside torch.save's own pickling, i.e. exactly where the requeue
that was lost to `RuntimeError: ... unexpected pos` landed."""

import io
import os
import signal

import pytest
import torch

from eaglelab.core import preemption
from eaglelab.train.ttt_module import AtomicCheckpointIO


class SignalWhilePickled:
    """Sends `signum` to this process while torch.save is writing the checkpoint that holds it."""

    def __init__(self, signum):
        self.signum = signum

    def __reduce__(self):
        os.kill(os.getpid(), self.signum)
        return (int, (7,))


@pytest.fixture
def handlers(monkeypatch):
    saved = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    preemption._previous.clear()


def checkpoint(signum) -> dict:
    weights = {f"w{i}": torch.randn(64, 64) for i in range(8)}  # several storage writes around the signal
    return {"state_dict": weights, "poison": SignalWhilePickled(signum), "global_step": 3}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2])
def test_a_signal_inside_a_checkpoint_write_is_acted_on_after_it(signum, handlers, tmp_path):
    preemption.install()
    preemption.enter_stage("train")
    path = tmp_path / "last.ckpt"
    with pytest.raises(KeyboardInterrupt, match=f"{signal.Signals(signum).name} during train"):
        AtomicCheckpointIO().save_checkpoint(checkpoint(signum), path)
    saved = torch.load(path, weights_only=False)  # whole: it was written before the signal was acted on
    assert saved["global_step"] == 3 and saved["poison"] == 7 and len(saved["state_dict"]) == 8
    assert not [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]  # no temporary file left
    got = preemption.received()
    assert got["name"] == signal.Signals(signum).name and got["stage"] == "train"
    assert got["waited_for"] == "checkpoint"


class SignallingFile(io.BytesIO):
    """A file that sends SIGTERM from inside one of torch.save's writes (its C++ writer calls Python's write)."""

    sent = False

    def write(self, data):
        if self.tell() > 4096 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().write(data)


def test_a_signal_raised_inside_torch_saves_write_tears_it_unless_deferred(handlers):
    """The failure this module exists for, reproduced: raised at once, the interrupt becomes torch's
    RuntimeError (a requeue turned into a crash); recorded and acted on after the write, it stays an interrupt
    and the file is whole."""

    def raise_now(signum, frame):
        raise KeyboardInterrupt

    weights = {f"w{i}": torch.randn(64, 64) for i in range(8)}
    signal.signal(signal.SIGTERM, raise_now)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save(weights, SignallingFile())

    preemption.install()
    f = SignallingFile()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with preemption.uninterruptible("checkpoint"):
            torch.save(weights, f)
    f.seek(0)
    loaded = torch.load(f)
    assert f.sent and all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_outside_a_write_a_signal_is_acted_on_at_once_and_only_once(handlers):
    preemption.install()
    preemption.enter_stage("evaluate")
    with pytest.raises(KeyboardInterrupt, match="SIGTERM during evaluate"):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**7):  # the handler runs between bytecodes
            pass
    os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping: recorded, not raised again
    assert preemption.received()["waited_for"] is None


def test_in_a_submitit_job_acting_calls_submitits_handler_after_the_write(handlers, monkeypatch, tmp_path):
    """submitit's USR2 handler checkpoints, requeues and exits: it must run after the write, not inside it."""
    calls = []

    def submitit_requeue(signum, frame):
        calls.append((signum, (tmp_path / "last.ckpt").exists()))
        raise SystemExit(-1)

    signal.signal(signal.SIGUSR2, submitit_requeue)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    preemption.install()
    with pytest.raises(SystemExit):
        AtomicCheckpointIO().save_checkpoint(checkpoint(signal.SIGUSR2), tmp_path / "last.ckpt")
    assert calls == [(signal.SIGUSR2, True)]  # called once, with the checkpoint already in place


def test_the_jobs_sigterm_during_submitits_requeue_does_not_fail_it(handlers, monkeypatch):
    """submitit requeues by running `scontrol requeue` inside the job it requeues, and Slurm then sends SIGTERM to
    every process of the job (proctrack follows children): scontrol could die of it before returning, and
    submitit wrote the accepted requeue as the job's failure (seen in CI, the 2-node test). Here the program is
    `sleep`, and the SIGTERM reaches it, as Slurm's would, while submitit waits for it."""
    import subprocess

    returned = []

    def submitit_requeue(signum, frame):
        program = subprocess.Popen(["sleep", "0.5"])
        os.kill(program.pid, signal.SIGTERM)  # Slurm, ending the requeued job's processes
        returned.append(program.wait())
        raise SystemExit(-1)

    signal.signal(signal.SIGUSR2, submitit_requeue)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    preemption.install()
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGUSR2)
    assert returned == [0]  # the program ran to its end (killed, it returns -15)
    assert signal.getsignal(signal.SIGTERM) is preemption._handle  # and the handler is back


def test_a_signal_while_a_figure_is_drawn_is_acted_on_after_it_is_saved(handlers, tmp_path):
    """Agg's renderer calls back into Python: an interrupt raised there became `ValueError: Invalid bounding box`
    (found by benchmarks/faults.py through Slurm). The signal here is sent while the figure is being drawn."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from eaglelab.evaluate.plots import save_figure

    class SignalWhileDrawn(Line2D):
        def draw(self, renderer):
            if not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            return super().draw(renderer)

    preemption.install()
    preemption.enter_stage("suites")
    fig, ax = plt.subplots()
    ax.add_line(SignalWhileDrawn([0, 1], [0, 1]))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM during suites"):
        save_figure(fig, tmp_path / "drift.png")
    assert (tmp_path / "drift.png").stat().st_size > 1000 and (tmp_path / "drift.pdf").exists()
    assert preemption.received()["waited_for"] == "figure"


def test_a_checkpoint_is_resumed_onto_the_host_first(tmp_path, monkeypatch):
    """Lightning's strategy reads the resume checkpoint with no map_location; torch.load alone would put every rank's
    copy where it was saved (cuda:0 on a GPU node). No GPU here: the device asked of torch.load is checked, and the
    state read back whole."""
    import torch

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    asked, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: asked.append(kw.get("map_location")) or load(*a, **kw))
    state = AtomicCheckpointIO().load_checkpoint(path)  # as Lightning's Strategy.load_checkpoint calls it
    assert asked == ["cpu"] and torch.equal(state["state_dict"]["w"], torch.ones(3))
