# The render nodes of the allocated GPUs ($GPUS), through the kernel's KFD topology: GPU i is the i-th topology
# node with SIMDs (ROCr's own order; CPU nodes have none), its render node /dev/dri/renderD<drm_render_minor>.
render_nodes() {
  local topo="${FLEETBOX_KFD_TOPOLOGY:-/sys/class/kfd/kfd/topology/nodes}" n i=0 simd minor found=0
  for n in $(cd "$topo" 2>/dev/null && printf '%s\n' [0-9]* | sort -n); do
    simd=$(awk '$1 == "simd_count" {print $2}' "$topo/$n/properties")
    [ "${simd:-0}" -gt 0 ] || continue
    minor=$(awk '$1 == "drm_render_minor" {print $2}' "$topo/$n/properties")
    case ",$GPUS," in *",$i,"*) echo "/dev/dri/renderD$minor"; found=$((found + 1));; esac
    i=$((i + 1))
  done
  if [ "$found" -ne "$GPU_COUNT" ]; then
    echo "@SAYS@the KFD topology ($topo) has $i GPU(s); Slurm allocated $GPUS" >&2
    return 2
  fi
}
