echo "fleetbox: image env-sha256 $(sha256sum < "$FLEETBOX_VENV/@RECORD@" | cut -c1-64) $(readlink -f "$FLEETBOX_VENV/bin/python")"
