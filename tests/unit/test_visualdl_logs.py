"""A job's metrics as VisualDL logs (run/visualdl_logs.py): the records are VisualDL's own bytes (recorded from
VisualDL 2.5.3's protobuf classes), every metric becomes a tag of its rank's run, restarts and allocations are runs
of their own and events, a malformed line is left out, stragglers are marked, and a run's file only grows."""
import struct

from fleetbox.run import visualdl_logs as vdl
from fleetbox.run.visualdl_logs import Point
from tests.unit.test_report import write_job

# Record.SerializeToString() of VisualDL's own component functions (visualdl/component/base_component.py):
# scalar('loss', 0.5, 3, 1795796252123), scalar('loss', 1e39, -2, 5), text('events', 'attempt1 began at step 20',
# 20, 1795796252123), meta_data(display_name='job/attempt0/rank1', walltime=1795796252000)
RECORDED = {
    "scalar": "0a14080312046c6f737318dbebb0eea134250000003f",
    "overflow": "0a1808feffffffffffffffff0112046c6f73731805250000807f",
    "text": "0a2e081412066576656e747318dbebb0eea134621b0a19617474656d70743120626567616e2061742073746570203230",
    "meta": "0a2c120d6d6574615f646174615f74616718e0eab0eea13452140a126a6f622f617474656d7074302f72616e6b31",
}


def framed(hexed: str) -> bytes:
    body = bytes.fromhex(hexed)
    return struct.pack("<Q", len(body)) + body


def test_records_are_the_bytes_visualdls_own_writer_makes():
    assert vdl.record(Point("loss", 3, 1795796252123, 0.5)) == framed(RECORDED["scalar"])
    assert vdl.record(Point("loss", -2, 5, 1e39)) == framed(RECORDED["overflow"])   # a negative step; inf
    assert vdl.record(Point("events", 20, 1795796252123, "attempt1 began at step 20")) == framed(RECORDED["text"])
    assert vdl.display_name("job/attempt0/rank1", 1795796252000) == framed(RECORDED["meta"])


def recs(attempt, steps, ranks=(0, 1), own=None, **extra):
    return [{"node": k, "attempt": attempt, "rank": k, "step": s, "time": 1000.0 + 100 * attempt + s,
             "loss": 1.0 / (s + 1) + k, "samples_per_s": 64.0, "samples": 32, "seconds": 0.5, "comm_seconds": 0.1,
             **({"own_seconds": own[k]} if own else {}), **extra} for s in steps for k in ranks]


def test_every_metric_is_a_tag_of_its_ranks_run_with_step_time_and_communication_share():
    runs = vdl.job_runs(recs(0, range(3), lr=0.01), "j", "restarts", 2, 1, {}, {})
    assert set(runs) == {"j/attempt0/rank0", "j/attempt0/rank1"}
    tags = runs["j/attempt0/rank1"]
    assert set(tags) == {f"train/{t}" for t in ("loss", "samples_per_s", "samples", "step_seconds", "comm_seconds",
                                                "comm_share", "lr")}
    assert [(p.step, p.value) for p in tags["train/loss"]] == [(0, 2.0), (1, 1.5), (2, 1 + 1 / 3)]
    assert [p.value for p in tags["train/comm_share"]] == [0.2] * 3
    assert [p.value for p in tags["train/step_seconds"]] == [0.5] * 3
    assert tags["train/loss"][1].ms == 1001000 and tags["train/loss"][1].tag == "train/loss"


def test_restarts_and_allocations_are_runs_of_their_own_with_where_each_began_and_how_it_ended():
    lines = recs(0, range(0, 30), ranks=(0,)) + recs(1, range(20, 40), ranks=(0,))
    runs = vdl.job_runs(lines, "j", "restarts", 1, 1, {0: "node0 (rank 0) failed: exit 3"}, {})
    assert {"j/attempt0/rank0", "j/attempt1/rank0", "j/events"} == set(runs)
    assert [p.step for p in runs["j/attempt1/rank0"]["train/loss"]] == list(range(20, 40))
    said = {(p.step, p.value) for ps in runs["j/events"].values() for p in ps}
    assert said == {(20, "attempt1 began at step 20"), (29, "attempt0 ended: node0 (rank 0) failed: exit 3")}
    assert {p.tag for ps in runs["j/events"].values() for p in ps} == {"events"}
    slurm = vdl.job_runs(lines, "j", "allocations", 1, 1, {}, {1: "node0 (rank 0) hung: no progress since step 39"})
    assert {"j/alloc1/rank0", "j/alloc2/rank0", "j/events"} == set(slurm)
    assert {(p.step, p.value) for ps in slurm["j/events"].values() for p in ps} == {
        (20, "alloc2 began at step 20"), (39, "node0 (rank 0) hung: no progress since step 39")}


def test_a_straggler_is_marked_at_each_step_once_every_rank_has_a_window_and_said_once():
    runs = vdl.job_runs(recs(0, range(25), ranks=(0, 1, 2), own={0: 0.01, 1: 0.01, 2: 0.05}), "j", "restarts",
                        3, 1, {}, {})
    marks = {k: [(p.step, p.value) for p in runs[f"j/attempt0/rank{k}"]["train/straggler"]] for k in (0, 1, 2)}
    assert marks[2] == [(s, 1.0) for s in range(19, 25)]   # the 20th step of own time is the first window
    assert marks[0] == marks[1] == [(s, 0.0) for s in range(19, 25)]
    (event,) = [p for ps in runs["j/events"].values() for p in ps]
    assert event.step == 19 and "node2 (rank 2) works 50.0 ms a step on its own against 10.0 ms" in event.value
    # a rank that has not logged yet leaves the marks unwritten, not wrong (they could not change later)
    assert "train/straggler" not in vdl.job_runs(recs(0, range(25), ranks=(0, 1), own={0: 0.01, 1: 0.05}), "j",
                                           "restarts", 3, 1, {}, {})["j/attempt0/rank1"]


def test_a_job_folder_read_as_it_is_a_malformed_line_left_out(tmp_path):
    job = tmp_path / "j"
    write_job(job, attempts=((0, 30), (20, 40)), fail=True)
    log = job / "node1" / "workerlog.0"
    log.write_text(log.read_text() + 'FLEETBOX-METRIC {"rank": 1, "step": "x", "time": 1.0, "loss": 9}\n'
                   'FLEETBOX-METRIC {"rank": 1, "step": 99, "time": 1.0, "loss": "high"}\nFLEETBOX-METRIC {"rank"\n')
    (job / "hang-1").mkdir()
    (job / "hang-1" / "blame.txt").write_text("node1 (rank 1) hung: no progress since step 39\nmore\n")
    runs = vdl.read_job(job, "j")
    assert set(runs) == {"j/attempt0/rank0", "j/attempt0/rank1", "j/attempt1/rank0", "j/attempt1/rank1", "j/events"}
    assert [p.step for p in runs["j/attempt1/rank1"]["train/loss"]] == list(range(20, 40))   # no step 99, no "x"
    texts = {p.value for ps in runs["j/events"].values() for p in ps}
    assert {"attempt0 ended: x", "attempt1 ended: x", "node1 (rank 1) hung: no progress since step 39"} <= texts


def read_back(path):
    """The records of a vdlrecords file, each as its length says."""
    data, out = path.read_bytes(), []
    while data:
        (n,) = struct.unpack("<Q", data[:8])
        out.append(data[8:8 + n])
        data = data[8 + n:]
    return out


def test_a_runs_file_only_grows_by_what_is_new(tmp_path):
    logs = vdl.Logs(tmp_path)
    first = vdl.job_runs(recs(0, range(5), ranks=(0,)), "j", "restarts", 1, 1, {}, {})
    assert logs.add(first) == 5 * 6
    (f,) = (tmp_path / "j" / "attempt0" / "rank0").glob("vdlrecords.*.log")
    before = f.read_bytes()
    assert logs.add(first) == 0 and f.read_bytes() == before
    more = vdl.job_runs(recs(0, range(8), ranks=(0,)), "j", "restarts", 1, 1, {}, {})
    assert logs.add(more) == 3 * 6
    assert f.read_bytes()[len(before):] == b"".join(vdl.record(p) for ps in more["j/attempt0/rank0"].values()
                                                   for p in ps[5:])
    bodies = read_back(f)
    assert len(bodies) == 1 + 8 * 6   # the display name first, then every point once
    assert b"meta_data_tag" in bodies[0] and b"j/attempt0/rank0" in bodies[0]


def test_the_board_lock_pins_visualdl_and_every_package_with_hashes():
    from fleetbox.commands import board
    lines = board.LOCK.read_text().splitlines()
    pins = [(i, ln) for i, ln in enumerate(lines) if ln and not ln.startswith((" ", "#"))]
    assert any(ln.startswith("visualdl==2.5.3 ") for _, ln in pins) and len(pins) > 20
    assert all(lines[i + 1].strip().startswith("--hash=sha256:") for i, _ in pins)
