"""Loads each library named on its command line by name, as Paddle's dynamic loader opens them, and says which
loaded (a line `FLEETBOX-NAMES <json>`), with the loader's path it ran under."""
import ctypes
import json
import os
import sys

said = {}
for name in sys.argv[1:]:
    try:
        ctypes.CDLL(name)
        said[name] = "loaded"
    except OSError as e:
        said[name] = str(e)
print("FLEETBOX-NAMES " + json.dumps({"names": said, "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
                                      "prefix": sys.prefix}), flush=True)
