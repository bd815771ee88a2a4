"""Paddle's other ways to start a job, run for real on the Docker Engine: a script that starts its own ranks
(paddle.distributed.spawn), told apart by fleetbox from its source and run without Paddle's launcher, gets what a
launched script gets: each rank's log, metrics, checkpoints, hang detection, a failed rank named, restarts."""
import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import invoke
from tests.integration.test_hangs import HANG_S
from tests.integration.test_train import job_containers, summary_of
from tests.unit.test_cli import one_line_error

pytestmark = pytest.mark.docker   # its jobs on the default engine, their containers counted (tests/conftest.py)

SPAWN = ["--script", "train/spawn_smoke.py"]


def job_dir_of(proc) -> Path:
    return Path(proc.stdout.split("logs in ")[1].split()[0].rstrip(","))


def test_a_script_that_spawns_its_ranks_runs_them_on_one_node_and_restarted_ends_bit_for_bit(cpu_image):
    ref = invoke("train", *SPAWN, "--args", "--steps 40 --checkpoint-every 5")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr
    s, d = summary_of(ref), job_dir_of(ref)
    assert [n["node"] for n in s["nodes"]] == ["node0"] and "1 node(s) x 2 process(es)" in ref.stdout
    smoke = s["smoke"]
    assert smoke["world"] == 2 and smoke["params_identical"] and smoke["whole_run"], smoke
    for r in (0, 1):   # each spawned rank's own log and progress, as a launched rank's
        log = (d / "node0" / f"workerlog.{r}").read_text()
        assert f'FLEETBOX-METRIC {{"rank": {r}, ' in log and f'"rank": {1 - r}, ' not in log
        assert json.loads((d / "node0" / f"progress-rank{r}.json").read_text())["step"] == 40
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["rank"], m["step"]) for m in recs) == [(r, t) for r in (0, 1) for t in range(40)]

    again = invoke("train", *SPAWN, "--max-restarts", "1", "--args",
                   "--steps 40 --checkpoint-every 5 --fail-rank 1 --fail-step 22 --fail-attempt 0")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr
    s2 = summary_of(again)
    assert [(a["attempt"], a["ok"]) for a in s2["attempts"]] == [(0, False), (1, True)]
    assert s2["attempts"][0]["ended"].startswith("node0 (rank 0) ended: its spawned rank "), s2["attempts"]
    assert s2["smoke"]["resumed_from"] == 20 and s2["smoke"]["whole_run"], s2["smoke"]
    assert s2["smoke"]["params_sha256"] == smoke["params_sha256"]   # bit for bit
    assert job_containers(s["job_id"], s2["job_id"]) == []


def test_a_spawned_rank_that_fails_stops_the_script_and_is_named(cpu_image):
    proc = invoke("train", *SPAWN, "--args", "--fail-rank 1 --fail-step -1")
    one_line_error(proc, "train failed: node0 (rank 0) ended: its spawned rank 1 exited with exit code 3 "
                         "(log: workerlog.1)", job_output=True)
    assert "failing on purpose before joining" in (job_dir_of(proc) / "node0" / "workerlog.1").read_text()
    assert job_containers(job_dir_of(proc).name) == []


def test_a_stuck_spawned_rank_is_named_from_its_stacks(cpu_image):
    proc = invoke("train", *SPAWN, "--hang-timeout", str(HANG_S), "--args", "--steps 30 --hang-rank 1 --hang-step 10")
    one_line_error(proc, "train failed: node0 (rank 1) hung: no progress since step 10",
                   "in `load_batch_that_never_returns` (smoke.py:", "rank 0 waiting in `fused_allreduce_gradients`",
                   job_output=True)
    d = job_dir_of(proc)
    assert "in load_batch_that_never_returns" in (d / "hang-0" / "rank1.txt").read_text()
    assert job_containers(d.name) == []


def test_a_spawning_script_asked_for_two_nodes_is_one_line_and_starts_nothing(cpu_image):
    job_id = f"spawn-two-nodes-{os.getpid()}"
    proc = invoke("train", *SPAWN, "--nodes", "2", "--job-id", job_id)
    one_line_error(proc, "train/spawn_smoke.py:9 starts its own ranks (paddle.distributed.spawn), on the machine it "
                         "runs on: run it on one node (--nodes 1, one host)")
    assert job_containers(job_id) == []


# Static-graph programs. Paddle's own static collective (fleet's minimize) cannot make its communicator on CPU
# ("comm_id must be generated in paddlepaddle-xpu or paddlepaddle-gpu"), so two static ranks here average their
# parameters after every step themselves (checkpoint_static.py --average: plain SGD, so data parallelism); the
# checkpoints, the ranks' agreement and the restart are fleetbox's, as they would be under fleet on GPUs (the Slurm
# spare test in test_hpc.py kills one and restarts it on a spare).
STATIC = ["--script", "tests/probes/checkpoint_static.py"]
STATIC_ARGS = "--steps 12 --every 4 --optimizer sgd --average --batchnorm"   # each rank its own statistics


def test_the_static_example_run_again_with_its_id_resumes_mid_epoch_and_ends_as_an_uninterrupted_run(
        cpu_image, seeded_flowers):
    """train/resnet_static_flowers.py, Paddle's documented static style (fleet's minimize, an Executor): one epoch
    of 6 steps, saved every 4, then run again with the same job id for two: it goes on from step 4, and ends
    where two epochs in one run end."""
    f = "/root/.cache/paddle/dataset/flowers"
    args = (f"--data-file {f}/102flowers.tgz --label-file {f}/imagelabels.mat --setid-file {f}/setid.mat "
            f"--image-size 32 --batch-size 1 --checkpoint-every 4")

    def train(more, *extra):
        proc = invoke("train", "--nodes", "1", "--script", "train/resnet_static_flowers.py", "--args",
                      f"{args} {more}", "--data-dir", str(seeded_flowers["dest"]), *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        line = next(ln for ln in proc.stdout.splitlines() if "FLEETBOX-TRAIN " in ln)
        return json.loads(line.split("FLEETBOX-TRAIN ", 1)[1])

    whole = train("--epochs 2")
    assert whole["steps"] == 12 and whole["resumed_from"] == 0 and whole["world"] == 1
    job = f"static-{os.getpid()}-{time.monotonic_ns()}"   # its own: a folder of an earlier run would be resumed
    first = train("--epochs 1", "--job-id", job)
    assert first["steps"] == 6
    second = train("--epochs 2", "--job-id", job)
    assert second["resumed_from"] == 4 and second["steps"] == 12   # its history, every step once
    assert second["params_sha256"] == whole["params_sha256"]   # bit for bit
