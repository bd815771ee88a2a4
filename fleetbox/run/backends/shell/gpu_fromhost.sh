# Charliecloud gives a container no driver of its own: the image must hold the node's NVIDIA driver libraries
# (ch-fromhost --nvidia copies them in and runs the image's ldconfig), and its libcuda.so.1 must be the driver this
# node runs (libcuda.so.1 -> libcuda.so.<version>).
HOST_DRIVER=$(cat /sys/module/nvidia/version 2>/dev/null || nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n 1p || true)
if [ -d "$GPU_IMAGE" ]; then
  FIX="run \`ch-fromhost --nvidia $GPU_IMAGE\` on a GPU node"
  LINK=$(find "$GPU_IMAGE" -maxdepth 4 -name 'libcuda.so.1' -print -quit 2>/dev/null || true)
  IMAGE_DRIVER=$( { [ -z "$LINK" ] || readlink "$LINK" || echo unnamed; } | sed 's/.*libcuda\.so\.//')
else   # a squashfs image: listed, not mounted; it cannot take libraries
  FIX="a squashfs image cannot take them: unpack it to a folder (ch-convert), run \`ch-fromhost --nvidia\` on that folder on a GPU node and give the folder as --image"
  LINK=$(unsquashfs -ll "$GPU_IMAGE" 2>/dev/null | grep -oE 'libcuda\.so\.1( -> .*)?$' | sed -n 1p || true)
  IMAGE_DRIVER=$(sed -n 's/.* -> .*libcuda\.so\.//p' <<<"$LINK")
  [ -z "$LINK" ] || IMAGE_DRIVER=${IMAGE_DRIVER:-unnamed}
fi
if [ -z "$LINK" ]; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the image $GPU_IMAGE holds no NVIDIA driver libraries (libcuda.so.1): $FIX" >&2
  exit 5
fi
if [ -n "$HOST_DRIVER" ] && [ "$IMAGE_DRIVER" != unnamed ] && [ "$IMAGE_DRIVER" != "$HOST_DRIVER" ]; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the image $GPU_IMAGE holds the libraries of driver $IMAGE_DRIVER, this node runs driver $HOST_DRIVER, and they must match: $FIX" >&2
  exit 5
fi
if [ "$IMAGE_DRIVER" = unnamed ]; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: the image holds libcuda.so.1 (its driver version unnamed) (ch-fromhost --nvidia)"
else
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: the image's libcuda.so.1 is driver ${IMAGE_DRIVER}'s${HOST_DRIVER:+, which this node runs} (ch-fromhost --nvidia)"
fi
