"""`invoke train --preflight` is a step of the job's own plan. Docker's probe_plan on a fake engine reuses what
the job's plan settled, with no second network probe."""
import json
import types

from fleetbox import settings
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends.docker import DockerBackend


def spec(**kw) -> spec_mod.JobSpec:
    return spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, **kw)


# -- Docker: the probe on what the job's plan settled --

class _Throwaway:
    """The network probe's container on one host: its answer, then removed."""
    def __init__(self, host: str, ip: str):
        self.out = json.dumps({"iface": f"eth-{host[-1]}", "local": ip, "names": ["lo", f"eth-{host[-1]}"],
                               "memlock": 65536, "port_free": True}).encode()

    def wait(self, timeout=None):
        return {"StatusCode": 0}

    def logs(self, stdout=True, stderr=False):
        return self.out if stdout else b""

    def remove(self, force=False):
        pass


def test_docker_probes_on_the_jobs_settled_network_without_probing_it_again(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    hosts = ("tcp://10.213.77.11:2375", "tcp://10.213.77.12:2375")
    runs: list[str] = []

    def engine(host):
        ip = host.split("//")[1].split(":")[0]
        containers = types.SimpleNamespace(list=lambda **kw: [],
                                           run=lambda *a, **kw: runs.append(host) or _Throwaway(host, ip))
        image = types.SimpleNamespace(id="sha256:" + "a" * 64, labels={settings.LABEL_INPUTS: "b" * 64})
        return types.SimpleNamespace(containers=containers, images=types.SimpleNamespace(get=lambda ref: image))
    b = DockerBackend(connect=engine)
    job = b.plan(spec(hosts=hosts, job_id="J"))
    assert runs == list(hosts)   # the job's plan asked each host once
    probe_spec = spec(hosts=hosts, job_id="doctor-x", command=("python", "-c", "probe"), image_identity=True)
    probe = b.probe_plan(job, probe_spec)
    assert runs == list(hosts)   # ... and the probe asked none again
    assert probe.job_id == "doctor-x" and probe.port == job.port and probe.spec.port == job.port
    assert probe.dir == settings.runs_root() / "doctor-x"
    same = ("master_ip", "master_port", "node_ip", "iface", "port_range")
    assert [{k: v[k] for k in same} for v in probe.values] == [{k: v[k] for k in same} for v in job.values]
    assert [v["node_ip"] for v in probe.values] == ["10.213.77.11", "10.213.77.12"]
    assert probe.template.memlock == job.template.memlock == 65536 and probe.notes == job.notes
    assert (probe.image_id, probe.content_tag) == (job.image_id, job.content_tag)
    assert [n.host for n in probe.nodes] == list(hosts)
    assert all(n.labels[settings.LABEL_JOB] == "doctor-x" for n in probe.nodes)
    assert probe.nodes[0].command != job.nodes[0].command
