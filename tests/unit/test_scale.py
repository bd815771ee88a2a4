"""A scaling study's pure parts: the runs it makes from the options, and the table's derived figures
(speed-up and efficiency against the image's smallest run, each image against the first), its text and plot."""
import json

import pytest
from PIL import Image

from fleetbox.commands import scale
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from tests.unit.test_report import write_job


def test_cells_are_every_image_at_every_size_smallest_first():
    got = scale.cells("4,1,2", "2,1", "a:1, b:2")
    assert [(c.image, c.nodes, c.procs, c.ranks) for c in got] == [
        (img, n, p, n * p) for img in ("a:1", "b:2") for n in (1, 2, 4) for p in (1, 2)]
    assert [(c.image, c.nodes, c.procs) for c in scale.cells("1,2", None, None)] == [("", 1, 1), ("", 2, 1)]


@pytest.mark.parametrize("nodes,procs,images,said", [
    ("", None, None, "--nodes takes a comma-separated list of sizes"),
    ("1,x", None, None, "--nodes takes a whole number (got 'x')"),
    ("0,1", None, None, "--nodes must be at least 1 (got 0)"),
    ("1,1", None, None, "--nodes 1,1: each size once"),
    ("1", "1,0", None, "--procs-per-node must be at least 1 (got 0)"),
    ("1", None, "a,a", "--image a,a: each image once"),
])
def test_bad_sizes_are_one_line(nodes, procs, images, said):
    with pytest.raises(UserError) as e:
        scale.cells(nodes, procs, images)
    assert str(e.value).startswith(said)


def row(image, nodes, procs, rate, step=0.01, comm=0.2, state="PASSED"):
    if state != "PASSED":   # as scale.run leaves a run that did not pass: not measured
        step = comm = None
    return {"image": image, "paddle": "3.3.1", "nodes": nodes, "procs": procs, "ranks": nodes * procs,
            "job": f"j-{image}-{nodes}-{procs}", "state": state, "samples_per_s": rate, "step_seconds": step,
            "comm_share": comm, "steps": 60, "ranks_reporting": nodes * procs, "failure": ""}


def test_speedup_and_efficiency_are_against_the_images_smallest_run_and_images_against_the_first():
    rows = scale.table([row("a", 1, 1, 100.0, comm=None), row("a", 2, 1, 150.0), row("a", 2, 2, 200.0),
                        row("b", 1, 1, 120.0), row("b", 2, 1, None, state="FAILED"), row("b", 2, 2, 400.0)])
    got = [(r["speedup"], r["efficiency"], r["vs_first_image"]) for r in rows]
    assert got == [(1.0, 1.0, 1.0), (1.5, 0.75, 1.0), (2.0, 0.5, 1.0),
                   (1.0, 1.0, 1.2), (None, None, None), (pytest.approx(400 / 120), pytest.approx(400 / 120 / 4), 2.0)]


def test_a_failed_smallest_run_leaves_the_next_one_as_the_base():
    rows = scale.table([row("a", 1, 1, None, state="FAILED"), row("a", 2, 1, 150.0), row("a", 4, 1, 300.0)])
    assert [(r["speedup"], r["efficiency"]) for r in rows] == [(None, None), (1.0, 1.0), (2.0, 1.0)]


def test_the_table_and_plot_say_what_each_run_measured(tmp_path):
    spec = spec_mod.JobSpec(matrix.load().get("cpu"))
    rows = [row("fleetbox/paddle:cpu", 1, 1, 1000.0, step=0.002, comm=0.0), row("fleetbox/paddle:cpu", 2, 1, 1500.0),
            row("old:3.2", 1, 1, 800.0, step=0.003, comm=0.0), row("old:3.2", 2, 1, None, state="FAILED")]
    rows[-1]["failure"] = "train failed: node1 (rank 1) exited with exit code 3"
    rows[1]["stragglers"] = [1]   # its figures are rank 1's pace
    done = scale.write(tmp_path / "s", "scale-x", spec, "docker", rows)
    md = (tmp_path / "s" / "scale.md").read_text()
    assert "| fleetbox/paddle:cpu | 3.3.1 | 2 | 1 | 2 | 1500.0 | 1.50 | 75% | 10.0 | 20% | rank 1 | 1.00 | " \
           "j-fleetbox/paddle:cpu-2-1: PASSED |" in md, md
    assert "| old:3.2 | 3.3.1 | 1 | 1 | 1 | 800.0 | 1.00 | 100% | 3.0 | 0% | - | 0.80 |" in md
    assert "| old:3.2 | 3.3.1 | 2 | 1 | 2 | - | - | - | - | - | - | - | j-old:3.2-2-1: FAILED |" in md
    assert "## Runs that did not pass\n\n- j-old:3.2-2-1: train failed: node1 (rank 1) exited with exit code 3" in md
    assert done["legend"] == ["fleetbox/paddle:cpu", "old:3.2"]
    assert json.loads((tmp_path / "s" / "scale.json").read_text())["rows"][1]["efficiency"] == 0.75
    im = Image.open(done["png"])
    im.load()
    lo, hi = im.convert("L").getextrema()
    assert im.size[0] > 800 and hi - lo > 100
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["scale.json", "scale.md", "scale.png"]
    # with more than one process count, a line per image and count
    rows = [row("a", 1, 1, 1000.0), row("a", 1, 2, 1500.0), row("a", 2, 2, 2000.0)]
    assert scale.write(tmp_path / "t", "scale-y", spec, "docker", rows)["legend"] == ["a, 1 proc/node",
                                                                                      "a, 2 proc/node"]


def test_a_run_is_measured_from_its_own_metrics_last_attempt_only(tmp_path):
    job = tmp_path / "train-r"
    write_job(job, attempts=((0, 20), (15, 60)))   # a restart: attempt 1 has steps 15..59 on both ranks
    m = scale.measure(job)
    # rank 0: 32 samples per 0.1 s, rank 1: per 0.05 s; all-reduce 0.01 and 0.02 s of it
    assert round(m["samples_per_s"], 6) == 960.0 and m["steps"] == 45 and m["ranks_reporting"] == 2
    assert round(m["step_seconds"], 9) == 0.075 and round(m["comm_share"], 9) == 0.2
    assert m["stragglers"] == []
    assert scale.measure(tmp_path / "nothing") == {"samples_per_s": None, "step_seconds": None,
                                                   "comm_share": None, "steps": 0, "ranks_reporting": 0,
                                                   "stragglers": []}


def test_a_study_refuses_a_job_id_and_too_few_hosts_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    base = spec_mod.JobSpec(matrix.load().get("cpu"), nodes=1)
    with pytest.raises(UserError, match="--job-id names one job"):
        scale.run(spec_mod.JobSpec(base.variant, job_id="x"), scale.cells("1", None, None))
    with pytest.raises(UserError, match="--hosts names 2 hosts; the largest run needs 4"):
        scale.run(spec_mod.JobSpec(base.variant, nodes=2), scale.cells("1,4", None, None), "docker",
                  {"hosts": ("tcp://a:1", "tcp://b:1")})
    with pytest.raises(UserError, match=r"spawn_smoke.py starts its own ranks .* a study needs a script Paddle's"):
        scale.run(spec_mod.from_options(base.variant, nodes="1", script="train/spawn_smoke.py"),
                  scale.cells("1", "1,4", None))
    assert list(tmp_path.iterdir()) == []


def fake_runs(monkeypatch, tmp_path, outcomes):
    """The train command replaced: each run writes the metrics of its ranks (or raises what `outcomes` says)."""
    from fleetbox.commands import train as train_cmd
    from fleetbox.errors import Failed
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    calls = []

    def train(spec, backend, opts, timeout=None, log=print):
        calls.append((spec.nodes, spec.procs_per_node, spec.image, opts.get("hosts", ()), timeout))
        what = outcomes[len(calls) - 1]
        if what == "fail":
            raise Failed("train failed: node1 (rank 1) exited with exit code 3")
        if what == "no image":
            raise UserError(f"image {spec.image} is not on this machine")
        if what == "ctrl-c":
            raise KeyboardInterrupt
        if what == "disk":
            raise OSError(28, "No space left on device")
        ranks = range(spec.nodes * spec.procs_per_node)
        write_job(tmp_path / spec.job_id, ranks=tuple(ranks) if what == "pass" else ())
        return None
    monkeypatch.setattr(train_cmd, "train", train)
    return calls


def test_a_study_runs_each_cell_as_its_own_job_and_goes_on_past_a_failed_one(tmp_path, monkeypatch):
    from fleetbox.errors import Failed
    calls = fake_runs(monkeypatch, tmp_path, ["pass", "fail", "no image", "pass"])
    base = spec_mod.JobSpec(matrix.load().get("cpu"), nodes=2)
    with pytest.raises(Failed, match=r"scale: 2 of 4 run\(s\) did not pass"):
        scale.run(base, scale.cells("1,2", None, "x:1,y:2"), "docker", {"hosts": ("tcp://a:1", "tcp://b:1")},
                  study="scale-t", log=lambda m: None)
    # the first N hosts for N nodes (Docker's own options, sized for each run); each run's spec names its own
    # image (Slurm's runtime takes it from there)
    assert calls == [(1, 1, "x:1", ("tcp://a:1",), None), (2, 1, "x:1", ("tcp://a:1", "tcp://b:1"), None),
                     (1, 1, "y:2", ("tcp://a:1",), None), (2, 1, "y:2", ("tcp://a:1", "tcp://b:1"), None)]
    rows = json.loads((tmp_path / "scale-t" / "scale.json").read_text())["rows"]
    assert [(r["job"], r["state"]) for r in rows] == [("scale-t-i0-n1p1", "PASSED"), ("scale-t-i0-n2p1", "FAILED"),
                                                      ("scale-t-i1-n1p1", "NOT STARTED"), ("scale-t-i1-n2p1", "PASSED")]
    # write_job's ranks: 32 samples per 0.1 s and per 0.05 s
    assert [r["samples_per_s"] for r in rows] == [pytest.approx(320.0), None, None, pytest.approx(960.0)]
    assert rows[3]["speedup"] == pytest.approx(1.0) and rows[3]["vs_first_image"] is None


@pytest.mark.parametrize("what,state,raised", [("ctrl-c", "INTERRUPTED", KeyboardInterrupt),
                                               ("disk", "ERROR", OSError)])
def test_a_study_stopped_by_ctrl_c_or_an_error_keeps_the_table_of_what_ended(tmp_path, monkeypatch, what, state,
                                                                             raised):
    fake_runs(monkeypatch, tmp_path, ["pass", what, "pass"])
    with pytest.raises(raised):
        scale.run(spec_mod.JobSpec(matrix.load().get("cpu")), scale.cells("1,2,4", None, None), study="scale-c",
                  log=lambda m: None)
    rows = json.loads((tmp_path / "scale-c" / "scale.json").read_text())["rows"]
    assert [r["state"] for r in rows] == ["PASSED", state, "not run"]
    assert sorted(p.name for p in (tmp_path / "scale-c").iterdir()) == ["scale.json", "scale.md", "scale.png"]


def test_a_passed_run_without_throughput_is_said_and_is_no_base(tmp_path, monkeypatch):
    fake_runs(monkeypatch, tmp_path, ["no metrics", "pass"])
    scale.run(spec_mod.JobSpec(matrix.load().get("cpu")), scale.cells("1,2", None, None), study="scale-n",
              log=lambda m: None)
    md = (tmp_path / "scale-n" / "scale.md").read_text()
    assert "## Runs that passed without figures\n\n- scale-n-i0-n1p1: it passed but reported no throughput" in md
    rows = json.loads((tmp_path / "scale-n" / "scale.json").read_text())["rows"]
    assert rows[0]["samples_per_s"] is None and rows[1]["speedup"] == 1.0


@pytest.mark.parametrize("kw,said", [
    ({"backend": "slurm", "timeout": 60.0}, "--timeout is for the docker backend"),
    ({"backend": "bogus"}, "unknown backend 'bogus'"),
    ({"port": 65525}, "--port 65525 leaves no room above it"),
])
def test_study_wide_input_errors_are_refused_once_before_any_run(tmp_path, monkeypatch, kw, said):
    calls = fake_runs(monkeypatch, tmp_path, ["pass"] * 4)
    spec = spec_mod.JobSpec(matrix.load().get("cpu"), port=kw.pop("port", 0))
    with pytest.raises(UserError, match=said):
        scale.run(spec, scale.cells("1,4", None, None), log=lambda m: None, **kw)
    assert calls == [] and list(tmp_path.iterdir()) == []
