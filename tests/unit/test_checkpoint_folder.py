"""The job's checkpoint folder on the host: `--resume never` moves earlier checkpoints aside, never deletes them,
also twice in one second and when the folder is a mount point (which cannot be renamed)."""
import errno
import json
from pathlib import Path

import pytest

from fleetbox.errors import UserError
from fleetbox.run import checkpoints


def with_step(path: Path, step: int) -> None:
    d = path / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(json.dumps({"step": step}))


def test_never_twice_in_one_second_keeps_both_earlier_sets(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints.time, "strftime", lambda fmt: "20261124-010203")
    ck = tmp_path / "ck"
    for step in (10, 20):
        with_step(ck, step)
        checkpoints.prepare(ck, "never", log=lambda m: None)
        assert checkpoints.steps(ck) == []
    asides = sorted(p.name for p in tmp_path.iterdir() if p.name != "ck")
    assert asides == ["ck.before-20261124-010203", "ck.before-20261124-010203-2"]
    assert checkpoints.steps(tmp_path / asides[1]) == [20]


def test_never_on_a_mount_point_moves_the_checkpoints_aside_inside_it(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    with_step(ck, 10)
    (ck / "notes.txt").write_text("mine")
    real = Path.rename

    def rename(self, target):
        if self == ck:   # what renaming a mount point gives
            raise OSError(errno.EBUSY, "Device or resource busy", str(self))
        return real(self, target)
    monkeypatch.setattr(Path, "rename", rename)
    said = []
    checkpoints.prepare(ck, "never", log=said.append)
    (aside,) = [p for p in ck.iterdir()]
    assert aside.name.startswith("before-") and checkpoints.steps(ck) == [] and checkpoints.steps(aside) == [10]
    assert (aside / "notes.txt").read_text() == "mine" and said == [f"--resume never: moved the earlier "
                                                                     f"checkpoints to {aside}"]


def test_a_folder_whose_checkpoints_cannot_be_moved_is_one_line(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    with_step(ck, 10)

    def rename(self, target):
        raise OSError(errno.EACCES, "Permission denied", str(self))
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(UserError, match=r"--resume never: cannot move the earlier checkpoints in .* aside: "
                                        r"Permission denied") as e:
        checkpoints.prepare(ck, "never", log=lambda m: None)
    assert "\n" not in str(e.value)
