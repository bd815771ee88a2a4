# The accelerators Slurm allocated to this task (their global ids, as gres.conf numbers them): SLURM_STEP_GPUS in
# srun's step, else SLURM_JOB_GPUS, which describes the batch node (node 0) only and is inherited by every task.
# The plan runs @PROCS@ process(es) per node, one per device.
GPUS="${SLURM_STEP_GPUS:-}"
if [ -z "$GPUS" ] && [ "$SLURM_NODEID" = 0 ]; then GPUS="${SLURM_JOB_GPUS:-}"; fi
GPU_COUNT=$(awk -F, '{print NF}' <<<"$GPUS")
if [ "$GPU_COUNT" -ne @PROCS@ ]; then
  echo "@SAYS@Slurm allocated $GPU_COUNT device(s) (${GPUS:-none}), but the job runs @PROCS@ process(es) per node, one per device: submit with --gpus-per-node @PROCS@" >&2
  exit 2
fi
