"""fleetbox front door: `fleetbox --list` (or `invoke --list` in the checkout) shows every task, `fleetbox --help
TASK` every option.

Each task parses its options and calls the package; user errors end as one line and a non-zero exit. A task
imports its part of the package when it runs (`invoke --list` and `--help` load only the backends' registry,
which adds their options). The options of the tasks that run a job are declared once (fleetbox/run/spec.py, a
backend's on its class): _job_task makes those tasks' options and help from the declarations.
"""

import functools
import inspect
import os
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import invoke
from invoke import Collection, Exit

from fleetbox import errors, settings
from fleetbox.errors import Failed, UserError
from fleetbox.options import Option, spelled
from fleetbox.run import backends
from fleetbox.run import spec as spec_mod

DECLARED = {**spec_mod.OPTIONS, **{o.name: o for _, o in backends.all_options()},
            backends.BACKEND.name: backends.BACKEND}
VARIANT_HELP = DECLARED["variant"].help
SIGN_KEY_HELP = ("an SSH key (a private key file, or a public one whose key is in ssh-agent) that signs the image's "
                 "provenance statement, offline (ssh-keygen -Y sign)")


class Task(invoke.Task):
    """invoke's Task, whose options keep their help once a parser has it (invoke's takes it out of the task: a
    second parse in one process, the docs' pages or a test's, found none)."""
    def get_arguments(self, ignore_unknown_help=None):
        kept = dict(self.help)
        try:
            return super().get_arguments(ignore_unknown_help)
        finally:
            self.help = kept


def task(*args, **kwargs):
    """invoke's @task, without one-letter flags: invoke made them from each task's own option names, so `-d` was
    --dry-run for build and --debug for train, and `-p gpu` was --procs-per-node. Every option is spelled out."""
    return invoke.task(*args, auto_shortflags=False, klass=Task, **kwargs)


def _refuse_invokes_own(argv: list[str], fn) -> None:
    """No fleetbox option has one letter, but invoke takes its own options anywhere on the line: `invoke train -d`
    or `--dry` ran the real job (invoke's --debug, or its --dry, which only its own `run` heeds), where --dry-run
    was meant. One of them after the task's name is refused; a value given to one of ours is passed over."""
    import invoke
    words = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    named = next((i for i, w in enumerate(words) if not w.startswith("-")), len(words))
    params = {spelled(n): p for n, p in list(inspect.signature(fn).parameters.items())[1:]}
    params |= {spelled(o.name): None for _, o in backends.all_options()}
    invokes = {n for a in invoke.Program().core_args() for n in a.names} - set(params)
    rest, i = words[named + 1:], 0
    while i < len(rest):
        w = rest[i]
        name = w[2:].split("=", 1)[0] if w.startswith("--") else ""
        if re.fullmatch(r"-[A-Za-z]+", w) or name in invokes:
            raise UserError(f"{w} is invoke's own option, not fleetbox's: fleetbox's options are spelled out "
                            f"(`invoke --help TASK` lists them)")
        takes = name in params and (params[name] is None or not isinstance(params[name].default, bool))
        i += 2 if takes and "=" not in w else 1   # the value of one of ours is passed over, whatever it looks like


def _options_of(fn) -> dict:
    """A task's options as declared (DECLARED), or as its own parameter's default says (a flag, a number, a
    string)."""
    declared, out = getattr(fn, "__options__", {}), {}
    for name, p in list(inspect.signature(fn).parameters.items())[1:]:
        if p.kind is p.VAR_KEYWORD or p.default is p.empty:   # a positional (a job's id) is always given
            continue
        kind = type(p.default) if isinstance(p.default, (bool, int)) else str
        out[name] = declared.get(name) or Option(name.rstrip("_"), "", p.default, kind)
    return out


def _site_defaults(fn, args, kwargs) -> tuple[dict, dict]:
    """The task's values with what the site files give the options the command line did not: (values, what came
    from the files by name). Given: named on this command line, or a value other than the default (a Python
    caller's)."""
    from fleetbox.commands import config
    name = spelled(fn.__name__)
    bound = inspect.signature(fn).bind(None, *args, **kwargs)
    bound.apply_defaults()
    values = dict(list(bound.arguments.items())[1:])
    params = _options_of(fn)
    words = sys.argv[sys.argv.index(name) + 1:] if name in sys.argv else []
    words = words[:words.index("--")] if "--" in words else words
    words = words[:next((i for i, w in enumerate(words) if w in ns.task_names), len(words))]   # this task's
    named = {w[2:].split("=", 1)[0].replace("-", "_") for w in words if w.startswith("--")}
    named |= {"args"} if "--" in sys.argv else set()   # the script's arguments, after --
    given = {n for n in params if n in named or f"no_{n}" in named or values[n] != params[n].default}
    tasks = {t.name: _options_of(t.body) for t in ns.tasks.values()}
    found = config.defaults(name, params, values, given, tasks)
    settings.pin_paths()
    return {**values, **{n: f.value for n, f in found.items()}}, found


def _fleetbox(fn):
    """Turn a UserError (or Ctrl-C) into one clear line and a non-zero exit, never a traceback. The options the
    command line did not give take the site files' values (commands/config.py); a dry-run says which."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        found = {}
        try:
            _refuse_invokes_own(sys.argv, wrapper)   # the task's options, as invoke has them (_job_task's)
            kwargs, found = _site_defaults(wrapper, args, kwargs)
            if found and kwargs.get("dry_run"):
                _log("# from the site files: " + ", ".join(f.said() for f in found.values()))
            return fn(c, **kwargs)
        except UserError as e:
            came = [f"{f.option.flag} came from {f.where}" for f in found.values() if f.named_in(str(e))]
            raise Exit(f"fleetbox: error: {e}" + (f" ({'; '.join(came)})" if came else ""),
                       code=errors.USER_ERROR) from None
        except Failed as e:
            raise Exit(f"fleetbox: {e}", code=errors.FAILED) from None
        except KeyboardInterrupt:
            raise Exit("fleetbox: interrupted", code=errors.INTERRUPTED) from None
        except BrokenPipeError:   # the output was closed (`| head`): stop quietly, as other tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise Exit(code=errors.OUTPUT_CLOSED) from None
    return wrapper


def _variant(name):
    from fleetbox.image import matrix
    if name is not None and not name.strip():
        raise UserError("--variant is empty; name a variant (default: cpu)")
    return matrix.load().get(name)


def _script_args(args):
    """The script's own arguments: `--args "..."` (one string, split as a shell would), or everything after `--`,
    word for word, so a script flag that is also one of ours (`-- --debug`) reaches the script."""
    if "--" not in sys.argv:
        return args
    if args is not None:
        raise UserError("give the script's arguments once: --args \"...\" or after --")
    return shlex.join(sys.argv[sys.argv.index("--") + 1:])


def _as_typed() -> str:
    """This command line as the user would type it again: `python3 -m invoke ...` (a venv's interpreter where it
    was one), `invoke ...` or `fleetbox ...`, with invoke's own options and this task's words (not another
    task's)."""
    orig = list(getattr(sys, "orig_argv", sys.argv))
    head = orig[:orig.index("-m") + 2] if "-m" in orig[:3] else \
        ["fleetbox" if Path(sys.argv[0]).name == "fleetbox" else "invoke"]
    words = sys.argv[1:]
    core = words[:next((i for i, w in enumerate(words) if not w.startswith("-")), len(words))]
    start = words.index("train") if "train" in words else len(core)
    return shlex.join(head + core + words[start:])


def _log(msg):
    print(msg, flush=True)


@task(help={"variant": VARIANT_HELP,
            "upgrade": "resolve every package afresh (default: keep the versions the lock pins where the matrix "
                       "still allows them, so one changed pin moves nothing else)",
            "paddle_index": "a mirror of the variant's Paddle index (the same pages, e.g. a site's proxy) to "
                            "resolve Paddle from instead; the lock names where each wheel came from",
            "out": "write the lock here instead of images/locks/<variant>.lock"})
@_fleetbox
def lock(c, variant=None, upgrade=False, paddle_index=None, out=None):
    """Resolve the variant's pins across PyPI and Paddle's index into images/locks/<variant>.lock (sha256)."""
    from fleetbox.image import locks
    v = _variant(variant)
    path = locks.make(v, Path(out) if out else None, upgrade=upgrade, paddle_index=paddle_index or "")
    entries = locks.parse(path.read_text())
    _log(f"wrote {path} ({len(entries)} packages, sha256 hashes, Python {v.python_version}, {v.platform})")


@task(help={"variant": VARIANT_HELP, "dest": "wheelhouse folder (default wheelhouse/<variant>/)"})
@_fleetbox
def wheels(c, variant=None, dest=None):
    """Download the lock's wheels into an offline wheelhouse (hash-checked; reused when complete).

    A CUDA variant's Paddle wheel is measured once: the GPUs its kernels run on, kept beside its lock."""
    from fleetbox.image import kernels
    from fleetbox.image import wheelhouse as wheelhouse_mod
    v = _variant(variant)
    kernels.ensure(v, wheelhouse_mod.ensure(v, Path(dest) if dest else None, log=_log), log=_log)


@task(help={"variant": VARIANT_HELP,
            "dest": "the folder the env goes in, as DEST/<variant>-<lock hash>/ (e.g. on the shared file system)",
            "python": "the interpreter to make it from, of the lock's Python version (default: python<version> on "
                      "PATH, else python3)",
            "wheelhouse": "wheelhouse folder (default wheelhouse/<variant>/)"})
@_fleetbox
def venv(c, variant=None, dest=None, python=None, wheelhouse=None):
    """Make the variant's locked environment as a venv, for sites without containers.

    Offline, from the verified wheelhouse; prints its path last (no-op when up to date)."""
    from fleetbox.image import venvs
    if not dest:
        raise UserError("--dest is required: the folder the env goes in, e.g. on the cluster's shared file system")
    venvs.make(_variant(variant), Path(dest), python, Path(wheelhouse) if wheelhouse else None, log=_log)


@task(help={"variant": VARIANT_HELP,
            "bootstrap": "make the base with debootstrap + docker import even when an OS image is available",
            "mirror": "Debian/Ubuntu mirror for the packages (e.g. http://mirrors.tuna.tsinghua.edu.cn/debian)",
            "rebuild": "make the base again even if it exists",
            "dry_run": "print how the base would be made, do nothing"})
@_fleetbox
def base(c, variant=None, bootstrap=False, mirror=None, rebuild=False, dry_run=False):
    """Make the variant's system base (OS + Python + runtime libraries) under fleetbox/base:<name>-<hash>."""
    from fleetbox import engine
    from fleetbox.image import bases
    v = _variant(variant)
    if dry_run:
        for line in bases.plan(v, bootstrap, mirror).describe():
            _log(line)
        return
    bases.ensure(engine.client(), v, bootstrap=bootstrap, mirror=mirror, rebuild=rebuild, log=_log)


@task(help={"variant": VARIANT_HELP, "dry_run": "print the whole build plan (any variant), build nothing",
            "wheelhouse": "wheelhouse folder (default wheelhouse/<variant>/)",
            "force": "build again even if an image with the same inputs exists",
            "datasets": "bake these seeded data sets (see `invoke cache`) into the image at Paddle's cache path",
            "dockerfile": "write images/<variant>.Dockerfile, the same build for any OCI builder (with --dry-run: "
                          "print it); needs no engine",
            "sign_key": SIGN_KEY_HELP})
@_fleetbox
def build(c, variant=None, dry_run=False, wheelhouse=None, force=False, datasets=None, dockerfile=False,
          sign_key=None):
    """Build the variant's image hermetically (network off) from the wheelhouse; no-op when up to date."""
    from fleetbox import engine
    from fleetbox.data import datasets as ds
    from fleetbox.image import images as images_mod
    v = _variant(variant)
    if dockerfile:
        if datasets or force or wheelhouse or sign_key:
            raise UserError("--dockerfile renders the file only: --datasets, --force, --wheelhouse and --sign-key do "
                            "not apply")
        images_mod.write_dockerfile(v, dry_run, log=_log)
        return
    data = ds.select(ds.load(), datasets) if datasets else []
    if dry_run:
        try:
            client = engine.client()
        except UserError:
            client = None
        for line in images_mod.dry_run(v, client, data).describe():
            _log(line)
        return
    images_mod.build(engine.client(), v, Path(wheelhouse) if wheelhouse else None, force=force, log=_log, data=data,
                     sign_key=Path(sign_key) if sign_key else None)


def _as(name: str, help: str, **rest) -> Option:
    """A declared option as one task words it (its own help, or default): the same flag, read the same way."""
    return replace(DECLARED[name], help=help, **rest)


def _job_task(*declared):
    """invoke's @task for a task that takes the job's options: its parameters (`__signature__`, which invoke
    reads) and their help made from the declarations, in the order given (its reference page's; --help sorts
    them itself). Each is a declared option's name, or an Option: one as the task words it (_as), or its own.
    Every registered backend's own options follow --backend, the long-run ones --max-restarts (`invoke train`'s);
    they arrive as None where not given, so that configure() can tell which were given."""
    def make(fn):
        made = []
        for d in declared:
            o = DECLARED[d] if isinstance(d, str) else d
            made.append((o, o.default))
            for after, long_run in (("backend", False), ("max_restarts", True)):
                if o.name == after:
                    made += [(b, None) for _, b in backends.all_options() if b.train_only == long_run]
        inspect.signature(fn).bind(None, **{o.name: None for o, _ in made})   # the body takes every one of them
        fn.__options__ = {o.name: replace(o, default=default) for o, default in made}   # as this task reads them
        P = inspect.Parameter
        sig = fn.__signature__ = inspect.Signature([P("c", P.POSITIONAL_OR_KEYWORD)] + [
            P(o.name, P.POSITIONAL_OR_KEYWORD, default=default) for o, default in made])

        @functools.wraps(fn)
        def with_defaults(*args, **kwargs):   # called from Python too (pre=, post=, a script): the defaults
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return fn(**bound.arguments)
        with_defaults.__signature__ = sig
        return task(help={o.name: o.help for o, _ in made})(with_defaults)
    return make


def _job(given: dict) -> dict:
    """The job's own options (spec.JOB_OPTIONS) among a task's values; the backends' are configure()'s."""
    return {name: value for name, value in given.items() if name in JOB}


JOB = {o.name for o in spec_mod.JOB_OPTIONS}


@_job_task("variant", "json_out",
           _as("image", "verify this image reference instead of the variant's build (e.g. a pulled image)"),
           _as("nodes", "also run the checks in every node's container and the smoke job across N nodes"),
           _as("hosts", "with --nodes: comma-separated Docker Engine URLs, one per node", default=None),
           Option("trusted_keys", "the SSH public keys (a .pub file, or an allowed_signers file) the image's "
                                  "provenance statement must be signed by"))
@_fleetbox
def verify(c, variant, json_out, image, nodes, hosts, trusted_keys):
    """Check the image with the network off: run_check(), device, scipy/cv2, installed == lock."""
    from fleetbox import engine, files, options
    from fleetbox.commands import verify as verify_mod
    v = _variant(variant)
    n = options.integer("--nodes", nodes or 0, 0)
    if n:
        if trusted_keys:
            raise UserError("--trusted-keys checks one image's statement: verify without --nodes")
        b = backends.get(backends.DEFAULT, **backends.configure(backends.DEFAULT, {"hosts": hosts}))
        report = verify_mod.run_nodes(spec_mod.from_options(v, b, nodes=n, image=image), b, log=_log)
    else:
        report = verify_mod.run(engine.client(), v, image, log=_log,
                                trusted=Path(trusted_keys) if trusted_keys else None)
    if json_out:
        files.write_json(Path(json_out), report)
    if not report["ok"]:
        raise Failed(f"verify failed for {v.name} (report: {report['path']})")


@_job_task("variant", Option("mirror", "Debian mirror for a bootstrapped base"),
           _as("nodes", "nodes of the closing training run (default 2; 0 skips it)"))
@_fleetbox
def up(c, variant, mirror, nodes):
    """The main job: base -> wheels -> build -> verify -> a 2-node training run (smoke), on this machine."""
    from fleetbox import options
    from fleetbox.commands import up as up_mod
    up_mod.up(_variant(variant), mirror, options.integer("--nodes", 2 if nodes is None else nodes, 0), log=_log)


@task(help={"datasets": "comma-separated data sets from offline_cache/datasets.toml, e.g. mnist,flowers",
            "mirror": "HTTP base URL or local folder laid out as <module>/<file> (default: the original URLs)",
            "dest": "cache folder (default offline_cache/dataset/, Paddle's ~/.cache/paddle/dataset layout)",
            "verify": "re-check the MD5 of what is in the cache instead of downloading",
            "pack": "write the named data sets (all known ones if none named) to this archive with checksums",
            "from_": "restore a cache archive made with --pack (every MD5 checked, unsafe members refused)",
            "manifest": "another dataset manifest (default offline_cache/datasets.toml)",
            "jobs": "files downloaded at a time (default 4)"})
@_fleetbox
def cache(c, datasets=None, mirror=None, dest=None, verify=False, pack=None, from_=None, manifest=None, jobs=None):
    """Seed Paddle's dataset cache offline-ready: download (MD5, resume, retry), verify, pack, restore."""
    from fleetbox.data import datasets as ds
    ds.cache_command(datasets, mirror, dest, verify, pack, from_, manifest, 4 if jobs is None else jobs, log=_log)


@_job_task("nodes", "procs_per_node", "variant", "script", "args", "image", "iface", "ib_hca", "debug",
           "gpus_per_node", "port", "env", "pass_env", "mount", "data_dir", "shm_size", "timeout",
           "dry_run", "backend", "job_id", "checkpoint_dir", "resume", "max_restarts", "min_nodes", "spare_nodes",
           "hang_timeout", "start_timeout", "detach", "preflight")
@_fleetbox
def train(c, variant, args, timeout, dry_run, backend, detach, preflight, **job):
    """Multi-node collective training: one host-network container per node, failures propagated, logs kept."""
    from fleetbox import options
    from fleetbox.commands import train as train_mod
    given = backends.configure(backend, job)
    spec = spec_mod.from_options(_variant(variant), backends.get(backend, **given), args=_script_args(args),
                                 **_job(job))
    train_mod.train(spec, backend, given, dry_run, options.seconds("--timeout", timeout),
                    detach=detach, log=_log, preflight=preflight, command=_as_typed())


@_job_task("nodes", "procs_per_node", "variant", "image", "iface", "ib_hca", "gpus_per_node",
           _as("port", "master port to check (the trainers' pinned ports follow it; default: as `invoke train` "
                       "picks)"),
           "env", "mount", "data_dir", "shm_size", "backend", "quick", "wait", "json_out",
           _as("dry_run", "print the probe's job (and the sweep's) as the backend would run it; start nothing (with "
                          "--hosts, a throwaway probe container runs on each host to find its network)"))
@_fleetbox
def doctor(c, variant, backend, quick, wait, json_out, dry_run, **job):
    """Check that the nodes are ready for a job, in the job's own containers.

    The image the same everywhere, shm, limits, interface and route, devices, clocks, disk, every port the job
    uses, then an all-reduce sweep."""
    from fleetbox import files, options
    from fleetbox.commands import doctor as doctor_mod
    given = backends.configure(backend, job)
    spec = spec_mod.from_options(_variant(variant), backends.get(backend, **given), **_job(job))
    report = doctor_mod.run(spec, backend, given, quick=quick,
                            wait=options.seconds("--wait", wait) or 30.0, log=_log, dry_run=dry_run)
    if report.get("dry_run"):
        if not report["ok"]:
            raise Failed(f"doctor: {sum(not r['ok'] for r in report['rows'])} check(s) failed before the probe")
        return
    if json_out:
        files.write_json(Path(json_out), report)
    if not report["ok"]:
        raise Failed(f"doctor: {sum(not r['ok'] for r in report['rows'])} check(s) failed (report: {report['path']})")


@_job_task(_as("nodes", "comma-separated node counts to run at, e.g. 1,2,4 (default 1,2); with --hosts, N nodes use "
                        "the first N hosts", default="1,2", kind=str, low=None),
           _as("procs_per_node", "comma-separated processes per node, e.g. 1,2 (default 1)", kind=str, low=None),
           _as("image", "comma-separated images to compare, each run at every size (default "
                        "fleetbox/paddle:<variant>)"),
           "variant", "script", "args", "iface", "ib_hca", "gpus_per_node", "port", "env", "mount",
           "data_dir", "shm_size", "timeout", "backend",
           _as("dry_run", "print every run's job as `invoke train --dry-run` would; start nothing (with --hosts, a "
                          "throwaway probe container runs on each host to find its network)"))
@_fleetbox
def scale(c, nodes, procs_per_node, image, variant, args, timeout, backend, dry_run, **job):
    """Run a scaling study: the same job at each size and for each image, then a table and a plot.

    Samples/s, speed-up, parallel efficiency, time per step and communication share (runs/<study>/scale.md,
    scale.png)."""
    from fleetbox import options
    from fleetbox.commands import scale as scale_mod
    study_cells = scale_mod.cells(nodes, procs_per_node, image)
    given, largest = backends.configure(backend, job), max(x.nodes for x in study_cells)
    spec = spec_mod.from_options(_variant(variant), backends.get(backend, **backends.sized(backend, given, largest)),
                                 nodes=largest, args=_script_args(args), **_job(job))
    scale_mod.run(spec, study_cells, backend, given,
                  options.seconds("--timeout", timeout), log=_log, dry_run=dry_run)


@task(name="jobs")
@_fleetbox
def jobs_(c):
    """List the jobs in runs/ with their state, attempt and newest checkpoint step.

    Also the backend and the Slurm allocation; a job whose supervisor died is flagged."""
    from fleetbox.commands import jobs
    jobs.listing(log=_log)


JOB_HELP = "the job's id, as `invoke jobs` lists it"


@task(help={"job": JOB_HELP, "node": "the node's rank (default 0)",
            "follow": "keep printing until the job ends (Ctrl-C stops following, never the job)"})
@_fleetbox
def logs(c, job, node=0, follow=False):
    """Print a job's node output (Docker: the container; Slurm: the node's log), from any shell."""
    from fleetbox import options
    from fleetbox.commands import jobs
    jobs.logs(job, options.integer("--node", node, 0), follow, log=_log)


@task(help={"job": JOB_HELP})
@_fleetbox
def report(c, job):
    """Draw a run's report again: runs/<job>/report.png and report.md.

    Also for a failed or cancelled run, from what exists; says what is missing."""
    from fleetbox.commands import jobs
    jobs.report(job, log=_log)


@task(help={"job": "the job's id, or a scaling study's (its runs), as `invoke jobs` lists it; several: a,b",
            "host": "the address VisualDL listens on (default 127.0.0.1: this machine only; reach it with ssh -L)",
            "port": "its port (default 8040, VisualDL's)",
            "interval": "how often the jobs' new metrics are written for it (default 10s)",
            "private": "serve on a Unix socket only you can open, not on a port: on a shared login node, 127.0.0.1 "
                       "is every user's (reach it with the ssh -L line it prints)"})
@_fleetbox
def board(c, job, host="127.0.0.1", port=8040, interval="10s", private=False):
    """Watch jobs in VisualDL, Paddle's dashboard, while they run: every rank's loss, samples/s, step time.

    Own time, communication share and stragglers too; a run per rank and attempt (Slurm: allocation), with
    restarts, hangs and stragglers in its Text tab. Ctrl-C stops it."""
    from fleetbox import options
    from fleetbox.commands import board as board_mod
    board_mod.serve(job, host, options.integer("--port", port, 1, 65535), options.seconds("--interval", interval),
                    private=private, log=_log)


@task(help={"job": JOB_HELP})
@_fleetbox
def cancel(c, job):
    """Stop a job from any shell: every node stopped, logs kept, containers removed (Slurm: the whole chain)."""
    from fleetbox.commands import jobs
    jobs.cancel(job, log=_log)


@task(help={"hosts": "comma-separated Docker Engine URLs to clean too (default: this machine)",
            "job": "only this job's containers: running ones too, once the job has ended",
            "force": "also remove the containers of jobs that have not ended",
            "images": "also untag older builds of every variant and build layers no image is built on (here)"})
@_fleetbox
def clean(c, hosts=None, job=None, force=False, images=False):
    """Remove the containers that earlier jobs left behind.

    Found by their labels: this user's, of jobs in this runs folder. Those of jobs that have not ended, and
    running ones, are kept unless --force."""
    from fleetbox import engine, options
    from fleetbox.image import images as images_mod
    from fleetbox.image import matrix
    if job is not None and not spec_mod.JOB_ID.fullmatch(job):
        raise UserError(f"--job {job!r} is not a job id")
    removed, kept = backends.clean(options.items(hosts), job or "", force, log=_log)
    _log(f"removed {removed} leftover container(s)" + (f"; kept {kept} running" if kept else ""))
    if images:
        old, unused, stopped = images_mod.prune(engine.client(), list(matrix.load().variants.values()), log=_log)
        _log(f"untagged {old} older build(s) and {unused} unused build layer(s); removed {stopped} container(s) "
             f"of stopped builds")


@task(help={"variant": VARIANT_HELP,
            "format": "docker-archive (with .sha256), charliecloud (ch-convert), sif (apptainer), sqsh (enroot)",
            "squash": "charliecloud: a squashfs file instead of a directory",
            "dest": "output folder (default exports/); `train` finds the export there too",
            "image": "image to export (default: the variant's)",
            "sign_key": SIGN_KEY_HELP})
@_fleetbox
def export(c, variant=None, format="docker-archive", squash=False, dest=None, image=None, sign_key=None):
    """Export the image for HPC runtimes, named for its content hash; a missing converter: the cluster's command."""
    from fleetbox import engine
    from fleetbox.image import built
    from fleetbox.ship import exports as hpc
    v = _variant(variant)
    client = engine.client()
    ref = image or built.resolve(client, v).tags[0]
    hpc.export(client, v, format, ref, squash, Path(dest) if dest else None, log=_log,
               sign_key=Path(sign_key) if sign_key else None)


@task(help={
    "variant": VARIANT_HELP, "out": "the kit file to write (default kits/fleetbox-<variant>.kit)",
    "datasets": "comma-separated seeded data sets to pack into the kit, e.g. mnist,flowers",
    "data_dir": "the seeded dataset cache to pack from (default offline_cache/dataset)",
    "manifest": "the data sets' manifest (default offline_cache/datasets.toml); the kit carries it",
    "with_image": "also carry the built image (the site then needs no build)",
    "load": "at the air-gapped site: verify and load this kit (fleetbox source, venv, base, wheelhouse, cache)",
    "expect": "with --load: the kit's sha256, sent apart from the kit (required, unless --no-expect)",
    "no_expect": "with --load: skip the check of the whole kit against a digest sent apart (not recommended)",
    "dest": "with --load: a new folder to load into (default ./fleetbox-<kit name>)",
    "skip_images": "with --load: load no image (a site with no container engine: `invoke venv` makes the env)",
    "trusted_keys": "with --load: SSH public keys (a .pub file or an allowed_signers file); the kit's image's "
                    "provenance statement must be signed by one of them"})
@_fleetbox
def kit(c, variant=None, out=None, datasets=None, data_dir=None, manifest=None, with_image=False, load=None,
        expect=None, no_expect=False, dest=None, skip_images=False, trusted_keys=None):
    """One verified bundle for an air-gapped site: source, host wheels, lock, wheelhouse, base (image), datasets."""
    from fleetbox.data import datasets as ds
    from fleetbox.ship import kit as kit_mod
    if load:
        if variant or out or datasets or data_dir or manifest or with_image:
            raise UserError("--load takes only --expect, --dest, --skip-images and --trusted-keys: the kit says "
                            "what it holds")
        kit_mod.load(Path(load), Path(dest) if dest else None, expect, log=_log, no_expect=no_expect,
                     skip_images=skip_images, trusted_keys=Path(trusted_keys) if trusted_keys else None)
        return
    if expect or no_expect or dest or skip_images or trusted_keys:
        raise UserError("--expect, --no-expect, --dest, --skip-images and --trusted-keys are for --load")
    v = _variant(variant)
    chosen = []
    if datasets:
        chosen = ds.select(ds.load(Path(manifest) if manifest else None), datasets)
    elif data_dir or manifest:
        raise UserError("--data-dir and --manifest say where --datasets come from; name the data sets")
    kit_mod.make(v, Path(out) if out else Path("kits") / f"fleetbox-{v.name}.kit", chosen,
                 Path(data_dir) if data_dir else None, Path(manifest) if manifest else None, with_image, log=_log)


@task(help={"variant": VARIANT_HELP, "registry": "HOST[:PORT]/NAMESPACE, e.g. registry.example.org:5000/paddle"})
@_fleetbox
def push(c, variant=None, registry=None):
    """Push the content tag and the aliases of the variant's image to a registry."""
    from fleetbox import engine
    from fleetbox.ship import exports as hpc
    for ref in hpc.push_variant(engine.client(), _variant(variant), registry or "", log=_log):
        _log(f"pushed {ref}")


@task(name="pull-cmd", help={"variant": VARIANT_HELP,
                             "runtime": "apptainer, singularity, pyxis, charliecloud, podman or docker",
                             "registry": "HOST[:PORT]/NAMESPACE it was pushed to",
                             "insecure": "the registry speaks plain HTTP"})
@_fleetbox
def pull_cmd(c, variant=None, runtime="apptainer", registry=None, insecure=False):
    """Print the pull/convert commands a cluster user runs for a runtime (immutable content tag first)."""
    from fleetbox.ship import exports as hpc
    from fleetbox.ship import shipped
    v = _variant(variant)
    content = shipped.built_here(v)
    refs = hpc.registry_refs(v, registry or "", content)
    content_ref, alias_ref = (refs[0], refs[1]) if content else (None, refs[0])
    for line in backends.pull_commands(runtime, content_ref, alias_ref, hpc.export_name(v), insecure):
        _log(line)


def _task_facts():
    """What invoke knows of every task here, for the reference pages (commands/docs.py)."""
    from fleetbox.commands import docs as docs_mod
    out = []
    for name, t in sorted(ns.tasks.items()):
        params = [p for p in list(inspect.signature(t.body).parameters.values())[1:] if p.kind is not p.VAR_KEYWORD]
        out.append(docs_mod.Task(name, inspect.getdoc(t.body) or "", tuple(
            docs_mod.Opt(p.name, None if p.default is p.empty else p.default, (t.help or {}).get(p.name, ""),
                         positional=p.default is p.empty) for p in params)))
    return out


@task
@_fleetbox
def config(c):
    """Say the defaults in effect, from the site files (a project's fleetbox.toml, the user's), and their sources.

    Where fleetbox keeps things (runs, exports, the dataset cache), and each option's value from a file, with the
    file and line it came from."""
    from fleetbox.commands import config as config_mod
    config_mod.show({t.name: _options_of(t.body) for t in ns.tasks.values()}, log=_log)


@task(help={"check": "say which reference page is stale instead of writing it (CI)"})
@_fleetbox
def docs(c, check=False):
    """Generate the docs site's reference pages (docs/reference/) from the code.

    Every task and option, every environment variable, the exit codes, the matrix, a job's folder.
    `python3 -m mkdocs serve` shows the site."""
    from fleetbox.commands import docs as docs_mod
    docs_mod.write(_task_facts(), check=check, log=_log)


# what `invoke` (tasks.py in the checkout) and `fleetbox` run
ns = Collection(*(t for t in list(globals().values()) if isinstance(t, invoke.tasks.Task)))
