"""What the test workers of one run share (tests/conftest.py): once() makes a thing in one of them, whichever asks
first, while the others wait for it and get what it made; a make() that fails leaves it to the next to ask."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, SHARED

ASK = """
import json, sys, time
from tests.conftest import once
def make():
    with open(sys.argv[1], "a") as f:
        f.write("made\\n")
    time.sleep(1)   # long enough that the other workers ask while it is being made
    if sys.argv[2] == "fail":
        raise RuntimeError("could not make it")
    return {"made by": sys.argv[3]}
print(json.dumps(once("thing", make)))
"""


def _workers(tmp_path, how: str, n: int = 3) -> list[subprocess.Popen]:
    env = {**os.environ, SHARED: str(tmp_path), "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-c", ASK, str(tmp_path / "log"), how, f"worker{k}"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(n)]


def test_once_makes_it_in_one_worker_and_the_others_get_what_it_made(tmp_path):
    got = [json.loads(p.communicate(timeout=60)[0]) for p in _workers(tmp_path, "ok")]
    assert (tmp_path / "log").read_text() == "made\n"
    assert len({g["made by"] for g in got}) == 1   # every worker has the one that made it


def test_a_make_that_fails_is_tried_again_by_the_next_to_ask(tmp_path):
    procs = _workers(tmp_path, "fail")
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 1 and "could not make it" in err
    assert (tmp_path / "log").read_text() == "made\n" * 3   # each tried, none was given a half-made thing
