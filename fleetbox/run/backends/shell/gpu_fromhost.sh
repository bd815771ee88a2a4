# Charliecloud gives a container no driver of its own: the image must hold the node's NVIDIA driver libraries
# (ch-fromhost --nvidia copies them in), among them those of the driver this node runs (libcuda.so.<version>).
HOST_DRIVER=$(cat /sys/module/nvidia/version 2>/dev/null || nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
if [ -d "$GPU_IMAGE" ]; then
  IMAGE_DRIVERS=$(find "$GPU_IMAGE" -maxdepth 4 -name 'libcuda.so.*.*' 2>/dev/null | sed 's/.*libcuda\.so\.//' | sort -u | xargs)
else   # a squashfs image: listed, not mounted
  IMAGE_DRIVERS=$(unsquashfs -l "$GPU_IMAGE" 2>/dev/null | grep -oE 'libcuda\.so\.[0-9]+\.[0-9.]+$' | sed 's/libcuda\.so\.//' | sort -u | xargs || true)
fi
if [ -z "$IMAGE_DRIVERS" ]; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the image $GPU_IMAGE holds no NVIDIA driver libraries (libcuda.so): run \`ch-fromhost --nvidia $GPU_IMAGE\` on a GPU node (an image folder: a squashfs image cannot take them)" >&2
  exit 5
fi
case " $IMAGE_DRIVERS " in
  *" ${HOST_DRIVER:-$IMAGE_DRIVERS} "*) ;;
  *) echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: the image $GPU_IMAGE holds the libraries of driver $IMAGE_DRIVERS, this node runs driver $HOST_DRIVER: run \`ch-fromhost --nvidia $GPU_IMAGE\` on a node with that driver" >&2
     exit 5;;
esac
echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: the image holds the libraries of driver ${HOST_DRIVER:-$IMAGE_DRIVERS}${HOST_DRIVER:+, which this node runs} (ch-fromhost --nvidia)"
