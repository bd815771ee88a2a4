"""`invoke up`, the main job on one variant: base -> wheels -> build -> verify -> a training run."""

from __future__ import annotations

from fleetbox import engine
from fleetbox.commands import train, verify
from fleetbox.errors import Failed
from fleetbox.image import bases, images, wheelhouse
from fleetbox.image.matrix import Variant
from fleetbox.run import spec as spec_mod


def up(variant: Variant, mirror: str | None = None, nodes: int = 2, log=print) -> None:
    client = engine.client()
    no_gpu = ""
    steps = ["base", "wheels", "build", "verify"] + ([f"train --nodes {nodes}"] if nodes else [])
    for i, step in enumerate(steps, 1):
        log(f"== [{i}/{len(steps)}] {step} ({variant.name})")
        if step == "base":
            bases.ensure(client, variant, mirror=mirror, log=log)
        elif step == "wheels":
            wheelhouse.ensure(variant, log=log)
        elif step == "build":
            images.build(client, variant, log=log)
        elif step == "verify":
            report = verify.run(client, variant, log=log)
            if not report["ok"]:
                raise Failed(f"verify failed for {variant.name} (report: {report['path']})")
            no_gpu = report.get("no_gpu", "")
        else:
            if no_gpu:   # a GPU image here, where there is none: its ranks run on CPU, as --gpus-per-node 0 says
                log("no GPU here: the ranks run on CPU (--gpus-per-node 0), collectives on Gloo")
            train.train(spec_mod.from_options(variant, nodes=nodes, gpus_per_node=0 if no_gpu else None), log=log)
