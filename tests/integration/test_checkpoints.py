"""fleetbox_checkpoint in the real image with real Paddle: a resumed run equals an uninterrupted one bit for bit
(parameters, optimizer, RNG), a damaged newest checkpoint falls back to the one before and says so, a
half-written one is never loaded, only the newest K are kept, and a folder it cannot write is one line."""
import json
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.docker   # its jobs on the default engine, their containers counted (tests/conftest.py)


def steps(image, ckdir, *args, env=(), mounts=(), probe="checkpoint_steps.py", init=False):
    argv = ["docker", "run", "--rm", *(["--init"] if init else []), "--network", "none",
            "-v", f"{ROOT / 'fleetbox/incontainer'}:/fleetbox/helpers:ro",
            "-v", f"{ROOT / 'tests/probes'}:/probes:ro", "-e", "PYTHONPATH=/fleetbox/helpers",
            "-e", "FLEETBOX_CHECKPOINT_DIR=/ck"]
    if ckdir is not None:
        argv += ["-v", f"{ckdir}:/ck"]
    for e in env:
        argv += ["-e", e]
    for m in mounts:
        argv += ["-v", m]
    proc = subprocess.run([*argv, image, "python", f"/probes/{probe}", *args], capture_output=True,
                          text=True, timeout=120)
    result = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return proc, (result[0] if result else None)


def names(d):
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def image(cpu_image):
    return cpu_image["image"].id


@pytest.fixture(scope="module")
def reference(image, tmp_path_factory):
    proc, r = steps(image, tmp_path_factory.mktemp("ref"), "--steps", "10")
    assert r and r["first"] == 0 and r["draws"] == 10, proc.stdout + proc.stderr
    return r["sha256"]


def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does(image, reference, tmp_path):
    proc, r = steps(image, tmp_path, "--steps", "6")
    assert r["first"] == 0
    assert names(tmp_path) == ["STATE", "step-00000002", "step-00000004", "step-00000006"]
    proc, r = steps(image, tmp_path, "--steps", "10")
    assert r["first"] == 6 and r["draws"] == 10 and r["sha256"] == reference, proc.stdout
    assert "fleetbox-checkpoint: resumed from step 6" in proc.stdout
    # only the newest K (3) are kept; the script said it is done
    assert names(tmp_path) == ["STATE", "step-00000006", "step-00000008", "step-00000010"]
    assert json.loads((tmp_path / "STATE").read_text())["state"] == "done"
    assert json.loads((tmp_path / "STATE").read_text())["step"] == 10


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(image, reference, tmp_path):
    steps(image, tmp_path, "--steps", "6")
    model = tmp_path / "step-00000006" / "model.pdparams"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF   # one flipped byte: the size is right, the content is not
    model.write_bytes(bytes(data))
    proc, r = steps(image, tmp_path, "--steps", "10")
    assert r["first"] == 4 and r["sha256"] == reference, proc.stdout
    assert "step 6 (/ck/step-00000006) is unusable: model.pdparams is damaged" in proc.stdout
    assert "resumed from step 4" in proc.stdout


def test_a_half_written_checkpoint_is_never_loaded(image, reference, tmp_path):
    steps(image, tmp_path, "--steps", "4")
    # a save cut short: its folder never got its final name, or (written by hand) has no COMPLETE
    (tmp_path / ".step-00000006.partial").mkdir()
    (tmp_path / ".step-00000006.partial" / "model.pdparams").write_bytes(b"half")
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / "model.pdparams").write_bytes(b"junk")
    proc, r = steps(image, tmp_path, "--steps", "10")
    assert r["first"] == 4 and r["sha256"] == reference, proc.stdout
    assert not (tmp_path / ".step-00000006.partial").exists()   # removed before the first save


def test_resume_from_a_given_checkpoint_or_never(image, reference, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    steps(image, src, "--steps", "6")
    new = tmp_path / "new"
    new.mkdir()
    proc, r = steps(image, new, "--steps", "10", env=["FLEETBOX_RESUME=/from"],
                    mounts=[f"{src / 'step-00000004'}:/from:ro"])
    assert r["first"] == 4 and r["sha256"] == reference, proc.stdout + proc.stderr
    proc, r = steps(image, src, "--steps", "10", env=["FLEETBOX_RESUME=never"])
    assert r["first"] == 0 and r["sha256"] == reference


def test_a_folder_it_cannot_write_is_one_line(image, tmp_path):
    proc, r = steps(image, None, "--steps", "2", mounts=[f"{tmp_path}:/ck:ro"])
    assert proc.returncode == 2 and r is None and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "fleetbox-checkpoint" in ln]
    assert errors == ["fleetbox-checkpoint: error: cannot write checkpoints to /ck: Read-only file system"]


def test_told_to_stop_at_its_last_step_a_script_finishes_instead_of_asking_for_another_allocation(image, tmp_path):
    """The stop (Slurm's time-limit warning) lands as the last step is taken: with `total` the work is saved and
    done (STATE "done"); without it the script stops and a next allocation would start only to finish."""
    stopped = tmp_path / "without"
    stopped.mkdir()
    (stopped / "STOP").touch()
    proc, r = steps(image, stopped, "--steps", "1")
    state = json.loads((stopped / "STATE").read_text())
    assert r is None and (state["state"], state["step"]) == ("continue", 1), proc.stdout
    done = tmp_path / "with"
    done.mkdir()
    (done / "STOP").touch()
    proc, r = steps(image, done, "--steps", "1", "--total", "1")
    assert r and r["draws"] == 1, proc.stdout + proc.stderr
    assert json.loads((done / "STATE").read_text())["state"] == "done"
    assert "told to stop at the last step (1): saved it; finishing" in proc.stdout


@pytest.mark.parametrize("optimizer,more", [("adam", ["--dropout", "0.3"]), ("momentum", [])])
def test_a_static_program_killed_mid_run_resumes_its_accumulators_and_ends_bit_for_bit(image, tmp_path, optimizer,
                                                                                      more):
    """A static-graph program's state is its persistables: the parameters, Adam's moments and beta powers or
    Momentum's velocities, the learning rate its scheduler sets (StepDecay: it changes mid-run), Paddle's
    generator for dropout. Killed (SIGKILL, after step 6, saved at 4) and run again, it ends as one that never
    stopped."""
    args = ["--steps", "10", "--every", "4", "--optimizer", optimizer, *more]
    _, want = steps(image, tmp_path / "ref", *args, probe="checkpoint_static.py")
    assert want and want["first"] == 0 and want["losses"] == 10, want
    ck = tmp_path / "ck"
    killed, none = steps(image, ck, *args, "--kill-at", "6", probe="checkpoint_static.py", init=True)
    assert killed.returncode == 137 and none is None, killed.stdout + killed.stderr   # --init: PID 1 passes it on
    assert names(ck) == ["STATE", "step-00000004"]
    proc, got = steps(image, ck, *args, probe="checkpoint_static.py")
    assert got and got["first"] == 4 and got["sha256"] == want["sha256"], proc.stdout + proc.stderr
