"""How fleetbox tells a script that starts its own ranks (paddle.distributed.spawn) from one Paddle's launcher
starts once per rank, from its source, and what it does with each: the command, one node, how many ranks."""

import textwrap

import pytest

from fleetbox import ROOT
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import backends, result, styles
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends.docker import DockerBackend, node_gpus
from fleetbox.settings import WORKDIR


@pytest.mark.parametrize("source,nprocs,line", [
    ("import paddle.distributed as dist\ndist.spawn(train, nprocs=2)", 2, 2),
    ("import paddle\n\npaddle.distributed.spawn(train, (), 4)", 4, 3),
    ("from paddle import distributed as d\nd.spawn(train)", 0, 2),
    ("from paddle.distributed import spawn\nspawn(train, nprocs=n)", 0, 2),
    ("from paddle.distributed import spawn as sp\nif __name__ == '__main__':\n    sp(main, args=(1,), nprocs=3)", 3, 3),
    ("from paddle.distributed.spawn import spawn\nspawn(train, nprocs=2)", 2, 2),
    ("import paddle as pd\npd.distributed.spawn(train, nprocs=2)", 2, 2),
    ("import paddle.distributed.spawn as sp\nsp(train, nprocs=2)", 2, 2),
])
def test_a_spawn_call_is_seen_however_it_is_imported_with_its_nprocs(source, nprocs, line):
    s = styles.of_source(source)
    assert (s.spawns, s.nprocs, s.line) == (True, nprocs, line)


@pytest.mark.parametrize("source", [
    "import paddle.distributed as dist\ndist.init_parallel_env()",
    "import multiprocessing as mp\nmp.get_context('spawn').Process(target=f).spawn()",   # another spawn
    "from os import spawn\nspawn(1)",
    "def spawn(f, nprocs): pass\nspawn(train, nprocs=2)",   # the script's own function
    "this is not python (",
    pytest.param("x = " + "1+" * 100000 + "1", id="nested-too-deep-for-the-parser"),   # Python says so when run
    pytest.param("import paddle.distributed as d\nd.spawn(f, nprocs=" + "-" * 900 + "1)",
                 id="a-count-too-deep-to-write-back"),   # left to Python: too deep to read here
])
def test_a_script_without_paddles_spawn_is_launched(source):
    """Also one too deep to read here: never a RecursionError (its count written back raised one)."""
    assert styles.of_source(source) == styles.LAUNCHED


def test_a_name_of_any_length_is_read():
    """A call on a name of 1500 attributes raised RecursionError; the spawn call after it is still seen."""
    s = styles.of_source("import paddle\n(a" + ".b" * 1500 + ")()\npaddle.distributed.spawn(f, nprocs=2)")
    assert (s.spawns, s.nprocs, s.line) == (True, 2, 3)


def test_a_script_bigger_than_a_training_script_is_left_to_python():
    """Generated, not written: parsing 2 million lines took a minute. One that spawns is then run as launched,
    where Paddle's spawn says in one line that it refuses to."""
    spawning = "import paddle.distributed as dist\ndist.spawn(train, nprocs=2)\n"
    assert styles.of_source(spawning + "x = 1\n" * 1000).spawns
    assert styles.of_source(spawning + "#" * styles.MAX_SOURCE) == styles.LAUNCHED


def test_the_examples_are_told_apart():
    assert styles.of_script(ROOT / "train" / "spawn_smoke.py") == styles.Style(True, 2, 9, "2")
    for name in ("smoke.py", "lenet_mnist.py", "resnet_flowers.py", "fit.py"):
        assert not styles.of_script(ROOT / "train" / name).spawns, name


def spec_of(tmp_path, source, variant="cpu", **kw):
    """The job as `invoke train` reads it: Docker's own options (--hosts, --devices) go to its backend."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    own = {k: kw.pop(k) for k in ("hosts", "devices") if k in kw}
    return spec_mod.from_options(matrix.load().get(variant), docker(**own), script=str(script), **kw)


def docker(**own) -> DockerBackend:
    return DockerBackend(**backends.configure("docker", own))


SPAWN2 = "import paddle.distributed as dist\ndist.spawn(main, nprocs=2)\n"


def test_a_spawning_script_runs_by_itself_on_one_node_with_its_own_ranks(tmp_path):
    s = spec_of(tmp_path, SPAWN2, args="--steps 5")
    assert (s.spawns, s.nodes, s.procs_per_node) == (True, 1, 2)
    t = planner.template(s, "train-x", "/logs/{node}")
    assert t.command == ("python", f"{WORKDIR}/job.py", "--steps", "5")   # no launcher
    assert t.env["FLEETBOX_STYLE"] == "spawn" and planner.ranks_log_dir(t) == t.env["FLEETBOX_LOG_DIR"]
    launched = planner.template(spec_of(tmp_path, "print(1)\n"), "train-x", "/logs/{node}")
    assert launched.command[:3] == ("python", "-m", "paddle.distributed.launch")
    assert "FLEETBOX_STYLE" not in launched.env and planner.ranks_log_dir(launched) == launched.env[
        "FLEETBOX_PROGRESS_DIR"]
    assert spec_of(tmp_path, SPAWN2, nodes="1", procs_per_node="2").procs_per_node == 2


@pytest.mark.parametrize("source,kw,needle", [
    (SPAWN2, {"nodes": "2"}, "job.py:2 starts its own ranks (paddle.distributed.spawn), on the machine it runs on: "
                             "run it on one node (--nodes 1, one host)"),
    (SPAWN2, {"hosts": "ssh://a,ssh://b"}, "on the machine it runs on: run it on one node"),
    (SPAWN2, {"procs_per_node": "3"}, "with nprocs=2, but --procs-per-node gives 3 rank(s) a node"),
    (SPAWN2, {"variant": "cu126", "gpus_per_node": "4"}, "with nprocs=2, but --gpus-per-node gives 4 rank(s) a node"),
    ("import paddle.distributed as dist\ndist.spawn(main, nprocs=args.n)\n", {}, "with nprocs=args.n: give "
                                                                                "--procs-per-node N"),
    ("import paddle.distributed as dist\ndist.spawn(main)\n", {}, "with no nprocs (one rank per CPU or GPU it sees)"),
])
def test_a_spawning_script_fleetbox_cannot_place_is_one_line(tmp_path, source, kw, needle):
    with pytest.raises(UserError) as e:
        spec_of(tmp_path, source, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_spawning_script_whose_count_is_not_a_number_runs_with_the_count_given(tmp_path):
    s = spec_of(tmp_path, "import paddle.distributed as dist\ndist.spawn(main, nprocs=args.n)\n", procs_per_node="3")
    assert (s.spawns, s.nodes, s.procs_per_node) == (True, 1, 3)


@pytest.mark.parametrize("source,kw,procs", [
    ("import paddle.distributed as dist\ndist.spawn(main, nprocs=4)\n", {"devices": "0,1,2,3"}, 4),
    ("import paddle.distributed as dist\ndist.spawn(main)\n", {"devices": "0,1,2,3"}, 4),   # one per GPU it sees
    ("import paddle.distributed as dist\ndist.spawn(main)\n", {"gpus_per_node": "2"}, 2),
])
def test_a_spawning_scripts_gpus_are_all_its_one_nodes(tmp_path, source, kw, procs):
    """The GPUs given are one node's, not split among the two nodes a launched job would have."""
    s = spec_of(tmp_path, source, variant="cu126", **kw)
    assert (s.spawns, s.nodes, s.procs_per_node) == (True, 1, procs)
    b = docker(**{k: v for k, v in kw.items() if k == "devices"})
    assert node_gpus(s, 0, b.devices, b.sharing) == ",".join(map(str, range(procs)))


@pytest.mark.parametrize("said,why", [
    ("Exception: Process 1 terminated with exit code 3.", "its spawned rank 1 exited with exit code 3 (log: "
                                                           "workerlog.1)"),
    ("Exception: Process 0 terminated with signal SIGKILL.", "its spawned rank 0 was killed by SIGKILL"),
    ("Exception: \n\n----\nProcess 2 terminated with the following error:\nTraceback", "its spawned rank 2 raised "
                                                                                        "an error"),
    ("LAUNCH INFO 2024 status failed cmd python x log workerlog.1", ""),
])
def test_the_spawned_rank_that_ended_the_script_is_named_from_paddles_words(tmp_path, said, why):
    log = tmp_path / "container.log"
    log.write_text("step 9\n" + said + "\n")
    assert why in result.spawned_end(log) and bool(why) == bool(result.spawned_end(log))
    assert result.spawned_end(tmp_path / "absent.log") == ""


def test_only_the_end_of_a_long_log_is_read_for_the_spawned_ranks_end(tmp_path):
    log = tmp_path / "container.log"
    log.write_text("Process 0 terminated with exit code 9.\n" + "x" * (64 << 10) + "\n")
    assert result.spawned_end(log) == ""   # an earlier run's words, far above the end
    with log.open("a") as f:
        f.write("Process 1 terminated with exit code 3.\n")
    assert result.spawned_end(log).startswith("ended: its spawned rank 1 exited with exit code 3")
