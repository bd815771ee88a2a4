if out=$(@ENGINE@ image inspect --format '{{.Id}} {{index @LABELS@ "@LABEL_INPUTS@"}}' "$IMAGE_REF" 2>&1); then
  echo "fleetbox: image id ${out//<no value>/}"
elif @IN_REGISTRY@; then echo "fleetbox: image ref $IMAGE_REF"   # not here yet: the run pulls it
else echo "fleetbox: image missing $(tail -n 1 <<<"$out")"; exit 3; fi
