"""The variant's image as built on this machine: found by its alias, named by its immutable content tag. Apart
from images.py (the build), so that running jobs can ask which build is here without the build's modules."""

from __future__ import annotations

from fleetbox.engine import image_or_none
from fleetbox.errors import UserError
from fleetbox.image.matrix import Variant


def content_tag(image, variant: Variant) -> str | None:
    """The image's immutable content tag (<image>:<variant>-<hash>), among its tags."""
    return next((t for t in image.tags if t.startswith(f"{variant.image}:{variant.name}-")), None)


def resolve(c, variant: Variant):
    """The built image for a variant (by alias), or a clear error saying how to build it."""
    image = image_or_none(c, variant.aliases[0])
    if image is None:
        raise UserError(f"image {variant.aliases[0]} is not built; run `invoke build --variant {variant.name}`")
    return image
