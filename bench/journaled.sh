#!/bin/bash
# bench/build.py again on an ext4 file system WITH a journal (mkfs.ext4's default), both sides on it: a second
# Docker Engine keeps its data there and a clone of this checkout (with its wheelhouse) runs the bench there,
# so the floor's venv is made on it too (not a test).
#
# Why: this machine's root ext4 has no journal, and ext4 without one skips every inode freed in the last 60 s
# (300 s while its inode table is unwritten) each time it allocates one (recently_deleted() in fs/ext4/ialloc.c):
# after a bench round has freed tens of thousands, each new file or folder cost 0.06 to 0.8 ms here (7 us on a
# tmpfs). A forced build allocates 30,899 inodes against the floor's 13,795, 2.2 times (perf stat's
# ext4:ext4_allocate_inode; the engine's commit writes every file of a layer again), so it pays more.
#
# The file system is a sparse file on a loop device (direct I/O, so its pages are not cached twice). The engine
# runs in a network namespace of its own with no bridge (the build uses none): in the host's, an engine with
# --bridge none deletes docker0, the default engine's bridge (nsenter, not `ip netns exec`, which remounts /sys
# without the cgroups). Everything is removed on the way out. Needs root, the cpu wheelhouse and the cpu base
# image in the default engine. Arguments go to bench/build.py. Run it as
# `flock /tmp/fleetbox-docker.lock bash bench/journaled.sh --repeat 1 --cold-repeat 5 --pin-repeat 0`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /var/tmp/fleetbox-journaled-XXXXXX)
IMG=$WORK/fs.img MNT=$WORK/mnt RUN=$WORK/run LOOP="" NS=fleetbox-journaled-$$
SOCK=unix://$RUN/docker.sock

cleanup() {
  if [ -f "$RUN/dockerd.pid" ]; then
    pid=$(cat "$RUN/dockerd.pid"); kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  umount "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null || true
  if [ -n "$LOOP" ]; then losetup -d "$LOOP" 2>/dev/null || true; fi
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

base=$(cd "$ROOT" && python3 -c "from fleetbox.image import matrix; print(matrix.load().get('cpu').base_ref)")
[ -d "$ROOT/wheelhouse/cpu" ] || { echo "no cpu wheelhouse: run invoke wheels --variant cpu" >&2; exit 2; }

truncate -s 16G "$IMG"
mkfs.ext4 -q -F "$IMG"
LOOP=$(losetup --direct-io=on -f --show "$IMG")
mkdir -p "$MNT" "$RUN"
mount "$LOOP" "$MNT"
ip netns add "$NS"
nsenter --net="/run/netns/$NS" dockerd --data-root "$MNT/docker" --exec-root "$RUN" --pidfile "$RUN/dockerd.pid" \
  -H "$SOCK" --bridge none --iptables=false --ip-masq=false > "$WORK/dockerd.log" 2>&1 &
for _ in $(seq 100); do DOCKER_HOST=$SOCK docker info > /dev/null 2>&1 && break; sleep 0.2; done
docker save "$base" | DOCKER_HOST=$SOCK docker load -q
git clone -q "$ROOT" "$MNT/fleetbox"
cp -a "$ROOT/wheelhouse" "$MNT/fleetbox/"
cd "$MNT/fleetbox"
export DOCKER_HOST=$SOCK
echo "journals: $(find /proc/fs/jbd2 -mindepth 1 -maxdepth 1 -printf '%f ')"
python3 -m invoke build --variant cpu | tail -1   # the bench starts from a current image
python3 bench/build.py "$@"
