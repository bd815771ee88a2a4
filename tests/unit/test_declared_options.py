"""Every option of the tasks that run a job is declared once (run/spec.py; a backend's own on its class): the
tasks' options and help are made from the declarations, from_options reads them, and an option without help,
a JobSpec field no option sets or a value read otherwise than before fails here."""
import inspect
from dataclasses import fields

import pytest

from fleetbox import options
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import backend, backends
from fleetbox.run import spec as spec_mod


def declared() -> list[options.Option]:
    """Every declaration: the job's, the tasks', --backend, and every registered backend's own."""
    return [*spec_mod.JOB_OPTIONS, *spec_mod.TASK_OPTIONS, backends.BACKEND, *(o for _, o in backends.all_options())]


def test_every_declared_option_has_help():
    assert [o.flag for o in declared() if not o.help.strip()] == []


def test_each_option_is_declared_once():
    names = [o.name for o in declared()]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_a_backends_option_is_the_one_declaration_type():
    assert backend.Option is options.Option


def test_every_jobspec_field_a_user_sets_has_an_option_and_every_job_option_a_field():
    set_by_options = {spec_mod.FIELDS.get(o.name, o.name) for o in spec_mod.JOB_OPTIONS}
    internal = {"variant", "on_cpu", "command", "image_identity", "spawns"}   # given otherwise, or worked out
    assert {f.name for f in fields(spec_mod.JobSpec)} - set_by_options == internal
    assert set_by_options <= {f.name for f in fields(spec_mod.JobSpec)}


def test_from_options_refuses_an_option_it_does_not_declare():
    with pytest.raises(TypeError, match="no job option node"):
        spec_mod.from_options(matrix.load().get("cpu"), node=2)


def _front_door():
    from fleetbox.tasks import ns
    return ns.tasks


@pytest.mark.parametrize("name", ["train", "doctor", "scale"])
def test_the_tasks_that_run_a_job_take_declared_options_only_with_their_help(name):
    t = _front_door()[name]
    params = list(inspect.signature(t.body).parameters.values())[1:]
    by_name = {o.name: o for o in declared()}
    assert [p.name for p in params if p.name not in by_name] == []
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)   # invoke makes an option of each
    helped = {p.name for p in params if t.help[p.name] == by_name[p.name].help}
    reworded = {"doctor": {"port", "dry_run"}, "scale": {"nodes", "procs_per_node", "image", "dry_run"}}
    assert {p.name for p in params} - helped == reworded.get(name, set())
    own = {o.name for _, o in backends.all_options()}
    assert all(p.default is None for p in params if p.name in own)   # configure() tells the given ones by it
    assert all(p.default == by_name[p.name].default for p in params if p.name not in own | reworded.get(name, set()))


def test_train_takes_every_job_option_in_the_declared_order():
    params = [p.name for p in list(inspect.signature(_front_door()["train"].body).parameters.values())[1:]]
    assert [n for n in params if n in spec_mod.OPTIONS and n not in {o.name for o in spec_mod.TASK_OPTIONS}] == [
        o.name for o in spec_mod.JOB_OPTIONS]


@pytest.mark.parametrize("kind,value,default,want", [
    (str, None, "8g", "8g"), (str, "", "8g", "8g"), (str, "16g", "8g", "16g"),
    (bool, False, False, False), (bool, True, False, True),
    (int, None, 0, 0), (int, "", 0, 0), (int, 0, 0, 0), (int, "3", 0, 3),
    (float, None, 600.0, 600.0), (float, "", 600.0, 600.0), (float, "20m", 600.0, 1200.0),
    (float, "0", 600.0, 0.0), (float, 0, 600.0, 0.0),   # a duration's 0 turns it off, from Python too
    (tuple, None, (), ()), (tuple, " a, ,b ", (), ("a", "b")),
    (dict, None, {}, {}), (dict, "A=1,B=x=y", {}, {"A": "1", "B": "x=y"}),
])
def test_a_value_is_read_by_its_kind_and_not_given_is_the_default(kind, value, default, want):
    assert options.Option("x", "an option", kind=kind).read(value, default) == want


@pytest.mark.parametrize("option,value,needle", [
    (options.Option("port", "p", kind=int, low=1024, high=65535), "80", "--port must be between 1024 and 65535"),
    (options.Option("max_restarts", "m", kind=int, low=0), "x", "--max-restarts takes a whole number (got 'x')"),
    (options.Option("hang_timeout", "h", kind=float), "soon", "--hang-timeout takes seconds, or minutes or hours"),
    (options.Option("env", "e", kind=dict), "1A=b", "--env '1A=b' must be NAME=VALUE"),
    (spec_mod.OPTIONS["mount"], "/a", "--mount '/a' must be SRC:DST[:ro|rw]"),
])
def test_a_bad_value_is_one_line_naming_its_flag(option, value, needle):
    with pytest.raises(UserError, match="^" + needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("|", r"\|").replace("]", r"\]")) as e:
        option.read(value, None)
    assert "\n" not in str(e.value)


def test_a_job_task_called_from_python_gets_its_declared_defaults(monkeypatch):
    """invoke's pre=/post= and scripts call a task's body with what they give; the rest take their defaults."""
    import invoke

    from fleetbox import tasks
    monkeypatch.setattr("sys.argv", ["invoke", "verify"])   # what the task checks its flags against
    with pytest.raises(invoke.exceptions.Exit, match="unknown variant 'nope'"):
        tasks.verify(invoke.Context(), variant="nope")
