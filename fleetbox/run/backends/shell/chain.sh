# A requeue (node failure, preemption, scontrol requeue) runs this script again in the same Slurm job, with the
# environment it was submitted with and SLURM_RESTART_COUNT grown: each run is an allocation and a restart.
# Every submission exports SLURM_RESTART_COUNT=0, so a count is never inherited from the submitting job.
REQUEUES="${SLURM_RESTART_COUNT:-0}"
ALLOCATION=$(( ${FLEETBOX_ALLOCATION:-1} + REQUEUES )); RESTARTS=$(( ${FLEETBOX_RESTARTS:-0} + REQUEUES ))
CHAIN="${FLEETBOX_CHAIN:-$SLURM_JOB_ID}"
STEP_NODES=$NODES LEFT_OUT=""   # the nodes a step runs on, and the allocation's nodes left out (step_here)
echo "fleetbox: run $((REQUEUES + 1)) of Slurm job $SLURM_JOB_ID"   # where this run's output begins
if [ -e "$JOB_DIR/CANCELLED.$CHAIN" ]; then echo "fleetbox: the job was cancelled"; exit 0; fi
newest_step() {
  local d n best=0
  for d in "$CHECKPOINTS"/step-*; do
    n=${d##*/step-}
    case "$n" in ""|*[!0-9]*) continue;; esac
    [ -e "$d/COMPLETE" ] || continue
    n=$((10#$n)); [ "$n" -gt "$best" ] && best=$n
  done
  echo "$best"
}
script_state() { sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p' "$CHECKPOINTS/STATE" 2>/dev/null || true; }
record() {  # allocation from_step to_step state exit ended next [left_out]: one line of allocations.jsonl
  printf '{"chain": "%s", "allocation": %d, "max_allocations": %d, "slurm_job": "%s", "from_step": %d, "to_step": %d, "state": "%s", "exit": %d, "ended": "%s", "next": "%s", "nodes": %d, "left_out": "%s"}\n' \
    "$CHAIN" "$1" "$MAX_ALLOCATIONS" "$SLURM_JOB_ID" "$2" "$3" "$4" "$5" "$6" "$7" "$STEP_NODES" "${8:-}" >> "$JOB_DIR/allocations.jsonl"
}
keep_logs() {  # the node logs of allocation $1, apart, before another one writes new ones
  mkdir -p "$JOB_DIR/alloc$1"
  mv "$JOB_DIR"/node[0-9]* "$JOB_DIR/alloc$1"/ 2>/dev/null || true
}
if [ "$REQUEUES" -gt 0 ]; then   # the run before this one was cut short: record it, as its own allocation
  cut_to=$(newest_step); cut_from=$cut_to   # unless it got as far as starting its training (below)
  read -r ran_job ran_run ran_from ran_alloc ran_restarts ran_nodes < "$JOB_DIR/started.$CHAIN" 2>/dev/null || true
  if [ "${ran_job:-}" = "$SLURM_JOB_ID" ] && [ "${ran_run:-}" = "$REQUEUES" ]; then   # its last step, as it began
    cut_from=$ran_from; ALLOCATION=$((ran_alloc + 1)); RESTARTS=$((ran_restarts + 1)); STEP_NODES=$ran_nodes
  fi
  keep_logs $((ALLOCATION - 1))
  record $((ALLOCATION - 1)) "$cut_from" "$cut_to" "$(script_state)" -1 requeued ""
  STEP_NODES=$NODES
  echo "fleetbox: Slurm requeued job $SLURM_JOB_ID (restart count $REQUEUES): allocation $ALLOCATION goes on from the newest checkpoint"
  if [ "$RESTARTS" -gt "$MAX_RESTARTS" ]; then
    rc=1; step=$(newest_step)
    record "$ALLOCATION" "$step" "$step" "" "$rc" requeue-refused ""
    echo "fleetbox: Slurm requeued the job, but --max-restarts $MAX_RESTARTS is spent: not running it again" >&2
    exit "$rc"
  fi
fi
begin_step() {   # a step's start (this run's first, or the next after a failed one, step_here), said
  rm -f "$CHECKPOINTS/STATE"   # the script records its state again once it runs
  FROM_STEP=$(newest_step); export FLEETBOX_ATTEMPT=$((ALLOCATION - 1))
  # a requeue reads where this run's last step began
  echo "$SLURM_JOB_ID $((REQUEUES + 1)) $FROM_STEP $ALLOCATION $RESTARTS $STEP_NODES" > "$JOB_DIR/started.$CHAIN"
  echo "fleetbox: allocation $ALLOCATION (Slurm job $SLURM_JOB_ID) starts from checkpoint step $FROM_STEP"
  echo "fleetbox: allocation $ALLOCATION started at $(date +%s.%N)"
}
step_here() {   # HOST NODES SPENT: the step failed; the next runs in this allocation without HOST, on NODES nodes
  local how=spare
  [ "$2" -lt "$STEP_NODES" ] && how=fewer
  keep_logs "$ALLOCATION"
  record "$ALLOCATION" "$FROM_STEP" "$(newest_step)" "$(script_state)" "$rc" "$how" "" "$1"
  LEFT_OUT="$LEFT_OUT,$1" STEP_NODES=$2 ALLOCATION=$((ALLOCATION + 1)) RESTARTS=$((RESTARTS + $3))
  begin_step
}
hosts() {   # STEP: the first STEP_NODES of the allocation's nodes not left out (Slurm's order); SPARES: the others
  local h n=0; STEP="" SPARES=""
  for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    case "$LEFT_OUT," in *",$h,"*) continue;; esac
    if [ "$n" -lt "$STEP_NODES" ]; then STEP="$STEP${STEP:+,}$h" n=$((n + 1)); else SPARES="$SPARES${SPARES:+,}$h"; fi
  done
}
stop_soon() {
  echo "fleetbox: the time limit is near: asking the training processes to checkpoint and stop"
  : > "$CHECKPOINTS/STOP"
}
trap stop_soon USR1
rm -f "$CHECKPOINTS/STOP"   # an earlier run's ask; within this run, Slurm's one warning stands for every step
begin_step
next_allocation() {
  local to state ended next="" restarts="$RESTARTS"
  to=$(newest_step); state=$(script_state)
  if [ -e "$JOB_DIR/CANCELLED.$CHAIN" ]; then ended=cancelled
  elif [ "$state" = continue ] && [ "$to" -le "$FROM_STEP" ]; then ended=no-progress
  elif [ "$state" = continue ] && [ "$ALLOCATION" -ge "$MAX_ALLOCATIONS" ]; then ended=max-allocations
  elif [ "$state" = continue ]; then ended=continue
  elif [ "$rc" -eq 0 ]; then ended=finished
  elif [ "$RESTARTS" -lt "$MAX_RESTARTS" ]; then ended=restart; restarts=$((RESTARTS + 1))
  elif grep -qs "\"slurm_job\": \"$SLURM_JOB_ID\"" "$JOB_DIR/hang-$FLEETBOX_ATTEMPT/hang.json"; then ended=hung
  else ended=failed
  fi
  if [ "$ended" = continue ] || [ "$ended" = restart ]; then
    keep_logs "$ALLOCATION"
    next=$(sbatch --parsable --dependency="afterany:$SLURM_JOB_ID" \
      --export="ALL,SLURM_RESTART_COUNT=0,FLEETBOX_ALLOCATION=$((ALLOCATION + 1)),FLEETBOX_RESTARTS=$restarts,FLEETBOX_CHAIN=$CHAIN" \
      "$JOB_DIR/job.sbatch") || { ended=submit-failed; next=""; }
    next=${next%%;*}
    [ "$ended" = continue ] && rc=0
  fi
  record "$ALLOCATION" "$FROM_STEP" "$to" "$state" "$rc" "$ended" "$next"
  echo "fleetbox: allocation $ALLOCATION ended ($ended) at checkpoint step $to${next:+; next: Slurm job $next}"
}
