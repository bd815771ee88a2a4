"""fleetbox's own sitecustomize. Run by every Python in a fleetbox job (the helpers folder is first on
PYTHONPATH), for hang detection; it does nothing outside a job (no FLEETBOX_PROGRESS_DIR).

- In a training rank (Paddle's launcher sets PADDLE_TRAINER_ID): faulthandler writes every thread's Python
  stack to <log folder>/stacks-rank<r>.txt on SIGUSR2 (a C-level handler: it works while the rank is stuck in
  a collective or holds the GIL; SIGTERM and SIGUSR1 belong to fleetbox_checkpoint), the rank's progress
  file is started with its pid, and once the script has imported Paddle, the calls that end a training step
  report one (fleetbox_progress.auto_step): a script needs no line of ours for its hangs to be seen, nor for
  its loss and learning rate (fleetbox_found).
- In Paddle's launcher: a thread waits for fleetbox's request (<log folder>/STACKS-REQUEST, written from
  outside the container on every runtime) and sends SIGUSR2 to the ranks of this node, which only this
  container's processes can signal.
- In a script that starts its own ranks (paddle.distributed.spawn; fleetbox runs it without the launcher and
  sets FLEETBOX_STYLE=spawn): a spawned process becomes a rank only when Paddle's spawn has given it its rank
  variables, so Paddle's `_set_trainer_env` is wrapped as its module loads; then the rank's output goes to
  <log folder>/workerlog.<rank>, as the launcher's ranks' does, and it is set up as above. The script's own
  process relays requests for stacks, as the launcher does, and once it calls spawn passes SIGTERM and SIGUSR1
  ("save and stop") on to its ranks, as the launcher does.

- In every process of a job: a VisualDL LogWriter the script makes (paddle.callbacks.VisualDL makes one) with
  a relative logdir writes below the node's log folder (FLEETBOX_VISUALDL_DIR, rank<r>/<logdir>): the
  workspace is read-only, and there `invoke board` shows it beside fleetbox's own.

Then the next sitecustomize on the path, if any (Debian's), runs as it would have.
"""
import os
import signal
import sys

STACKS_SIGNAL = signal.SIGUSR2
REQUEST = "STACKS-REQUEST"


def _rank_setup(d: str) -> None:
    import faulthandler

    import fleetbox_progress
    owner = os.environ.get(fleetbox_progress.OWNER_ENV)
    if owner and owner != str(os.getpid()):   # a rank's child (a subprocess, a spawned worker): not a rank
        return
    os.environ[fleetbox_progress.OWNER_ENV] = str(os.getpid())
    out = open(os.path.join(d, f"stacks-rank{fleetbox_progress.rank()}.txt"), "a")   # open for the process's life
    faulthandler.register(STACKS_SIGNAL, file=out, all_threads=True)
    fleetbox_progress.started()
    _hook_steps()


WRAPPED = "_fleetbox_step"   # set on the wrappers: a class is wrapped once


def _wrap(owner, name: str, through) -> None:
    """owner.name (a class's own method, or a module's function) made to run as through(f, *args, **kwargs)."""
    import functools
    f = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if not callable(f) or getattr(f, WRAPPED, False):
        return

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return through(f, *args, **kwargs)
    setattr(wrapped, WRAPPED, True)
    setattr(owner, name, wrapped)


def _paddle_ready():
    """Paddle, once the script's `import paddle` has finished (never imported here: a rank may not use it)."""
    p = sys.modules.get("paddle")
    done = p is not None and all(hasattr(p, a) for a in ("optimizer", "static", "io", "save", "load"))
    return p if done else None


def _loader_iterators(p) -> list:
    """The classes whose __next__ gives a DataLoader's batches (single- and multi-process)."""
    module = sys.modules.get("paddle.io.dataloader.dataloader_iter")
    return [v for k, v in vars(module).items() if isinstance(v, type) and k.startswith("_DataLoaderIter")] \
        if module is not None else []


def _hook_steps() -> None:
    """As the script's `import paddle` finishes (or now, where it has: a spawned rank), wraps what shows a rank
    going on: every optimizer class's step, and minimize in dynamic mode (Adam and others define their own step;
    paddle.Model's train_batch calls minimize; in static mode minimize builds the graph), Executor.run (static
    graph), a data loader's next batch (an evaluation goes on without an optimizer); paddle.save and paddle.load
    run as declared phases (a long save is no hang). The same wrappers, with backward() and a GradScaler's scale,
    give fleetbox_found each step's loss, learning rate and batch."""
    import fleetbox_found as found
    import fleetbox_progress as progress

    def optimizer_step(f, optimizer, *args, **kwargs):
        with found.step(optimizer):
            out = f(optimizer, *args, **kwargs)
        progress.auto_step()
        return out

    def loader_next(f, it):
        out = f(it)
        found.batch(out)
        progress.auto_step()
        return out

    def backward(f, tensor, grad_tensor=None, *args, **kwargs):
        found.backward(tensor, grad_tensor)
        return f(tensor, grad_tensor, *args, **kwargs)

    def scale(f, scaler, var, *args, **kwargs):
        out = f(scaler, var, *args, **kwargs)
        found.scaled(out, var)
        return out

    def scaler_step(f, scaler, optimizer, *args, **kwargs):   # a step, also where an overflow skips the optimizer's
        with found.step(optimizer):
            return f(scaler, optimizer, *args, **kwargs)

    def in_phase(name):
        def through(f, *args, **kwargs):
            with progress.phase(name):
                return f(*args, **kwargs)
        return through

    def install(p):
        def minimize(f, optimizer, loss, *args, **kwargs):
            if p.in_dynamic_mode():
                return optimizer_step(f, optimizer, loss, *args, **kwargs)
            out = f(optimizer, loss, *args, **kwargs)   # static: the graph is built, no step taken
            found.minimised(optimizer, loss)
            return out

        def executor_run(f, exe, *args, **kwargs):
            out = f(exe, *args, **kwargs)
            found.ran(args[0] if args else kwargs.get("program"),
                      args[2] if len(args) > 2 else kwargs.get("fetch_list"), out)
            progress.auto_step()
            return out
        try:
            base = p.optimizer.Optimizer
            for c in {base, *(v for v in vars(p.optimizer).values() if isinstance(v, type) and issubclass(v, base))}:
                _wrap(c, "step", optimizer_step)
                _wrap(c, "minimize", minimize)
            _wrap(p.static.Executor, "run", executor_run)
            for c in _loader_iterators(p):
                _wrap(c, "__next__", loader_next)
            _wrap(p.Tensor, "backward", backward)
            scalers = sys.modules.get("paddle.amp.grad_scaler")
            for c in vars(scalers).values() if scalers is not None else ():
                if isinstance(c, type) and c.__module__ == scalers.__name__:   # its own, not what it imports
                    _wrap(c, "scale", scale)
                    _wrap(c, "step", scaler_step)
                    _wrap(c, "minimize", scaler_step)
            _wrap(p, "save", in_phase("paddle.save"))
            _wrap(p, "load", in_phase("paddle.load"))
        except Exception as e:   # another Paddle's layout: the script's own reports still count
            print(f"fleetbox: no steps seen in the training itself: {type(e).__name__}: {e}", file=sys.stderr)
    if (p := _paddle_ready()) is not None:
        install(p)
    else:
        sys.meta_path.insert(0, _WhenLoads("paddle", install))


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def asked(d: str) -> str:
    """The request for stacks now in the node's log folder ("" for none)."""
    try:
        with open(os.path.join(d, REQUEST)) as f:
            return f.read().strip()
    except OSError:
        return ""


def pass_on(d: str, done: str) -> str:
    """A request other than `done` is sent on to this node's ranks: the launcher's own children whose pids
    their progress files give (SIGUSR2 kills a process that did not register it). Returns the request now."""
    import glob
    import json
    now = asked(d)
    if not now or now == done:
        return done
    for p in glob.glob(os.path.join(glob.escape(d), "progress-rank*.json")):
        try:
            with open(p) as f:
                pid = int(json.load(f)["pid"])
            if pid > 1 and _parent(pid) == os.getpid():
                os.kill(pid, STACKS_SIGNAL)
        except (OSError, ValueError, KeyError, TypeError):
            pass   # a rank that has ended, or a file being replaced: the others still dump
    return now


def _relay(d: str) -> None:
    """In the launcher, a thread: every request for stacks after its start is passed on (one an earlier run
    left is not)."""
    import threading
    import time

    def loop():
        done = asked(d)
        while True:
            time.sleep(0.5)
            done = pass_on(d, done)
    threading.Thread(target=loop, name="fleetbox-stacks-relay", daemon=True).start()


OURS = b"fleetbox's own sitecustomize"   # in the first line of this file


def _ours(folder: str) -> bool:
    """The folder holds a copy of this file (another checkout's helpers, say): running it would run this again."""
    try:
        with open(os.path.join(folder or ".", "sitecustomize.py"), "rb") as f:
            return OURS in f.read(256)
    except OSError:
        return False


def _next_sitecustomize() -> None:
    """The sitecustomize this one shadows (the next on sys.path that is not a copy of this one), run as its own
    module."""
    import importlib.machinery
    import importlib.util
    rest = [p for p in sys.path if not _ours(p)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:   # as Python treats a failing sitecustomize: never fatal
            pass


SPAWN_MODULE = "paddle.distributed.spawn"
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)   # fleetbox_checkpoint's "save and stop"


def _spawned_rank() -> None:
    """In a spawned process, just after Paddle's spawn set its rank variables: its log, then as a rank."""
    r = os.environ.get("PADDLE_TRAINER_ID")
    if r is None:
        return
    for sig in FORWARDED:   # a forked rank inherits the script's forwarding: its own signals are its own again
        if signal.getsignal(sig) is _forward:
            signal.signal(sig, signal.SIG_DFL)
    os.environ.setdefault("PADDLE_LOCAL_RANK", r)   # one node: the rank is the rank in the node
    logs = os.environ.get("FLEETBOX_LOG_DIR")
    try:
        if logs:
            os.makedirs(logs, exist_ok=True)
            fd = os.open(os.path.join(logs, f"workerlog.{int(r)}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    except OSError as e:   # its output stays in the script's; hang detection below still holds
        print(f"fleetbox: rank {r}'s output stays in the script's: {e}", file=sys.stderr)
    d = os.environ.get("FLEETBOX_PROGRESS_DIR")
    if d and os.path.isdir(d):
        _rank_setup(d)


def _wrap_spawn_module(module) -> None:
    """Paddle's spawn module, as it loads (before `paddle.distributed` binds its `spawn`): in a spawned process,
    setting the rank variables makes it a rank; in the script's process, calling spawn passes the "save and
    stop" signals on (Paddle's import replaced any handler set earlier with its own, which exits at once)."""
    import functools
    trainer_env, spawn = getattr(module, "_set_trainer_env", None), getattr(module, "spawn", None)
    if not callable(trainer_env) or not callable(spawn):   # another Paddle's layout: the ranks still run
        print("fleetbox: Paddle's spawn is not as expected: its ranks' output stays in the script's, unwatched",
              file=sys.stderr)
        return

    @functools.wraps(trainer_env)
    def set_then_become_a_rank(*args, **kwargs):
        trainer_env(*args, **kwargs)
        try:
            _spawned_rank()
        except Exception as e:   # a help, never a reason for a rank not to run
            print(f"fleetbox: this spawned rank has no log or hang detection of its own: {type(e).__name__}: {e}",
                  file=sys.stderr)

    @functools.wraps(spawn)
    def spawn_passing_signals_on(*args, **kwargs):
        try:
            for sig in FORWARDED:
                signal.signal(sig, _forward)
        except ValueError:   # spawn called from another thread than the main one: signals stay Paddle's
            pass
        return spawn(*args, **kwargs)
    module._set_trainer_env = set_then_become_a_rank
    module.spawn = spawn_passing_signals_on


class _WhenLoads:
    """A finder that loads module `name` as usual, then calls then(module) (once)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        import importlib.machinery
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.then(module)
        spec.loader.exec_module = exec_module
        return spec


VISUALDL_MODULE = "visualdl.writer.writer"   # VisualDL's LogWriter (paddle.callbacks.VisualDL makes one)


def visualdl_logdir(logdir, folder: str, rank: str):
    """Where a LogWriter of the script writes: a relative (or no) logdir goes below `folder`/rank<rank> (the node's
    log folder: the workspace is read-only, and there the board finds it), as the path it names, less any `..`;
    an absolute or remote one (bos://, hdfs://) is the script's to choose."""
    if isinstance(logdir, bytes):
        logdir = os.fsdecode(logdir)
    if logdir and (os.path.isabs(logdir) or "://" in str(logdir)):
        return logdir
    parts = [p for p in os.path.normpath(str(logdir or "runs")).split(os.sep) if p not in ("", ".", "..")]
    return os.path.join(folder, f"rank{rank}", *parts)


def _wrap_log_writer(module) -> None:
    import functools
    cls = getattr(module, "LogWriter", None)
    init = getattr(cls, "__init__", None)
    folder = os.environ.get("FLEETBOX_VISUALDL_DIR")
    if not callable(init) or not folder:
        return

    @functools.wraps(init)
    def init_in_the_job_folder(self, logdir=None, *args, **kwargs):
        if not logdir:   # VisualDL's own default: runs/<time>[.<comment>]
            from datetime import datetime
            comment = args[0] if args else kwargs.get("comment", "")
            logdir = os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + (f".{comment}" if comment else ""))
        init(self, visualdl_logdir(logdir, folder, os.environ.get("PADDLE_TRAINER_ID", "0")), *args, **kwargs)
    cls.__init__ = init_in_the_job_folder


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ranks() -> list[int]:
    """The ranks this process spawned: its children started by multiprocessing's spawn (--multiprocessing-fork)
    or forked from it (its own command line), and a forkserver's children in its stead; not the resource
    tracker, a Manager's server or the script's own subprocesses, which the signal would end."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            children.setdefault(_parent(int(p)), []).append(int(p))
    me, out = _cmdline(os.getpid()), []
    for pid in children.get(os.getpid(), []):
        c = _cmdline(pid)
        if b"multiprocessing.forkserver" in c:
            out += children.get(pid, [])
        elif b"--multiprocessing-fork" in c or c == me:
            out.append(pid)
    return out


def _forward(signum, frame) -> None:
    for pid in _ranks():
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _spawn_setup() -> None:
    """Every process of a script that starts its own ranks, before the rank variables are set."""
    sys.meta_path.insert(0, _WhenLoads(SPAWN_MODULE, _wrap_spawn_module))
    if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):   # a spawned process: a rank once told
        return
    d = os.environ.get("FLEETBOX_PROGRESS_DIR")
    if d and os.path.isdir(d):
        _relay(d)


def _main() -> None:
    d = os.environ.get("FLEETBOX_PROGRESS_DIR")
    try:
        if os.environ.get("FLEETBOX_VISUALDL_DIR"):
            sys.meta_path.insert(0, _WhenLoads(VISUALDL_MODULE, _wrap_log_writer))
        if os.environ.get("PADDLE_TRAINER_ID") is not None:
            if d and os.path.isdir(d):
                _rank_setup(d)
        elif os.environ.get("FLEETBOX_STYLE") == "spawn":
            _spawn_setup()
        elif d and os.path.isdir(d) and "paddle.distributed.launch" in getattr(sys, "orig_argv", ()):
            _relay(d)
    except Exception as e:   # detection is a help, never a reason for a rank not to start
        print(f"fleetbox: no hang detection in this process: {type(e).__name__}: {e}", file=sys.stderr)
    _next_sitecustomize()


_main()
