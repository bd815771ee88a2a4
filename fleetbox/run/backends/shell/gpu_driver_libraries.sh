# Apptainer's (and SingularityCE's) --nv binds the node's NVIDIA driver libraries into the container: the node's loader must know them.
# ldconfig is in /sbin, which a user's PATH may lack (Apptainer runs /sbin/ldconfig itself). grep reads the whole
# cache: under pipefail, `grep -q` would cut ldconfig off and fail the test.
LDCONFIG=$(command -v ldconfig || { for l in /sbin/ldconfig /usr/sbin/ldconfig; do [ -x "$l" ] && echo "$l" && break; done; } || true)
if [ -z "$LDCONFIG" ]; then
  echo "@SAYS@GPU prerequisite: not checked (no ldconfig here to list the driver's libraries)"
elif "$LDCONFIG" -p 2>/dev/null | grep 'libcuda\.so\.1 ' >/dev/null; then
  echo "@SAYS@GPU prerequisite: the node's driver libraries (@RUNTIME@ --nv)"
else
  echo "@SAYS@GPU prerequisite missing: the node's loader knows no libcuda.so.1 ($LDCONFIG -p), so @RUNTIME@ --nv gives the container no NVIDIA driver: check the driver install on this node" >&2
  exit 5
fi
