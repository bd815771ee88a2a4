"""How a training script starts its ranks, read from its source (pure: nothing is run or imported).

Paddle's launcher (`python -m paddle.distributed.launch script.py`) starts a script once per rank; a script that
calls `paddle.distributed.spawn(train, nprocs=N)` starts its own N ranks on the machine it runs on, and refuses
to run inside the launcher (CPU: "CPUONLY spawn doesn't support multi-trainer"; GPU: it replaces the launcher's
rank variables with its own). fleetbox starts the first kind with the launcher and the second by itself, and
tells them apart here, so that a script is run unchanged and needs no option."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SPAWN_MODULES = ("paddle.distributed", "paddle.distributed.spawn")   # where `spawn` is imported from
NPROCS_AT = 2   # spawn(func, args=(), nprocs=-1, ...): nprocs's position
MAX_SOURCE = 4 << 20   # characters: a bigger script is generated, not one that starts its own ranks (2M lines of
                       # `x = 1` took 61 s to parse and walk)


@dataclass(frozen=True)
class Style:
    spawns: bool = False   # the script starts its own ranks with paddle.distributed.spawn
    nprocs: int = 0        # how many, where the call says it as a number (0: not said, or not a number)
    line: int = 0          # the spawn call's line
    text: str = ""         # the call's nprocs as written, for a message ("" where not given)


LAUNCHED = Style()


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names this module binds to `paddle.distributed` (modules) and to its `spawn` function."""
    modules, functions = {"paddle.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "paddle" and a.asname:
                    modules.add(f"{a.asname}.distributed")
                elif a.name == "paddle.distributed" and a.asname:
                    modules.add(a.asname)
                elif a.name == "paddle.distributed.spawn" and a.asname:   # the function: the package's
                    functions.add(a.asname)                                # attribute shadows the module
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                if node.module == "paddle" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module in SPAWN_MODULES and a.name == "spawn":
                    functions.add(a.asname or a.name)
    return modules, functions


def _dotted(e: ast.AST) -> str:
    """`a.b.c` as written; "" where it is not a dotted name (a chain of any length: no recursion)."""
    attrs = []
    while isinstance(e, ast.Attribute):
        attrs.append(e.attr)
        e = e.value
    return ".".join([e.id, *reversed(attrs)]) if isinstance(e, ast.Name) else ""


def _is_spawn(call: ast.Call, modules: set[str], functions: set[str]) -> bool:
    name = _dotted(call.func)
    if name in functions:
        return True
    owner, _, attr = name.rpartition(".")
    return attr == "spawn" and owner in modules


def _nprocs(call: ast.Call) -> tuple[int, str]:
    given = next((k.value for k in call.keywords if k.arg == "nprocs"), None)
    if given is None and len(call.args) > NPROCS_AT:
        given = call.args[NPROCS_AT]
    if given is None:
        return 0, ""
    n = given.value if isinstance(given, ast.Constant) and type(given.value) is int else 0
    return max(n, 0), ast.unparse(given)


def of_source(text: str, filename: str = "<script>") -> Style:
    """The style of a script's source; one that does not parse, or is too big or too deep to read here, is left to
    Python (run as launched). A script that never says `spawn` is not parsed at all."""
    if "spawn" not in text or len(text) > MAX_SOURCE:
        return LAUNCHED
    try:
        tree = ast.parse(text, filename)
        modules, functions = _names(tree)
        calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_spawn(n, modules, functions)),
                       key=lambda n: n.lineno)
        if not calls:
            return LAUNCHED
        n, text_ = _nprocs(calls[0])
    except (SyntaxError, ValueError, RecursionError, MemoryError):   # nested too deep for the parser: Python's
        return LAUNCHED
    return Style(True, n, calls[0].lineno, text_)


def of_script(path: Path) -> Style:
    try:
        return of_source(path.read_text(errors="replace"), str(path))
    except OSError:
        return LAUNCHED
