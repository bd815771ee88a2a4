"""--pass-env NAME: a secret reaches every node's container by name, from the environment the container is made
in, and its value is in no script, dry-run or record."""
import json

import pytest

from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import records
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import runtimes, slurm
from tests.unit.conftest import fake_env, given_image, run_node

SECRET = "s3cret-$(touch pwned)-`touch pwned`-'x'"   # run, it would write in the folder the node script runs in


def spec(**kw):
    return spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id="train-secret-1", port=29555,
                            pass_env=("HF_TOKEN",), **kw)


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
def test_a_passed_variable_reaches_each_runtime_by_name_and_no_script_holds_it(runtime, stubs, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    own = {"venv": str(fake_env(tmp_path / "env", python=stubs / "python"))} if runtime == "none" else {}
    plan = slurm.SlurmBackend(runtime, **own).plan(spec(image="" if own else given_image(runtime, tmp_path)))
    files = dict(plan.files)
    assert not any(SECRET in text or "s3cret" in text for text in files.values())
    proc, calls = run_node(files["node.sh"], stubs, tmp_path, {"HF_TOKEN": SECRET})   # as srun hands it on
    assert proc.returncode == 0, proc.stderr
    tool = {"charliecloud": "ch-run", "pyxis": "python", "none": "python"}.get(runtime, runtime)
    (call,) = [c for c in calls if c["tool"] == tool]
    argv, env = call["argv"], call["env"]
    got = {
        # the client takes `-e NAME`'s value from its own environment, which has it
        "docker": lambda: "HF_TOKEN" in [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
        and env["HF_TOKEN"] == SECRET,
        "podman": lambda: "HF_TOKEN" in [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
        and env["HF_TOKEN"] == SECRET,
        "apptainer": lambda: env["APPTAINERENV_HF_TOKEN"] == SECRET,           # --cleanenv keeps these
        "singularity": lambda: env["SINGULARITYENV_HF_TOKEN"] == SECRET,
        # ch-run passes its environment through: no value on its command line, where every user could read it
        "charliecloud": lambda: env["HF_TOKEN"] == SECRET and not any("HF_TOKEN" in a or "s3cret" in a for a in argv),
        "pyxis": lambda: env["HF_TOKEN"] == SECRET,                             # node.sh runs in the container
        "none": lambda: env["HF_TOKEN"] == SECRET,                              # no container: the task's own
    }[runtime]
    assert got(), (argv, {k: v for k, v in env.items() if "HF" in k})
    assert not (tmp_path / "cwd" / "pwned").exists()


def test_the_docker_backend_reads_it_where_it_makes_the_containers_and_stores_only_its_name(tmp_path, monkeypatch):
    from tests.unit.test_docker_backend import FakeEngine, Life, job
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    engine = FakeEngine({0: Life(code=0), 1: Life(code=0)})
    b, plan = job(engine, pass_env=("HF_TOKEN",))
    assert "s3cret" not in b.describe(plan) and "-e HF_TOKEN " in b.describe(plan)   # what --dry-run prints
    plan.make_dir()
    records.save_plan(plan.dir, b.name, plan)                                        # a detached job's record
    assert "s3cret" not in (plan.dir / records.PLAN).read_text()
    assert b.run(plan, log=lambda m: None).ok
    assert all(c.kwargs["environment"]["HF_TOKEN"] == SECRET for c in engine.history)
    assert not any("s3cret" in p.read_text(errors="replace") for p in plan.dir.rglob("*") if p.is_file())


@pytest.mark.parametrize("given,env,said", [
    ("HF_TOKEN", {}, "--pass-env HF_TOKEN: it is not set in your environment"),
    ("HF-TOKEN", {"HF-TOKEN": "x"}, "--pass-env 'HF-TOKEN': give variable names"),
    ("A=1", {}, "--pass-env 'A=1': give variable names"),
])
def test_a_name_that_is_not_a_set_variable_is_refused_in_one_line(given, env, said, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=f"^{said}") as e:
        spec_mod.from_options(matrix.load().get("cpu"), pass_env=given)
    assert "\n" not in str(e.value)


def test_a_name_given_a_value_too_is_refused(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "x")
    with pytest.raises(UserError, match="also given a value with --env"):
        spec_mod.from_options(matrix.load().get("cpu"), pass_env="HF_TOKEN", env="HF_TOKEN=y")


def test_a_record_of_the_spec_keeps_the_names(tmp_path):
    s = spec()
    assert json.loads(json.dumps(records.to_record(s)))["pass_env"] == ["HF_TOKEN"]
