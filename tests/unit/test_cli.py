"""The front door as a user meets it: `invoke ...` in a subprocess."""
import pytest


def one_line_error(proc, *needles, job_output=False):
    """Non-zero exit, one `fleetbox: error:` line on stderr, no Python traceback of ours. With job_output,
    stdout carries a training job's own streamed output (Paddle prints C++ traces there) and is not checked."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + ("" if job_output else proc.stdout)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fleetbox: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_list_shows_every_task_with_help(run_invoke):
    out = run_invoke("--list").stdout
    for name in ("lock", "wheels", "base", "build", "verify", "up"):
        assert any(line.split()[:1] == [name] and len(line.split()) > 1 for line in out.splitlines()), name
    helptext = run_invoke("--help", "build").stdout
    for opt in ("--variant", "--dry-run", "--wheelhouse", "--force"):
        assert opt in helptext


def test_unknown_variant(run_invoke):
    one_line_error(run_invoke("build", "--variant", "cu999"), "unknown variant 'cu999'", "cpu, cu118, cu126")


@pytest.mark.parametrize("variant", ["cu118", "cu126", "cu129", "dcu"])
def test_gpu_and_dcu_print_a_full_plan_but_cannot_build_without_a_lock(run_invoke, variant):
    plan = run_invoke("build", "--variant", variant, "--dry-run")
    assert plan.returncode == 0, plan.stderr
    for needle in ("paddle    paddlepaddle-", "scipy==", "opencv-python-headless==", "docker build --network none",
                   "BASE_IMAGE=fleetbox/base:", f"fleetbox/paddle:{variant}"):
        assert needle in plan.stdout, needle
    one_line_error(run_invoke("wheels", "--variant", variant), f"no lock for variant {variant}",
                   "on a machine that reaches https://www.paddlepaddle.org.cn/packages/stable/")


def test_dcu_base_cannot_be_bootstrapped(run_invoke):
    one_line_error(run_invoke("base", "--variant", "dcu", "--bootstrap", "--dry-run"), "cannot be bootstrapped")


def test_docker_daemon_unreachable_says_how_to_start_it(run_invoke, tmp_path):
    proc = run_invoke("build", env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    one_line_error(proc, "cannot reach the Docker Engine", "dockerd")


def test_lock_for_unreachable_paddle_index_says_where_to_run_it(run_invoke):
    one_line_error(run_invoke("lock", "--variant", "cu126"), "cannot reach https://www.paddlepaddle.org.cn",
                   "invoke lock")


@pytest.mark.parametrize("args,needle", [
    (["train", "--nodes", "abc"], "--nodes takes a whole number"),
    (["train", "--timeout", "abc"], "--timeout takes a number of seconds"),
    (["train", "--timeout", "nan"], "--timeout must be a positive number"),
    (["train", "--env", "A=1,NOEQ"], "--env 'NOEQ' must be NAME=VALUE"),
    (["train", "--mount", "/tmp:/x:rx"], "the mode must be ro or rw"),
    (["train", "--job-id", "a;b", "--dry-run"], "--job-id 'a;b'"),
    (["train", "--backend", "slurm", "--partition", "gpu\nrm -rf /", "--dry-run"], "--partition"),
    (["train", "--backend", "slurm", "--timeout", "5", "--dry-run"], "--timeout is for the docker backend"),
    (["train", "--backend", "k8s"], "unknown backend 'k8s'"),
    (["build", "--variant", ""], "--variant is empty"),
    (["cache", "--datasets", "mnist", "--jobs", "x"], "--jobs takes a whole number"),
])
def test_bad_values_are_one_line(run_invoke, args, needle):
    one_line_error(run_invoke(*args), needle)
