"""The front door as a user meets it: `invoke ...` in a subprocess."""
import subprocess
from dataclasses import replace

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
    for needle in ("paddle    paddlepaddle-", "scipy==", "opencv-python-headless==", "docker run --network none",
                   "base      fleetbox/base:", f"fleetbox/paddle:{variant}"):
        assert needle in plan.stdout, needle
    one_line_error(run_invoke("wheels", "--variant", variant), f"no lock for variant {variant}",
                   "on a machine that reaches https://www.paddlepaddle.org.cn/packages/stable/")


def test_dcu_base_cannot_be_bootstrapped(run_invoke):
    one_line_error(run_invoke("base", "--variant", "dcu", "--bootstrap", "--dry-run"), "cannot be bootstrapped")


def test_docker_daemon_unreachable_says_how_to_start_it(run_invoke, tmp_path):
    proc = run_invoke("build", env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    one_line_error(proc, "cannot reach the Docker Engine", "dockerd")


@pytest.mark.parametrize("args,needle", [
    (["train", "--nodes", "abc"], "--nodes takes a whole number"),
    (["train", "--timeout", "abc"], "--timeout takes seconds, or minutes or hours like 90, 90s, 20m, 1h"),
    (["train", "--timeout", "0"], "--timeout must be positive: seconds, or minutes or hours like"),
    (["train", "--timeout", "nan"], "--timeout takes seconds, or minutes or hours like"),
    (["train", "--backend", "slurm", "--runtime", "podman", "--image", "fleetbox/paddle:cpu", "--time", "5",
      "--dry-run"], "--time 5: give its unit (5m, or 5h) or Slurm's HH:MM:SS: Slurm reads a bare number as minutes, "
                    "fleetbox's other durations as seconds"),
    (["train", "--backend", "slurm", "--time", "0m", "--dry-run"], "--time must be positive"),
    (["train", "--timeout", "-5"], "--timeout takes seconds, or minutes or hours like"),
    (["train", "--variant", "", "--dry-run"], "--variant is empty"),
    (["train", "--data-dir", "/nonexistent/cache", "--dry-run"], "--data-dir /nonexistent/cache is not a folder"),
    (["train", "--mount", "/tmp:/x:rx"], "the mode must be ro or rw"),
    (["clean", "--job", "a;b"], "--job 'a;b' is not a job id"),
    (["clean", "--job", ""], "--job '' is not a job id"),
    (["train", "--env", "A=1,NOEQ"], "--env 'NOEQ' must be NAME=VALUE"),
    (["train", "--job-id", "a;b", "--dry-run"], "--job-id 'a;b'"),
    (["train", "--backend", "slurm", "--partition", "gpu\nrm -rf /", "--dry-run"], "--partition"),
    (["train", "--backend", "slurm", "--timeout", "5", "--dry-run"], "--timeout is for the docker backend"),
    (["train", "--backend", "k8s"], "unknown backend 'k8s'"),
    (["build", "--variant", ""], "--variant is empty"),
    (["train", "--max-restarts", "-1", "--dry-run"], "--max-restarts must be at least 0 (got -1)"),
    (["train", "--max-restarts", "x", "--dry-run"], "--max-restarts takes a whole number"),
    (["train", "--nodes", "2", "--min-nodes", "3", "--max-restarts", "1", "--dry-run"],
     "--min-nodes 3 is above --nodes 2"),
    (["train", "--nodes", "3", "--min-nodes", "2", "--dry-run"], "--min-nodes 2 goes on with fewer nodes at a restart: "
                                                                  "give --max-restarts too"),
    (["train", "--backend", "kubernetes", "--k8s-kind", "volcano", "--nodes", "3", "--min-nodes", "2",
      "--max-restarts", "1", "--k8s-checkpoint-claim", "ck", "--dry-run"],
     "--min-nodes 2 with --k8s-kind volcano: Volcano's controller restarts the whole job, on every node"),
    (["train", "--backend", "kubernetes", "--nodes", "3", "--min-nodes", "2", "--max-restarts", "1", "--dry-run"],
     "--min-nodes 2 on kubernetes needs --k8s-checkpoint-claim: the nodes left resume from it"),
    (["train", "--nodes", "2", "--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.2:2375", "--min-nodes", "1",
      "--max-restarts", "1", "--dry-run"], "--min-nodes 1 with --hosts needs a --checkpoint-dir every host shares"),
    (["train", "--nodes", "2", "--spare-nodes", "1", "--dry-run"], "--spare-nodes needs --hosts: the spares are the "
     "hosts after the first N"),
    (["train", "--nodes", "2", "--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.2:2375", "--spare-nodes", "1",
      "--dry-run"], "--hosts names 2 hosts for 2 nodes and 1 spare(s): give one per node, then the spares"),
    (["train", "--nodes", "1", "--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.2:2375", "--spare-nodes", "1",
      "--max-restarts", "1", "--dry-run"], "--spare-nodes 1 with --hosts needs a --checkpoint-dir every host shares"),
    (["train", "--backend", "kubernetes", "--nodes", "2", "--spare-nodes", "1", "--dry-run"],
     "--spare-nodes: the kubernetes backend keeps no spare nodes yet (docker with --hosts, and slurm, do); drop it"),
    (["train", "--nodes", "2", "--spare-nodes", "-1", "--dry-run"], "--spare-nodes must be at least 0 (got -1)"),
    (["train", "--nodes", "1", "--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.1:2375", "--spare-nodes", "1",
      "--dry-run"], "--spare-nodes: --hosts names a spare twice, or a node's host as a spare; a spare must be a "
     "machine no node runs on"),
    (["train", "--nodes", "1", "--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.2:2375", "--spare-nodes", "1",
      "--preflight"], "--preflight checks the nodes as --hosts names them; with --spare-nodes the job picks"),
    (["train", "--resume", "/nonexistent/ck", "--dry-run"], "--resume /nonexistent/ck: give auto, never, or a"),
    (["train", "--checkpoint-dir", "/etc/hostname", "--dry-run"], "--checkpoint-dir /etc/hostname is not a folder"),
    (["train", "--backend", "slurm", "--signal-grace", "0", "--dry-run"], "--signal-grace must be between 1 and 65535"),
    (["train", "--backend", "slurm", "--max-allocations", "0", "--dry-run"], "--max-allocations must be at least 1"),
    (["train", "--max-allocations", "3", "--dry-run"], "--max-allocations is for --backend slurm"),
    (["train", "--partition", "gpu", "--signal-grace", "60", "--dry-run"],
     "--partition and --signal-grace are for --backend slurm"),
    (["train", "--backend", "slurm", "--time", "2 hours", "--dry-run"],
     "--time '2 hours' is not a value Slurm accepts for --time (a duration like 90m or 48h, or Slurm's MM:SS, "),
    (["cache", "--datasets", "mnist", "--jobs", "x"], "--jobs takes a whole number"),
    (["board", "j", "--private", "--host", "0.0.0.0"], "--private serves on a socket, not on an address"),
])
def test_bad_values_are_one_line(run_invoke, args, needle):
    one_line_error(run_invoke(*args), needle)


@pytest.mark.parametrize("case,needle", [
    ("seed-into-a-file", "exists and is not a folder"),
    ("verify-a-file", "exists and is not a folder"),
    ("restore-into-a-file", "exists and is not a folder"),
    ("restore-random-bytes", "is not a readable archive"),
    ("restore-index-not-json", "fleetbox-cache.json is not a cache index"),
    ("malformed-mirror", "mirror http://[::1 is not a valid URL"),
    ("pack-an-empty-cache", "nothing to pack"),
])
def test_cache_bad_input_is_one_line_and_changes_nothing(run_invoke, tmp_path, case, needle):
    import io
    import tarfile

    from tests import mnistgen
    md5s = dict.fromkeys(mnistgen.NAMES, "0" * 32)   # nothing is downloaded: each case fails before
    manifest = mnistgen.manifest(tmp_path / "datasets.toml", "http://127.0.0.1:9", md5s)
    afile, dest, out = tmp_path / "afile", tmp_path / "dest", tmp_path / "out.tar"
    afile.write_bytes(b"mine")
    (tmp_path / "random.tar").write_bytes(bytes(range(256)) * 64)
    with tarfile.open(tmp_path / "notjson.tar", "w") as tar:
        info = tarfile.TarInfo("fleetbox-cache.json")
        info.size = 9
        tar.addfile(info, io.BytesIO(b"{not json"))
    args = {"seed-into-a-file": ["--datasets", "mnist", "--dest", afile],
            "verify-a-file": ["--datasets", "mnist", "--dest", afile, "--verify"],
            "restore-into-a-file": ["--from", tmp_path / "random.tar", "--dest", afile],
            "restore-random-bytes": ["--from", tmp_path / "random.tar", "--dest", dest],
            "restore-index-not-json": ["--from", tmp_path / "notjson.tar", "--dest", dest],
            "malformed-mirror": ["--datasets", "mnist", "--mirror", "http://[::1", "--dest", dest],
            "pack-an-empty-cache": ["--pack", out, "--dest", dest]}[case]
    proc = run_invoke("cache", "--manifest", str(manifest), *map(str, args))
    assert proc.returncode == 2
    one_line_error(proc, needle)
    assert afile.read_bytes() == b"mine" and not dest.exists() and not list(tmp_path.glob("out.tar*"))


def test_a_checkpoint_folder_on_a_read_only_file_system_is_one_line(run_invoke, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        proc = run_invoke("train", "--backend", "slurm", "--image", "fleetbox/paddle:cpu", "--dry-run",
                          "--checkpoint-dir", str(ro / "ck"))
        one_line_error(proc, f"checkpoint folder {ro / 'ck'} is not writable ({ro}: read-only file system)")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_every_tasks_description_in_the_list_is_whole(run_invoke):
    """`invoke --list` shows a docstring's first line: six of them stopped mid-sentence."""
    proc = run_invoke("--list")
    described, name = {}, None
    for line in proc.stdout.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("    "):
            name, _, text = line.strip().partition(" ")
            described[name] = text.strip()
        elif name and line.strip():
            described[name] += " " + line.strip()
    assert len(described) >= 20 and [n for n, text in described.items() if not text.endswith(".")] == []


def test_no_task_has_one_letter_flags():
    """invoke made them from each task's own names: -d was --dry-run for build but --debug for train."""
    from fleetbox.tasks import ns
    short = [(name, n) for name, t in ns.tasks.items() for a in t.get_arguments()
             for n in a.names if len(n) == 1]
    assert short == []


@pytest.mark.parametrize("flag,value", [("--hosts", "tcp://10.0.0.1:2375,tcp://10.0.0.2:2375"), ("--devices", "0,1"),
                                        ("--timeout", "5m")])
def test_an_option_only_one_backend_takes_says_so_in_its_help(run_invoke, flag, value):
    """`invoke --help train` was a flat list: nothing told --devices was Docker's alone until Slurm refused it."""
    refused = run_invoke("train", "--backend", "slurm", "--runtime", "podman", "--variant", "cu126", flag, value,
                         "--dry-run")
    one_line_error(refused, f"{flag} is for the docker backend")
    lines = run_invoke("--help", "train").stdout.splitlines()
    (at,) = [i for i, ln in enumerate(lines) if ln.strip().startswith(f"{flag}=")]
    assert lines[at].split("=STRING", 1)[1].strip().startswith("docker backend:"), lines[at]


def test_a_scripts_own_flags_pass_after_a_double_dash_word_for_word(run_invoke):
    """`--args "--debug"` fails in invoke's parser (its own --debug wants no value there)."""
    import shlex
    proc = run_invoke("train", "--nodes", "1", "--dry-run", "--", "--debug", "--steps", "5", "it's $HOME")
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("docker run")]
    assert shlex.split(line)[-5:] == ["/workspace/smoke.py", "--debug", "--steps", "5", "it's $HOME"]
    one_line_error(run_invoke("train", "--dry-run", "--args", "--steps 5", "--", "--debug"),
                   "give the script's arguments once")


@pytest.mark.parametrize("letter", ["-d", "-e", "-p", "-ed", "--dry", "--echo"])
def test_one_of_invokes_own_options_after_a_task_is_refused(run_invoke, letter):
    """`invoke train -d` (or --dry) ran the real job, in invoke's --debug (or its --dry, which only its own `run`
    heeds), where --dry-run was meant. (--dry-run here keeps a regression from starting a job.)"""
    one_line_error(run_invoke("train", "--dry-run", letter), f"{letter} is invoke's own option, not fleetbox's")
    after = run_invoke("train", "--nodes", "1", "--dry-run", "--", letter)   # the script's: passed on
    assert after.returncode == 0 and f"smoke.py {letter}\n" in after.stdout, after.stderr


def test_a_value_of_ours_that_looks_like_a_letter_is_a_value(run_invoke):
    proc = run_invoke("train", "--nodes", "1", "--dry-run", "--env", "-x", "--debug")   # train's own --debug
    assert "is invoke's own option" not in proc.stderr



@pytest.mark.parametrize("given,want", [
    ("invoke train --nodes 2", "invoke train --job-id J --nodes 2"),
    ("invoke train --job-id old --resume never --nodes 2", "invoke train --job-id J --nodes 2"),
    ("invoke train --resume=never --job-id=old --detach --backend slurm --time 1:00:00",
     "invoke train --job-id J --backend slurm --time 1:00:00"),
    ("invoke train --args '--lr 0.1' -- --resume never", "invoke train --job-id J --args '--lr 0.1' -- --resume never"),
    # a checkpoint to start from stays: until the job saved its own, it is where the job goes on from
    ("python3 -m invoke train --resume /ck/step-00000100 --nodes 2",
     "python3 -m invoke train --job-id J --resume /ck/step-00000100 --nodes 2"),
    ("invoke train --resume=/ck --dry-run", "invoke train --job-id J --resume=/ck"),
])
def test_a_stopped_job_says_the_command_that_goes_on_from_its_checkpoint(given, want):
    from fleetbox.commands.train import resume_command
    assert resume_command(given, "J") == want


def test_an_engine_failure_or_fresh_hosts_volumes_say_how_to_go_on(monkeypatch, tmp_path):
    """An engine lost under the job raises Failed from the backend: it said nothing of a resume. With --hosts and
    --resume never (no shared --checkpoint-dir), the job's checkpoints are in fresh volumes a rerun does not read:
    said so, not a command. The plan is Docker's own, made of what the engines would have said."""
    from fleetbox.commands import train
    from fleetbox.errors import Failed
    from fleetbox.image import matrix
    from fleetbox.run import backends
    from fleetbox.run.spec import JobSpec

    class Lost(backends.lookup("docker")):   # Docker's, its engine lost while the job ran
        def plan(self, spec):
            facts = [{"iface": "eth0", "local": f"10.0.0.{k + 1}"} for k in range(spec.nodes)]
            return self._settled(replace(spec, port=29500), "J", "10.0.0.1", 29500, facts, -1, "sha256:x", "",
                                 "3.2.0", hosts=list(self.hosts) or [""] * spec.nodes)

        def run(self, plan, log, timeout):
            raise Failed("train failed: the Docker Engine at tcp://h1:2375 failed")
    monkeypatch.setattr(backends, "get", lambda name, **kw: Lost(**kw))
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    command = "to go on from its newest checkpoint: invoke train --job-id J"
    fresh = "its checkpoints are in a fresh volume per node (fleetbox-J-*-checkpoints-*) on each host"
    for hosts, resume, shared, said in (((), "never", "", command),
                                        (("tcp://h1:2375", "tcp://h2:2375"), "auto", "", command),
                                        (("tcp://h1:2375", "tcp://h2:2375"), "never", "/shared/ck", command),
                                        (("tcp://h1:2375", "tcp://h2:2375"), "never", "", fresh)):
        lines = []
        spec = JobSpec(variant=matrix.load().get("cpu"), nodes=2, resume=resume, checkpoint_dir=shared)
        with pytest.raises(Failed):
            train.train(spec, "docker", {"hosts": hosts}, log=lines.append, command="invoke train --resume never")
        assert [ln for ln in lines if ln.startswith(("to go on", "its checkpoints"))] == [
            ln for ln in lines if ln.startswith(said)], (hosts, resume, shared, lines)
        assert any(ln.startswith(said) for ln in lines), lines


@pytest.mark.parametrize("claim,said", [("ckpt", "to go on from its newest checkpoint: invoke train --job-id j "
                                                 "--backend kubernetes"),
                                         ("", "it had no --k8s-checkpoint-claim: its checkpoints went with its pods")])
def test_a_failed_kubernetes_job_says_the_command_that_goes_on_from_its_claim(claim, said):
    """With a claim, the same id finds its folder of it again: the command is said, not only where they are."""
    from fleetbox.commands import train
    from fleetbox.image import matrix
    from fleetbox.run import backends
    from fleetbox.run.spec import JobSpec
    lines = []
    plan = backends.get("kubernetes", k8s_checkpoint_claim=claim).plan(
        JobSpec(variant=matrix.load().get("cpu"), job_id="j"))
    train.say_how_to_resume(plan, "invoke train --backend kubernetes", lines.append)
    assert lines == [said]


def test_doctor_and_scale_show_their_jobs_and_start_nothing_with_dry_run(run_invoke, tmp_path):
    """Both submit jobs (doctor --backend slurm to the queue); neither had a --dry-run."""
    runs = tmp_path / "runs"
    doc = run_invoke("doctor", "--backend", "slurm", "--runtime", "podman", "--image", "fleetbox/paddle:cpu",
                     "--nodes", "2", "--dry-run", env={"FLEETBOX_RUNS": str(runs)})
    assert doc.returncode == 0, doc.stderr
    assert "# doctor: the probe job (doctor-" in doc.stdout and "#SBATCH --job-name=fleetbox-doctor-" in doc.stdout
    assert "# doctor: then, when every check passes, the all-reduce sweep (doctor-sweep-" in doc.stdout
    study = run_invoke("scale", "--nodes", "1,2", "--dry-run", env={"FLEETBOX_RUNS": str(runs)})
    assert study.returncode == 0, study.stderr
    assert [ln.split(" (job ")[0] for ln in study.stdout.splitlines() if ln.startswith("# scale: run")] == [
        "# scale: run 1/2: fleetbox/paddle:cpu, 1 node(s) x 1 process(es)",
        "# scale: run 2/2: fleetbox/paddle:cpu, 2 node(s) x 1 process(es)"]
    assert study.stdout.count("\ndocker run ") == 3 and not runs.exists()   # nothing made, nothing submitted


@pytest.mark.parametrize("orig,argv,want", [
    (["python3", "-m", "invoke", "train", "--nodes", "2"], ["m", "train", "--nodes", "2"],
     "python3 -m invoke train --nodes 2"),
    (["/opt/venv/bin/python", "/opt/venv/bin/invoke", "-e", "build", "--dry-run", "train", "--nodes", "2"],
     ["invoke", "-e", "build", "--dry-run", "train", "--nodes", "2"], "invoke -e train --nodes 2"),
    (["/opt/venv/bin/python", "/opt/venv/bin/fleetbox", "train", "--nodes", "2"],
     ["/opt/venv/bin/fleetbox", "train", "--nodes", "2"], "fleetbox train --nodes 2"),
])
def test_the_command_to_go_on_is_as_it_was_typed_and_this_tasks_only(monkeypatch, orig, argv, want):
    """Not `invoke` where `python3 -m invoke` (a venv's) was typed; not another task of the same line (a real
    build, its --dry-run dropped)."""
    from fleetbox import tasks
    monkeypatch.setattr(tasks.sys, "orig_argv", orig)
    monkeypatch.setattr(tasks.sys, "argv", argv)
    assert tasks._as_typed() == want


def fleetbox_here(*args, cwd):
    """`fleetbox ARGS` in this process, run from `cwd`: (exit code, stdout, stderr)."""
    from tests.conftest import invoke_here
    p = invoke_here(*args, cwd=cwd, command="fleetbox")
    return p.returncode, p.stdout, p.stderr


def test_the_fleetbox_command_runs_the_tasks_from_a_folder_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    code, out, err = fleetbox_here("train", "--backend", "slurm", "--runtime", "podman", "--image",
                                   "fleetbox/paddle:cpu", "--nodes", "2", "--dry-run", cwd=tmp_path)
    assert code == 0 and "#SBATCH --nodes=2" in out, err
    assert not (tmp_path / "runs").exists()   # a dry run makes nothing


@pytest.mark.parametrize("args,said", [
    (("train", "--gpus", "4"), "train has no option --gpus; did you mean --gpus-per-node? (`fleetbox --help train` "
                               "lists them)"),
    (("train", "--gres=gpu:4"), "train has no option --gres; did you mean --gpus-per-node? (`fleetbox --help "
                                "train` lists them)"),
    (("scale", "--nodez", "2"), "scale has no option --nodez; did you mean --nodes? (`fleetbox --help scale` lists "
                                "them)"),
    (("train", "--colour"), "train has no option --colour (`fleetbox --help train` lists them)"),
    (("board",), "board needs JOB: `fleetbox board JOB`"),
    (("train", "--nodes"), "--nodes needs a value"),
    (("board", "--port"), "--port needs a value"),
    (("train", "--detach", "false"), "train's flags take no value ('false'): give the flag where you want it, leave "
                                     "it out where not"),
    (("trian",), "no task 'trian'; did you mean train? (base, board, build, cache, cancel, clean, config, docs, "
                 "doctor, export, jobs, kit, lock, logs, pull-cmd, push, report, scale, train, up, venv, verify, "
                 "wheels)"),
])
def test_invokes_parse_errors_are_one_line_of_fleetbox_with_what_was_likely_meant(tmp_path, args, said):
    code, out, err = fleetbox_here(*args, cwd=tmp_path)
    assert (code, out, err) == (2, "", f"fleetbox: error: {said}\n")
