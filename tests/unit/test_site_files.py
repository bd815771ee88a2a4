"""Site and project defaults in TOML (settings.site_files, commands/config.py), through the fleetbox command run
from a project's folder: the command line, then FLEETBOX_* variables, then the project's fleetbox.toml, then the
user's file, then fleetbox's own defaults."""
import textwrap

import pytest

from tests.conftest import invoke_here

SITE = """\
    [paths]
    runs = "my-runs"

    [job]
    backend = "slurm"
    nodes = 4

    [backends.slurm]
    runtime = "podman"
    partition = "gpu"
    account = "proj123"

    [backends.kubernetes]
    k8s-namespace = "team-a"

    [train]
    nodes = 2
    image = "fleetbox/paddle:cpu"
    procs-per-node = 1
    """


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with a site file, a folder below it to run from, and a user file (none yet)."""
    (tmp_path / "proj" / "src").mkdir(parents=True)
    (tmp_path / "proj" / "fleetbox.toml").write_text(textwrap.dedent(SITE))
    monkeypatch.setenv("FLEETBOX_CONFIG", str(tmp_path / "user.toml"))
    for var in ("FLEETBOX_RUNS", "FLEETBOX_EXPORTS"):   # the unit tests' own (tests/unit/conftest.py)
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def fleetbox(project, *args):
    return invoke_here(*args, cwd=project / "proj" / "src", command="fleetbox")


def sbatch(out: str, name: str) -> str:
    return next(ln.split("=", 1)[1] for ln in out.splitlines() if ln.startswith(f"#SBATCH --{name}="))


def test_the_project_file_found_from_a_folder_below_it_gives_the_options_the_command_line_did_not(project):
    p = fleetbox(project, "train", "--dry-run", "--account", "mine")
    assert p.returncode == 0, p.stderr
    # [train]'s nodes beats [job]'s; the backend's own from [backends.slurm]; the command line's account wins
    assert (sbatch(p.stdout, "nodes"), sbatch(p.stdout, "partition"), sbatch(p.stdout, "account")) == (
        "2", "gpu", "mine")
    site = project / "proj" / "fleetbox.toml"
    assert p.stdout.splitlines()[0] == (f"# from the site files: --backend slurm ({site}:5), --nodes 2 ({site}:17), "
                                        f"--procs-per-node 1 ({site}:19), --image fleetbox/paddle:cpu ({site}:18), "
                                        f"--runtime podman ({site}:9), "
                                        f"--partition gpu ({site}:10)")
    assert not (project / "proj" / "my-runs").exists()   # a dry run makes nothing


def test_a_backends_section_counts_only_where_it_is_the_jobs_backend(project):
    """--backend kubernetes on the command line: [backends.slurm]'s partition and runtime are not given to it (it
    would refuse them: they are Slurm's)."""
    p = fleetbox(project, "train", "--backend", "kubernetes", "--dry-run")
    assert p.returncode == 0, p.stderr
    site = project / "proj" / "fleetbox.toml"
    assert p.stdout.splitlines()[0] == (f"# from the site files: --nodes 2 ({site}:17), --procs-per-node 1 "
                                        f"({site}:19), --image fleetbox/paddle:cpu ({site}:18), --k8s-namespace team-a "
                                        f"({site}:14)")
    assert "kind: Job" in p.stdout and "namespace: team-a" in p.stdout


def test_the_project_file_beats_the_users_and_the_variable_beats_both(project, monkeypatch):
    (project / "user.toml").write_text('[paths]\nruns = "/user/runs"\nexports = "/user/exports"\n\n'
                                       '[backends.slurm]\npartition = "cpu"\nqos = "long"\n')
    p = fleetbox(project, "train", "--dry-run")
    assert (sbatch(p.stdout, "partition"), sbatch(p.stdout, "qos")) == ("gpu", "long"), p.stderr
    p = fleetbox(project, "config")
    assert p.returncode == 0, p.stderr
    site, user = project / "proj" / "fleetbox.toml", project / "user.toml"
    lines = p.stdout.splitlines()
    assert f"  runs               {project / 'proj' / 'my-runs'}  ({site}:2)" in lines
    assert f"  exports            /user/exports  ({user}:3)" in lines
    assert f'  [backends.slurm] partition = "gpu"  ({site}:10); overrides "cpu"  ({user}:6)' in lines
    monkeypatch.setenv("FLEETBOX_RUNS", str(project / "elsewhere"))
    assert f"  runs               {project / 'elsewhere'}  (FLEETBOX_RUNS)" in fleetbox(project, "config").stdout


@pytest.mark.parametrize("edit,said", [
    (("nodes = 2", "nodez = 2"), "fleetbox.toml:17: [train] has no option 'nodez'; did you mean nodes?"),
    (("account = ", "acount = "), "fleetbox.toml:11: the slurm backend has no option 'acount'; did you mean "
                                  "account?"),
    (("[train]", "[trian]"), "fleetbox.toml:16: no section [trian] in fleetbox's files; did you mean [train]?"),
    (("nodes = 2", "nodes = 0"), "fleetbox.toml:17: --nodes must be at least 1 (got 0)"),
    (("nodes = 2", 'nodes = "two"'), "fleetbox.toml:17: --nodes takes a whole number (got 'two')"),
    (("[job]", "[job]\ndebug = true"), "fleetbox.toml:5: debug is a flag, which a file may not set (the command "
                                      "line could not turn it off again): give --debug where you want it"),
    (("[job]", "[job]\nenv = {A = \"1,2\"}"), "fleetbox.toml:5: env's items are strings without commas"),
    (("[job]", "[job]\nenv = {A = true}"), "fleetbox.toml:5: env's items are strings without commas"),
    (("[job]", "[jb]"), "fleetbox.toml:4: no section [jb] in fleetbox's files; did you mean [job]?"),
    (("[backends.kubernetes]", "[backends.kubernets]"), "fleetbox.toml:13: no backend 'kubernets'; did you mean "
                                                        "[backends.kubernetes]?"),
    (("[paths]", "nodes = 3\n[paths]"), "fleetbox.toml:1: nodes is outside any section"),
    (('runs = "my-runs"', "runs = 3"), "fleetbox.toml:2: [paths] runs must be a folder's path, as a string"),
    (('runtime = "podman"', 'runtime = "singularty"'), "unknown runtime 'singularty'; choose one of: "),
    (('"my-runs"', '"my-runs'), "fleetbox.toml: not TOML that fleetbox can read: "),
])
def test_a_wrong_key_or_value_is_one_line_naming_the_file_and_its_line(project, edit, said):
    site = project / "proj" / "fleetbox.toml"
    site.write_text(site.read_text().replace(*edit, 1))
    p = fleetbox(project, "train", "--dry-run")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stdout == "" or p.stdout.startswith("# from the site files: ") and p.stdout.count("\n") == 1
    assert p.stderr.startswith(f"fleetbox: error: {project}/proj/{said}" if said.startswith("fleetbox.toml")
                               else f"fleetbox: error: {said}"), p.stderr
    if "runtime" in edit[0]:   # refused later, by the option itself: where it came from is said
        assert p.stderr.rstrip().endswith(f"(--runtime came from {site}:9)"), p.stderr


def test_the_guides_example_file_is_one_fleetbox_reads_as_the_guide_says(tmp_path, monkeypatch):
    """docs/guides/site-defaults.md's file, as written: every key taken, each where the guide says it goes."""
    from fleetbox import ROOT
    page = (ROOT / "docs" / "guides" / "site-defaults.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "fleetbox.toml").write_text(example)
    monkeypatch.setenv("FLEETBOX_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.delenv("FLEETBOX_RUNS", raising=False)
    p = invoke_here("train", "--image", "docker://registry.example.org/fleetbox/paddle:cu126", "--dry-run",
                    cwd=tmp_path, command="fleetbox")
    assert p.returncode == 0, p.stderr
    assert [sbatch(p.stdout, k) for k in ("nodes", "partition", "account", "time", "gpus-per-node")] == [
        "2", "gpu", "proj123", "24:00:00", "4"]
    assert sbatch(p.stdout, "output").startswith(f"{tmp_path}/runs/train-")   # [paths] runs, beside the file
    assert "--variant cu126 (" in p.stdout.splitlines()[0]


def test_a_studys_lists_and_numbers_from_the_files_are_taken_as_its_command_line_would_take_them(project):
    """scale's --nodes and --procs-per-node are comma-separated lists: [job]'s number 4 and [scale]'s "1,2" (a
    traceback, then a refusal, before)."""
    site = project / "proj" / "fleetbox.toml"
    site.write_text(site.read_text() + '\n[scale]\nnodes = "1,2"\nprocs-per-node = 1\nimage = "fleetbox/paddle:cpu"\n')
    p = fleetbox(project, "scale", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert [ln.split(" (job ")[0] for ln in p.stdout.splitlines() if ln.startswith("# scale: run")] == [
        "# scale: run 1/2: fleetbox/paddle:cpu, 1 node(s) x 1 process(es)",
        "# scale: run 2/2: fleetbox/paddle:cpu, 2 node(s) x 1 process(es)"]


def test_what_the_command_line_gives_after_a_double_dash_or_for_another_task_is_not_this_tasks(project):
    site = project / "proj" / "fleetbox.toml"
    site.write_text(site.read_text() + 'args = "--epochs 1"\n[cache]\nfrom = "seed.tar"\n')   # [cache]'s from_
    p = fleetbox(project, "train", "--dry-run", "--", "--lr", "0.1")
    assert p.returncode == 0, p.stderr
    assert "--args" not in p.stdout.splitlines()[0] and "/workspace/smoke.py --lr 0.1 &\n" in p.stdout


def test_a_project_file_another_user_owns_is_not_read(project):
    """As git trusts a repository: someone's /tmp/fleetbox.toml must not choose your engines, mounts or image."""
    import os
    site = project / "proj" / "fleetbox.toml"
    os.chown(site, 12345, 12345)
    p = fleetbox(project, "config")
    assert p.returncode == 0 and p.stdout.startswith("project file: none"), p.stdout
    os.chown(site, os.getuid(), os.getgid())
    assert fleetbox(project, "config").stdout.startswith(f"project file: {site}")
