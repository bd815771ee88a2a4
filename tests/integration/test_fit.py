"""A script in Paddle's high-level style (paddle.Model, prepare, fit; train/fit.py) with fleetbox_fit's callback,
for real (two host-network containers, Gloo on CPU): a rank killed mid-epoch restarts the job, which resumes as
the README says (the network and optimizer of the newest checkpoint, the finished epochs not run again, the
epoch in progress from its start); every rank's loss and throughput reach the report; a stuck data loader is
noticed and named from the stacks."""
import json
from pathlib import Path

import pytest

from fleetbox.run import metrics
from tests.conftest import invoke
from tests.integration.test_train import job_containers, summary_of

pytestmark = pytest.mark.docker   # its jobs on the default engine, their containers counted (tests/conftest.py)

PER_EPOCH = 4096 // 2 // 64   # train/fit.py's defaults on 2 ranks: batches per epoch


def test_a_fit_job_whose_rank_is_killed_resumes_with_the_epochs_left(image_args):
    proc = invoke("train", *image_args, "--nodes", "2", "--script", "train/fit.py", "--max-restarts", "1", "--args",
                  "--epochs 5 --kill-rank 1 --kill-epoch 2 --kill-batch 10")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    job = Path(s["dir"])
    assert [a["state"] for a in s["attempts"]] == ["FAILED", "PASSED"], s["attempts"]
    assert s["attempts"][0]["ended"].startswith("node1 (rank 1) exited with")
    said = (job / "node0" / "workerlog.0").read_text()
    assert f"fleetbox_fit: resumed at step {2 * PER_EPOCH} (2 of 5 epoch(s) done): fit runs the 3 left\n" in said
    # every rank's lines: attempt 0 trained epochs 0 and 1 and part of 2; attempt 1 epochs 2 to 4 from their start
    recs = metrics.read(job)
    for rank in (0, 1):
        mine = {a: [r for r in recs if r["rank"] == rank and r["attempt"] == a] for a in (0, 1)}
        # (its loader thread reads ahead: the kill comes a few batches before batch 10 is trained)
        assert {r["epoch"] for r in mine[0]} == {0, 1, 2} and 2 * PER_EPOCH < len(mine[0]) < 3 * PER_EPOCH
        assert [r["step"] for r in mine[1]] == list(range(2 * PER_EPOCH, 5 * PER_EPOCH))
        assert [r["epoch"] for r in mine[1]] == [e for e in (2, 3, 4) for _ in range(PER_EPOCH)]
        assert all(r["samples"] == 64 and r["seconds"] > 0 and r["own_seconds"] >= 0 for r in mine[1])
    accuracy = json.loads(said.split("FLEETBOX-FIT ")[1].splitlines()[0])["accuracy"]
    assert accuracy > 0.85, accuracy
    md = (job / "report.md").read_text()
    final = next(ln for ln in md.splitlines() if ln.startswith("- final loss: "))
    assert "rank 0 " in final and "rank 1 " in final and final.count(f"(step {5 * PER_EPOCH - 1})") == 2, final
    rate = next(ln for ln in md.splitlines() if ln.startswith("- throughput: "))
    assert "samples/s (attempt 1); node0 " in rate and "; node1 " in rate, rate
    assert "- stragglers: none (own work per step: rank 0 " in md
    assert job_containers(s["job_id"]) == []


def test_a_fit_job_stuck_in_its_data_loader_is_named_from_the_stacks(cpu_image):
    proc = invoke("train", "--nodes", "2", "--script", "train/fit.py", "--hang-timeout", "15", "--args",
                  "--epochs 3 --hang-rank 1 --hang-epoch 1 --hang-batch 5")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    h = s["hang"]
    assert (h["kind"], h["ranks"], h["decided"]) == ("hang", [1], True), h
    # its last progress: the batch before the stuck one (fit's batch 4 of epoch 1)
    assert h["text"].startswith(f"node1 (rank 1) hung: no progress since step {PER_EPOCH + 5} ("), h["text"]
    assert "; in `trouble` (fit.py:" in h["text"] and "← `__getitem__` (fit.py:" in h["text"] and \
        "rank 0 waiting in `backward`" in h["text"], h["text"]
    assert "in __getitem__" in (Path(h["dir"]) / "rank1.txt").read_text()
    assert job_containers(s["job_id"]) == []


def test_a_fit_job_that_fails_once_fit_is_done_trains_nothing_again(cpu_image):
    """Every epoch's last batch is also saved by the batch count (FLEETBOX_CHECKPOINT_EVERY, one epoch): that
    checkpoint has its epoch done, so the restart after a failure past fit reads one batch, trains nothing and
    goes on with what follows fit (the evaluation), from the weights fit ended with."""
    proc = invoke("train", "--nodes", "2", "--script", "train/fit.py", "--max-restarts", "1",
                  "--env", f"FLEETBOX_CHECKPOINT_EVERY={PER_EPOCH}", "--args",
                  "--epochs 3 --kill-rank 1 --kill-epoch 3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    job = Path(s["dir"])
    said = (job / "node0" / "workerlog.0").read_text()
    assert f"fleetbox_fit: resumed at step {3 * PER_EPOCH} (3 of 3 epoch(s) done): nothing left to train" in said
    recs = metrics.read(job)
    assert [r for r in recs if r["attempt"] == 1] == []   # no batch trained again
    assert {r["epoch"] for r in recs if r["attempt"] == 0} == {0, 1, 2}
    assert json.loads(said.split("FLEETBOX-FIT ")[1].splitlines()[0])["accuracy"] > 0.85
