"""Site and project defaults: what a task's options take where the command line gave none, from the site files
(settings.site_files: the project's fleetbox.toml, then the user's), and `fleetbox config`, which says what is in
effect and where each value came from.

A file holds `[paths]` (where fleetbox keeps things: settings.PATHS), `[job]` (any option of the tasks that run a
job), `[backends.<name>]` (that backend's own options, where it is the job's backend) and a section per task
(`[train]`, `[build]`, ...). Keys are the options' flags without the dashes (options.spelled). The first file
that sets a value wins; within one file, the task's section, then the backend's, then [job]. The command line beats
them all.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from fleetbox import options, settings
from fleetbox.errors import UserError
from fleetbox.options import Option, spelled
from fleetbox.run import backends
from fleetbox.run import spec as spec_mod

JOB_SECTION, BACKENDS_SECTION, PATHS_SECTION = "job", "backends", "paths"


@dataclass(frozen=True)
class FromFile:
    """A value a site file gave an option."""
    option: Option
    value: object   # as the command line would have given it
    where: str      # FILE:LINE

    def named_in(self, message: str) -> bool:
        """A refusal names this value: by its flag (a whole one: not --time in --timeout), or the value itself
        (`unknown runtime 'singularity'`)."""
        return bool(re.search(rf"{re.escape(self.option.flag)}(?![\w-])", message)) or \
            isinstance(self.value, str) and f"'{self.value}'" in message

    def said(self) -> str:
        return f"{self.option.flag}{'' if self.value is True else ' ' + shlex.quote(str(self.value))} ({self.where})"


def job_options() -> dict[str, Option]:
    """What [job] may set: every option of the tasks that run a job but the backends' own."""
    return {spelled(o.name): o for o in (*spec_mod.JOB_OPTIONS, *spec_mod.TASK_OPTIONS, backends.BACKEND)}


def check(f: settings.SiteFile, tasks: dict[str, dict[str, Option]], task: str = "") -> None:
    """Every section and key of the file is one fleetbox has: else one line naming the file and line, with the
    nearest name. For a `task`, another task's section goes unread (its own run, or `config`, checks it): a slip
    there does not stop `cancel`."""
    def refuse(section: str, name: str, known, what: str) -> None:
        guess = options.nearest(name, known)
        raise UserError(f"{f.where(section, name)}: {what} {name!r}" + (f"; did you mean {guess}?" if guess else ""))

    for section, body in f.data.items():
        if not isinstance(body, dict):   # a key outside any section
            raise UserError(f"{f.where('', section)}: {section} is outside any section: put it under [job], "
                            f"[backends.<name>] or a task's section")
        if section == BACKENDS_SECTION:
            for b, table in body.items():
                if b not in backends.BACKENDS:
                    guess = options.nearest(b, backends.BACKENDS)
                    raise UserError(f"{f.where(f'{section}.{b}')}: no backend {b!r}" +
                                    (f"; did you mean [backends.{guess}]?" if guess else ""))
                if not isinstance(table, dict):
                    raise UserError(f"{f.where(f'{section}.{b}')}: [{section}.{b}] must be a section of keys")
                own = {spelled(o.name) for o in backends.BACKENDS[b].options}
                for k in table:
                    if k not in own:
                        refuse(f"{section}.{b}", k, own, f"the {b} backend has no option")
            continue
        if task and section in tasks and section != task:
            continue
        known = (set(settings.PATHS) if section == PATHS_SECTION else set(job_options()) if section == JOB_SECTION
                 else {spelled(n) for n in tasks.get(section, {})})
        if section not in (PATHS_SECTION, JOB_SECTION, *tasks):
            raise UserError(f"{f.where(section)}: no section [{section}] in fleetbox's files" + (
                f"; did you mean [{g}]?" if (g := options.nearest(section, [PATHS_SECTION, JOB_SECTION,
                                                                               BACKENDS_SECTION, *tasks])) else ""))
        for k in body:
            if k not in known:
                refuse(section, k, known, f"[{section}] has no option")


def as_given(o: Option, value, where: str):
    """A file's value as the command line would give it, checked as the option checks a given one."""
    kind = o.kind
    if kind is bool:   # the command line could not turn it off again: flags are the command line's
        raise UserError(f"{where}: {spelled(o.name)} is a flag, which a file may not set (the command line could not "
                        f"turn it off again): give {o.flag} where you want it")
    words = value if kind is tuple and isinstance(value, list) else \
        [f"{k}={v}" if isinstance(v, str) else None for k, v in value.items()] if kind is dict and \
        isinstance(value, dict) else None
    if words is not None:   # a TOML array or table: the command line's comma-separated words
        if not all(isinstance(w, str) and "," not in w for w in words):
            raise UserError(f"{where}: {spelled(o.name)}'s items are strings without commas (the command line "
                            f"separates them with commas; got {value!r})")
        value = ",".join(words)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = value if kind is int else str(value)
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise UserError(f"{where}: {spelled(o.name)} takes {kind.__name__ if kind in (int, str) else 'a string'} "
                        f"(got {value!r})")
    try:
        o.parse(value)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return int(value) if isinstance(o.default, int) else str(value)   # as invoke gives it: a number where the
    #                                                                   task's default is one, else the words


def defaults(task: str, params: dict[str, Option], values: dict, given: set[str],
             tasks: dict[str, dict[str, Option]]) -> dict[str, FromFile]:
    """What the site files give the task's options that the command line did not (`given`; `values`: the task's
    values as given), by name. The backend comes first: its section counts only where it is the job's."""
    files = settings.site_files()
    for f in files:
        check(f, tasks, task)

    def first(name: str, backend: str = "") -> FromFile | None:
        for f in files:   # check() held each section's keys to what it may set
            sections = [(task, f.data.get(task, {}))]
            if backend:
                sections.append((f"{BACKENDS_SECTION}.{backend}", f.data.get(BACKENDS_SECTION, {}).get(backend, {})))
            if "backend" in params:   # a task that runs a job
                sections.append((JOB_SECTION, f.data.get(JOB_SECTION, {})))
            for section, table in sections:
                if spelled(name) in table:
                    where = f.where(section, spelled(name))
                    return FromFile(params[name], as_given(params[name], table[spelled(name)], where), where)
        return None

    out: dict[str, FromFile] = {}
    backend = ""
    if "backend" in params:
        got = None if "backend" in given else first("backend")
        if got:
            out["backend"] = got
        backend = str(got.value) if got else values["backend"] or backends.DEFAULT
    for name in params:
        if name in given or name in out:
            continue
        if got := first(name, backend):
            out[name] = got
    return out


def show(tasks: dict[str, dict[str, Option]], log=print) -> None:
    """`fleetbox config`: the files, where fleetbox keeps things, and every default the files give, each with
    where it came from (a value a nearer file sets again is said to be overridden)."""
    files = settings.site_files()
    for f in files:
        check(f, tasks)
    project, user = settings.project_file(), settings.user_file()
    log(f"project file: {project or f'none ({settings.PROJECT_FILE} here or above)'}")
    log(f"user file:    {user}{'' if user.is_file() else ' (none)'}")
    log("paths:")
    for k in settings.PATHS:
        path, where = settings.path_of(k)
        log(f"  {k:<18} {path}  ({where})")
    rows: dict[tuple[str, str], list[str]] = {}
    for f in files:
        for section, body in f.data.items():
            if section == PATHS_SECTION:
                continue
            tables = body.items() if section == BACKENDS_SECTION else [("", body)]
            for b, table in tables:
                name = f"{section}.{b}" if b else section
                for k, v in table.items():
                    rows.setdefault((name, k), []).append(f"{_toml(v)}  ({f.where(name, k)})")
    log("defaults:" if rows else "defaults: none (the command line's and fleetbox's own)")
    for (section, k), said in sorted(rows.items()):
        log(f"  [{section}] {k} = {said[0]}" + "".join(f"; overrides {s}" for s in said[1:]))


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)
