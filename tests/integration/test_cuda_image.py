"""The GPU image built here (cu118-pypi: PyPI's paddlepaddle-gpu 2.6.2 and NVIDIA's cu11 wheels), on a machine
without a GPU: its build and layers, `invoke verify` saying what it could and could not check, a library missing
from it named in one line, and a checkpoint resumed bit for bit. Training, hang detection and fit run on it in
test_hangs.py and test_fit.py (image_args), on Slurm in test_hpc.py."""
import json
import subprocess

import pytest

from fleetbox import incontainer
from fleetbox.commands import verify
from fleetbox.image import images, layers, locks, matrix, wheelhouse
from tests.conftest import invoke
from tests.integration.conftest import GPU_VARIANT, ON_CPU, layer_digests
from tests.integration.test_checkpoints import names, steps

pytestmark = pytest.mark.images   # builds, verifies, compares the default engine's images (tests/conftest.py)

VARIANT = matrix.load().get(GPU_VARIANT)
SITE = "/opt/venv/lib/python3.11/site-packages"


def test_the_libraries_are_the_layer_above_the_base_and_a_second_build_is_a_no_op(cuda_image):
    image = cuda_image["image"]
    assert "fleetbox/paddle:cu118-pypi" in image.tags and "fleetbox/paddle:2.6.2-cu118-pypi-py311" in image.tags
    base = layer_digests(VARIANT.base_ref)
    have = layer_digests(image.id)
    assert have[:len(base)] == base and len(have) == len(base) + 5   # libraries, paddle, visualdl, scipy, opencv
    tags = [t for t in subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}",
                                       layers.LAYERS_REPO], capture_output=True, text=True).stdout.split()
            if t.startswith(f"{layers.LAYERS_REPO}:libraries-")]
    assert any(layer_digests(t) == have[:len(base) + 1] for t in tags), tags
    proc = invoke("build", "--variant", GPU_VARIANT)
    assert proc.returncode == 0 and "is up to date" in proc.stdout, proc.stdout[-2000:] + proc.stderr


def test_verify_without_a_gpu_says_what_it_checked_and_what_only_a_gpu_can(cuda_image, tmp_path):
    out = tmp_path / "report.json"
    proc = invoke("verify", "--variant", GPU_VARIANT, "--json-out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    report = json.loads(out.read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] and report["no_gpu"].startswith("the engine has no GPU to give (could not select")
    assert checks["import paddle"]["detail"].startswith("paddle 2.6.2")
    assert checks["compiled device"] == {"check": "compiled device", "ok": True,
                                         "detail": "cuda, CUDA 11.8, cuDNN 8.6.0"}
    assert checks["device count"]["no_gpu"] and checks["device count"]["detail"].startswith("no GPU visible here")
    libs = checks["GPU libraries"]
    assert libs["no_gpu"] and libs["detail"].endswith("opened by name; libcuda.so is the host driver's: no GPU "
                                                      "visible here"), libs
    found = int(libs["detail"].split(" libraries' dependencies found")[0])
    assert found >= 40   # Paddle's own (libpaddle.so, paddle/libs) and every NVIDIA library file
    assert checks["paddle.utils.run_check()"]["detail"] == "no GPU visible here: PaddlePaddle works well on 1 CPU."
    assert checks["import scipy"]["detail"] == "scipy 1.17.1, numpy 1.26.4"
    assert checks["installed == lock"]["detail"] == f"{len(locks.read(VARIANT)[1])} packages match"
    assert "NO GPU  GPU libraries" in proc.stdout and "PASS    compiled device" in proc.stdout
    # the GPUs its kernels run on, as measured from its wheel: in the image's label, the report and what verify says
    assert report["gpu_architectures"] == "6.1,7.0,7.5,8.0,8.6 measured"
    assert "GPUs: SASS 6.1, 7.0, 7.5, 8.0, 8.6: runs on 6.1 (P40/GTX 10), " in proc.stdout
    assert "PASSED without a GPU (not run on one: device count, GPU libraries, paddle.utils.run_check())" in proc.stdout
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "label=io.fleetbox.role=verify"], capture_output=True,
                          text=True).stdout.split()
    assert left == []   # the container the engine could not start with a GPU is gone too


def _probe(image_id: str, before: str, source: str = "") -> dict:
    """The verify probe (or `source`) in a container of the image that first runs `before` (ours)."""
    proc = subprocess.run(["docker", "run", "--rm", "--network", "none", "-e", "FLEETBOX_DEVICE=cuda",
                           "-e", "FLEETBOX_NO_GPU=none here", image_id, "sh", "-c", f'{before}; exec python -c "$0"',
                           source or incontainer.source("fleetbox_verify_image")], capture_output=True, text=True,
                          timeout=300)
    return {c["check"]: c for c in verify.parse_report(proc.stdout)["checks"]}


def test_a_library_missing_from_the_image_is_named_in_one_line(cuda_image):
    image = cuda_image["image"].id
    gone = _probe(image, f"rm {SITE}/nvidia/cudnn/lib/libcudnn.so && ldconfig")["GPU libraries"]
    assert not gone["ok"] and gone["detail"].startswith(
        "RuntimeError: libcudnn.so, which Paddle opens by name, does not load: libcudnn.so: cannot open"), gone
    needed = _probe(image, f"rm {SITE}/nvidia/cublas/lib/libcublasLt.so.11 && ldconfig")["GPU libraries"]
    assert not needed["ok"] and needed["detail"].startswith(
        "RuntimeError: libcublasLt.so.11 (needed by libcublas.so.11, libcudnn_adv_infer.so.8 and "), needed


def test_a_machine_whose_driver_has_gpus_the_engine_did_not_give_fails_the_device_count(cuda_image):
    """The host's driver lists its GPUs under /proc/driver/nvidia/gpus, which a container sees; a runtime cannot
    mount there, so the probe reads a folder of the container's in its stead."""
    source = incontainer.source("fleetbox_verify_image").replace('"/proc/driver/nvidia/gpus"', '"/tmp/gpus"')
    count = _probe(cuda_image["image"].id, "mkdir -p /tmp/gpus/0000:3b:00.0", source)["device count"]
    assert not count["ok"] and count["detail"] == (
        "RuntimeError: this machine has NVIDIA GPUs (/tmp/gpus), but its engine gave the container none: none here; "
        "set the NVIDIA container toolkit up for this engine"), count


def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does_on_paddle_2_6(cuda_image, tmp_path):
    """Paddle 2.6's CPU generator state does not pickle whole: fleetbox_checkpoint reseeds it after each step,
    so a run resumed from a save (every 2 steps here) draws what an uninterrupted one does."""
    image = cuda_image["image"].id
    proc, whole = steps(image, tmp_path / "whole", "--steps", "10")
    assert whole and whole["first"] == 0 and whole["draws"] == 10, proc.stdout + proc.stderr
    proc, part = steps(image, tmp_path / "resumed", "--steps", "6")
    assert part["first"] == 0, proc.stdout + proc.stderr
    proc, rest = steps(image, tmp_path / "resumed", "--steps", "10")
    assert rest["first"] == 6 and rest["sha256"] == whole["sha256"], proc.stdout
    assert names(tmp_path / "resumed") == ["STATE", "step-00000006", "step-00000008", "step-00000010"]


def test_on_paddle_2_6_a_stop_between_saves_and_a_stream_untouched_until_late_resume_bit_for_bit(cuda_image,
                                                                                                   tmp_path):
    """A stop (Slurm's time-limit warning: a STOP file) saves off the schedule, at step 1; a script that draws
    from Paddle's generator only from step 9 on resumes, from step 4, with nothing drawn since its seed."""
    image = cuda_image["image"].id
    proc, whole = steps(image, tmp_path / "whole", "--steps", "10")
    assert whole and whole["draws"] == 10, proc.stdout + proc.stderr
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "STOP").touch()
    proc, r = steps(image, stopped, "--steps", "10")
    assert r is None and json.loads((stopped / "STATE").read_text())["step"] == 1, proc.stdout + proc.stderr
    (stopped / "STOP").unlink()
    proc, rest = steps(image, stopped, "--steps", "10")
    assert rest["first"] == 1 and rest["sha256"] == whole["sha256"], proc.stdout
    late = ("--steps", "12", "--every", "4", "--draw-from", "9")
    proc, whole = steps(image, tmp_path / "late-whole", *late)
    assert whole and whole["draws"] == 3, proc.stdout + proc.stderr
    proc, part = steps(image, tmp_path / "late", "--steps", "6", "--every", "4", "--draw-from", "9")
    proc, rest = steps(image, tmp_path / "late", *late)
    assert rest["first"] == 4 and rest["sha256"] == whole["sha256"], proc.stdout


def test_the_libraries_layer_made_again_from_the_base_is_the_same_bytes(cuda_image):
    """Its loader cache and the auxiliary cache it puts back are the same bytes each time: made again from the
    base, as by-hand.sh makes it, it has the digest of the image's own."""
    lock_text, entries = locks.read(VARIANT)
    base = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", VARIANT.base_ref], capture_output=True,
                          text=True, check=True).stdout.strip()
    first = layers.plan(VARIANT, lock_text, entries, base, VARIANT.base.python, images.pip_wheel(entries))[0]
    name = "fleetbox-test-libraries-again"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    try:
        subprocess.run(["docker", "run", "--name", name, "--network", "none", "--mount",
                        f"{layers.MOUNT},src={wheelhouse.default_dir(VARIANT)}", base, "sh", "-c", first.script, "sh",
                        first.requirements], check=True, capture_output=True, timeout=600)
        again = subprocess.run(["docker", "commit", name], capture_output=True, text=True, check=True).stdout.strip()
        try:
            n = len(layer_digests(base)) + 1
            assert layer_digests(again)[:n] == layer_digests(cuda_image["image"].id)[:n]
        finally:
            subprocess.run(["docker", "rmi", again], capture_output=True)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


@pytest.mark.docker   # a 2-node job on this machine's ports
def test_doctor_checks_two_nodes_of_the_gpu_image_and_its_all_reduce_sweep_runs_on_gloo(cuda_image):
    """The collective benchmark chooses its backend from the devices a rank sees, not from how Paddle was built."""
    proc = invoke("doctor", *ON_CPU, "--nodes", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    path = (proc.stdout + proc.stderr).split("report: ")[-1].split()[0].rstrip(")")
    rep = json.loads(open(path).read())
    assert rep["ok"] and all(r["ok"] for r in rep["rows"])
    assert (rep["sweep"]["backend"], rep["sweep"]["world"]) == ("gloo", 2)
    assert rep["sweep"]["rows"] and all(r["wrong"] == 0 for r in rep["sweep"]["rows"])
