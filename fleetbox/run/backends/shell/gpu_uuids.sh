# The GPUs this task may use, by UUID: in the task's cgroup (ConstrainDevices) nvidia-smi lists only those Slurm
# allocated. invoke doctor holds the container's GPUs to them (an engine takes Slurm's ids as the driver's indices,
# which a hand-written gres.conf may number otherwise). nvidia-smi says its errors on stdout: only UUIDs count.
if command -v nvidia-smi >/dev/null 2>&1 && SEEN=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null); then
  echo "@SAYS@GPUs the task sees: $(grep -E '^(GPU|MIG)-' <<<"$SEEN" | paste -sd, || true)"
fi
