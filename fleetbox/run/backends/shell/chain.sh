ALLOCATION="${FLEETBOX_ALLOCATION:-1}"; RESTARTS="${FLEETBOX_RESTARTS:-0}"
CHAIN="${FLEETBOX_CHAIN:-$SLURM_JOB_ID}"
export FLEETBOX_ATTEMPT=$((ALLOCATION - 1))
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
rm -f "$CHECKPOINTS/STOP" "$CHECKPOINTS/STATE"   # the script records its state again once it runs
FROM_STEP=$(newest_step)
stop_soon() {
  echo "fleetbox: the time limit is near: asking the training processes to checkpoint and stop"
  : > "$CHECKPOINTS/STOP"
}
trap stop_soon USR1
echo "fleetbox: allocation $ALLOCATION (Slurm job $SLURM_JOB_ID) starts from checkpoint step $FROM_STEP"
echo "fleetbox: allocation $ALLOCATION started at $(date +%s.%N)"
next_allocation() {  # max_allocations max_restarts
  local to state ended next="" restarts="$RESTARTS"
  to=$(newest_step); state=$(script_state)
  if [ -e "$JOB_DIR/CANCELLED.$CHAIN" ]; then ended=cancelled
  elif [ "$state" = continue ] && [ "$to" -le "$FROM_STEP" ]; then ended=no-progress
  elif [ "$state" = continue ] && [ "$ALLOCATION" -ge "$1" ]; then ended=max-allocations
  elif [ "$state" = continue ]; then ended=continue
  elif [ "$rc" -eq 0 ]; then ended=finished
  elif [ "$RESTARTS" -lt "$2" ]; then ended=restart; restarts=$((RESTARTS + 1))
  else ended=failed
  fi
  if [ "$ended" = continue ] || [ "$ended" = restart ]; then
    mkdir -p "$JOB_DIR/alloc$ALLOCATION"
    mv "$JOB_DIR"/node[0-9]* "$JOB_DIR/alloc$ALLOCATION"/ 2>/dev/null
    next=$(sbatch --parsable --dependency="afterany:$SLURM_JOB_ID" \
      --export="ALL,FLEETBOX_ALLOCATION=$((ALLOCATION + 1)),FLEETBOX_RESTARTS=$restarts,FLEETBOX_CHAIN=$CHAIN" \
      "$JOB_DIR/job.sbatch") || { ended=submit-failed; next=""; }
    next=${next%%;*}
    [ "$ended" = continue ] && rc=0
  fi
  printf '{"chain": "%s", "allocation": %d, "max_allocations": %d, "slurm_job": "%s", "from_step": %d, "to_step": %d, "state": "%s", "exit": %d, "ended": "%s", "next": "%s"}\n' \
    "$CHAIN" "$ALLOCATION" "$1" "$SLURM_JOB_ID" "$FROM_STEP" "$to" "$state" "$rc" "$ended" "$next" >> "$JOB_DIR/allocations.jsonl"
  echo "fleetbox: allocation $ALLOCATION ended ($ended) at checkpoint step $to${next:+; next: Slurm job $next}"
}
