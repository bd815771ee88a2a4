"""fleetbox_found's rules, with stand-in tensors (real Paddle in tests/integration/test_found_metrics.py): a loss
on a device is read only as the newest of those queued, a GradScaler's scaled loss counts as the loss it scaled, a
grad_tensor is no loss, and an error of its own ends finding, never the script's call."""
import importlib
import json

import pytest

from fleetbox.incontainer import fleetbox_found, fleetbox_progress
from fleetbox.run import hang


class Place:
    def __init__(self, cpu):
        self.cpu = cpu

    def is_cpu_place(self):
        return self.cpu


class Tensor:
    """As much of a Paddle tensor as fleetbox_found reads: its shape, its place, its value (counted)."""
    reads = 0

    def __init__(self, value, shape=(), cpu=True):
        self.value, self.shape, self.place = value, list(shape), Place(cpu)

    def __float__(self):
        Tensor.reads += 1
        return float(self.value)


class Optimizer:
    def __init__(self, lr):
        self.lr = lr

    def get_lr(self):
        return self.lr


@pytest.fixture
def found(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.delenv("FLEETBOX_PROGRESS_PID", raising=False)
    monkeypatch.delenv(fleetbox_found.ENV, raising=False)
    monkeypatch.setattr("atexit.register", lambda f: None)   # the test writes itself
    monkeypatch.setattr(fleetbox_progress, "_also", [])
    Tensor.reads = 0
    yield importlib.reload(fleetbox_found)
    importlib.reload(fleetbox_found)


def written(tmp_path) -> list[dict]:
    text = (tmp_path / fleetbox_found.FILE.format(rank=0)).read_text()
    return [json.loads(ln.removeprefix(fleetbox_found.PREFIX)) for ln in text.splitlines()]


OPT = Optimizer(0.1)   # one optimizer: a second one's steps are not steps


def steps(found, losses, optimizer=OPT):
    for loss in losses:
        found.backward(loss, None)
        with found.step(optimizer):
            pass


def test_a_loss_on_a_device_is_read_once_per_write_the_newest_and_on_the_cpu_every_one(found, tmp_path):
    steps(found, [Tensor(1.0, cpu=False), Tensor(2.0, cpu=False), Tensor(3.0, cpu=False)])
    found.write()
    assert Tensor.reads == 1   # one read (one wait for the device) per write, never per step
    steps(found, [Tensor(4.0), Tensor(5.0)])
    found.write()
    assert Tensor.reads == 3
    assert [(r["step"], r.get("loss")) for r in written(tmp_path)] == [(1, None), (2, None), (3, 3.0), (4, 4.0),
                                                                       (5, 5.0)]


def test_a_scaled_loss_counts_as_the_loss_it_scaled_and_a_grad_tensor_gives_none(found, tmp_path, capsys):
    loss, scaled = Tensor(0.25), Tensor(0.25 * 65536)
    found.scaled(scaled, loss)
    steps(found, [scaled])
    found.backward(Tensor(7.0), Tensor(2.0))   # backward(grad_tensor): which loss is not the script's to guess
    with found.step(OPT):
        pass
    found.write()
    assert [(r.get("loss"), r["lr"]) for r in written(tmp_path)] == [(0.25, 0.1), (None, 0.1)]
    assert capsys.readouterr().err == ("fleetbox: no loss is found for steps where backward() is given a grad_tensor; "
                                       "log your own with fleetbox_metrics.Meter\n")


def test_an_error_of_finding_ends_finding_once_and_never_reaches_the_script(found, tmp_path, capsys):
    class Broken:
        @property
        def shape(self):
            raise RuntimeError("no shape here")
    found.backward(Broken(), None)   # raises nothing
    steps(found, [Tensor(1.0)])
    found.write()
    assert not (tmp_path / fleetbox_found.FILE.format(rank=0)).exists()
    assert capsys.readouterr().err == ("fleetbox: no more metrics are found in this rank's training: RuntimeError: "
                                       "no shape here\n")


def test_a_step_counts_every_batch_since_the_last_one_and_a_second_optimizers_steps_are_not_steps(found, tmp_path,
                                                                                                 capsys):
    """Gradient accumulation: two batches of 8, one step of 16 samples (and no loss: backward() twice); an
    evaluation's batch, with no backward(), counts nothing. A GAN's
    second optimizer: said once, its steps not counted, the first one's loss found. A scaler's step around the
    optimizer's: one step."""
    adam, sgd = Optimizer(0.1), Optimizer(0.5)
    steps(found, [Tensor(5.0)], adam)   # a first step: the next ones have a time since it
    for _ in range(2):
        found.batch([Tensor(0.0, shape=(8, 3))])
        found.backward(Tensor(1.0), None)
    with found.step(adam):
        pass
    for d_loss in (2.0, 3.0):
        found.batch([Tensor(0.0, shape=(100, 3))])   # an evaluation's batch: no backward() follows, never counted
        found.batch({"x": Tensor(0.0, shape=(4, 3))})
        found.backward(Tensor(d_loss), None)
        with found.step(adam), found.step(adam):   # a GradScaler's step, then the optimizer's own inside it
            pass
        found.backward(Tensor(9.0), None)
        with found.step(sgd):
            pass
    found.write()
    got = written(tmp_path)
    assert [(r["step"], r.get("loss"), r["lr"], r.get("samples")) for r in got] == [
        (1, 5.0, 0.1, None), (2, None, 0.1, 16), (3, 2.0, 0.1, 4), (4, 3.0, 0.1, 4)]
    assert capsys.readouterr().err.splitlines() == [
        "fleetbox: no loss is found for steps where backward() is called more than once (several losses, gradient "
        "accumulation); log your own with fleetbox_metrics.Meter",
        "fleetbox: several optimizers step (Optimizer, Optimizer): the steps, loss and learning rate found are the "
        "first one's; log your own with fleetbox_metrics.Meter"]
    steps(found, [Tensor(1.0)], adam)   # with no batch since: no samples, never the last batch's again
    found.write()
    assert "samples" not in written(tmp_path)[-1]


def test_an_earlier_runs_found_metrics_are_cleared_with_its_progress():
    assert fleetbox_found.FILE.format(rank="*") in hang.LEFT_OVER


def test_finding_turned_off_finds_nothing(found, tmp_path, monkeypatch):
    monkeypatch.setenv(fleetbox_found.ENV, "0")
    steps(found, [Tensor(1.0)])
    found.write()
    assert not (tmp_path / fleetbox_found.FILE.format(rank=0)).exists()
