"""Which of a job's paths compute nodes can see, judged on the login node from its own mount table.

A Slurm job reads its scripts, helpers, image and checkpoints on every node at the paths they have here: only a file
system every node mounts (NFS, Lustre, GPFS, ...) holds them for all. The rule, from the file system type of the
mount that holds each path (/proc/self/mountinfo):
- memory and container-private types (tmpfs, overlay, ...) are never shared: warned about;
- a local disk (ext4, xfs, ...) is warned about only where this machine mounts a shared one too (a login node with
  /home on NFS): a machine with local disks alone is taken as one whose nodes mount the same (a test cluster);
- shared and unknown types (fuse.*, a site's own) are not warned about.
Only a warning: the node itself stops, naming the path, when it cannot see one (node.sh).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

NOT_SHARED = frozenset({"tmpfs", "ramfs", "devtmpfs", "overlay", "aufs", "squashfs", "zram"})
LOCAL_DISK = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs", "vfat",
                        "exfat", "ntfs", "ntfs3"})
SHARED = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs", "ceph", "fuse.ceph-fuse", "cephfs",
                    "glusterfs", "fuse.glusterfs", "pvfs2", "orangefs", "wekafs", "panfs", "cifs", "smb3", "afs",
                    "fuse.juicefs", "quobyte", "fuse.quobyte", "virtiofs", "dvs"})
MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class Mounted:
    target: str    # the mount point
    fstype: str
    source: str


def unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (a space is \\040) read back."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(mountinfo: str) -> list[Mounted]:
    """The mounts of a /proc/<pid>/mountinfo text, in its order (a later mount on a point hides the earlier)."""
    out = []
    for ln in mountinfo.splitlines():
        fields, sep, rest = ln.partition(" - ")
        parts, after = fields.split(), rest.split()
        if not sep or len(parts) < 5 or len(after) < 2:
            continue
        out.append(Mounted(unescape(parts[4]), after[0], unescape(after[1])))
    return out


def under(path: str, target: str) -> bool:
    return target == "/" or path == target or path.startswith(target + "/")


def holder(path: str, table: list[Mounted]) -> Mounted | None:
    """The mount that holds an absolute, resolved path: the one on the longest mount point above it among those
    that no later mount hides (a mount on a point, or on a folder above it, hides what was mounted there before)."""
    seen: list[Mounted] = []
    for m in table:
        t = m.target.rstrip("/") or "/"
        seen = [s for s in seen if not under(s.target, t)] + [Mounted(t, m.fstype, m.source)]
    return max((m for m in seen if under(path, m.target)), key=lambda m: len(m.target), default=None)


def why_not_shared(path: str, table: list[Mounted]) -> str:
    """Why compute nodes may not see `path` (resolved), by the rule above; "" when nothing says so."""
    m = holder(path, table)
    if m is None:
        return ""
    if m.fstype in NOT_SHARED:
        return f"on {m.fstype} ({m.target})"
    shared = next((s for s in table if s.fstype in SHARED), None)
    if m.fstype in LOCAL_DISK and shared:
        return f"on a local {m.fstype} disk ({m.source} at {m.target}), while {shared.target} is on {shared.fstype}"
    return ""


def resolved(path: str) -> str:
    """The real path of `path`, or of its nearest existing folder (a checkpoint folder not made yet)."""
    path = os.path.abspath(path)   # and normalised: /tmp/a/../../etc is /etc
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.path.join(os.path.realpath(p), os.path.relpath(path, p)) if p != Path(path) else os.path.realpath(p)


def warning(paths: dict[str, str], table: list[Mounted]) -> str:
    """One line naming each of a job's paths ({what: path}, resolved) that nodes may not see; "" when none."""
    said = [f"{what} {path} is {why}" for what, path in paths.items() if (why := why_not_shared(path, table))]
    if not said:
        return ""
    return ("; ".join(said) + ": Slurm's nodes see only file systems they mount too (NFS, Lustre, GPFS, BeeGFS, "
            "CephFS, ...); a node that cannot see one stops, naming it")
