# the env's identity: the lock it was made from (its record's lock_sha256), then the interpreter it links to
lock=$(sed -n 's/.*"lock_sha256": *"\([0-9a-f]*\)".*/\1/p' "$FLEETBOX_VENV/@RECORD@" | head -n 1)
echo "fleetbox: image env-sha256 ${lock:-unknown} $(readlink -f "$FLEETBOX_VENV/bin/python")"
