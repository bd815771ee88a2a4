"""The docs site: it builds with --strict (a broken link or a page outside the navigation fails it), and its
reference pages are what the code says now (a stale page, an option without help text or an environment variable
the table does not name fails)."""
import re
import shutil
import subprocess
import sys

import pytest

from fleetbox import ROOT, settings
from fleetbox.commands import docs
from fleetbox.errors import UserError


def test_the_reference_pages_are_the_codes(run_invoke):
    proc = run_invoke("docs", "--check")
    assert proc.returncode == 0 and "reference pages are up to date" in proc.stdout, proc.stdout + proc.stderr


def test_a_stale_page_or_an_option_without_help_fails(tmp_path, monkeypatch):
    tasks = [docs.Task("up", "Do it all.", (docs.Opt("variant", None, "matrix variant"),))]
    monkeypatch.setattr(docs, "REFERENCE", tmp_path)
    docs.write(tasks, log=lambda m: None)
    docs.write(tasks, check=True, log=lambda m: None)
    stale = [docs.Task("up", "Do it all.", (docs.Opt("variant", None, "matrix variant"), docs.Opt("nodes", 2, "n")))]
    with pytest.raises(UserError, match=r"stale reference page\(s\): .*tasks.md; run `invoke docs`"):
        docs.write(stale, check=True, log=lambda m: None)
    bare = [docs.Task("up", "Do it all.", (docs.Opt("nodes", 2, " "),))]
    with pytest.raises(UserError, match=r"options without help text .*: up --nodes"):
        docs.write(bare, log=lambda m: None)


def test_every_fleetbox_variable_the_code_uses_is_in_the_environment_table():
    used = set()
    for p in [*(ROOT / "fleetbox").rglob("*.py"), *(ROOT / "fleetbox").rglob("*.sh")]:
        used |= set(re.findall(r"\bFLEETBOX_[A-Z0-9_]*[A-Z0-9]\b", p.read_text()))
    assert used == set(settings.ENVIRONMENT)
    assert {who for who, _ in settings.ENVIRONMENT.values()} <= set(settings.ENVIRONMENT_KINDS)


def _build(folder):
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(folder / "site")],
                          cwd=folder, capture_output=True, text=True)


def test_the_site_builds_strict_and_a_broken_link_or_a_page_left_out_fails_it(tmp_path):
    for name in ("docs", "mkdocs.yml"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp_path / name)
    proc = _build(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "docs" / "orphan.md").write_text("# not in the navigation\n")
    assert _build(tmp_path).returncode != 0
    (tmp_path / "docs" / "orphan.md").unlink()
    with open(tmp_path / "docs" / "guides" / "train.md", "a") as f:
        f.write("\nSee [nowhere](no-such-page.md).\n")
    proc = _build(tmp_path)
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr


def test_a_file_a_job_starts_to_leave_is_named_until_the_job_folder_page_has_it(tmp_path):
    """Each backend's own files (Slurm's CANCELLED.<id>, alloc<N>) are its layout's, which the backends register
    as every command loads them: loaded here, or the test passed only after another in its worker had."""
    from fleetbox.run import backends, records
    assert backends.lookup("slurm").layout.earlier == "alloc<N>"
    for name in ("handle.json", "node0", "node12.log", "alloc2", "run-20261127-010203-2", "CANCELLED.41", "hang-0"):
        (tmp_path / name).touch()
    assert records.undescribed(tmp_path) == []
    (tmp_path / "nodeX").touch()
    (tmp_path / "traces.json").touch()
    assert records.undescribed(tmp_path) == ["nodeX", "traces.json"]
