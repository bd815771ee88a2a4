"""Which of a job's paths Slurm's nodes may not see, by the rule in run/filesystems.py, on recorded mount tables."""
import pytest

from fleetbox.run import filesystems

# /proc/self/mountinfo of a login node: / on a local disk, /home on NFS, /scratch on Lustre, /tmp a tmpfs, a
# project folder whose name has a space (the kernel writes it \040), and /opt mounted twice (the last one holds)
LOGIN_NODE = r"""22 1 8:2 / / rw,relatime shared:1 - ext4 /dev/sda2 rw
23 22 0:21 / /proc rw,nosuid shared:12 - proc proc rw
24 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=65536k
25 24 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
31 22 0:26 / /tmp rw,nosuid,nodev shared:9 - tmpfs tmpfs rw
40 22 0:45 / /home rw,relatime shared:20 - nfs4 nas01:/export/home rw,vers=4.2
41 22 0:46 / /scratch rw,relatime shared:21 - lustre 10.0.0.5@o2ib:/scratch rw,flock
42 40 0:47 / /home/proj\040one rw,relatime shared:22 - nfs4 nas01:/export/proj\040one rw
43 22 8:3 / /opt rw,relatime shared:23 - ext4 /dev/sda3 rw
44 22 0:48 / /opt rw,relatime shared:24 - gpfs gpfs0 rw
45 22 8:4 / /local rw,relatime shared:25 - xfs /dev/sdb1 rw
46 22 0:49 / /data rw,relatime shared:26 - fuse.s3fs s3fs rw
"""

# a login "node" that is itself a container: / is an overlay, the home a bind of a real disk
CONTAINER = """500 450 0:60 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
501 500 0:61 / /proc rw - proc proc rw
502 500 8:1 /home/ada /home/ada rw,relatime - ext4 /dev/vda1 rw
"""

# this machine's (a test cluster's: local disks only, the nodes mount the same)
LOCAL_ONLY = """26 1 254:0 / / rw,relatime - ext4 /dev/vda rw
27 26 0:5 / /dev rw - devtmpfs devtmpfs rw
28 27 0:24 / /dev/shm rw - tmpfs tmpfs rw
29 26 254:0 /var/lib/docker /var/lib/docker rw,relatime - ext4 /dev/vda rw
"""


@pytest.mark.parametrize("table,path,why", [
    (LOGIN_NODE, "/home/ada/runs/train-1", ""),                     # NFS
    (LOGIN_NODE, "/scratch/ada/ckpt", ""),                          # Lustre
    (LOGIN_NODE, "/home/proj one/train.py", ""),                    # NFS, a mount point with a space
    (LOGIN_NODE, "/opt/site/env", ""),                              # GPFS mounted over the local /opt
    (LOGIN_NODE, "/data/set", ""),                                  # a FUSE type we do not know: not judged
    (LOGIN_NODE, "/tmp/ada/train.py", "on tmpfs (/tmp)"),
    (LOGIN_NODE, "/dev/shm/x", "on tmpfs (/dev/shm)"),
    (LOGIN_NODE, "/usr/src/fleetbox/runs", "on a local ext4 disk (/dev/sda2 at /), while /home is on nfs4"),
    (LOGIN_NODE, "/local/ada", "on a local xfs disk (/dev/sdb1 at /local), while /home is on nfs4"),
    (LOGIN_NODE, "/tmpfoo/x", "on a local ext4 disk (/dev/sda2 at /), while /home is on nfs4"),   # not /tmp's
    (CONTAINER, "/work/runs", "on overlay (/)"),
    (CONTAINER, "/home/ada/runs", ""),                              # a local disk, but no shared one here
    (LOCAL_ONLY, "/work/main/runs", ""),
    (LOCAL_ONLY, "/var/lib/docker/x", ""),
    (LOCAL_ONLY, "/dev/shm/ck", "on tmpfs (/dev/shm)"),
])
def test_a_path_is_judged_by_the_file_system_that_holds_it(table, path, why):
    assert filesystems.why_not_shared(path, filesystems.parse(table)) == why


def test_the_warning_is_one_line_naming_each_path_and_nothing_when_all_are_shared():
    table = filesystems.parse(LOGIN_NODE)
    said = filesystems.warning({"the runs folder": "/home/ada/runs", "the script": "/tmp/ada/train.py",
                                "the checkpoint folder": "/usr/ck"}, table)
    assert said.startswith("the script /tmp/ada/train.py is on tmpfs (/tmp); the checkpoint folder /usr/ck is on a "
                           "local ext4 disk (/dev/sda2 at /), while /home is on nfs4: Slurm's nodes see only")
    assert "\n" not in said and "/home/ada/runs" not in said
    assert filesystems.warning({"the runs folder": "/home/ada/runs", "the script": "/scratch/t.py"}, table) == ""


def test_a_path_not_made_yet_is_judged_by_its_nearest_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert filesystems.resolved(str(tmp_path / "link" / "ckpt" / "x")) == str(tmp_path / "real" / "ckpt" / "x")
    assert filesystems.resolved(str(tmp_path / "link")) == str(tmp_path / "real")


def test_a_later_mount_on_a_folder_above_hides_what_was_mounted_below_it():
    table = filesystems.parse("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                              "2 1 0:40 / /a/b rw - nfs4 nas:/b rw\n"
                              "3 1 0:41 / /a rw - tmpfs tmpfs rw\n"
                              "4 3 0:42 / /a/c rw - lustre l:/c rw\n")
    assert filesystems.holder("/a/b/x", table).fstype == "tmpfs"   # /a/b's NFS is under the tmpfs now
    assert filesystems.holder("/a/c/x", table).fstype == "lustre"   # mounted after the tmpfs
    assert filesystems.holder("/ab", table).fstype == "ext4"


def test_an_nfs_server_or_a_9p_share_does_not_make_a_local_disk_suspect():
    """/proc/fs/nfsd (an NFS server's own) and 9p (WSL's drives) are not file systems compute nodes mount."""
    table = filesystems.parse("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                              "2 1 0:40 / /proc/fs/nfsd rw - nfsd nfsd rw\n"
                              "3 1 0:41 / /mnt/c rw - 9p drvfs rw\n")
    assert filesystems.why_not_shared("/home/ada/runs", table) == ""


def test_a_path_is_normalised_before_it_is_judged(tmp_path):
    assert filesystems.resolved(str(tmp_path / "nope" / ".." / ".." / "x")) == str(tmp_path.parent / "x")
