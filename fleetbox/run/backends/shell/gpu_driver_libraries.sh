# Apptainer --nv binds the node's NVIDIA driver libraries into the container: the node's loader must know them.
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: the node's driver libraries (apptainer --nv)"
else
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the node's loader knows no libcuda.so.1 (ldconfig -p), so apptainer --nv gives the container no NVIDIA driver: check the driver install on this node" >&2
  exit 5
fi
