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
# runs in a session and a network namespace of its own, with no bridge (the build uses none) and containerd
# namespaces of its own: in the host's network namespace, an engine with --bridge none deletes docker0, the
# default engine's bridge (nsenter, not `ip netns exec`, which remounts /sys without the cgroups); in its own
# session, Ctrl-C reaches the bench, which removes what it made, before the engine is stopped. The bench runs
# on a clone of this checkout's HEAD (changes not committed are not in it). Everything is removed on every way
# out: the bench stopped first (SIGTERM), then the engine (SIGTERM, SIGKILL after 30 s), a second Ctrl-C
# ignored meanwhile. Needs root, the cpu wheelhouse and the cpu base image in the default engine. Arguments go
# to bench/build.py. Run it as
# `flock /tmp/fleetbox-docker.lock bash bench/journaled.sh --repeat 1 --cold-repeat 5 --pin-repeat 0`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /var/tmp/fleetbox-journaled-XXXXXX)
IMG=$WORK/fs.img MNT=$WORK/mnt RUN=$WORK/run LOOP="" NS=fleetbox-journaled-$$ ENGINE="" CHILD=""
SOCK=unix://$RUN/docker.sock

stop() {   # stop process $1: SIGTERM, then SIGKILL after $2 seconds
  kill "$1" 2>/dev/null || return 0
  for _ in $(seq $(($2 * 5))); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$1" 2>/dev/null || true
}

cleanup() {
  trap '' INT TERM HUP   # a second Ctrl-C does not cut the cleanup short
  if [ -n "$CHILD" ]; then stop "$CHILD" 120; fi   # the bench removes its containers while its engine runs
  if [ -n "$ENGINE" ]; then stop "$ENGINE" 30; fi   # the engine stops its containers (10 s each at most)
  umount "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null || true
  if [ -n "$LOOP" ]; then losetup -d "$LOOP" 2>/dev/null || true; fi
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

child() {   # run "$@" in the background and wait for it, so a signal is taken at once (bash defers its traps
  "$@" &    # until a foreground command ends) and cleanup can stop it
  CHILD=$!
  local rc=0
  wait "$CHILD" || rc=$?
  CHILD=""
  return "$rc"
}

base=$(cd "$ROOT" && python3 -c "from fleetbox.image import matrix; print(matrix.load().get('cpu').base_ref)")
[ -d "$ROOT/wheelhouse/cpu" ] || { echo "no cpu wheelhouse: run invoke wheels --variant cpu" >&2; exit 2; }

truncate -s 16G "$IMG"
mkfs.ext4 -q -F "$IMG"
LOOP=$(losetup --direct-io=on -f --show "$IMG")
mkdir -p "$MNT" "$RUN"
mount "$LOOP" "$MNT"
ip netns add "$NS"
# setsid without a fork (a background job of a script leads no process group): $! is the engine itself
nsenter --net="/run/netns/$NS" setsid dockerd --data-root "$MNT/docker" --exec-root "$RUN" \
  --pidfile "$RUN/dockerd.pid" -H "$SOCK" --bridge none --iptables=false --ip-masq=false \
  --containerd-namespace "$NS" --containerd-plugins-namespace "$NS-plugins" > "$WORK/dockerd.log" 2>&1 &
ENGINE=$!
for _ in $(seq 100); do DOCKER_HOST=$SOCK docker info > /dev/null 2>&1 && break; sleep 0.2; done
if ! DOCKER_HOST=$SOCK docker info > /dev/null 2>&1; then
  echo "the second engine did not start; the end of its log:" >&2
  tail -n 20 "$WORK/dockerd.log" >&2
  exit 1
fi
docker save "$base" | DOCKER_HOST=$SOCK docker load -q
git clone -q "$ROOT" "$MNT/fleetbox"
cp -a "$ROOT/wheelhouse" "$MNT/fleetbox/"
cd "$MNT/fleetbox"
export DOCKER_HOST=$SOCK
echo "journals: $(find /proc/fs/jbd2 -mindepth 1 -maxdepth 1 -printf '%f ')"
child python3 -m invoke build --variant cpu > "$WORK/build.out"   # the bench starts from a current image
tail -n 1 "$WORK/build.out"
child python3 bench/build.py "$@"
