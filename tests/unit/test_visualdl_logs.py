"""A job's metrics as VisualDL logs (run/visualdl_logs.py): the records are VisualDL's own bytes (recorded from
VisualDL 2.5.3's protobuf classes), every metric becomes a tag of its rank's run, restarts and allocations are runs
of their own and events, a malformed line is left out, stragglers are marked, and a run's file only grows."""
import json
import struct

import pytest

from fleetbox import settings
from fleetbox.run import backends, metrics
from fleetbox.run import visualdl_logs as vdl
from fleetbox.run.visualdl_logs import Point

assert backends.BACKENDS   # every backend's layout registered, as `invoke board` has them: alone, this file had none

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


def line(rank, step, t=None, **values):
    values = {"loss": 1.0 / (step + 1) + rank, "samples_per_s": 64.0, "samples": 32, "seconds": 0.5,
              "comm_seconds": 0.1, **values}
    return "FLEETBOX-METRIC " + json.dumps({"rank": rank, "step": step, "time": 1000.0 + step if t is None else t,
                                            **values}) + "\n"


def job_folder(root, backend="docker", nodes=2):
    root.mkdir(parents=True, exist_ok=True)
    (root / "job.json").write_text(json.dumps({"backend": backend, "nodes": nodes, "procs_per_node": 1}))
    return root


def log_lines(job, rank, lines, folder=None):
    """Append to rank's worker log (one rank per node) in the job folder, or in an earlier attempt's folder."""
    d = (folder or job) / f"node{rank}"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "workerlog.0", "a") as f:
        f.write("".join(lines))


def points(runs, run, tag):
    return [(p.step, p.value) for p in runs.get(run, {}).get(tag, [])]


def texts(runs, job="j"):
    return {(p.step, p.value) for ps in runs.get(f"{job}/events", {}).values() for p in ps}


def test_every_metric_is_a_tag_of_its_ranks_run_with_step_time_and_communication_share(tmp_path):
    job = job_folder(tmp_path / "j")
    for k in (0, 1):
        log_lines(job, k, [line(k, s, lr=0.01) for s in range(3)])
    runs = vdl.JobRuns(job, "j").read()
    assert set(runs) == {"j/attempt0/rank0", "j/attempt0/rank1"}
    tags = runs["j/attempt0/rank1"]
    assert set(tags) == {f"train/{t}" for t in ("loss", "samples_per_s", "samples", "step_seconds", "comm_seconds",
                                                "comm_share", "lr")}
    assert points(runs, "j/attempt0/rank1", "train/loss") == [(0, 2.0), (1, 1.5), (2, 1 + 1 / 3)]
    assert [v for _, v in points(runs, "j/attempt0/rank1", "train/comm_share")] == [0.2] * 3
    assert [v for _, v in points(runs, "j/attempt0/rank1", "train/step_seconds")] == [0.5] * 3
    assert tags["train/loss"][1].ms == 1001000 and tags["train/loss"][1].tag == "train/loss"


def test_each_read_gives_only_the_new_lines_and_a_restart_moving_node_folders_repeats_nothing(tmp_path):
    job = job_folder(tmp_path / "j", nodes=1)
    watch = vdl.JobRuns(job, "j")
    log_lines(job, 0, [line(0, s) for s in range(10)] + [line(0, 10)[:30]])   # a line still being written
    assert [s for s, _ in points(watch.read(), "j/attempt0/rank0", "train/loss")] == list(range(10))
    log_lines(job, 0, [line(0, 10)[30:]] + [line(0, s) for s in range(11, 30)])
    assert [s for s, _ in points(watch.read(), "j/attempt0/rank0", "train/loss")] == list(range(10, 30))
    (job / "attempt0").mkdir()   # the restart: attempt 0's node folders move aside, attempt 1 logs at the top
    (job / "node0").rename(job / "attempt0" / "node0")
    log_lines(job, 0, [line(0, s, t=2000.0 + s) for s in range(20, 40)])
    runs = watch.read()
    assert set(runs) == {"j/attempt1/rank0", "j/events"}
    assert [s for s, _ in points(runs, "j/attempt1/rank0", "train/loss")] == list(range(20, 40))
    assert texts(runs) == {(20, "attempt1 began at step 20")}
    assert watch.read() == {}


def test_a_long_history_is_caught_up_a_bounded_part_at_a_time_and_an_endless_line_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(vdl, "READ_LIMIT", 1000)
    job = job_folder(tmp_path / "j", nodes=1)
    log_lines(job, 0, [line(0, s) for s in range(20)] + ["x" * 2500 + "\n"] + [line(0, s) for s in range(20, 25)])
    watch, steps, reads = vdl.JobRuns(job, "j"), [], 0
    while True:
        steps += [s for s, _ in points(watch.read(), "j/attempt0/rank0", "train/loss")]
        reads += 1
        if not watch.behind:
            break
    assert steps == list(range(25)) and reads > 5


def test_lines_are_taken_in_the_order_the_rank_wrote_them_not_by_their_clock(tmp_path):
    job = job_folder(tmp_path / "j", nodes=1)
    log_lines(job, 0, [line(0, 0, t=100.0), line(0, 1, t=101.0), line(0, 2, t=99.0), line(0, 3, t=102.0)])
    assert [s for s, _ in points(vdl.JobRuns(job, "j").read(), "j/attempt0/rank0", "train/loss")] == [0, 1, 2, 3]


def test_allocations_hangs_and_endings_are_runs_and_events(tmp_path):
    job = job_folder(tmp_path / "j", backend="slurm", nodes=1)
    log_lines(job, 0, [line(0, s) for s in range(30)], folder=job / "alloc1")
    log_lines(job, 0, [line(0, s) for s in range(20, 40)])
    (job / "hang-1").mkdir()
    (job / "hang-1" / "blame.txt").write_text("node0 (rank 0) hung: no progress since step 39\nmore\n")
    (job / "summary.json").write_text(json.dumps({"attempts": [{"attempt": 0, "ended": "its time limit"},
                                                               {"attempt": 1, "ended": "hung"}]}))
    runs = vdl.JobRuns(job, "j").read()
    assert {"j/alloc1/rank0", "j/alloc2/rank0", "j/events"} == set(runs)
    assert texts(runs) == {(20, "alloc2 began at step 20"), (39, "node0 (rank 0) hung: no progress since step 39"),
                           (29, "alloc1 ended: its time limit"), (39, "alloc2 ended: hung")}
    assert {p.tag for ps in runs["j/events"].values() for p in ps} == {"events"}


def test_a_straggler_is_marked_at_each_step_once_every_rank_has_a_window_the_same_however_it_is_read(tmp_path):
    own = {0: 0.01, 1: 0.01, 2: 0.05}
    whole, bits = job_folder(tmp_path / "whole", nodes=3), job_folder(tmp_path / "bits", nodes=3)
    for k in own:
        log_lines(whole, k, [line(k, s, own_seconds=own[k]) for s in range(25)])
    once = vdl.JobRuns(whole, "j").read()
    marks = {k: points(once, f"j/attempt0/rank{k}", "train/straggler") for k in own}
    assert marks[2] == [(s, 1.0) for s in range(19, 25)]   # the 20th step of own time is the first window
    assert marks[0] == marks[1] == [(s, 0.0) for s in range(19, 25)]
    ((step, said),) = texts(once)
    assert step == 19 and "node2 (rank 2) works 50.0 ms a step on its own against 10.0 ms" in said
    watch, got = vdl.JobRuns(bits, "j"), {k: [] for k in own}
    for upto, k in [(10, 0), (22, 1), (5, 2), (25, 0), (25, 2), (25, 1)]:   # ranks logging at their own pace
        have = sum(1 for _ in open(bits / f"node{k}" / "workerlog.0")) if (bits / f"node{k}").exists() else 0
        log_lines(bits, k, [line(k, s, own_seconds=own[k]) for s in range(have, upto)])
        runs = watch.read()
        for j in own:
            got[j] += points(runs, f"j/attempt0/rank{j}", "train/straggler")
    assert got == marks


def test_a_malformed_or_hostile_line_is_left_out_and_the_rest_shown(tmp_path):
    job = job_folder(tmp_path / "j", nodes=1)
    good = [line(0, s) for s in range(3)]
    bad = ['FLEETBOX-METRIC {"rank": 0, "step": "x", "time": 1.0, "loss": 9}\n',
           'FLEETBOX-METRIC {"rank": 0, "step": 99, "time": 1.0, "loss": "high"}\n',
           'FLEETBOX-METRIC {"rank": 0, "step": 98, "time": Infinity, "loss": 1}\n',
           'FLEETBOX-METRIC {"rank": 0, "step": 97, "time": NaN, "loss": 1}\n',
           'FLEETBOX-METRIC {"rank": 0, "step": 18446744073709551616, "time": 1.0}\n',
           'FLEETBOX-METRIC {"rank": true, "step": 96, "time": 1.0}\n', 'FLEETBOX-METRIC {"rank"\n']
    odd = [line(0, 3, huge=10 ** 400, **{"a%b": 1.0, "\ud800": 2.0, "nested": {"x": 1}, "attempt": 7, "node": 5,
                                          "straggler": 1.0, "comm_share": 9.0, "step_seconds": 3.0})]
    log_lines(job, 0, good[:2] + bad + good[2:] + odd)
    runs = vdl.JobRuns(job, "j").read()
    assert set(runs) == {"j/attempt0/rank0"}   # the line's own attempt and node count for nothing
    tags = runs["j/attempt0/rank0"]
    assert [s for s, _ in points(runs, "j/attempt0/rank0", "train/loss")] == [0, 1, 2, 3]
    assert "train/huge" not in tags and "train/a%b" not in tags and "train/nested" not in tags
    assert [v for _, v in points(runs, "j/attempt0/rank0", "train/step_seconds")] == [0.5] * 4   # the Meter's
    assert [v for _, v in points(runs, "j/attempt0/rank0", "train/comm_share")] == [0.2] * 4     # ours
    assert "train/straggler" not in tags
    assert sum(len(ps) for ps in tags.values()) == 4 * 6
    assert vdl.Logs(tmp_path / "logs").add(runs) == 4 * 6   # every point left encodes
    assert {(r["attempt"], r["node"]) for r in metrics.read(job)} == {(0, 0)}   # the report's reading too


def test_the_same_job_id_run_again_is_said_not_mixed_in(tmp_path):
    job = job_folder(tmp_path / "j", nodes=1)
    log_lines(job, 0, [line(0, s) for s in range(5)])
    watch = vdl.JobRuns(job, "j")
    watch.read()
    (job / "run-20261127-120000").mkdir()   # records.set_aside: the earlier run goes whole, a new one starts
    for name in ("job.json", "node0"):
        (job / name).rename(job / "run-20261127-120000" / name)
    job_folder(job, nodes=1)
    log_lines(job, 0, [line(0, s) for s in range(5)])
    with pytest.raises(ValueError, match="its id ran again since the board started"):
        watch.read()


def read_back(path):
    """The records of a vdlrecords file, each as its length says."""
    data, out = path.read_bytes(), []
    while data:
        (n,) = struct.unpack("<Q", data[:8])
        out.append(data[8:8 + n])
        data = data[8 + n:]
    return out


def test_a_runs_file_only_grows_by_what_is_new_and_a_failed_write_is_written_next_time(tmp_path, monkeypatch):
    job = job_folder(tmp_path / "j", nodes=1)
    logs, watch = vdl.Logs(tmp_path / "logs"), vdl.JobRuns(job, "j")
    log_lines(job, 0, [line(0, s) for s in range(5)])
    assert logs.add(watch.read()) == 5 * 6
    (f,) = (tmp_path / "logs" / "j" / "attempt0" / "rank0").glob("vdlrecords.*.log")
    before = f.read_bytes()
    assert logs.add(watch.read()) == 0 and f.read_bytes() == before
    log_lines(job, 0, [line(0, s) for s in range(5, 8)])
    more = watch.read()
    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(vdl, "open", full, raising=False)   # the module's own open: the disk is full
    with pytest.raises(OSError):
        logs.add(more)
    monkeypatch.undo()
    assert f.read_bytes() == before
    assert logs.add({}) == 3 * 6 and f.read_bytes()[len(before):] == b"".join(
        vdl.record(p) for ps in more["j/attempt0/rank0"].values() for p in ps)
    bodies = read_back(f)
    assert len(bodies) == 1 + 8 * 6   # the display name first, then every point once
    assert b"meta_data_tag" in bodies[0] and b"j/attempt0/rank0" in bodies[0]


def test_the_scripts_own_visualdl_files_are_copied_whole_record_by_record_across_a_restart(tmp_path, monkeypatch):
    """paddle.callbacks.VisualDL's files (node<k>/visualdl/rank<r>/<logdir>/, where sitecustomize puts them): a
    record still being written waits, a restart's move repeats nothing, a failed write is written next time."""
    job = job_folder(tmp_path / "j", nodes=2)
    logs, watch = vdl.Logs(tmp_path / "logs"), vdl.JobRuns(job, "j")
    first = job / "node0" / "visualdl" / "rank0" / "vdl_log" / "vdlrecords.1795796252.log"
    first.parent.mkdir(parents=True)
    recs = [framed(RECORDED[k]) for k in ("meta", "scalar", "text")]
    first.write_bytes(recs[0] + recs[1] + recs[2][:11])   # the third cut short: still being written
    copy = tmp_path / "logs" / "j" / "script" / "attempt0" / "rank0" / "vdl_log" / first.name
    assert logs.copy(watch.script_records()) == len(recs[0] + recs[1])
    named = read_back(copy)[0]   # the run's name on the board comes first: the script's LogWriter names none
    assert b"meta_data_tag" in named and b"j/script/attempt0/rank0/vdl_log" in named
    name = copy.read_bytes()[:8 + len(named)]
    assert copy.read_bytes() == name + recs[0] + recs[1]
    with open(first, "ab") as f:
        f.write(recs[2][11:])
    (job / "attempt0").mkdir()   # the restart: the node folder moves aside; attempt 1 writes a file of its own
    (job / "node0").rename(job / "attempt0" / "node0")
    again = job / "node1" / "visualdl" / "rank1" / "vdl_log" / "vdlrecords.1795796300.log"
    again.parent.mkdir(parents=True)
    again.write_bytes(recs[1])
    got = watch.script_records()
    assert got == {"j/script/attempt0/rank0/vdl_log/" + first.name: recs[2],
                   "j/script/attempt1/rank1/vdl_log/" + again.name: recs[1]}
    monkeypatch.setattr(vdl, "open", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")), raising=False)
    with pytest.raises(OSError):
        logs.copy(got)
    monkeypatch.undo()
    assert copy.read_bytes() == name + recs[0] + recs[1]
    assert logs.copy(watch.script_records()) == len(recs[2] + recs[1]) and watch.script_records() == {}
    assert read_back(copy)[1:] == [bytes.fromhex(RECORDED[k]) for k in ("meta", "scalar", "text")]
    assert vdl.whole_records(recs[1][:-1]) == 0 and vdl.whole_records(recs[1] * 2 + b"\0" * 7) == 2 * len(recs[1])


def test_a_record_bigger_than_one_read_is_copied_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(vdl, "READ_LIMIT", 16)
    job = job_folder(tmp_path / "j", nodes=1)
    f = job / "node0" / "visualdl" / "rank0" / "log" / "vdlrecords.1.log"
    f.parent.mkdir(parents=True)
    big, small = struct.pack("<Q", 40) + b"x" * 40, framed(RECORDED["scalar"])
    f.write_bytes(big + small)
    watch = vdl.JobRuns(job, "j")
    for want, behind in ((big, True), (small, False)):   # as the board reads: its runs, then the script's files
        assert watch.read() == {}
        assert watch.script_records() == {"j/script/attempt0/rank0/log/vdlrecords.1.log": want}
        assert watch.behind == behind


def test_a_scripts_file_that_is_no_record_file_or_leads_out_of_the_job_folder_is_left_out_and_the_rest_copied(
        tmp_path):
    job = job_folder(tmp_path / "j", nodes=1)
    d = job / "node0" / "visualdl" / "rank0" / "log"
    d.mkdir(parents=True)
    good, rec = d / "vdlrecords.2.log", framed(RECORDED["scalar"])
    (d / "vdlrecords.1.log").write_bytes(struct.pack("<Q", 2**63) + b"x" * 100)   # a length no record has
    good.write_bytes(rec)
    outside = tmp_path / "secret"
    outside.write_bytes(rec)
    (d / "vdlrecords.3.log").symlink_to(outside)                  # a link a script made: never followed
    (job / "node0" / "visualdl" / "rank1").symlink_to(tmp_path)   # nor a linked folder
    watch = vdl.JobRuns(job, "j")
    assert watch.script_records() == {"j/script/attempt0/rank0/log/vdlrecords.2.log": rec}
    assert watch.problems == ["node0/visualdl/rank0/log/vdlrecords.1.log: a record of 9223372036854775808 bytes at "
                              "byte 0: not VisualDL's records"]
    with open(good, "ab") as f:
        f.write(rec)
    assert watch.script_records() == {"j/script/attempt0/rank0/log/vdlrecords.2.log": rec}
    assert len(watch.problems) == 1   # said once


def test_a_copy_cut_short_by_a_full_disk_is_taken_back_and_written_whole_next_time(tmp_path, monkeypatch):
    import builtins
    logs, rec = vdl.Logs(tmp_path / "logs"), framed(RECORDED["scalar"])
    assert logs.copy({"j/script/attempt0/rank0/log/vdlrecords.1.log": rec}) == len(rec)
    copy = tmp_path / "logs" / "j/script/attempt0/rank0/log/vdlrecords.1.log"
    before = copy.read_bytes()

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def tell(self):
            return self.f.tell()

        def write(self, data):
            self.f.write(data[:5])
            self.f.flush()
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(vdl, "open", lambda *a: Full(builtins.open(*a)), raising=False)
    with pytest.raises(OSError):
        logs.copy({"j/script/attempt0/rank0/log/vdlrecords.1.log": rec})
    monkeypatch.undo()
    assert copy.read_bytes() == before   # the part written taken back
    assert logs.copy({}) == len(rec) and copy.read_bytes() == before + rec
    assert read_back(copy)[1:] == [bytes.fromhex(RECORDED["scalar"])] * 2   # one name, then whole records


def test_the_board_lock_pins_visualdl_and_every_package_with_hashes():
    lines = settings.BOARD_LOCK.read_text().splitlines()
    pins = [(i, ln) for i, ln in enumerate(lines) if ln and not ln.startswith((" ", "#"))]
    assert any(ln.startswith("visualdl==2.5.3 ") for _, ln in pins) and len(pins) > 20
    assert all(lines[i + 1].strip().startswith("--hash=sha256:") for i, _ in pins)
