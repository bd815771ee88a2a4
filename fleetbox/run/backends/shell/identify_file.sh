if [ -f "$IMAGE_REF" ]; then echo "fleetbox: image file-sha256 $(sha256sum < "$IMAGE_REF" | cut -c1-64)"
elif [ -d "$IMAGE_REF" ]; then
  echo "fleetbox: image tree-sha256 $(cd "$IMAGE_REF" && find . -type f -printf '%P %s\n' | LC_ALL=C sort | sha256sum | cut -c1-64)"
elif [[ "$IMAGE_REF" == *://* ]]; then echo "fleetbox: image ref $IMAGE_REF"
else echo "fleetbox: image missing $IMAGE_REF is not on $(hostname)"; exit 3; fi
