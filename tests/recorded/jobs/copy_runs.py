"""Copy job folders that fleetbox wrote into a runs folder here, as fixtures, trimmed to a few KB each:

    python3 tests/recorded/jobs/copy_runs.py RUNS_FOLDER JOB_ID... [--damage JOB_ID]

What is dropped: what `invoke report` writes again (report.md, report.png, metrics.jsonl) and the checkpoints'
own files (each step-*/ keeps its COMPLETE marker, the folder its STATE: `invoke jobs` reads those). In every
log, the FLEETBOX-METRIC lines of each rank's first and last KEEP steps stay, every other line stays whole.
The job folder's absolute path becomes @JOB_DIR@ (handle.json's `dir` is absolute: tests put theirs back).
--damage cuts that job's handle.json in half, as a full disk or a crash leaves it, and keeps of that job only its
records and its worker logs (what `invoke jobs`, `logs` and `report` read of it).
"""

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKEN = "@JOB_DIR@"
KEEP = 4
REPORTED = {"report.md", "report.png", "metrics.jsonl"}
LOGS = ("workerlog.", "container.log", "supervisor.log")


def trimmed(text: str) -> str:
    """The log without the metrics lines of any rank's middle steps."""
    steps: dict[int, list[int]] = {}
    for ln in text.splitlines():
        if ln.startswith("FLEETBOX-METRIC "):
            rec = json.loads(ln[len("FLEETBOX-METRIC "):])
            steps.setdefault(rec["rank"], []).append(rec["step"])
    kept = {r: set(s[:KEEP] + s[-KEEP:]) for r, s in steps.items()}
    out = []
    for ln in text.splitlines(keepends=True):
        if ln.startswith("FLEETBOX-METRIC "):
            rec = json.loads(ln[len("FLEETBOX-METRIC "):])
            if rec["step"] not in kept[rec["rank"]]:
                continue
        out.append(ln)
    return "".join(out)


def copy(runs: Path, job: str, records_only: bool = False) -> Path:
    src, dst = runs / job, HERE / job
    shutil.rmtree(dst, ignore_errors=True)
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        if records_only and not (len(rel.parts) == 1 and f.is_file() or rel.name.startswith("workerlog.")):
            continue
        if rel.name in REPORTED and len(rel.parts) == 1:
            continue
        if rel.parts[0] == "checkpoints" and f.is_file() and rel.name not in ("COMPLETE", "STATE"):
            continue
        out = dst / rel
        if f.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        data = f.read_bytes()
        try:
            text = data.decode()
        except UnicodeDecodeError:
            out.write_bytes(data)
            continue
        if rel.name.startswith(LOGS):
            text = trimmed(text)
        out.write_text(text.replace(str(src), TOKEN))
    return dst


def main(argv: list[str]) -> None:
    damage = argv[argv.index("--damage") + 1] if "--damage" in argv else None
    runs, jobs = Path(argv[0]), list(dict.fromkeys(a for a in argv[1:] if a != "--damage"))
    for job in jobs:
        dst = copy(runs, job, records_only=job == damage)
        if job == damage:
            whole = (dst / "handle.json").read_text()
            (dst / "handle.json").write_text(whole[:len(whole) // 2])
        print(f"{dst}: {sum(f.stat().st_size for f in dst.rglob('*') if f.is_file())} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
