"""The metrics protocol: what the helper prints, and what the host collects from a job folder."""
import json

import pytest

from fleetbox.incontainer import fleetbox_metrics
from fleetbox.run import backends, metrics


def test_the_helper_prints_one_line_per_step_with_rank_time_and_scalars(capsys, monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINER_ID", "3")
    meter = fleetbox_metrics.Meter()
    meter.step(7, loss=0.5, samples=64, lr=0.01)
    fleetbox_metrics.log(8, loss=0.25)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" ", 1)[0] for ln in lines] == ["FLEETBOX-METRIC", "FLEETBOX-METRIC"]
    a, b = (json.loads(ln.split(" ", 1)[1]) for ln in lines)
    assert (a["rank"], a["step"], a["loss"], a["lr"]) == (3, 7, 0.5, 0.01) and a["samples_per_s"] > 0
    assert b == {"rank": 3, "step": 8, "time": b["time"], "loss": 0.25} and b["time"] >= a["time"]
    with pytest.raises(ValueError, match="rank are set by the protocol"):
        fleetbox_metrics.log(1, rank=5)


def line(rank, step, t, **kw):
    return "FLEETBOX-METRIC " + json.dumps({"rank": rank, "step": step, "time": t, **kw}) + "\n"


def test_collect_reads_every_node_worker_and_attempt_in_time_order(tmp_path):
    job = tmp_path / "job"
    (job / "attempt0" / "node0").mkdir(parents=True)
    (job / "attempt0" / "node0" / "workerlog.0").write_text("step 0\n" + line(0, 0, 10.0, loss=1.0)
                                                           + 'FLEETBOX-METRIC {"rank": 0, "st')   # cut by a kill
    for k in (0, 1):
        (job / f"node{k}").mkdir()
        (job / f"node{k}" / "workerlog.0").write_text(line(2 * k, 1, 21.0 + k) + line(2 * k, 2, 30.0 + k))
        (job / f"node{k}" / "workerlog.1").write_text(line(2 * k + 1, 1, 20.5) + "other output\n")
    (job / "node1.log").write_text(line(9, 9, 1.0))   # a Slurm node log, not a worker log: not read
    path = metrics.collect(job)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["attempt"], r["node"], r["rank"], r["step"]) for r in recs] == [
        (0, 0, 0, 0), (1, 0, 1, 1), (1, 1, 3, 1), (1, 0, 0, 1), (1, 1, 2, 1), (1, 0, 0, 2), (1, 1, 2, 2)]
    assert recs[0]["loss"] == 1.0
    assert not (job / ".metrics.jsonl.part").exists()


def test_slurm_allocations_count_as_attempts_and_no_metrics_writes_nothing(tmp_path):
    """Slurm's alloc<N> folders are its layout's, which the backends register as every command loads them (run
    alone, this test once read the job with the default layout only)."""
    assert backends.lookup("slurm").layout.earlier == "alloc<N>"
    job = tmp_path / "job"
    (job / "alloc1" / "node0").mkdir(parents=True)
    (job / "alloc1" / "node0" / "workerlog.0").write_text(line(0, 0, 1.0))
    (job / "node0").mkdir()
    (job / "node0" / "workerlog.0").write_text(line(0, 5, 2.0))
    assert [(r["attempt"], r["step"]) for r in metrics.read(job)] == [(0, 0), (1, 5)]
    empty = tmp_path / "empty"
    (empty / "node0").mkdir(parents=True)
    (empty / "node0" / "workerlog.0").write_text("no metrics\n")
    assert metrics.collect(empty) is None and not (empty / "metrics.jsonl").exists()


@pytest.mark.parametrize("bad", [{"rank": "0", "step": 1, "time": 2.0}, {"rank": 0, "step": 1.5, "time": 2.0},
                                 {"rank": 0, "step": 1, "time": "now"}, {"rank": True, "step": 1, "time": 2.0},
                                 {"rank": 0, "step": 1, "time": 2.0, "loss": "nan"},
                                 {"rank": 0, "step": 1, "time": 2.0, "samples": None}, [0, 1, 2], "text"])
def test_a_malformed_metrics_line_is_left_out_and_the_report_still_draws(tmp_path, bad):
    from fleetbox.run import report
    job = tmp_path / "job"
    (job / "node0").mkdir(parents=True)
    (job / "node0" / "workerlog.0").write_text(line(0, 0, 1.0, loss=2.0, samples=8, seconds=0.5)
                                               + "FLEETBOX-METRIC " + json.dumps(bad) + "\n"
                                               + line(0, 2, 3.0, loss=1.0, samples=8, seconds=0.5))
    assert [r["step"] for r in metrics.read(job)] == [0, 2]
    report.draw(job)
    assert "- throughput: 16.0 samples/s" in (job / "report.md").read_text()


@pytest.mark.parametrize("value", ["0", "abc", "-3", "1.5"])
def test_a_bad_checkpoint_interval_ends_the_rank_in_one_line(monkeypatch, value):
    from fleetbox.incontainer import fleetbox_checkpoint
    monkeypatch.setenv("FLEETBOX_CHECKPOINT_EVERY", value)
    with pytest.raises(SystemExit) as e:
        fleetbox_checkpoint._positive("FLEETBOX_CHECKPOINT_EVERY", 100)
    assert str(e.value) == f"fleetbox-checkpoint: FLEETBOX_CHECKPOINT_EVERY={value!r} must be a whole number >= 1"
    monkeypatch.setenv("FLEETBOX_CHECKPOINT_EVERY", "25")
    assert fleetbox_checkpoint._positive("FLEETBOX_CHECKPOINT_EVERY", 100) == 25
    monkeypatch.delenv("FLEETBOX_CHECKPOINT_EVERY")
    assert fleetbox_checkpoint._positive("FLEETBOX_CHECKPOINT_EVERY", 100) == 100


def test_a_record_reads_as_the_line_it_was_in_slots_not_a_dict(tmp_path):
    """The report holds a long job's records (a million): each in slots, read as the mapping the line was, the
    script's own fields too; its text let go once the gather wrote it."""
    line = ('{"rank": 3, "step": 7, "time": 1795797000.5, "loss": 0.25, "samples_per_s": 900.0, "lr": 0.1, '
            '"phase": "warmup"}')
    rec = metrics.parse(metrics.PREFIX + line)
    r = metrics.Record(rec, line, node=1, attempt=2)
    assert dict(r.items()) == {**rec, "node": 1, "attempt": 2} and r == {**rec, "node": 1, "attempt": 2}
    assert (r["loss"], r["lr"], r.get("seconds"), r.get("lr"), "loss" in r, "seconds" in r, "_text" in r) == \
        (0.25, 0.1, None, 0.1, True, False, False)
    for absent in ("seconds", "nope"):
        with pytest.raises(KeyError):
            r[absent]
    job = tmp_path / "job"
    job.mkdir()
    assert metrics.collect(job, [r]).read_text() == line[:-1] + ', "node": 1, "attempt": 2}\n'
    assert not hasattr(r, "_text") and r["loss"] == 0.25   # written: the text let go, the fields kept

