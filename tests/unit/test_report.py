"""A run's report from a job folder: the plot (opened with Pillow: not blank, a legend entry per rank),
report.md's figures (throughput added up from the metrics exactly as the script's Meter does), restarts
marked, and what is missing said."""
import json

import pytest
from PIL import Image

from fleetbox.incontainer.fleetbox_found import FILE as FOUND
from fleetbox.run import report


def write_job(job, attempts=((0, 60),), ranks=(0, 1), fail=False, own=None):
    """A job folder as a run leaves it; `own`: {rank: own_seconds} its metrics lines carry."""
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"backend": "docker", "nodes": len(ranks), "procs_per_node": 1,
                                              "variant": "cpu", "image": "fleetbox/paddle:cpu",
                                              "image_id": "sha256:" + "ab" * 32, "content_tag": "cd" * 32,
                                              "paddle": "3.3.1", "started": 1000.0}))
    for a, (first, last) in enumerate(attempts):
        base = job if a == len(attempts) - 1 else job / f"attempt{a}"
        for k in ranks:
            d = base / f"node{k}"
            d.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps({"rank": k, "step": s, "time": 1002.0 + 10 * a + s * 0.1, "loss": 5.0 / (s + 1),
                                 "samples_per_s": 320.0 * (k + 1), "samples": 32, "seconds": 0.1 / (k + 1),
                                 "comm_seconds": 0.01 * (k + 1), **({"own_seconds": own[k]} if own else {})})
                     for s in range(first, last)]
            (d / "workerlog.0").write_text("".join(f"FLEETBOX-METRIC {ln}\n" for ln in lines))
    summary = {"job_id": job.name, "backend": "docker", "ok": not fail, "dir": str(job), "nodes": [
        {"node": f"node{k}", "rank": k, "host": "local", "exit_code": 3 if fail and k == 1 else 0,
         "state": "FAILED" if fail and k == 1 else "ok", "logs": str(job / f"node{k}")} for k in ranks],
        "culprit": 1 if fail else None}
    if len(attempts) > 1:
        summary["attempts"] = [{"attempt": a, "ok": a == len(attempts) - 1, "ended": "x", "logs": ""}
                               for a in range(len(attempts))]
    (job / "summary.json").write_text(json.dumps(summary))


def not_blank(png):
    im = Image.open(png)
    im.load()
    lo, hi = im.convert("L").getextrema()
    return im.size[0] > 400 and im.size[1] > 400 and hi - lo > 100


def test_a_passed_run_draws_every_rank_and_adds_up_throughput_as_the_meter_does(tmp_path):
    job = tmp_path / "train-a"
    write_job(job)
    drawn = report.draw(job)
    assert drawn["legend"] == ["rank 0", "rank 1"] and drawn["missing"] == []
    assert not_blank(drawn["png"])
    # rank 0: 32 samples per 0.1 s, rank 1: 32 per 0.05 s
    assert round(drawn["throughput"]["total"], 6) == 320.0 + 640.0
    md = (job / "report.md").read_text()
    assert md.startswith("# train-a: PASSED")
    assert "- throughput: 960.0 samples/s; node0 320.0; node1 640.0" in md
    assert "- started: " in md and "time to first step: 2.0 s" in md
    assert "- final loss: rank 0 0.0833 (step 59), rank 1 0.0833 (step 59)" in md
    assert "content tag cdcdcdcdcdcd" in md and "Paddle 3.3.1" in md
    # rank 0: 0.1 s steps with 0.01 s all-reduce, rank 1: 0.05 s with 0.02 s: (0.6 + 1.2) / (6 + 3) of all step time
    assert "- step time: 75.0 ms (mean over ranks and steps), 20.0% in the script's own all-reduce" in md, md
    assert "- plotted: loss of rank 0, rank 1; samples/s of node0, node1" in md
    assert json.loads((job / "metrics.jsonl").read_text().splitlines()[0])["rank"] in (0, 1)


def test_a_failed_run_draws_what_exists_and_says_what_is_missing(tmp_path):
    job = tmp_path / "train-b"
    write_job(job, attempts=((0, 10),), ranks=(0,), fail=True)
    j = json.loads((job / "job.json").read_text())
    (job / "job.json").write_text(json.dumps({**j, "nodes": 2}))   # two nodes ran; rank 1 printed nothing
    s = json.loads((job / "summary.json").read_text())
    s["nodes"].append({"node": "node1", "rank": 1, "host": "local", "exit_code": 3, "state": "FAILED",
                       "logs": str(job / "node1")})
    (job / "summary.json").write_text(json.dumps(s))
    drawn = report.draw(job)
    assert drawn["legend"] == ["rank 0"] and drawn["missing"] == ["rank 1 printed no metrics"]
    assert not_blank(drawn["png"])
    md = (job / "report.md").read_text()
    assert md.startswith("# train-b: FAILED") and "- failure: node1 (rank 1) exited with exit code 3" in md
    assert "## Missing\n\n- rank 1 printed no metrics" in md


def test_restarts_are_reported_per_attempt_and_an_empty_folder_still_draws(tmp_path):
    job = tmp_path / "train-c"
    write_job(job, attempts=((0, 20), (15, 60)))
    drawn = report.draw(job)
    md = (job / "report.md").read_text()
    assert "(attempt 1)" in md and "- attempt 0: x" in md and "rank 0 65 (last 59)" in md
    assert drawn["shrank"] == {} and "shrank" not in md
    summary = json.loads((job / "summary.json").read_text())   # the same restart, on one node fewer
    summary["attempts"] = [{**a, "nodes": n} for a, n in zip(summary["attempts"], (3, 2), strict=True)]
    (job / "summary.json").write_text(json.dumps(summary))
    drawn = report.draw(job)
    md = (job / "report.md").read_text()
    assert drawn["shrank"] == {1: 2} and "- attempt 1, on 2 nodes: the world shrank: x" in md
    assert "2 node(s) x 1 process(es) (3 at the start)" in md
    summary["replaced"] = [{"attempt": 1, "node": 1, "host": "tcp://h2:2375", "by": "tcp://h3:2375", "why": "y",
                            "ran": True},
                           {"attempt": 1, "node": 0, "host": "tcp://h1:2375", "by": "tcp://h4:2375", "why": "z",
                            "ran": False}]
    (job / "summary.json").write_text(json.dumps(summary))   # a spare, where the world stayed as it was
    drawn = report.draw(job)
    assert drawn["spared"] == {1: [1, 0]}   # marked on the loss chart where attempt 1 began
    md = (job / "report.md").read_text()
    assert "- node1 on tcp://h2:2375 failed at step 19 (y); the spare tcp://h3:2375 took its place from step 15 " \
        "(attempt 1)" in md   # a host that ran: its last step; one that could not start the job: none
    assert "- node0 on tcp://h1:2375 could not start the job (z); the spare tcp://h4:2375 took its place from step " \
        "15 (attempt 1)" in md
    empty = tmp_path / "train-d"
    empty.mkdir()
    drawn = report.draw(empty)
    assert not_blank(drawn["png"]) and drawn["legend"] == []
    assert drawn["missing"][:2] == ["no metrics lines (no optimizer step ran, or hang detection was off: metrics are "
                                    "found in the training by its writer)",
                                    "no summary.json (the job is still running, or was killed before it ended)"]


def test_a_run_whose_script_counts_no_samples_has_an_unknown_throughput(tmp_path):
    """A script that logs loss but no samples (paddle.Model.fit's own loop, say): 'unknown', never 0.0."""
    job = tmp_path / "train-e"
    write_job(job)
    for k in (0, 1):
        log = job / f"node{k}" / "workerlog.0"
        lines = [json.dumps({"rank": k, "step": s, "time": 1002.0 + s, "loss": 1.0}) for s in range(5)]
        log.write_text("".join(f"FLEETBOX-METRIC {ln}\n" for ln in lines))
    drawn = report.draw(job)
    md = (job / "report.md").read_text()
    assert "- throughput: unknown (no data loader's batch was seen" in md and "0.0 samples/s" not in md
    assert "- learning rate: not logged" in md and drawn["lr"] == {}


def test_metrics_found_in_the_training_are_read_beside_the_scripts_own_and_the_learning_rate_is_reported(tmp_path):
    """A node's found-metrics file is read as its worker log is (the report, metrics.jsonl); the learning rate is
    drawn and said once where every rank has the same, and per rank where they differ."""
    job = tmp_path / "train-f"
    write_job(job, attempts=((0, 0),))   # no line of the script's own
    for k in (0, 1):
        lines = [json.dumps({"rank": k, "step": s, "time": 1002.0 + s, "loss": 2.0 - s / 10, "lr": 0.1 / s})
                 for s in range(1, 6)]
        (job / f"node{k}" / FOUND.format(rank=k)).write_text("".join(f"FLEETBOX-METRIC {ln}\n" for ln in lines))
    drawn = report.draw(job)
    md = (job / "report.md").read_text()
    assert drawn["legend"] == ["rank 0", "rank 1"] and "rank 0 1.5000 (step 5), rank 1 1.5000 (step 5)" in md
    assert drawn["lr"][0] == drawn["lr"][1] == tuple((s, 0.1 / s) for s in range(1, 6))
    assert "- learning rate: 0.1 at step 1 to 0.02 at step 5, the same on every rank" in md
    assert len((job / "metrics.jsonl").read_text().splitlines()) == 10
    (job / "node1" / FOUND.format(rank=1)).write_text(
        'FLEETBOX-METRIC {"rank": 1, "step": 1, "time": 1003.0, "lr": 0.5}\n')
    assert "- learning rate: 0.1 to 0.02 (rank 0); 0.5 to 0.5 (rank 1)" in (report.draw(job) and
                                                                            (job / "report.md").read_text())


def test_a_hung_attempt_and_a_hung_job_say_so(tmp_path):
    job = tmp_path / "train-h"
    write_job(job, attempts=((0, 20), (15, 60)), fail=True)
    s = json.loads((job / "summary.json").read_text())
    text = "node1 (rank 1) hung: no progress since step 19 (10:00:00, 20 s); in `load` (t.py:3)"
    s["attempts"][0].update(state="HUNG", ended=text)
    s["hang"] = {"kind": "hang", "ranks": [1], "decided": True, "node": 1, "text": text, "dir": str(job / "hang-1")}
    (job / "summary.json").write_text(json.dumps(s))
    report.draw(job)
    md = (job / "report.md").read_text()
    assert md.startswith("# train-h: HUNG") and f"- attempt 0 (HUNG): {text}" in md
    assert f"- failure: {text}" in md and f"- stacks and last lines of every rank: {job / 'hang-1'}" in md


@pytest.mark.parametrize("own,said,named", [
    ({0: 0.0021, 1: 0.0523}, "- stragglers: node1 (rank 1): 52.3 ms a step of its own work against 2.1 ms for the "
                             "other ranks (24.9x)", [1]),
    ({0: 0.0021, 1: 0.0025}, "- stragglers: none (own work per step: rank 0 2.1 ms, rank 1 2.5 ms)", []),
    # 1.5x but only 3 ms more: noise on a short step, not a straggler
    ({0: 0.002, 1: 0.005}, "- stragglers: none (own work per step: rank 0 2.0 ms, rank 1 5.0 ms)", []),
    (None, "- stragglers: unknown (the script reports no own time per step", []),
])
def test_a_straggler_is_named_with_its_own_work_per_step_against_the_others(tmp_path, own, said, named):
    job = tmp_path / "train-s"
    write_job(job, own=own)
    done = report.draw(job)
    md = (job / "report.md").read_text()
    assert said in md, md
    assert sorted(done["stragglers"]) == named


def test_own_times_no_float_holds_or_negative_are_left_out_of_the_straggler_figures(tmp_path):
    from fleetbox.run import metrics
    assert not metrics.well_formed({"rank": 0, "step": 1, "time": 1.0, "own_seconds": 10**400})
    recs = [{"rank": 0, "step": s, "own_seconds": 0.002} for s in range(5)] + \
        [{"rank": 1, "step": s, "own_seconds": v} for s, v in enumerate([float("nan"), -5.0, 0.003, 0.003, 0.003])]
    assert report.straggling(recs) == {"own": {0: 0.002, 1: 0.003}, "stragglers": {}}


def test_the_throughput_plot_runs_from_the_jobs_first_start_with_a_line_per_attempt(tmp_path):
    """After a restart, time ran from the last attempt's start: the earlier attempt sat at negative seconds, and
    one line crossed the gap between the failure and the restart."""
    from fleetbox.run import metrics
    job = tmp_path / "train-r"
    write_job(job, attempts=((0, 20), (15, 60)))   # attempt 0's lines at 1002 s on, attempt 1's at 1013.5 s on
    info = json.loads((job / "job.json").read_text()) | {"started": 1012.0, "first_started": 1000.0}
    (job / "job.json").write_text(json.dumps(info))
    t0 = report.first_start(job, info)
    lines = report.rate_lines(metrics.read(job), t0)
    assert t0 == 1000.0 and sorted(lines) == [0, 1] and all(len(v) == 2 for v in lines.values())
    assert [round(seg[0][0], 1) for seg in lines[0]] == [2.0, 13.5]   # from the first start, each attempt apart
    drawn = report.draw(job)
    assert drawn["node_legend"] == ["node0", "node1"]   # one entry a node, not one an attempt


class Counted(dict):
    """A record that counts every read of one of its fields."""
    reads = 0

    def __getitem__(self, key):
        Counted.reads += 1
        return super().__getitem__(key)


def reads_per_record(tmp_path, monkeypatch, ranks: int, steps: int = 40) -> float:
    from fleetbox.run import metrics
    job = tmp_path / f"train-{ranks}"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"backend": "slurm", "nodes": ranks // 4, "procs_per_node": 4}))
    recs = [Counted(rank=k, step=s, time=1000.0 + s + 0.001 * k, loss=1.0 / (s + 1) + (0.5 if k == 3 else 0.0),
                    samples_per_s=100.0, samples=8.0, seconds=0.05, comm_seconds=0.01, own_seconds=0.04,
                    node=k // 4, attempt=0) for s in range(steps) for k in range(ranks)]
    monkeypatch.setattr(metrics, "read", lambda job_dir: recs)
    Counted.reads = 0
    drawn = report.draw(job)
    assert drawn["outliers"] == [3], drawn["outliers"]   # the band's own check: rank 3's loss is off the others'
    return Counted.reads / len(recs)


def test_the_report_reads_each_record_a_fixed_number_of_times_at_any_number_of_ranks(tmp_path, monkeypatch):
    """Every figure from one grouping: the reads per record stay the same from 40 ranks to 160 (both beyond 8 ranks
    and 8 nodes: the same figures), where they grew with the ranks (256 ranks took 43 s)."""
    few, many = (reads_per_record(tmp_path, monkeypatch, n) for n in (40, 160))
    assert many <= 1.1 * few, (few, many)


def test_a_large_jobs_report_reads_as_summaries_with_the_ranks_outside_them_named(tmp_path):
    """Beyond 8 ranks: final loss as median and range with the odd ranks named, steps as one figure, every line
    short whatever the size."""
    job = tmp_path / "train-big"
    write_job(job, ranks=tuple(range(12)))
    drawn = report.draw(job)
    text = (job / "report.md").read_text()
    assert "- steps: 60 (last 59) for all 12 ranks\n" in text
    assert "- final loss: median 0.0833 over 12 ranks (0.0833 to 0.0833, step 59)\n" in text
    assert "- throughput: " in text and "; per node: median " in text and "over 12 nodes" in text
    assert drawn["legend"] == ["range of 12 ranks", "median of 12 ranks"] and not_blank(drawn["png"])
    assert max(map(len, text.splitlines())) <= 300
