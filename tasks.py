"""fleetbox front door: `invoke --list` shows every task, `invoke --help TASK` every option.

Each task parses its options and calls the package; user errors end as one line and a non-zero exit.
"""

import functools
import json
import sys

from invoke import Exit, task

from fleetbox.errors import UserError

VARIANT_HELP = "matrix variant (images/matrix.toml): cpu (default), cu118, cu126, cu129, dcu"


def _fleetbox(fn):
    """Turn a UserError (or Ctrl-C) into one clear line and a non-zero exit, never a traceback."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        try:
            return fn(c, *args, **kwargs)
        except UserError as e:
            raise Exit(f"fleetbox: error: {e}", code=2) from None
        except KeyboardInterrupt:
            raise Exit("fleetbox: interrupted", code=130) from None
    return wrapper


def _variant(name):
    from fleetbox import matrix
    return matrix.load().get(name)


def _log(msg):
    print(msg, flush=True)


@task(help={"variant": VARIANT_HELP})
@_fleetbox
def lock(c, variant=None):
    """Resolve the variant's pins across PyPI and Paddle's index into images/locks/<variant>.lock (sha256)."""
    from fleetbox import locks
    v = _variant(variant)
    path = locks.make(v)
    _, entries = locks.read(v)
    _log(f"wrote {path} ({len(entries)} packages, sha256 hashes, Python {v.python_version}, {v.platform})")


@task(help={"variant": VARIANT_HELP, "dest": "wheelhouse folder (default wheelhouse/<variant>/)"})
@_fleetbox
def wheels(c, variant=None, dest=None):
    """Download the lock's wheels into an offline wheelhouse (hash-checked; reused when complete)."""
    from pathlib import Path
    from fleetbox import wheelhouse
    wheelhouse.ensure(_variant(variant), Path(dest) if dest else None, log=_log)


@task(help={"variant": VARIANT_HELP,
            "bootstrap": "make the base with debootstrap + docker import even when an OS image is available",
            "mirror": "Debian/Ubuntu mirror for the packages (e.g. http://mirrors.tuna.tsinghua.edu.cn/debian)",
            "rebuild": "make the base again even if it exists",
            "dry_run": "print how the base would be made, do nothing"})
@_fleetbox
def base(c, variant=None, bootstrap=False, mirror=None, rebuild=False, dry_run=False):
    """Make the variant's system base (OS + Python + runtime libraries) under fleetbox/base:<name>-<hash>."""
    from fleetbox import bases, engine
    v = _variant(variant)
    if dry_run:
        for line in bases.plan(v, bootstrap, mirror).describe():
            _log(line)
        return
    bases.ensure(engine.client(), v, bootstrap=bootstrap, mirror=mirror, rebuild=rebuild, log=_log)


@task(help={"variant": VARIANT_HELP, "dry_run": "print the whole build plan (any variant), build nothing",
            "wheelhouse": "wheelhouse folder (default wheelhouse/<variant>/)",
            "force": "build again even if an image with the same inputs exists",
            "datasets": "bake these seeded data sets (see `invoke cache`) into the image at Paddle's cache path"})
@_fleetbox
def build(c, variant=None, dry_run=False, wheelhouse=None, force=False, datasets=None):
    """Build the variant's image hermetically (network off) from the wheelhouse; no-op when up to date."""
    from pathlib import Path
    from fleetbox import datasets as ds, engine, images
    v = _variant(variant)
    data = ds.select(ds.load(), datasets) if datasets else []
    if dry_run:
        try:
            client = engine.client()
        except UserError:
            client = None
        for line in images.dry_run(v, client, data).describe():
            _log(line)
        return
    images.build(engine.client(), v, Path(wheelhouse) if wheelhouse else None, force=force, log=_log, data=data)


@task(help={"variant": VARIANT_HELP, "json_out": "also write the JSON report to this path",
            "image": "verify this image reference instead of the variant's build (e.g. a pulled image)",
            "nodes": "also run the checks in every node's container and the smoke job across N nodes",
            "hosts": "with --nodes: comma-separated Docker Engine URLs, one per node"})
@_fleetbox
def verify(c, variant=None, json_out=None, image=None, nodes=0, hosts=None):
    """Check the image with the network off: run_check(), device, scipy/cv2, installed == lock."""
    from fleetbox import engine, verify as verify_mod
    v = _variant(variant)
    if int(nodes or 0):
        report = verify_mod.run_nodes(_spec(variant, nodes, image=image, hosts=hosts), log=_log)
    else:
        report = verify_mod.run(engine.client(), v, image, log=_log)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    if not report["ok"]:
        raise Exit(f"fleetbox: verify failed for {v.name} (report: {report['path']})", code=1)


@task(help={"variant": VARIANT_HELP, "mirror": "Debian mirror for a bootstrapped base",
            "nodes": "nodes of the closing training run (default 2; 0 skips it)"})
@_fleetbox
def up(c, variant=None, mirror=None, nodes=2):
    """The main job: base -> wheels -> build -> verify -> a 2-node training run (smoke), on this machine."""
    from fleetbox import bases, engine, images, verify as verify_mod, wheelhouse
    v = _variant(variant)
    client = engine.client()
    steps = ["base", "wheels", "build", "verify"] + ([f"train --nodes {nodes}"] if int(nodes) else [])
    for i, step in enumerate(steps, 1):
        _log(f"== [{i}/{len(steps)}] {step} ({v.name})")
        if step == "base":
            bases.ensure(client, v, mirror=mirror, log=_log)
        elif step == "wheels":
            wheelhouse.ensure(v, log=_log)
        elif step == "build":
            images.build(client, v, log=_log)
        elif step == "verify":
            report = verify_mod.run(client, v, log=_log)
            if not report["ok"]:
                raise Exit(f"fleetbox: verify failed for {v.name} (report: {report['path']})", code=1)
        else:
            _run_job(_spec(v.name, nodes))
    sys.stdout.flush()


@task(help={"datasets": "comma-separated data sets from offline_cache/datasets.toml, e.g. mnist,flowers",
            "mirror": "HTTP base URL or local folder laid out as <module>/<file> (default: the original URLs)",
            "dest": "cache folder (default offline_cache/dataset/, Paddle's ~/.cache/paddle/dataset layout)",
            "verify": "re-check the MD5 of what is in the cache instead of downloading",
            "pack": "write the named data sets (all known ones if none named) to this archive with checksums",
            "from_": "restore a cache archive made with --pack (every MD5 checked, unsafe members refused)",
            "manifest": "another dataset manifest (default offline_cache/datasets.toml)",
            "jobs": "files downloaded at a time (default 4)"})
@_fleetbox
def cache(c, datasets=None, mirror=None, dest=None, verify=False, pack=None, from_=None, manifest=None, jobs=4):
    """Seed Paddle's dataset cache offline-ready: download (MD5, resume, retry), verify, pack, restore."""
    from pathlib import Path
    from fleetbox import datasets as ds
    known = ds.load(manifest)
    dest = Path(dest) if dest else ds.default_dest()
    if from_:
        rows = ds.restore(Path(from_), dest, known, log=_log)
        _log(ds.table(rows))
        _log(f"restored {len(rows)} files into {dest}")
        return
    chosen = ds.select(known, datasets) if (datasets or not pack) else [
        d for d in known.values() if all((dest / f.relpath).exists() for f in d.files)]
    if pack:
        out = ds.pack(chosen, dest, Path(pack))
        _log(f"packed {', '.join(d.name for d in chosen)} into {out} ({out.stat().st_size / 1e6:.1f} MB)")
        return
    if verify:
        rows = ds.check(chosen, dest)
        _log(ds.table(rows))
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            raise Exit(f"fleetbox: {len(bad)} of {len(rows)} files missing or bad in {dest}", code=1)
        return
    rows = ds.seed(chosen, dest, mirror, log=_log, jobs=int(jobs))
    _log(ds.table(rows))
    _log(f"cache {dest}: {len(rows)} files verified; mount it at {ds.CONTAINER_CACHE} (read-only)")


TRAIN_HELP = {
    "nodes": "number of nodes: one container each (default 2)",
    "procs_per_node": "training processes per node (default 1)",
    "variant": VARIANT_HELP,
    "script": "training script (default train/smoke.py); its folder is the workspace",
    "args": "arguments for the script, as one string (e.g. \"--epochs 2\")",
    "image": "image to run (default fleetbox/paddle:<variant>)",
    "hosts": "comma-separated Docker Engine URLs, one per node (ssh://user@h1,ssh://user@h2); master = first",
    "iface": "network interface for NCCL/Gloo (default: the one that routes to the master)",
    "ib_hca": "InfiniBand HCA, e.g. mlx5_0 (sets NCCL_IB_HCA and NCCL_IB_DISABLE=0)",
    "debug": "NCCL_DEBUG=INFO",
    "gpus_per_node": "GPUs per node (CUDA variants)",
    "devices": "accelerator ids, e.g. 0,1",
    "port": "master port (default: a free one)",
    "env": "extra environment, comma-separated KEY=VALUE pairs",
    "mount": "extra bind mounts, comma-separated SRC:DST[:ro]",
    "data_dir": "seeded dataset cache to mount read-only at Paddle's cache path (default offline_cache/dataset)",
    "shm_size": "shared memory per container (default 8g; NCCL needs more than Docker's 64m)",
    "timeout": "stop the job after this many seconds (default: none)",
    "dry_run": "print the exact docker run command of every node (slurm: the sbatch script); start nothing",
    "backend": "docker (default: containers via Docker Engines) or slurm (an sbatch job)",
    "runtime": "with --backend slurm: apptainer, pyxis, charliecloud, podman or docker (default docker)",
    "partition": "with --backend slurm: the partition (-p)",
    "time": "with --backend slurm: the time limit (e.g. 01:00:00)",
    "account": "with --backend slurm: the account (-A)",
    "runtime_args": "with --backend slurm: extra options for the runtime, e.g. \"--ulimit nproc=32768:32768\"",
}


def _spec(variant=None, nodes=2, procs_per_node=1, script=None, args=None, image=None, hosts=None, iface=None,
          ib_hca=None, debug=False, gpus_per_node=0, devices=None, port=0, env=None, mount=None, data_dir=None,
          shm_size=None):
    """A validated JobSpec from command-line strings."""
    import shlex
    from fleetbox import datasets as ds, jobs
    data = data_dir or (str(ds.default_dest()) if ds.default_dest().is_dir() and not hosts else "")
    spec = jobs.JobSpec(
        variant=_variant(variant), nodes=int(nodes), procs_per_node=int(procs_per_node),
        script=script or str(jobs.DEFAULT_SCRIPT), args=tuple(shlex.split(args or "")), image=image or "",
        hosts=tuple(h for h in (hosts or "").split(",") if h), iface=iface or "", ib_hca=ib_hca or "",
        debug=debug, gpus_per_node=int(gpus_per_node or 0), devices=devices or "", port=int(port or 0),
        env=dict(kv.split("=", 1) for kv in (env or "").split(",") if "=" in kv),
        mounts=tuple(m for m in (mount or "").split(",") if m), data_dir=data, shm_size=shm_size or "8g",
        job_id=jobs.new_job_id())
    jobs.validate(spec)
    return spec


@task(help=TRAIN_HELP)
@_fleetbox
def train(c, nodes=2, procs_per_node=1, variant=None, script=None, args=None, image=None, hosts=None,
          iface=None, ib_hca=None, debug=False, gpus_per_node=0, devices=None, port=0, env=None, mount=None,
          data_dir=None, shm_size=None, timeout=None, dry_run=False, backend="docker", runtime="docker",
          partition=None, time=None, account=None, runtime_args=None):
    """Multi-node collective training: one host-network container per node, failures propagated, logs kept."""
    from fleetbox import backend_docker
    spec = _spec(variant, nodes, procs_per_node, script, args, image, hosts, iface, ib_hca, debug,
                 gpus_per_node, devices, port, env, mount, data_dir, shm_size)
    if backend == "slurm":
        return _train_slurm(spec, runtime, image, partition, time, account, int(port or 0), dry_run, runtime_args)
    if backend != "docker":
        raise Exit(f"fleetbox: error: unknown backend {backend!r}; choose docker or slurm", code=2)
    if dry_run:
        for n in backend_docker.dry_run(spec):
            _log(f"# node{n.rank} (rank {n.rank}) on {n.host or 'this machine'}")
            _log(n.shell())
        return
    _run_job(spec, timeout)


def _train_slurm(spec, runtime, image, partition, time_limit, account, port, dry_run, runtime_args=None):
    from fleetbox import backend_slurm as slurm
    sj = slurm.make(spec, runtime, image or "", partition or "", time_limit or "", account or "", port,
                    runtime_args or "")
    if dry_run:
        _log(f"# {sj.dir}/job.sbatch\n{slurm.render_sbatch(sj)}\n# {sj.dir}/node.sh\n{slurm.render_node_script(sj)}")
        return
    job_id = slurm.submit(sj)
    result = slurm.follow(sj, job_id, log=_log)
    _log(slurm.table(result))
    if not result["ok"]:
        who = (f"{result['failed_node']} (rank {result['failed_rank']}) exited with code {result['failed_exit_code']}"
               if result.get("failed_rank") is not None else f"job ended {result['state']}")
        raise Exit(f"fleetbox: train failed: {who} (logs: {sj.dir})", code=1)


def _run_job(spec, timeout=None):
    from fleetbox import backend_docker
    result = backend_docker.run(spec, log=_log, timeout=float(timeout) if timeout else None)
    _log(backend_docker.table(result))
    if not result["ok"]:
        raise Exit("fleetbox: train failed: " + (
            f"node{result['failed_rank']} (rank {result['failed_rank']}) exited with code "
            f"{result['failed_exit_code']}" if result.get("failed_rank") is not None else
            f"timed out after {timeout} s")
            + f" (logs: {backend_docker.runs_root() / spec.job_id})", code=1)


@task(help={"hosts": "comma-separated Docker Engine URLs to clean too (default: this machine)"})
@_fleetbox
def clean(c, hosts=None):
    """Remove containers that earlier jobs left behind (found by their io.fleetbox.job label)."""
    from fleetbox import backend_docker
    n = backend_docker.clean([h for h in (hosts or "").split(",") if h], log=_log)
    _log(f"removed {n} leftover container(s)")


@task(help={"variant": VARIANT_HELP,
            "format": "docker-archive (with .sha256), charliecloud (ch-convert), sif (apptainer), sqsh (enroot)",
            "squash": "charliecloud: a squashfs file instead of a directory",
            "dest": "output folder (default exports/)", "image": "image to export (default: the variant's)"})
@_fleetbox
def export(c, variant=None, format="docker-archive", squash=False, dest=None, image=None):
    """Export the image for HPC runtimes; where a converter is missing, print the command for the cluster."""
    from pathlib import Path
    from fleetbox import engine, hpc, images
    v = _variant(variant)
    client = engine.client()
    ref = image or images.resolve(client, v).tags[0]
    hpc.export(client, v, format, ref, squash, Path(dest) if dest else None, log=_log)


@task(help={"variant": VARIANT_HELP, "registry": "HOST[:PORT]/NAMESPACE, e.g. registry.example.org:5000/paddle"})
@_fleetbox
def push(c, variant=None, registry=None):
    """Push the content tag and the aliases of the variant's image to a registry."""
    from fleetbox import engine, hpc, images
    v = _variant(variant)
    client = engine.client()
    image = images.resolve(client, v)
    content = images.content_tag(image, v)
    if content is None:
        raise Exit(f"fleetbox: error: image {v.aliases[0]} has no content tag; run `invoke build --variant {v.name}`",
                   code=2)
    for ref in hpc.push(client, image, hpc.registry_refs(v, registry or "", content), log=_log):
        _log(f"pushed {ref}")


@task(name="pull-cmd", help={"variant": VARIANT_HELP, "runtime": "apptainer, pyxis, charliecloud, podman or docker",
                             "registry": "HOST[:PORT]/NAMESPACE it was pushed to",
                             "insecure": "the registry speaks plain HTTP"})
@_fleetbox
def pull_cmd(c, variant=None, runtime="apptainer", registry=None, insecure=False):
    """Print the pull/convert commands a cluster user runs for a runtime (immutable content tag first)."""
    from fleetbox import engine, hpc, images
    v = _variant(variant)
    try:
        content = images.content_tag(images.resolve(engine.client(), v), v)
    except UserError:
        content = None
    content = content or f"{v.image}:{v.name}"
    refs = hpc.registry_refs(v, registry or "", content)
    for ref, what in ((refs[0], "content tag (immutable)"), (refs[1], "alias")):
        _log(f"# {what}")
        for line in hpc.pull_commands(runtime, ref, hpc.export_name(v), insecure):
            _log(line)
