# Apptainer --nv binds the node's NVIDIA driver libraries into the container: the node's loader must know them.
# (grep reads the whole cache: under pipefail, `grep -q` would cut ldconfig off and fail the test.)
if ldconfig -p 2>/dev/null | grep 'libcuda\.so\.1 ' >/dev/null; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: the node's driver libraries (apptainer --nv)"
else
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the node's loader knows no libcuda.so.1 (ldconfig -p), so apptainer --nv gives the container no NVIDIA driver: check the driver install on this node" >&2
  exit 5
fi
