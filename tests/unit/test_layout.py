"""The shape of the code, where import-linter cannot see it: what runs inside containers (and the kit loader)
imports only the standard library, and nothing outside run/backends/ chooses behaviour by a backend's or a
runtime's name."""
import ast
import sys
from pathlib import Path

import pytest

from fleetbox.run import backends
from fleetbox.run.backends import runtimes
from tests.conftest import ROOT

PACKAGE = ROOT / "fleetbox"
SELF_CONTAINED = sorted((PACKAGE / "incontainer").glob("*.py")) + [PACKAGE / "ship" / "kit_load.py"]
# Paddle and what comes with it exist only in the images: imported inside the functions that need them, except in
# the all-reduce sweep, a script that runs only there
IMAGE_ONLY = {"paddle", "numpy", "scipy", "cv2"}
IMAGE_SCRIPTS = {"fleetbox_collective.py"}


def imports(tree: ast.AST):
    """(module's top name, at module level?, node) of every import."""
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], id(node) in top_level, node
        elif isinstance(node, ast.ImportFrom):
            yield ("." if node.level else (node.module or "").split(".")[0]), id(node) in top_level, node


def foreign_imports(path: Path) -> list[str]:
    bad = []
    for name, at_top, node in imports(ast.parse(path.read_text())):
        if name in sys.stdlib_module_names or name == "__future__":
            continue
        if name in IMAGE_ONLY and (not at_top or path.name in IMAGE_SCRIPTS):
            continue
        bad.append(f"{path.name}:{node.lineno}: {name}" + (" (at import)" if at_top else ""))
    return bad


@pytest.mark.parametrize("path", SELF_CONTAINED, ids=lambda p: p.name)
def test_code_that_runs_in_containers_or_before_install_imports_only_the_standard_library(path):
    assert foreign_imports(path) == []


def test_the_self_contained_check_catches_what_would_break_in_a_container(tmp_path):
    probe = tmp_path / "fleetbox_probe.py"
    probe.write_text("import json\nfrom fleetbox import settings\nimport paddle\nimport requests\n"
                     "def f():\n    import numpy\n    from fleetbox.incontainer import fleetbox_netinfo\n"
                     "    from . import sibling\n")
    assert [b.split(": ", 1)[1] for b in foreign_imports(probe)] == [
        "fleetbox (at import)", "paddle (at import)", "requests (at import)", "fleetbox", "."]


NAMES = set(backends.BACKENDS) | set(runtimes.RUNTIMES)
SUBJECTS = ("backend", "runtime", "name")   # what a name test compares: h.backend, e.runtime, b.name, ...
OWN_MODULES = ("fleetbox.run.backends.",)    # a backend's own module: reached through the registry only


def _constants(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def name_tests(path: Path, names: set[str] = NAMES, own_modules: bool = True) -> list[str]:
    """`x.backend == "slurm"`, `runtime in ("docker", "podman")`, `backends.get("docker")`, ... and (own_modules)
    an import of a backend's own module."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = set().union(*map(_constants, sides)) & names
            subject = " ".join(ast.get_source_segment(source, s) or "" for s in sides if not _constants(s))
            if named and any(word in subject for word in SUBJECTS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(source, node)}")
        elif isinstance(node, ast.Call) and node.args and _constants(node.args[0]) & names:
            func = ast.get_source_segment(source, node.func) or ""
            if func.split(".")[-1] in ("get", "lookup") and "backend" in func:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(source, node)}")
        elif not own_modules:
            continue
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OWN_MODULES) \
                or isinstance(node, ast.ImportFrom) and node.module == "fleetbox.run.backends" \
                and {a.name for a in node.names} & {"docker", "slurm", "runtimes"}:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def outside_backends() -> list[Path]:
    inside = PACKAGE / "run" / "backends"
    return [p for p in sorted(PACKAGE.rglob("*.py")) if inside not in p.parents] + [ROOT / "tasks.py"]


def test_nothing_outside_run_backends_tests_a_backend_or_runtime_name():
    assert [hit for p in outside_backends() for hit in name_tests(p)] == []


def test_in_run_backends_only_the_runtime_classes_test_a_runtime_name():
    """The Slurm backend asks its runtime (node_script_inside, remove_now, ...), not which one it is."""
    mine = [p for p in sorted((PACKAGE / "run" / "backends").glob("*.py")) if p.name != "runtimes.py"]
    assert [hit for p in mine for hit in name_tests(p, set(runtimes.RUNTIMES), own_modules=False)] == []


def test_the_name_check_finds_each_way_of_asking(tmp_path):
    p = ROOT / "tests" / "unit" / "_name_probe.py"   # under ROOT: the check names files relative to it
    try:
        p.write_text('if h.backend == "slurm": pass\nif e.runtime in ("docker", "podman"): pass\n'
                     'if rt.name != "pyxis": pass\nb = backends.get("docker")\nif fmt == "charliecloud": pass\n'
                     'from fleetbox.run.backends.docker import DockerBackend\n'
                     'from fleetbox.run.backends import slurm\nfrom fleetbox.run import backends\n')
        assert sorted(hit.split(": ", 1)[1] for hit in name_tests(p)) == sorted([
            'h.backend == "slurm"', 'e.runtime in ("docker", "podman")', 'rt.name != "pyxis"',
            'backends.get("docker")', "from fleetbox.run.backends.docker import DockerBackend",
            "from fleetbox.run.backends import slurm"])
    finally:
        p.unlink()
