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
            "force": "build again even if an image with the same inputs exists"})
@_fleetbox
def build(c, variant=None, dry_run=False, wheelhouse=None, force=False):
    """Build the variant's image hermetically (network off) from the wheelhouse; no-op when up to date."""
    from pathlib import Path
    from fleetbox import engine, images
    v = _variant(variant)
    if dry_run:
        try:
            client = engine.client()
        except UserError:
            client = None
        for line in images.dry_run(v, client).describe():
            _log(line)
        return
    images.build(engine.client(), v, Path(wheelhouse) if wheelhouse else None, force=force, log=_log)


@task(help={"variant": VARIANT_HELP, "json_out": "also write the JSON report to this path",
            "image": "verify this image reference instead of the variant's build (e.g. a pulled image)"})
@_fleetbox
def verify(c, variant=None, json_out=None, image=None):
    """Check the image with the network off: run_check(), device, scipy/cv2, installed == lock."""
    from fleetbox import engine, verify as verify_mod
    v = _variant(variant)
    report = verify_mod.run(engine.client(), v, image, log=_log)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    if not report["ok"]:
        raise Exit(f"fleetbox: verify failed for {v.name} (report: {report['path']})", code=1)


@task(help={"variant": VARIANT_HELP, "mirror": "Debian mirror for a bootstrapped base"})
@_fleetbox
def up(c, variant=None, mirror=None):
    """The whole path for a variant: base -> wheels -> build -> verify."""
    from fleetbox import bases, engine, images, verify as verify_mod, wheelhouse
    v = _variant(variant)
    client = engine.client()
    steps = ["base", "wheels", "build", "verify"]
    for i, step in enumerate(steps, 1):
        _log(f"== [{i}/{len(steps)}] {step} ({v.name})")
        if step == "base":
            bases.ensure(client, v, mirror=mirror, log=_log)
        elif step == "wheels":
            wheelhouse.ensure(v, log=_log)
        elif step == "build":
            images.build(client, v, log=_log)
        else:
            report = verify_mod.run(client, v, log=_log)
            if not report["ok"]:
                raise Exit(f"fleetbox: verify failed for {v.name} (report: {report['path']})", code=1)
    sys.stdout.flush()
