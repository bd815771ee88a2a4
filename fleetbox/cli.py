"""The `fleetbox` command: fleetbox's tasks (fleetbox/tasks.py) from any folder, as `invoke` runs them in the
checkout, with the same options and help; invoke's own parse errors said as fleetbox's one line."""
import os
import re
import sys
from importlib.metadata import version

from invoke import Exit, ParseError, Program

from fleetbox import errors, options
from fleetbox.tasks import ns


def parse_error_line(message: str, task: str, flags, tasks) -> str:
    """invoke's parse error (`message`, for `task`, whose `flags` are its options; "" before any task) as one line
    that says what is wrong and what was likely meant."""
    if m := re.fullmatch(r"No idea what '(.*)' is!", message):
        word = m[1]
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            guess = options.nearest(name, [f for f in flags if f.startswith("--")])
            where = f"{task} has no option {name}" if task else f"no option {name} before a task"
            return (where + (f"; did you mean {guess}?" if guess else "") +
                    f" (`fleetbox --help {task}` lists them)" if task else where)
        if word.lower() in ("true", "false", "yes", "no", "on", "off") and task:
            return f"{task}'s flags take no value ({word!r}): give the flag where you want it, leave it out where not"
        guess = options.nearest(word, tasks)
        return (f"no task {word!r}" + (f"; did you mean {guess}?" if guess else "") +
                f" ({', '.join(sorted(tasks))})")
    if m := re.fullmatch(r"'(.*)' did not receive required positional arguments: (.*)", message):
        missing = [n.strip("'").upper() for n in m[2].split(", ")]
        return f"{m[1]} needs {' and '.join(missing)}: `fleetbox {m[1]} {' '.join(missing)}`"
    if m := re.fullmatch(r"Flag <Argument: ([^ >]+)[^>]*> needed value and was not given one!", message):
        return f"--{m[1].replace('_', '-')} needs a value"
    return message


class FleetboxProgram(Program):
    def parse_tasks(self) -> None:
        try:
            super().parse_tasks()
        except ParseError as e:
            ctx = e.context
            line = parse_error_line(str(e), ctx.name if ctx else "", ctx.flags if ctx else {},
                                    self.collection.task_names)
            raise Exit(f"fleetbox: error: {line}", code=errors.USER_ERROR) from None


program = FleetboxProgram(namespace=ns, name="fleetbox", binary="fleetbox", version=version("fleetbox"))


def main() -> None:
    try:
        program.run()
    except BrokenPipeError:   # the output was closed (`fleetbox --list | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(errors.OUTPUT_CLOSED)
