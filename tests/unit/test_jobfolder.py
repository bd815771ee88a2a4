"""A job's folder read through its backend's layout: each backend says where its attempts' node folders and its
nodes' output are, and the readers (metrics, report, board, doctor) find them there."""
import json

from fleetbox.run import backends, metrics, report
from fleetbox.run.jobfolder import JobFolder, Layout

NESTED = Layout(earlier="tries/try<N>", first=1, node="n<k>", output="n<k>/out.log")


def _line(rank, step):
    return 'FLEETBOX-METRIC ' + json.dumps({"rank": rank, "step": step, "time": 1000.0 + step, "loss": 1.0}) + "\n"


def _lay_out(job, layout, attempts=2):
    """Worker logs of every attempt, where `layout` puts them: earlier ones in their folders, the last at the top."""
    for a in range(attempts):
        top = job if a == attempts - 1 else job / layout.earlier.replace("<N>", str(a + layout.first))
        for k in range(2):
            node = top / layout.node.replace("<k>", str(k))
            node.mkdir(parents=True)
            (node / "workerlog.0").write_text(_line(k, 10 * a))


def test_each_backends_attempts_and_nodes_are_where_its_layout_says(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.LAYOUTS, "nested", NESTED)
    for name, layout in (("slurm", backends.lookup("slurm").layout), ("docker", backends.lookup("docker").layout),
                         ("nested", NESTED)):
        job = tmp_path / name
        _lay_out(job, layout)
        (job / "handle.json").write_text(json.dumps({"backend": name, "job_id": name, "dir": str(job)}))
        folder = JobFolder.at(job)
        assert folder.layout is layout
        assert [a for a, _ in folder.attempts()] == [0, 1], name
        assert [(r["attempt"], r["node"], r["step"]) for r in metrics.read(job)] == [
            (0, 0, 0), (0, 1, 0), (1, 0, 10), (1, 1, 10)], name
    assert JobFolder.at(tmp_path / "nested").output(1) == tmp_path / "nested" / "n1" / "out.log"
    assert JobFolder.at(tmp_path / "slurm").output(1) == tmp_path / "slurm" / "node1.log"
    assert JobFolder.at(tmp_path / "nested").layout.attempt_name(0) == "try1"


def test_a_folder_that_names_no_backend_is_read_with_every_layout(tmp_path):
    job = tmp_path / "old"
    for d in ("attempt0/node0", "alloc2/node0", "node0"):   # as a fleetbox before job.json said its backend
        (job / d).mkdir(parents=True)
        (job / d / "workerlog.0").write_text(_line(0, 1))
    assert [(a, d.name) for a, d in JobFolder.at(job).attempts()] == [(0, "attempt0"), (1, "alloc2"), (2, "old")]


def test_when_attempts_began_comes_from_the_backends_own_files(tmp_path):
    slurm = tmp_path / "s"
    slurm.mkdir()
    (slurm / "job.json").write_text(json.dumps({"backend": "slurm", "started": 0.0}))
    (slurm / "slurm-7.out").write_text("fleetbox: allocation 1 started at 100.5\n")
    (slurm / "slurm-8.out").write_text("x\nfleetbox: allocation 2 started at 250.0\n")
    assert (report.first_start(slurm, {"started": 0.0}), report.job_start(slurm, {})) == (100.5, 250.0)
    docker = tmp_path / "d"
    docker.mkdir()
    (docker / "job.json").write_text(json.dumps({"backend": "docker"}))
    (docker / "slurm-7.out").write_text("fleetbox: allocation 1 started at 100.5\n")   # not Docker's: not read
    assert report.first_start(docker, {"first_started": 5.0, "started": 9.0}) == 5.0
    assert report.job_start(docker, {}) is None


def test_a_layout_that_names_no_place_or_one_outside_the_job_folder_is_refused():
    import pytest
    for bad, said in ((dict(earlier="previous"), "earlier='previous' must hold <N>"),
                      (dict(node="n0"), "node='n0' must hold <k>"), (dict(output="out.log"), "must hold <k>"),
                      (dict(output="/etc/<k>"), "must be a path inside the job's folder"),
                      (dict(earlier="../t<N>"), "must be a path inside"), (dict(earlier="t<N>/x<N>"), "inside")):
        with pytest.raises(ValueError, match=said):
            Layout(**bad)
    assert hash(NESTED) == hash(Layout(earlier="tries/try<N>", first=1, node="n<k>", output="n<k>/out.log"))


def test_a_record_that_is_not_a_file_is_not_read_for_the_layout(tmp_path):
    import os
    job = tmp_path / "j"
    job.mkdir()
    os.mkfifo(job / "handle.json")   # reading it would wait for a writer forever
    (job / "job.json").write_text(json.dumps({"backend": "slurm"}))
    assert JobFolder.at(job).layout is backends.lookup("slurm").layout


def test_a_backend_without_a_layout_has_fleetboxs_default_and_docker_declares_every_place_of_its_own():
    """Layout's defaults are fleetbox's default layout, what a backend that declares none has; Docker's layout is
    its own, each place named in docker.py, so that the defaults may change without moving Docker's files."""
    import ast
    import inspect

    from fleetbox.run.backend import Backend
    from fleetbox.run.backends import docker
    from tests.unit.test_backend_registry import EchoBackend
    assert EchoBackend.layout == Backend.layout == Layout()
    declared = next(n.value for n in ast.walk(ast.parse(inspect.getsource(docker.DockerBackend)))
                    if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["layout"])
    assert {k.arg for k in declared.keywords} >= {"earlier", "first", "node", "output"}
    assert docker.DockerBackend.layout.output == f"node<k>/{docker.OUTPUT}"
