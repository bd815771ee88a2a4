"""Docker's own options (--hosts, --devices) with the job: where the nodes are is read from the plan once it is
made (a detached job's supervisor makes DockerBackend() with no options), the default dataset cache stays here,
a plan made without from_options is checked, and a study's runs get the first N hosts."""
from __future__ import annotations

import dataclasses
import types

import pytest

from fleetbox import ROOT
from fleetbox.image import matrix
from fleetbox.run import backends, records
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import docker as docker_backend
from fleetbox.run.backends import restarts
from fleetbox.run.backends.docker import DockerBackend

RECORDED = ROOT / "tests" / "recorded" / "plans" / "hosts"


class Stop(Exception):
    pass


def _old_plan(tmp_path):
    _, plan = records.load_plan(RECORDED, lambda n: backends.lookup(n).plan_type)
    return dataclasses.replace(plan, dir=tmp_path / "train-1", job_id="train-1")


def test_the_supervisor_runs_an_old_hosts_plan_without_touching_a_local_checkpoint_folder(monkeypatch, tmp_path):
    """The supervisor makes DockerBackend() with no options: run() must read where the nodes are from the plan."""
    plan = _old_plan(tmp_path)
    touched = []
    monkeypatch.setattr(docker_backend.checkpoints, "prepare", lambda *a, **k: touched.append(("prepare", a)))
    monkeypatch.setattr(docker_backend.checkpoints, "release", lambda *a, **k: touched.append(("release", a)))
    monkeypatch.setattr(docker_backend.checkpoints, "state", lambda *a, **k: touched.append(("state", a)) or {})
    monkeypatch.setattr(restarts.metrics, "collect", lambda d: None)
    b = DockerBackend(connect=lambda host: (_ for _ in ()).throw(Stop(host)))
    done = types.SimpleNamespace(ok=True, timed_out=False, reason=lambda: "", state="PASSED")
    monkeypatch.setattr(b, "_run_once", lambda *a, **k: done)
    b.run(plan, log=lambda m: None)
    assert touched == []


def test_submitting_an_old_hosts_plan_prepares_no_local_checkpoint_folder(monkeypatch, tmp_path):
    plan = _old_plan(tmp_path)
    touched = []
    monkeypatch.setattr(docker_backend.checkpoints, "prepare", lambda *a, **k: touched.append(a))
    monkeypatch.setattr(docker_backend._Live, "start", lambda self, log: (_ for _ in ()).throw(Stop()))
    monkeypatch.setattr(docker_backend._Live, "remove_all", lambda self: None)
    b = DockerBackend(connect=lambda host: (_ for _ in ()).throw(Stop(host)))
    with pytest.raises(Stop):
        b.submit(plan, log=lambda m: None)
    assert touched == []


def test_the_default_dataset_cache_is_not_given_to_hosts_engines(monkeypatch, tmp_path):
    """reads_here: a --hosts job's nodes cannot read this machine's dataset cache (the default is dropped)."""
    from fleetbox import settings
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(settings, "data_dir", lambda: tmp_path / "cache")
    v = matrix.load().get("cpu")
    assert spec_mod.from_options(v, DockerBackend(), nodes=1).data_dir == str(tmp_path / "cache")
    assert spec_mod.from_options(v, DockerBackend(hosts=("tcp://a:1",)), nodes=1).data_dir == ""


def test_a_study_run_planned_directly_is_checked(monkeypatch, tmp_path):
    """_plan checks the spec itself (a Python caller's spec, made without from_options)."""
    from fleetbox.errors import UserError
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    s = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=3)
    with pytest.raises(UserError, match="--hosts names 2 hosts for 3 nodes"):
        DockerBackend(hosts=("tcp://a:1", "tcp://b:1"), connect=lambda h: (_ for _ in ()).throw(Stop(h))).plan(s)


def test_devices_on_a_cpu_variant_or_a_study_of_hosts_given_as_text():
    from fleetbox.errors import UserError
    v = matrix.load().get("cpu")
    with pytest.raises(UserError, match="variant cpu is CPU-only: drop --gpus-per-node/--devices"):
        spec_mod.from_options(v, DockerBackend(devices="0,1"), nodes=2)
    # a Python caller's text, read as the command line's
    assert backends.sized("docker", {"hosts": "tcp://a:1,tcp://b:1"}, 1) == {"hosts": ("tcp://a:1",)}
