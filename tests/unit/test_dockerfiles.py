import shutil
import subprocess

import pytest

from fleetbox import ROOT
from fleetbox.build import matrix
from fleetbox.build.bases import BASE_DOCKERFILE
from fleetbox.build.images import DATA_DOCKERFILE, DOCKERFILE

DOCKERFILES = sorted({DOCKERFILE, BASE_DOCKERFILE, DATA_DOCKERFILE})


@pytest.mark.parametrize("variant", sorted(matrix.load().variants))
def test_every_variants_dockerfiles_pass_hadolint(variant):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[dev]'"
    for df in DOCKERFILES:
        proc = subprocess.run([hadolint, "--failure-threshold", "info", str(df)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{df.relative_to(ROOT)} ({variant}):\n{proc.stdout}{proc.stderr}"


def test_final_stage_copies_only_the_environment():
    text = DOCKERFILE.read_text()
    final = text[text.rindex("\nFROM "):]
    assert "COPY --from=install /opt/venv /opt/venv" in final
    assert "/wheels" not in final and "--require-hashes" in text and "--no-cache-dir" in text
