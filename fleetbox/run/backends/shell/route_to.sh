route_to() {
  local out dev src
  out=$(ip -o route get "$1")
  dev=$(sed -n 's/.* dev \([^ ]*\).*/\1/p' <<<"$out")
  src=$(sed -n 's/.* src \([^ ]*\).*/\1/p' <<<"$out")
  if [ "$dev" = lo ] && [ "${1#127.}" = "$1" ]; then
    dev=$(ip -o -4 addr show | awk -v ip="$1" 'index($4, ip "/") == 1 {print $2; exit}')
    src=$1
  fi
  echo "$dev $src"
}
