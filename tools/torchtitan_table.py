"""The torchtitan training table: each torchtitan release x torch x parallelism, trained with
``examples/torchtitan_cpu.py`` under TORCHPATCH=1 from one seed checkpoint, per-step losses and gradient
norms compared with the newest torch's native run, which is never compared with itself.

    python tools/torchtitan_table.py \\
        --torch 2.4.1=~/.cache/torchpatch/nox/matrix-torch-2-4-1/bin/python \\
        --torch 2.15.0=~/.cache/torchpatch/nox/matrix-torch-2-15-0/bin/python \\
        --release 0.1.0=~/.cache/torchpatch/titan/0.1.0 [--write] [--json out.json]

``--release V=DIR``: torchtitan V installed with ``pip install --no-deps --target DIR``. The seed
checkpoint of a release is made once, by the oldest torch given that can run the release with
TORCHPATCH=1 (newer torch reads older DCP checkpoints; the reverse does not hold; a torch that cannot
even make it gets one row saying why), and every run starts from it: each run's weights after loading it
must be bitwise those of the reference. The newest torch given is the reference: its runs are native
(TORCHPATCH unset); where a native run fails (FSDP with a gradient divide factor: gloo has no
PREMUL_SUM), the reference is the newest torch's native run on one process over the same global batch,
and the newest torch runs the parallelism with TORCHPATCH=1. Each torch also runs its FSDP configuration
with TORCHPATCH unset, to record what happens without torchpatch; an FSDP run that saves a DCP
checkpoint at step 2, then a run resuming from it, whose steps 3.. must repeat the first run's; a
resume from the newest torch's step-2 checkpoint (DCP across versions); and, older to newer, a resume
from the step-2 checkpoint of the oldest torch's FSDP run from the seed checkpoint, whose steps 3.. must
repeat the resuming torch's own uninterrupted run from the seed checkpoint. ``--write`` puts the table into
``docs/torchtitan.md`` between its torchtitan-table markers, replacing the rows of the release x torch
pairs it ran and keeping the others; with ``--only-dcp-from-older`` it runs that last column alone and
writes its cells into the page's rows, and with ``--only-parallel`` the ``--parallel`` columns alone (the
seed, the newest torch's one process and native runs, each torch's runs), a column the page lacks added.
A whole run with some ``--parallel`` (not all of them) writes its cells the same way: the natively
(FSDP), ``--parallel``, DCP save + resume, DCP from the newest torch and DCP older to newer cells of the
rows it ran, the other cells kept (a row that said "cannot start" gets its cells).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "torchtitan_cpu.py"
PAGE = REPO / "docs" / "torchtitan.md"  # the docs page that holds the table
MARKERS = ("<!-- torchtitan-table:start -->", "<!-- torchtitan-table:end -->")
PARALLELS = ("fsdp", "tp", "pp", "fsdp+tp+sac", "pp+fsdp+tp", "hsdp+tp")
RANKS = {"single": 1, "fsdp": 2, "tp": 2, "pp": 2, "fsdp+tp+sac": 4, "pp+fsdp+tp": 8, "hsdp+tp": 8}
OLDER_COLUMN = "DCP older to newer"  # the header of dcp_from_older's column (written alone by write_columns)
TOLERANCE = 1e-5  # relative, per step (the bar): float32 sums in another order, another parallelism or torch
# (command, environment, ranks, timeout, working directory) -> the ranks' exit status and output, joined;
# raises subprocess.TimeoutExpired. What starts the ranks in place of torchrun (the tests fork them).
Launch = Callable[[List[str], Dict[str, str], int, float, str], subprocess.CompletedProcess]


@dataclass(frozen=True)
class Run:
    """What one run of the example printed, or why it failed."""

    losses: List[float]
    grad_norms: List[float]
    weights: str  # the SHA-256 of the weights training started from ("" before that)
    error: str


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(python: str, release_dir: str, args: Sequence[str], ranks: int, torchpatch: bool,
                timeout: float = 600, launch: Optional[Launch] = None) -> Run:
    """Run the example under torchrun (or plain python for one process), or with ``launch``: ``ranks``
    processes of ``python example args`` in the same environment, each with torchrun's RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT (tests/test_torchtitan.py forks them from a warm interpreter)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPATCH", "PYTEST_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # the release first; a PYTHONPATH already set (a torchpatch build shadowing the venv's) stays after it
    env.update(PYTHONPATH=os.pathsep.join(p for p in (release_dir, env.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    # torch 2.4 starts inductor's compile-worker pool (a process that imports torch, per rank) when torchtitan
    # imports inductor; the example compiles nothing (a pool would start when it did: the same results)
    env.setdefault("TORCH_WARM_POOL", "0")
    if torchpatch:
        env["TORCHPATCH"] = "1"
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                f"--master_port={_port()}"] if ranks > 1 else []
    try:
        if launch is not None:
            proc = launch([python, str(EXAMPLE), *args], env, ranks, timeout, tempfile.gettempdir())
        else:
            proc = subprocess.run([python, *launcher, str(EXAMPLE), *args], env=env, capture_output=True,
                                  text=True, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return Run([], [], "", f"timed out after {timeout:.0f} s")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"')]
    steps = [line for line in lines if "step" in line]
    weights = next((line["weights"] for line in lines if "weights" in line), "")
    return Run([s["loss"] for s in steps], [s["grad_norm"] for s in steps], weights,
               "" if proc.returncode == 0 else first_error(proc.stderr))


def first_error(stderr: str) -> str:
    """The first exception line of a failed run (the root cause, not torchrun's summary nor DCP's
    ``CheckpointException`` naming the ranks before their tracebacks), or what a C++ exception that
    aborted a rank said; file paths left out."""
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if "what():" in line:
            line = "C++ abort: " + line.split("what():")[-1].strip()
        elif not re.match(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt): ", line) or any(
                wrapper in line for wrapper in ("ChildFailedError", "CheckpointException ranks")):
            continue
        return re.sub(r" \((/|\w:\\)[^)]*\)", "", line)[:240]
    return (stderr.strip().splitlines() or ["failed without output"])[-1][:240]


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare(run: Run, reference: Run, first: int = 0) -> Optional[float]:
    """The largest relative difference of the per-step losses and gradient norms, from step ``first``
    + 1 on (``reference``'s steps cut to ``run``'s); None where either has no steps or one failed."""
    if run.error or reference.error or not run.losses or len(run.losses) > len(reference.losses) - first:
        return None
    end = first + len(run.losses)
    diffs = [max_rel_diff(run.losses, reference.losses[first:end]),
             max_rel_diff(run.grad_norms, reference.grad_norms[first:end])]
    return None if None in diffs else max(diffs)


def dcp_resume(python: str, release_dir: str, folder: str, steps: int, torchpatch: bool,
               resume_python: str = "", save_torchpatch: Optional[bool] = None, parallel: str = "fsdp") -> dict:
    """``parallel`` (FSDP by default) for ``steps`` steps saving a DCP checkpoint at step 2, then a second
    run resuming from that checkpoint (on ``resume_python``'s torch where given: DCP across versions): its steps 3.. must
    repeat the first run's (losses and gradient norms). The first run (TORCHPATCH=1 where
    ``save_torchpatch``, default ``torchpatch``) starts from torchtitan's own seeded initialisation on its
    torch, not a seed checkpoint: the second is compared with that run itself, whatever its weights."""
    common = ["--parallel", parallel, "--steps", str(steps), "--checkpoint-dir", folder]
    saving = torchpatch if save_torchpatch is None else save_torchpatch
    whole = run_example(python, release_dir, [*common, "--checkpoint-interval", "2"], RANKS[parallel], saving)
    if whole.error:
        return {"error": whole.error, "losses": whole.losses, "vs_uninterrupted": None}
    rest = run_example(resume_python or python, release_dir, [*common, "--load-step", "2"], RANKS[parallel], torchpatch)
    return {"error": rest.error, "losses": whole.losses[:2] + rest.losses, "vs_uninterrupted": compare(rest, whole, 2)}


def dcp_from_older(torches: Dict[str, str], release_dir: str, seed: str, work: Path, steps: int,
                   uninterrupted: Dict[str, Run], launch: Optional[Launch] = None) -> Dict[str, dict]:
    """DCP from an older torch to the newer ones: the oldest torch (the seed checkpoint's maker) trains
    FSDP from the seed checkpoint for ``steps`` steps saving at step 2, and every newer torch resumes from
    that step-2 checkpoint; its steps 3.. must repeat its own uninterrupted FSDP run from the seed
    checkpoint (``uninterrupted``, run here where missing), after the saving run started from bitwise
    its weights. All with TORCHPATCH=1 (ranks started by ``launch`` where given, see :func:`run_example`).
    torch -> the JSON-able outcome."""
    (oldest, saver), *newer = torches.items()
    fsdp = ["--parallel", "fsdp", "--steps", str(steps)]
    saved = work / f"ckpt-{oldest}-seeded"
    save = run_example(saver, release_dir, [*fsdp, "--seed-checkpoint", seed, "--checkpoint-dir", str(saved),
                                            "--checkpoint-interval", "2"], 2, True, launch=launch)
    outcome = {oldest: {"saves": True, "error": save.error}}
    for torch, python in newer:
        if save.error:
            outcome[torch] = {"saved_by": oldest, "error": f"no checkpoint: the save on {oldest} failed", "losses": []}
            continue
        own = uninterrupted.get(torch) or run_example(python, release_dir, [*fsdp, "--seed-checkpoint", seed], 2, True,
                                                        launch=launch)
        folder = work / f"ckpt-{oldest}-on-{torch}"  # a copy of step 2 alone: this run saves into it
        shutil.copytree(saved / "step-2", folder / "step-2")
        rest = run_example(python, release_dir, [*fsdp, "--checkpoint-dir", str(folder), "--load-step", "2"], 2, True,
                           launch=launch)
        outcome[torch] = {"saved_by": oldest, "error": rest.error, "losses": save.losses[:2] + rest.losses,
                          "same_weights": save.weights == own.weights, "vs_uninterrupted": compare(rest, own, 2)}
    return outcome


def make_seed(torches: Dict[str, str], release: str, release_dir: str, seed: str) -> dict:
    """The seed checkpoint, made by the oldest torch that can (the others before it cannot start the
    release); the JSON-able start of a release's result."""
    result: dict = {"release": release, "seed_by": None, "seed_error": "", "reference": list(torches)[-1],
                    "runs": {}, "cannot_start": {}, "commit": _commit()}
    for torch, python in torches.items():
        error = run_example(python, release_dir, ["--make-seed-checkpoint", seed], 1, True).error
        if not error:
            result["seed_by"] = torch
            return result
        result["cannot_start"][torch] = error
    result["seed_error"] = error
    return result


def survey_dcp_from_older(torches: Dict[str, str], release: str, release_dir: str, steps: int) -> dict:
    """The runs of the table's "DCP older to newer" column alone (``--only-dcp-from-older``)."""
    work = Path(tempfile.mkdtemp(prefix=f"titan-table-{release}-"))
    try:
        result = make_seed(torches, release, release_dir, str(work / "seed"))
        if result["seed_by"]:
            able = {t: p for t, p in torches.items() if t not in result["cannot_start"]}
            cells = dcp_from_older(able, release_dir, str(work / "seed"), work, steps, {})
            result["runs"] = {torch: {"dcp_from_older": cell} for torch, cell in cells.items()}
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def train_cells(torches: Dict[str, str], release_dir: str, common: Sequence[str], parallels: Sequence[str],
                native: Dict[str, Run]) -> Dict[str, Dict[str, dict]]:
    """Each torch's run of each of ``parallels`` (TORCHPATCH=1; the newest torch's native run is the
    reference, compared with its one process ``native["single"]``, which is the reference where the native
    run failed: the newest torch then runs it with TORCHPATCH=1, and its cell keeps the native error).
    torch -> parallelism -> the JSON-able cell."""
    newest = list(torches)[-1]
    reference = {p: run if not run.error else native["single"] for p, run in native.items()}
    cells: Dict[str, Dict[str, dict]] = {}
    for torch, python in torches.items():
        row = cells.setdefault(torch, {})
        for p in parallels:
            is_reference = torch == newest and not native[p].error
            run = native[p] if is_reference else run_example(python, release_dir, ["--parallel", p, *common],
                                                             RANKS[p], True)
            row[p] = {**asdict(run), "is_reference": is_reference,
                      "reference": "native" if not native[p].error else "one process",
                      "same_weights": run.weights == reference[p].weights,
                      "vs_reference": compare(run, native["single"] if is_reference else reference[p])}
            if torch == newest and native[p].error:
                row[p]["native_error"] = native[p].error
    return cells


def survey_release(torches: Dict[str, str], release: str, release_dir: str, steps: int,
                   parallels: Sequence[str], only_parallels: bool = False) -> dict:
    """Every run of one release (with ``only_parallels``, the ``parallels`` columns' runs alone); a
    JSON-able dict."""
    work = Path(tempfile.mkdtemp(prefix=f"titan-table-{release}-"))
    try:
        newest = list(torches)[-1]
        seed = str(work / "seed")
        result = make_seed(torches, release, release_dir, seed)
        if not result["seed_by"]:
            return result
        torches = {t: p for t, p in torches.items() if t not in result["cannot_start"]}
        common = ["--steps", str(steps), "--seed-checkpoint", seed]
        natives = ("single", *parallels) if only_parallels else ("single", "fsdp", *parallels)  # fsdp: the native column
        native = {p: run_example(torches[newest], release_dir, ["--parallel", p, *common], RANKS[p], False)
                  for p in dict.fromkeys(natives)}
        result["runs"] = train_cells(torches, release_dir, common, parallels, native)
        if only_parallels:
            return result
        newest_dcp = str(work / "ckpt-newest")
        for torch, python in torches.items():
            row = result["runs"][torch]
            row["native_fsdp_error"] = (native["fsdp"] if torch == newest else run_example(
                python, release_dir, ["--parallel", "fsdp", *common], 2, False)).error
            row["dcp_resume"] = dcp_resume(python, release_dir, str(work / f"ckpt-{torch}"), steps, True)
            if torch == newest:
                row["dcp_from_newest"] = {"saves": True}
            else:  # save on the newest torch (natively where its FSDP runs), resume here
                shutil.rmtree(newest_dcp, ignore_errors=True)
                row["dcp_from_newest"] = dcp_resume(torches[newest], release_dir, newest_dcp, steps, True,
                                                    resume_python=python, save_torchpatch=bool(native["fsdp"].error))
        patched_fsdp = {torch: Run(*(row["fsdp"][k] for k in Run.__dataclass_fields__))
                        for torch, row in result["runs"].items() if "fsdp" in row and not row["fsdp"]["is_reference"]}
        for torch, outcome in dcp_from_older(torches, release_dir, seed, work, steps, patched_fsdp).items():
            result["runs"][torch]["dcp_from_older"] = outcome
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _commit() -> str:
    """The commit the table is measured at, and the date."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{sha.stdout.strip()} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d})"


def _cell(run: dict) -> str:
    if run.get("native_error"):  # the newest torch's native run failed: this is its run with TORCHPATCH=1
        return f"natively `{run['native_error']}`; TORCHPATCH=1: " + _cell({**run, "native_error": ""})
    if run["error"]:
        return f"fails: `{run['error']}`"
    diff = run["vs_reference"]
    if diff is None:
        return "no losses"
    verdict = f"{'equal' if diff <= TOLERANCE else 'DIFFERS'} ({diff:.1e})"
    if run["is_reference"]:  # never compared with itself: with its one process instead
        return f"the reference; one process: {verdict}"
    if not run["same_weights"]:
        return f"starts from other weights than the reference; {verdict}"
    return f"trains, {verdict}" + (" to one process" if run["reference"] == "one process" else "")


def _dcp(resume: Optional[dict], resumers: str = "older") -> str:
    if resume is None:
        return "not measured"
    if resume.get("saves"):
        saves = f"saves the checkpoint the {resumers} torches resume"
        return f"fails: `{resume['error']}`" if resume.get("error") else saves
    if resume["error"]:
        return f"fails: `{resume['error']}`"
    diff = resume["vs_uninterrupted"]
    return "resumes, equal" if diff is not None and diff <= TOLERANCE else "resumes, DIFFERS"


def _dcp_from_older(resume: Optional[dict]) -> str:
    """A cell of the "DCP older to newer" column: which torch saved, and the largest difference."""
    if resume is None or resume.get("saves"):
        return _dcp(resume, "newer")
    if resume["error"] or resume["vs_uninterrupted"] is None:
        return f"from {resume['saved_by']}: {_dcp(resume)}"
    weights = "" if resume["same_weights"] else "saved from other weights than this torch's run; "
    return f"from {resume['saved_by']}: {weights}{_dcp(resume)} ({resume['vs_uninterrupted']:.1e})"


def markdown(results: List[dict], parallels: Sequence[str] = PARALLELS) -> str:
    """The table: one row per release x torch."""
    lines = ["| torchtitan | torch | natively (FSDP) | " + " | ".join(parallels)
             + f" | DCP save + resume | DCP from the newest torch | {OLDER_COLUMN} |",
             "|---|---|---|" + "---|" * len(parallels) + "---|---|---|"]
    for r in results:
        for torch, error in r.get("cannot_start", {}).items():
            lines.append(f"| {r['release']} | {torch} | cannot start with TORCHPATCH=1: `{error}` |"
                         + " |" * (len(parallels) + 3))
        for torch, row in r["runs"].items():
            native = "trains" if not row["native_fsdp_error"] else f"`{row['native_fsdp_error']}`"
            ref = " (reference: native)" if torch == r["reference"] else ""
            lines.append(f"| {r['release']} | {torch}{ref} | {native} | "
                         + " | ".join(_cell(row[p]) for p in parallels)
                         + f" | {_dcp(row['dcp_resume'])} | {_dcp(row.get('dcp_from_newest'))}"
                         + f" | {_dcp_from_older(row.get('dcp_from_older'))} |")
    return "\n".join(lines)


def write_page(table: str) -> None:
    """Put the table into its docs page, replacing the rows of the release x torch pairs it holds; the
    other rows stay (a release or a torch is trained again without the others), in release and torch order."""
    text = PAGE.read_text()
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    header, rows = table.splitlines()[:2], table.splitlines()[2:]
    ran = {_row_key(row) for row in rows}
    kept = [row for row in text[start:end].strip().splitlines()[2:] if _row_key(row) not in ran]
    rows = sorted(kept + rows, key=lambda row: tuple(Version(v) for v in _row_key(row)))
    PAGE.write_text(text[:start] + "\n" + "\n".join(header + rows) + "\n" + text[end:])


def write_columns(columns: Dict[str, Dict[tuple, str]]) -> None:
    """Put ``columns`` (header -> (release, torch) -> cell) into the page's rows of their release x torch
    pairs, the other cells kept. A column the page lacks is added, empty in the other rows: a
    parallelism's before "DCP save + resume" (in ``PARALLELS``' order), "DCP older to newer" last."""
    text = PAGE.read_text()
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    rows = [row.split("|")[1:-1] for row in text[start:end].strip().splitlines()]  # cells with their spaces
    for header in columns:
        headers = [cell.strip() for cell in rows[0]]
        if header in headers:
            continue
        at = len(headers) if header == OLDER_COLUMN else 1 + max(
            i for i, h in enumerate(headers) if h == "natively (FSDP)" or h in PARALLELS[:PARALLELS.index(header)])
        for cells, added in zip(rows, [f" {header} ", "---"] + [" "] * (len(rows) - 2)):
            cells.insert(min(at, len(cells)), added)
    headers = [cell.strip() for cell in rows[0]]
    new = {(key, header): cell for header, cells in columns.items() for key, cell in cells.items()}
    for cells in rows[2:]:
        key = _row_key("|" + "|".join(cells) + "|")
        cells.extend([" "] * (len(headers) - len(cells)))  # a row that cannot start: its empty cells
        for header in columns:
            if (key, header) in new:
                cell = new.pop((key, header))
                cells[headers.index(header)] = f" {cell} " if cell else " "
    if new:
        raise SystemExit(f"no row in {PAGE.name} for {sorted({key for key, _ in new})}: run the whole table for them first")
    PAGE.write_text(text[:start] + "\n" + "\n".join("|" + "|".join(cells) + "|" for cells in rows) + "\n" + text[end:])


def table_columns(table: str) -> Dict[str, Dict[tuple, str]]:
    """``markdown``'s table as ``write_columns``' columns, header -> (release, torch) -> cell (all but the
    first two: a row's release and torch stay the page's)."""
    lines = table.splitlines()
    headers = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    columns: Dict[str, Dict[tuple, str]] = {header: {} for header in headers[2:]}
    for row in lines[2:]:
        key = _row_key(row)
        for header, cell in zip(headers[2:], row.split("|")[3:-1]):
            columns[header][key] = cell.strip()
    return columns


def _row_key(row: str) -> tuple:
    """(release, torch) of a table row."""
    cells = row.split("|")
    return cells[1].strip(), cells[2].split()[0]


def _pairs(values: Sequence[str], what: str) -> Dict[str, str]:
    out = {}
    for value in values:
        if "=" not in value:
            raise SystemExit(f"--{what} wants VERSION=PATH, not {value!r}")
        key, path = value.split("=", 1)
        out[key] = os.path.expanduser(path)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", action="append", default=[], metavar="VERSION=PYTHON",
                        help="a torch to run on (oldest first; the last one is the native reference)")
    parser.add_argument("--release", action="append", default=[], metavar="VERSION=DIR",
                        help="a torchtitan release installed with pip install --no-deps --target DIR")
    parser.add_argument("--parallel", action="append", choices=PARALLELS,
                        help="default: all (--write with some: their cells and the FSDP and DCP ones alone, "
                        "in the page's rows)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/torchtitan.md")
    parser.add_argument("--json", metavar="FILE", help="also write every run's losses and errors as JSON")
    parser.add_argument("--from-json", metavar="FILE", help="print (and --write) the table of an earlier --json, "
                        "run nothing (give the run's --parallel and --only-... options)")
    parser.add_argument("--only-dcp-from-older", action="store_true",
                        help=f"run only the {OLDER_COLUMN!r} column (--write: its cells alone, in the page's rows)")
    parser.add_argument("--only-parallel", action="store_true",
                        help="run only the --parallel columns (--write: their cells alone, in the page's rows)")
    args = parser.parse_args(argv)
    if not args.from_json and (not args.torch or not args.release):
        parser.error("--torch and --release are needed (or --from-json)")
    if args.only_parallel and not args.parallel:
        parser.error("--only-parallel needs --parallel")
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        torches, releases = _pairs(args.torch, "torch"), _pairs(args.release, "release")
        results = [survey_dcp_from_older(torches, release, path, args.steps) if args.only_dcp_from_older
                   else survey_release(torches, release, path, args.steps, args.parallel or PARALLELS, args.only_parallel)
                   for release, path in releases.items()]
        print("measured at " + ", ".join(f"{r['release']}: {r['commit']}" for r in results), file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    if args.only_dcp_from_older:
        for r in results:
            print(f"{r['release']} (seed by {r['seed_by']}, at {r['commit']}): " + "; ".join(
                f"{torch}: {_dcp_from_older(row['dcp_from_older'])}" for torch, row in r["runs"].items()))
        if args.write:
            write_columns({OLDER_COLUMN: {(r["release"], torch): _dcp_from_older(row["dcp_from_older"])
                                          for r in results for torch, row in r["runs"].items()}})
        return 0
    if args.only_parallel:
        columns = {p: {(r["release"], torch): _cell(row[p]) for r in results for torch, row in r["runs"].items()}
                   for p in args.parallel}
        for r in results:
            print(f"{r['release']} (seed by {r['seed_by']}, at {r['commit']}): " + "; ".join(
                f"{torch} {p}: {columns[p][r['release'], torch]}" for torch in r["runs"] for p in args.parallel))
        if args.write:
            write_columns(columns)
        return 0
    table = markdown(results, args.parallel or PARALLELS)
    print(table)
    if args.write and set(args.parallel or PARALLELS) != set(PARALLELS):
        write_columns(table_columns(table))  # the page's other columns kept
    elif args.write:
        write_page(table)
    return 0

if __name__ == "__main__":
    sys.exit(main())
