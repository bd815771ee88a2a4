"""The in-container side of hang detection, in real processes on the host: sitecustomize makes a rank dump
every thread's stack on SIGUSR2 and starts its progress file, a rank's own child processes stay out of it, and
the launcher's relay passes on only a new request, only to its own children."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fleetbox import settings
from fleetbox.incontainer import fleetbox_progress
from fleetbox.incontainer import sitecustomize as site
from fleetbox.processes import process_start

# "ready" is printed from inside stuck_here: once it is read, stuck_here is on the main thread's stack (printed
# before the call, a signal could catch the thread still at module level: 18 runs in 60 under load)
SLEEPER = "import sys, time\ndef stuck_here():\n    print('ready', flush=True)\n    time.sleep(60)\nstuck_here()\n"


def rank_process(tmp_path, **env):
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(settings.HELPERS), "FLEETBOX_PROGRESS_DIR": str(tmp_path),
                              "PADDLE_TRAINER_ID": "3", **env})
    assert p.stdout.readline() == "ready\n"
    return p


def test_a_rank_dumps_every_threads_stack_on_sigusr2_and_keeps_going(tmp_path):
    p = rank_process(tmp_path)
    try:
        rec = json.loads((tmp_path / "progress-rank3.json").read_text())
        assert rec["pid"] == p.pid and rec["step"] is None and rec["reports"] is False
        p.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while "stuck_here" not in (tmp_path / "stacks-rank3.txt").read_text():
            assert time.monotonic() < deadline, "no stacks"
            time.sleep(0.05)
        assert p.poll() is None   # a dump, not a death
    finally:
        p.kill()
        p.wait()
    assert json.loads((tmp_path / "progress-rank3.json").read_text())["done"] is False   # SIGKILL: no atexit


def test_a_ranks_child_process_writes_no_progress_and_takes_no_signal(tmp_path):
    """A subprocess or a spawned worker inherits the rank's environment: it must not take over its files."""
    p = rank_process(tmp_path, FLEETBOX_PROGRESS_PID="1")   # the rank is another process
    try:
        assert not (tmp_path / "progress-rank3.json").exists() and not (tmp_path / "stacks-rank3.txt").exists()
    finally:
        p.kill()
        p.wait()


def test_progress_is_only_the_owners(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    monkeypatch.setenv(fleetbox_progress.OWNER_ENV, str(os.getpid()))
    assert fleetbox_progress.path() == str(tmp_path / "progress-rank2.json")
    monkeypatch.setenv(fleetbox_progress.OWNER_ENV, str(os.getpid() + 1))
    assert fleetbox_progress.path() is None


def test_the_relay_passes_on_only_a_new_request_and_only_to_its_own_children(tmp_path):
    mine = subprocess.Popen(["sleep", "60"])                        # a rank: the launcher's (our) child
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    stranger = int(out.stdout)                                      # reparented away: not ours
    try:
        for r, pid in ((0, mine.pid), (1, stranger), (2, 0), (3, -1)):
            (tmp_path / f"progress-rank{r}.json").write_text(json.dumps({"pid": pid}))
        (tmp_path / "STACKS-REQUEST").write_text("left by an earlier run\n")
        done = site.asked(str(tmp_path))                             # what the relay takes at its start
        assert site.pass_on(str(tmp_path), done) == done and mine.poll() is None
        (tmp_path / "STACKS-REQUEST").write_text("0-1234.5\n")
        assert site.pass_on(str(tmp_path), done) == "0-1234.5"
        assert mine.wait(timeout=10) == -signal.SIGUSR2               # it got the signal (and, unregistered, died)
        assert process_start(stranger)                               # the stranger did not (not even a zombie)
        assert site.pass_on(str(tmp_path), "0-1234.5") == "0-1234.5"
    finally:
        mine.kill()
        mine.wait()
        if process_start(stranger):
            os.kill(stranger, signal.SIGKILL)


def test_a_second_copy_of_the_helpers_on_the_path_runs_once_and_the_sites_own_sitecustomize_still_runs(tmp_path):
    """As in an env made by `invoke venv` with an older copy of the helpers, or two checkouts: each copy skips
    the others (they ran it into a RecursionError before), and the next sitecustomize that is not ours runs."""
    import shutil
    copy, site_dir = tmp_path / "copy", tmp_path / "site"
    copy.mkdir()
    site_dir.mkdir()
    for f in settings.HELPERS.glob("*.py"):
        shutil.copy(f, copy / f.name)
    (site_dir / "sitecustomize.py").write_text("import os\nprint('site ran', os.getpid(), flush=True)\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{settings.HELPERS}:{copy}:{site_dir}",
                               "FLEETBOX_PROGRESS_DIR": str(logs), "PADDLE_TRAINER_ID": "0"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [f"site ran {proc.stdout.split()[2]}", "ok"]   # once, then the script
    assert (logs / "progress-rank0.json").exists()


# Paddle's layout as far as the step hooks read it (the real one is a 100 MB wheel; the integration tests train
# with it): optimizer classes, Adam with its own step, a static Executor, a data loader's iterator, save and load
FAKE_PADDLE = {
    "paddle/__init__.py": "from paddle import amp, io, optimizer, static\nDYNAMIC = [True]\n"
                          "class Tensor:\n    def backward(self, grad_tensor=None):\n        pass\n"
                          "def in_dynamic_mode():\n    return DYNAMIC[0]\n"
                          "def save(obj, path):\n    import fleetbox_progress\n"
                          "    print('phase while saving:', fleetbox_progress._state['phase'])\n"
                          "def load(path):\n    return {}\n",
    "paddle/optimizer/__init__.py": "from paddle.optimizer.optimizer import Optimizer\n"
                                    "class Adam(Optimizer):\n    def step(self):\n        pass\n",
    "paddle/optimizer/optimizer.py": "class Optimizer:\n    def step(self):\n        pass\n"
                                     "    def minimize(self, loss):\n        pass\n",
    "paddle/static/__init__.py": "class Executor:\n    def run(self, program=None):\n        return []\n",
    "paddle/io/__init__.py": "from paddle.io.dataloader import dataloader_iter\n",
    "paddle/amp/__init__.py": "from paddle.amp import grad_scaler\n",
    "paddle/amp/grad_scaler.py": "class AmpScaler:\n    def scale(self, var):\n        return var\n",
    "paddle/io/dataloader/__init__.py": "",
    "paddle/io/dataloader/dataloader_iter.py": "class _DataLoaderIterSingleProcess:\n    def __init__(self):\n"
                                              "        self.left = [1, 2]\n    def __iter__(self):\n"
                                              "        return self\n    def __next__(self):\n"
                                              "        if not self.left:\n            raise StopIteration\n"
                                              "        return self.left.pop()\n",
}
HOOKED = ("import time\nimport paddle\nend = time.monotonic() + 20\n"   # the hooks' thread, not a fixed sleep
          "while not getattr(paddle.save, '_fleetbox_step', False):\n    assert time.monotonic() < end\n"
          "    time.sleep(0.01)\n")


def plain_script(tmp_path, body: str) -> tuple[dict, str]:
    """Run `body` as a rank (a script with no line of ours) with the stand-in Paddle, once its hooks are in:
    (its progress record, its output)."""
    for name, text in FAKE_PADDLE.items():
        (tmp_path / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / name).write_text(text)
    out = subprocess.run([sys.executable, "-c", HOOKED + body], check=True, timeout=60, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": f"{settings.HELPERS}:{tmp_path / 'lib'}",
                                          "FLEETBOX_PROGRESS_DIR": str(tmp_path), "PADDLE_TRAINER_ID": "1"}).stdout
    return json.loads((tmp_path / "progress-rank1.json").read_text()), out


def test_a_script_with_no_line_of_ours_reports_each_step_from_the_training_itself(tmp_path):
    """An optimizer's step (Adam's own too), minimize in dynamic mode only (in static mode it builds the graph), a
    static program's run and a data loader's batches each report a step, their results the originals'; paddle.save
    runs inside a declared phase."""
    rec, out = plain_script(tmp_path, "opt = paddle.optimizer.Adam()\nfor _ in range(3):\n    opt.step()\n"
                                      "paddle.optimizer.Optimizer().minimize(1.0)\n"
                                      "paddle.DYNAMIC[0] = False\npaddle.optimizer.Optimizer().minimize(1.0)\n"
                                      "assert paddle.static.Executor().run() == []\n"
                                      "from paddle.io.dataloader.dataloader_iter import _DataLoaderIterSingleProcess\n"
                                      "assert list(_DataLoaderIterSingleProcess()) == [2, 1]\n"
                                      "paddle.save({}, 'x')\n")
    assert rec["step"] == 7 and rec["reports"] and rec["done"] and rec["phase"] is None, rec
    assert "phase while saving: paddle.save" in out


def test_a_scripts_own_steps_win_over_those_seen_in_the_training(tmp_path):
    rec, _ = plain_script(tmp_path, "import fleetbox_progress\nopt = paddle.optimizer.Adam()\n"
                                    "fleetbox_progress.step(100)\nfor _ in range(3):\n    opt.step()\n")
    assert rec["step"] == 100, rec


# Paddle's spawn module as far as sitecustomize relies on it (3.3.1 and 2.6.2 alike): the children get their rank
# variables from _set_trainer_env, called through the module's global by _func_wrapper, then run the function
STAND_IN_SPAWN = '''import multiprocessing, os
def _set_trainer_env(env_dict, backend):
    for k, v in env_dict.items():
        os.environ[k] = v
def _func_wrapper(func, args, env_dict, backend):
    _set_trainer_env(env_dict, backend)
    func(*args)
def spawn(func, args=(), nprocs=-1, join=True, daemon=False, **options):
    mp = multiprocessing.get_context(options.get("start_method", "spawn"))
    ps = [mp.Process(target=_func_wrapper, args=(func, args, {"PADDLE_TRAINER_ID": str(i)}, "gloo"))
          for i in range(nprocs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    return [p.exitcode for p in ps]
'''
SPAWNING_SCRIPT = '''import os, signal, sys, time
import paddle.distributed as dist
def train():
    r = os.environ["PADDLE_TRAINER_ID"]
    if r == "0":   # as the checkpoint helper does; rank 1 keeps the default: SIGTERM ends it
        signal.signal(signal.SIGTERM, lambda *a: (print(f"rank {r} asked to stop", flush=True), sys.exit(0)))
    print(f"hello from rank {r}", flush=True)
    open(os.path.join(os.environ["READY"], r), "w").close()
    time.sleep(60)
if __name__ == "__main__":
    print("the script's own line", flush=True)
    print("exits", dist.spawn(train, nprocs=2, start_method=sys.argv[1]), flush=True)
'''


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_a_scripts_spawned_processes_become_ranks_with_their_own_logs_and_take_the_stop_signal(tmp_path,
                                                                                               start_method):
    """FLEETBOX_STYLE=spawn: each process Paddle's spawn starts writes its own workerlog.<rank> and progress file
    once its rank is set, and SIGTERM to the script (a container's first process) reaches every rank, through
    a forkserver too."""
    pkg = tmp_path / "site" / "paddle" / "distributed"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .spawn import spawn\n")
    (pkg / "spawn.py").write_text(STAND_IN_SPAWN)
    (tmp_path / "job.py").write_text(SPAWNING_SCRIPT)
    logs, ready = tmp_path / "logs", tmp_path / "ready"
    logs.mkdir()
    ready.mkdir()
    p = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), start_method], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": f"{settings.HELPERS}:{tmp_path / 'site'}",
                              "FLEETBOX_STYLE": "spawn", "FLEETBOX_LOG_DIR": str(logs),
                              "FLEETBOX_PROGRESS_DIR": str(logs), "READY": str(ready)})
    try:
        deadline = time.monotonic() + 30
        while len(list(ready.iterdir())) < 2:
            assert time.monotonic() < deadline and p.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        pids = {json.loads((logs / f"progress-rank{r}.json").read_text())["pid"] for r in (0, 1)}
        assert len(pids) == 2 and p.pid not in pids   # each spawned process is its rank, the script none
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    # the forwarding is the script's own: a forked rank without a handler of its own ends as SIGTERM ends it
    assert p.returncode == 0 and "exits [0, -15]" in out and "hello" not in out, out
    assert (logs / "workerlog.0").read_text() == "hello from rank 0\nrank 0 asked to stop\n"
    assert (logs / "workerlog.1").read_text() == "hello from rank 1\n"


def test_a_visualdl_logdir_of_the_script_lands_in_the_nodes_log_folder_unless_absolute_or_remote():
    folder = "/fleetbox/logs/visualdl"
    assert site.visualdl_logdir("vdl_log", folder, "3") == "/fleetbox/logs/visualdl/rank3/vdl_log"
    assert site.visualdl_logdir("./out/../../x/./y", folder, "0") == "/fleetbox/logs/visualdl/rank0/x/y"
    assert site.visualdl_logdir("../../etc", folder, "0") == "/fleetbox/logs/visualdl/rank0/etc"   # never above
    assert site.visualdl_logdir(".", folder, "1") == "/fleetbox/logs/visualdl/rank1"
    assert site.visualdl_logdir("/data/vdl", folder, "0") == "/data/vdl"
    assert site.visualdl_logdir("bos://bucket/vdl", folder, "0") == "bos://bucket/vdl"
    assert site.visualdl_logdir(b"vdl", folder, "0") == "/fleetbox/logs/visualdl/rank0/vdl"


def test_a_phase_is_written_at_once_by_the_flusher_never_by_the_training_thread(tmp_path):
    """Every paddle.save and paddle.load is a phase: its write (244 µs a call on a local disk, more on the shared
    file system of a Slurm job's log folder) ran in the training thread."""
    probe = ("import json, os, threading, time\nimport fleetbox_progress as fp\nwho, real = [], os.replace\n"
             "def replace(a, b):\n    who.append(threading.current_thread().name)\n    return real(a, b)\n"
             "os.replace = replace\nfp.step(1)\nwith fp.phase('paddle.save'):\n    end = time.monotonic() + 10\n"
             "    while time.monotonic() < end:\n        try:\n            if json.load(open(fp.path()))['phase']:\n"
             "                break\n        except (OSError, ValueError):\n            pass\n"
             "        time.sleep(0.01)\nprint(json.dumps([json.load(open(fp.path()))['phase'], who]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(settings.HELPERS),
                              "FLEETBOX_PROGRESS_DIR": str(tmp_path)}).stdout
    phase, who = json.loads(out)
    assert phase == "paddle.save" and who and set(who) == {"fleetbox-progress"}, who
