# No container: the env (FLEETBOX_VENV) must be one `invoke venv` made, its interpreter on this node (the site's
# modules, modules.sh, are loaded by now).
if [ ! -f "$FLEETBOX_VENV/@RECORD@" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV is not an env made by invoke venv on $(hostname) (no @RECORD@)"; exit 3
fi
if [ ! -x "$FLEETBOX_VENV/bin/python" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV: its interpreter $(readlink "$FLEETBOX_VENV/bin/python") is not on $(hostname) (a venv needs it at the same path on every node)"; exit 3
fi
SITE_PYTHONPATH="${PYTHONPATH:-}"   # a module's (or the caller's): kept after the helpers
export VIRTUAL_ENV="$FLEETBOX_VENV" PATH="$FLEETBOX_VENV/bin:$PATH"   # as the images have their venv
# the env's GPU libraries (a variant with them): ahead of a module's, under the names Paddle opens
# shellcheck source=/dev/null
if [ -f "$FLEETBOX_VENV/@LIBRARIES@" ]; then . "$FLEETBOX_VENV/@LIBRARIES@"; fi
