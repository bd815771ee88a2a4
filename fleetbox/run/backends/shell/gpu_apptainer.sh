# How @RUNTIME@ gives the container the node's NVIDIA GPUs, chosen here, on each node (GPU_ARGS, before the image):
#  - Apptainer 1.5 and later: by CDI name (--device nvidia.com/gpu=INDEX), where a CDI spec names every allocated
#    GPU (nvidia-ctk cdi list: the specs in /etc/cdi and /var/run/cdi, the folders Apptainer reads by default);
#  - SingularityCE with NVIDIA's nvidia-container-cli installed: --nv --nvccli (NVIDIA's own library setup);
#  - else --nv, which binds the driver libraries the node's loader knows.
# ldconfig is in /sbin, which a user's PATH may lack (Apptainer runs /sbin/ldconfig itself). grep reads the whole
# cache: under pipefail, `grep -q` would cut ldconfig off and fail the test.
GPU_ARGS=(--nv); TAKES_CDI=@TAKES_CDI@; TAKES_NVCCLI=@TAKES_NVCCLI@
RT_VERSION=$(@RUNTIME@ --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n 1 || true)
if $TAKES_CDI && [ -n "$RT_VERSION" ] \
    && [ "$(printf '1.5\n%s\n' "$RT_VERSION" | sort -V | head -n 1)" = 1.5 ] \
    && command -v nvidia-ctk >/dev/null 2>&1 && CDI=$(nvidia-ctk cdi list 2>/dev/null); then
  NAMED=(); for g in ${GPUS//,/ }; do grep -xF "nvidia.com/gpu=$g" <<<"$CDI" >/dev/null && NAMED+=(--device "nvidia.com/gpu=$g"); done
  if [ "${#NAMED[@]}" -gt 0 ] && [ "${#NAMED[@]}" -eq $((2 * GPU_COUNT)) ]; then GPU_ARGS=("${NAMED[@]}"); fi
fi
if [ "${GPU_ARGS[0]}" = --device ]; then
  echo "@SAYS@GPU prerequisite: a CDI spec names nvidia.com/gpu=${GPUS//,/, nvidia.com/gpu=} (@RUNTIME@ $RT_VERSION --device, CDI)"
else
  if $TAKES_NVCCLI && command -v nvidia-container-cli >/dev/null 2>&1; then GPU_ARGS=(--nv --nvccli); fi
  LDCONFIG=$(command -v ldconfig || { for l in /sbin/ldconfig /usr/sbin/ldconfig; do [ -x "$l" ] && echo "$l" && break; done; } || true)
  if [ -z "$LDCONFIG" ]; then
    echo "@SAYS@GPU prerequisite: not checked (no ldconfig here to list the driver's libraries; @RUNTIME@ ${GPU_ARGS[*]})"
  elif "$LDCONFIG" -p 2>/dev/null | grep 'libcuda\.so\.1 ' >/dev/null; then
    echo "@SAYS@GPU prerequisite: the node's driver libraries (@RUNTIME@ ${GPU_ARGS[*]})"
  else
    echo "@SAYS@GPU prerequisite missing: the node's loader knows no libcuda.so.1 ($LDCONFIG -p), so @RUNTIME@ ${GPU_ARGS[*]} gives the container no NVIDIA driver: check the driver install on this node" >&2
    exit 5
  fi
fi
