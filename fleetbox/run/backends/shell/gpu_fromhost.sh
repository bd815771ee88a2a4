# Charliecloud gives a container no driver of its own: the image must hold the node's NVIDIA driver libraries
# (ch-fromhost --nvidia copies them in and runs the image's ldconfig), and its libcuda.so.1 must be the driver this
# node runs (libcuda.so.1 -> libcuda.so.<version>).
HOST_DRIVER=$(cat /sys/module/nvidia/version 2>/dev/null || nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n 1p || true)
if [ -d "$GPU_IMAGE" ]; then
  FIX="run \`ch-fromhost --nvidia $GPU_IMAGE\` on a GPU node"
  # where ch-fromhost puts them: the first folder the image's ldconfig names (in a GPU image, a library folder of
  # its own, deep in the venv), else wherever one is; a CUDA image's compat copy is not the driver's
  DEST=$(ch-fromhost --lib-path "$GPU_IMAGE" 2>/dev/null | sed -n '$p' || true)
  LINK="$GPU_IMAGE/$DEST/libcuda.so.1"
  if [ -z "$DEST" ] || { [ ! -L "$LINK" ] && [ ! -e "$LINK" ]; }; then
    LINK=$(find "$GPU_IMAGE" -name 'libcuda.so.1' ! -path '*/compat/*' -print -quit 2>/dev/null || true)
  fi
  IMAGE_DRIVER=$( { [ -z "$LINK" ] || readlink "$LINK" || echo unnamed; } | sed 's/.*libcuda\.so\.//')
elif ! command -v unsquashfs >/dev/null 2>&1; then   # Charliecloud runs it with squashfuse alone
  FIX=""; LINK="unlisted"; IMAGE_DRIVER=unnamed
else   # a squashfs image: listed, not mounted; it cannot take libraries
  FIX="a squashfs image cannot take them: unpack it to a folder (ch-convert), run \`ch-fromhost --nvidia\` on that folder on a GPU node and give the folder as --image"
  LINK=$(unsquashfs -ll "$GPU_IMAGE" 2>/dev/null | grep -v '/compat/' | grep -oE 'libcuda\.so\.1( -> .*)?$' | sed -n 1p || true)
  IMAGE_DRIVER=$(sed -n 's/.* -> .*libcuda\.so\.//p' <<<"$LINK")
  [ -z "$LINK" ] || IMAGE_DRIVER=${IMAGE_DRIVER:-unnamed}
fi
if [ -z "$LINK" ]; then
  echo "@SAYS@GPU prerequisite missing: the image $GPU_IMAGE holds no NVIDIA driver libraries (libcuda.so.1): $FIX" >&2
  exit 5
fi
if [ -n "$HOST_DRIVER" ] && [ "$IMAGE_DRIVER" != unnamed ] && [ "$IMAGE_DRIVER" != "$HOST_DRIVER" ]; then
  echo "@SAYS@GPU prerequisite missing: the image $GPU_IMAGE holds the libraries of driver $IMAGE_DRIVER, this node runs driver $HOST_DRIVER, and they must match: $FIX" >&2
  exit 5
fi
if [ "$LINK" = unlisted ]; then
  echo "@SAYS@GPU prerequisite: not checked (no unsquashfs here to list the squashfs image)"
elif [ "$IMAGE_DRIVER" = unnamed ]; then
  echo "@SAYS@GPU prerequisite: the image holds libcuda.so.1 (its driver version unnamed) (ch-fromhost --nvidia)"
else
  echo "@SAYS@GPU prerequisite: the image's libcuda.so.1 is driver ${IMAGE_DRIVER}'s${HOST_DRIVER:+, which this node runs} (ch-fromhost --nvidia)"
fi
