"""The shape of the code, where import-linter cannot see it: what runs inside containers (and the kit loader)
imports only the standard library, and nothing outside run/backends/ chooses behaviour by a backend's or a
runtime's name."""
import ast
import re
import sys
from pathlib import Path

import pytest

from fleetbox.run import backends
from fleetbox.run.backends import runtimes
from tests.conftest import ROOT

PACKAGE = ROOT / "fleetbox"
SELF_CONTAINED = sorted((PACKAGE / "incontainer").glob("*.py")) + [PACKAGE / "ship" / "kit_load.py",
                                                                   PACKAGE / "run" / "hang.py"]
# Paddle and what comes with it exist only in the images: imported inside the functions that need them, except in
# the all-reduce sweep, a script that runs only there, and fit's callback, which subclasses Paddle's Callback and
# is imported only by training scripts
IMAGE_ONLY = {"paddle", "numpy", "scipy", "cv2", "visualdl"}
IMAGE_SCRIPTS = {"fleetbox_collective.py", "fleetbox_fit.py"}
HELPERS = {p.stem for p in (PACKAGE / "incontainer").glob("*.py")}   # each other's: the same folder, checked here


def imports(tree: ast.AST):
    """(module's top name, at module level?, node) of every import."""
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], id(node) in top_level, node
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:   # from . import x
            for alias in node.names:
                yield alias.name, id(node) in top_level, node
        elif isinstance(node, ast.ImportFrom):
            yield ("." if node.level else (node.module or "").split(".")[0]), id(node) in top_level, node


def foreign_imports(path: Path) -> list[str]:
    bad = []
    for name, at_top, node in imports(ast.parse(path.read_text())):
        if name in sys.stdlib_module_names or name == "__future__" or name in HELPERS:
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
        "fleetbox (at import)", "paddle (at import)", "requests (at import)", "fleetbox", "sibling"]


NAMES = set(backends.BACKENDS) | set(runtimes.RUNTIMES)
SUBJECTS = ("backend", "runtime", "name")   # what a name test compares: h.backend, e.runtime, b.name, ...
OWN_MODULES = ("fleetbox.run.backends.",)    # a backend's own module: reached through the registry only


def _constants(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def name_tests(path: Path, names: set[str] = NAMES, own_modules: bool = True, root: Path = ROOT) -> list[str]:
    """Every way of asking which backend or runtime it is: `x.backend == "slurm"`, `runtime in ("docker", ...)`,
    `backends.get("docker")`, `h.backend.startswith("sl")`, `match h.backend: case "slurm"`, `{"slurm": ...}[
    h.backend]`, and (own_modules) reaching into a backend's own module or class."""
    source = path.read_text()

    def about(node) -> bool:   # the thing compared is a backend's or runtime's name
        return any(word in (ast.get_source_segment(source, node) or "") for word in SUBJECTS)

    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = bool(set().union(*map(_constants, sides)) & names) and any(about(s) for s in sides
                                                                          if not _constants(s))
        elif isinstance(node, ast.Call):
            hit = any(_constants(a) & names for a in node.args) and about(node.func)
        elif isinstance(node, ast.Match):
            cases = {c.pattern.value.value for c in node.cases
                     if isinstance(c.pattern, ast.MatchValue) and isinstance(c.pattern.value, ast.Constant)}
            hit = bool(cases & names) and about(node.subject)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            hit = bool({k.value for k in node.value.keys if isinstance(k, ast.Constant)} & names) and about(node.slice)
        elif own_modules and isinstance(node, ast.Import):
            hit = any(a.name.startswith(OWN_MODULES) for a in node.names)
        elif own_modules and isinstance(node, ast.ImportFrom):
            hit = (node.module or "").startswith(OWN_MODULES) or node.module == "fleetbox.run.backends" and any(
                a.name in ("docker", "slurm", "runtimes") or a.name.endswith("Backend") for a in node.names)
        if hit:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def outside_backends() -> list[Path]:
    inside = PACKAGE / "run" / "backends"
    return [p for p in sorted(PACKAGE.rglob("*.py")) if inside not in p.parents] + []


def test_nothing_outside_run_backends_tests_a_backend_or_runtime_name():
    assert [hit for p in outside_backends() for hit in name_tests(p)] == []


def test_in_run_backends_only_the_runtime_classes_test_a_runtime_name():
    """The Slurm backend asks its runtime (node_script_inside, remove_now, ...), not which one it is."""
    mine = [p for p in sorted((PACKAGE / "run" / "backends").glob("*.py")) if p.name != "runtimes.py"]
    assert [hit for p in mine for hit in name_tests(p, set(runtimes.RUNTIMES), own_modules=False)] == []


def test_the_name_check_finds_each_way_of_asking(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text('if h.backend == "slurm": pass\nif e.runtime in ("docker", "podman"): pass\n'
                 'if rt.name != "pyxis": pass\nb = backends.get("docker")\nif fmt == "charliecloud": pass\n'
                 'from fleetbox.run.backends.docker import DockerBackend\n'
                 'from fleetbox.run.backends import slurm\nfrom fleetbox.run import backends\n'
                 'import fleetbox.run.backends.slurm\nfrom fleetbox.run.backends import SlurmBackend\n'
                 'if h.backend.startswith("slurm"): pass\nx = {"slurm": 1, "docker": 2}[h.backend]\n'
                 'match h.backend:\n    case "slurm":\n        pass\n')
    assert sorted(hit.split(": ", 1)[1] for hit in name_tests(p, root=tmp_path)) == sorted([
        'h.backend == "slurm"', 'e.runtime in ("docker", "podman")', 'rt.name != "pyxis"',
        'backends.get("docker")', "from fleetbox.run.backends.docker import DockerBackend",
        "from fleetbox.run.backends import slurm", "import fleetbox.run.backends.slurm",
        "from fleetbox.run.backends import SlurmBackend", 'h.backend.startswith("slurm")',
        '{"slurm": 1, "docker": 2}[h.backend]', 'match h.backend:\n    case "slurm":\n        pass'])


def _judging(path: Path, results: set[str]) -> list[str]:
    """Where a module decides what its nodes' ends mean (a NodeResult or JobResult made: run/judge.py's work) or
    watches for hangs itself (hang.Watch's verdicts, stacks asked for and kept: run/hang.py's Watcher's work)."""
    own = {"verdict", "collective_stall", "ask_for_stacks", "keep", "Watch", "new_stragglers"}
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in results or name in own:
                found.append((node.lineno, f"{path.name}:{node.lineno}: {ast.get_source_segment(source, node)[:60]}"))
    return [hit for _, hit in sorted(found)]


def _result_types() -> set[str]:
    from fleetbox.run.result import JobResult, NodeResult
    todo, names = [JobResult], {"NodeResult", NodeResult.__name__}
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def test_backends_report_facts_and_neither_judge_them_nor_watch_for_hangs():
    """run/judge.py alone turns what a backend saw into node states, the blamed node and the JobResult;
    run/hang.py's Watcher alone watches for hangs, driven by each backend."""
    mine = sorted((PACKAGE / "run" / "backends").glob("*.py"))
    assert [hit for p in mine for hit in _judging(p, _result_types())] == []


def test_the_judging_check_finds_a_result_made_and_a_hang_loop(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text("r = JobResult('j', 'x', True, [])\nn = result.NodeResult('node0', 0)\ns = SlurmResult()\n"
                 "w = hang.Watch(2, 1, 1)\nif w.verdict() is None: pass\nhang.keep(out)\n")
    assert [hit.split(": ", 1)[1] for hit in _judging(p, _result_types())] == [
        "JobResult('j', 'x', True, [])", "result.NodeResult('node0', 0)", "SlurmResult()", "hang.Watch(2, 1, 1)",
        "w.verdict()", "hang.keep(out)"]


def test_the_layout_page_names_every_module_and_no_other():
    page = (ROOT / "docs" / "explanation" / "layout.md").read_text()
    tree = page[page.index("```\ntasks.py"):page.index("```", page.index("```\ntasks.py") + 3)]
    named = set(re.findall(r"\b(\w+)\.py\b", tree)) - {"__init__"}
    modules = {p.stem for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert (sorted(modules - named), sorted(named - modules)) == ([], [])


@pytest.mark.parametrize(("spelled", "home"), [("fleetbox: node ", "node_log.py"),
                                               ("FLEETBOX-METRIC", "fleetbox_found.py")])
def test_each_log_line_shape_is_spelled_in_one_module(spelled, home):
    """The node log protocol and the metrics lines: writers and readers take the shape from its one module (shell
    templates get it rendered in), so they cannot drift apart."""
    code = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".sh")]
    assert [p.name for p in code if spelled in p.read_text()] == [home]
