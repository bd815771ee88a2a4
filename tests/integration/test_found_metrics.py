"""Metrics found in the training itself (incontainer/fleetbox_found.py), for scripts with no line of fleetbox, in
real Paddle: each of Paddle's styles in both images, and a plain CNN on MNIST as a 2-node job whose report and
board (in a real browser) show both ranks' loss and learning rate."""
import json
import math
import os
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.incontainer.fleetbox_found import FILE, PREFIX
from fleetbox.run import report
from tests.conftest import ROOT, invoke
from tests.integration.browser import Browser
from tests.integration.conftest import GPU_VARIANT
from tests.integration.test_board import free_port, start_board, stop_board, stop_quietly
from tests.integration.test_train import summary_of
from tests.integration.test_train_scripts import CACHE

pytestmark = pytest.mark.docker

PROBES = ROOT / "tests" / "probes"
CASES = ("static", "fit", "odd", "meter")


def found(path: Path) -> list[dict]:
    return [json.loads(ln[len(PREFIX):]) for ln in path.read_text().splitlines() if ln.startswith(PREFIX)]


@pytest.mark.parametrize("variant", ["cpu", GPU_VARIANT])
def test_each_paddle_style_gets_its_loss_and_learning_rate_found_exactly_and_odd_steps_none(variant, request,
                                                                                          tmp_path):
    """probes/found_cases.py, one process per style, as a rank of a job sees it (sitecustomize on PYTHONPATH, its
    progress folder set): the metrics found are the values the training itself saw, bit for bit."""
    image = request.getfixturevalue("cpu_image" if variant == "cpu" else "cuda_image")["image"]
    runs = [f"mkdir /out/{c} && FLEETBOX_PROGRESS_DIR=/out/{c} python /probe/found_cases.py {c} "
            f">/out/{c}/seen 2>/out/{c}/err" for c in CASES]
    runs.append("mkdir /out/off && FLEETBOX_FIND_METRICS=0 FLEETBOX_PROGRESS_DIR=/out/off "
                "python /probe/found_cases.py plain >/out/off/seen 2>&1")
    proc = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{tmp_path}:/out",
                           "-v", f"{settings.HELPERS}:{settings.HELPERS_DIR}:ro", "-v", f"{PROBES}:/probe:ro",
                           "-e", f"PYTHONPATH={settings.HELPERS_DIR}", "-e", "PADDLE_TRAINER_ID=0", image.id,
                           "bash", "-ec", " && ".join(runs)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr + "".join(
        p.read_text()[-2000:] for p in tmp_path.glob("*/err"))
    seen = {c: json.loads((tmp_path / c / "seen").read_text().splitlines()[-1]) for c in (*CASES, "off")}
    got = {c: found(tmp_path / c / FILE.format(rank=0)) for c in ("static", "fit", "odd")}
    for c in ("static", "fit"):   # every step, its exact loss and learning rate; the static test clone's runs not
        assert [(r["step"], r["loss"], r["lr"]) for r in got[c]] == [
            (i + 1, s["loss"], s["lr"]) for i, s in enumerate(seen[c])], (c, got[c], seen[c])
    assert [r["lr"] for r in got["static"]] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]   # the scheduler's, at each step
    odd = got["odd"]
    assert len(odd) == len(seen["odd"]) == 8
    for r, s in zip(odd, seen["odd"], strict=True):   # the loss only where backward() was called once on a scalar
        assert r.get("loss") == (s["loss"] if s["kind"] == "plain" else None), (r, s)
        assert r["lr"] == s["lr"] and r.get("samples", s["batch"]) == s["batch"]
    assert all(r["samples"] == 8 and r["seconds"] > 0 for r in odd[1:])   # the loader's batch, over the step's time
    said = [ln for ln in (tmp_path / "odd" / "err").read_text().splitlines() if ln.startswith("fleetbox:")]
    assert said == ["fleetbox: no loss is found for steps where backward() is called more than once (several losses, "
                    "gradient accumulation); log your own with fleetbox_metrics.Meter",   # once, for two such steps
                    "fleetbox: no loss is found for steps where backward() is called on a tensor of several values "
                    "(shape [8, 1]), not on one loss; log your own with fleetbox_metrics.Meter"], said
    for c in ("meter", "off"):   # a script that logs its own metrics, and finding turned off: nothing found
        assert seen[c] and not (tmp_path / c / FILE.format(rank=0)).exists(), c
        assert (tmp_path / c / "progress-rank0.json").exists()   # while its steps are still seen


def series(got) -> dict[tuple[str, str], list]:
    """The last series the page received per run and tag: {(run, tag): [[ms, step, value], ...]}."""
    out = {}
    for g in got:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(g["url"]).query)
        assert g["status"] == 200, g
        out[(q["run"][0], q["tag"][0])] = json.loads(g["body"])["data"] or []
    return out


@pytest.mark.browser
def test_a_plain_cnn_on_mnist_on_two_nodes_shows_both_ranks_loss_and_learning_rate_in_report_and_board(
        cpu_image, seeded_mnist, tmp_path):
    """probes/plain_mnist.py, as Paddle's docs write it, with no line of fleetbox."""
    job_id = f"found-{os.getpid()}-{time.monotonic_ns()}"
    mnist = f"{CACHE}/mnist"
    proc = invoke("train", "--nodes", "2", "--job-id", job_id, "--script", str(PROBES / "plain_mnist.py"),
                  "--data-dir", str(seeded_mnist["dest"]), "--args",
                  f"{mnist}/train-images-idx3-ubyte.gz {mnist}/train-labels-idx1-ubyte.gz")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    d = ROOT / summary_of(proc)["dir"]
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    steps = 5 * 600 // 2 // 50   # epochs x samples per rank / batch
    for rank in (0, 1):
        mine = sorted((r for r in recs if r["rank"] == rank), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(1, steps + 1)) and all(r["node"] == rank for r in mine)
        loss = [r["loss"] for r in mine]
        assert sum(loss[-3:]) < sum(loss[:3]) / 5, loss   # falling: the CNN learns the band each label puts in
        for r in mine:   # ExponentialDecay(0.002, 0.97), stepped after every optimizer step: its rate at the step
            assert math.isclose(r["lr"], 0.002 * 0.97 ** (r["step"] - 1), rel_tol=1e-12), r
        assert all(r["samples"] == 50 for r in mine[1:])
    drawn = report.draw(d)
    assert drawn["legend"] == ["rank 0", "rank 1"] and drawn["throughput"]["total"] > 0, drawn
    assert drawn["lr"][0] == drawn["lr"][1] == tuple((r["step"], r["lr"]) for r in sorted(
        (r for r in recs if r["rank"] == 0), key=lambda r: r["step"]))

    port, board = free_port(), None
    try:
        board = start_board(job_id, port)
        want = r"/app/api/scalar/list\?.*tag=train%2F(loss|lr)(&|$)"
        with Browser() as browser:
            got = series(browser.load(f"http://127.0.0.1:{port}/app/scalar", want, settle=2.0, timeout=60,
                                      at_least=4))
        for rank in (0, 1):
            mine = {r["step"]: r for r in recs if r["rank"] == rank}
            for tag in ("loss", "lr"):   # every step's value, as float32 (VisualDL's record)
                points = got[(f"{job_id}/attempt0/rank{rank}", f"train/{tag}")]
                assert sorted(s for _, s, _ in points) == sorted(mine), (rank, tag, points[:3])
                assert all(math.isclose(v, mine[s][tag], rel_tol=1e-6) for _, s, v in points), (rank, tag)
        stop_board(board)
    finally:
        stop_quietly(board)
        invoke("clean", "--job", job_id, "--force")
