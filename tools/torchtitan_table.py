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
checkpoint at step 2, then a run resuming from it, whose steps 3.. must repeat the first run's; and a
resume from the newest torch's step-2 checkpoint (DCP across versions). ``--write`` puts the table into
``docs/torchtitan.md`` between its torchtitan-table markers, replacing the rows of the release x torch
pairs it ran and keeping the others.
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
from typing import Dict, List, Optional, Sequence

from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "torchtitan_cpu.py"
PAGE = REPO / "docs" / "torchtitan.md"  # the docs page that holds the table
MARKERS = ("<!-- torchtitan-table:start -->", "<!-- torchtitan-table:end -->")
PARALLELS = ("fsdp", "tp", "pp", "fsdp+tp+sac")
RANKS = {"single": 1, "fsdp": 2, "tp": 2, "pp": 2, "fsdp+tp+sac": 4}
TOLERANCE = 1e-5  # relative, per step (the bar): float32 sums in another order, another parallelism or torch


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
                timeout: float = 600) -> Run:
    """Run the example under torchrun (or plain python for one process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPATCH", "PYTEST_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # the release first; a PYTHONPATH already set (a torchpatch build shadowing the venv's) stays after it
    env.update(PYTHONPATH=os.pathsep.join(p for p in (release_dir, env.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    if torchpatch:
        env["TORCHPATCH"] = "1"
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                f"--master_port={_port()}"] if ranks > 1 else []
    try:
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
    """The first exception line of a failed run (the root cause, not torchrun's summary), or what a
    C++ exception that aborted a rank said; file paths left out."""
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if "what():" in line:
            line = "C++ abort: " + line.split("what():")[-1].strip()
        elif not re.match(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt): ", line) or "ChildFailedError" in line:
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
    ``save_torchpatch``, default ``torchpatch``) starts from torchtitan's own seeded initialisation, not a
    seed checkpoint: torchtitan 0.1.0 drops ``freqs_cis`` from its cached model state dict when it loads
    a model-only checkpoint, so what it saves afterwards cannot be resumed (on every torch)."""
    common = ["--parallel", parallel, "--steps", str(steps), "--checkpoint-dir", folder]
    saving = torchpatch if save_torchpatch is None else save_torchpatch
    whole = run_example(python, release_dir, [*common, "--checkpoint-interval", "2"], RANKS[parallel], saving)
    if whole.error:
        return {"error": whole.error, "losses": whole.losses, "vs_uninterrupted": None}
    rest = run_example(resume_python or python, release_dir, [*common, "--load-step", "2"], RANKS[parallel], torchpatch)
    return {"error": rest.error, "losses": whole.losses[:2] + rest.losses, "vs_uninterrupted": compare(rest, whole, 2)}


def survey_release(torches: Dict[str, str], release: str, release_dir: str, steps: int,
                   parallels: Sequence[str]) -> dict:
    """Every run of one release; a JSON-able dict."""
    work = Path(tempfile.mkdtemp(prefix=f"titan-table-{release}-"))
    try:
        newest = list(torches)[-1]
        seed = str(work / "seed")
        result: dict = {"release": release, "seed_by": None, "seed_error": "", "reference": newest, "runs": {},
                        "cannot_start": {}, "commit": _commit()}
        for torch, python in torches.items():  # the oldest torch that can make it
            error = run_example(python, release_dir, ["--make-seed-checkpoint", seed], 1, True).error
            if not error:
                result["seed_by"] = torch
                break
            result["cannot_start"][torch] = error
        else:
            result["seed_error"] = error
            return result
        torches = {t: p for t, p in torches.items() if t not in result["cannot_start"]}
        common = ["--steps", str(steps), "--seed-checkpoint", seed]
        native = {p: run_example(torches[newest], release_dir, ["--parallel", p, *common], RANKS[p], False)
                  for p in dict.fromkeys(("single", "fsdp", *parallels))}  # fsdp: the native column
        # where the newest torch's native run fails, its one process over the same global batch is the reference
        reference = {p: run if not run.error else native["single"] for p, run in native.items()}
        newest_dcp = str(work / "ckpt-newest")
        for torch, python in torches.items():
            row: dict = {"native_fsdp_error": (native["fsdp"] if torch == newest else run_example(
                python, release_dir, ["--parallel", "fsdp", *common], 2, False)).error}
            for p in parallels:
                is_reference = torch == newest and not native[p].error
                run = native[p] if is_reference else run_example(python, release_dir, ["--parallel", p, *common],
                                                                 RANKS[p], True)
                row[p] = {**asdict(run), "is_reference": is_reference,
                          "reference": "native" if not native[p].error else "one process",
                          "same_weights": run.weights == reference[p].weights,
                          "vs_reference": compare(run, native["single"] if is_reference else reference[p])}
            row["dcp_resume"] = dcp_resume(python, release_dir, str(work / f"ckpt-{torch}"), steps, True)
            if torch == newest:
                row["dcp_from_newest"] = {"saves": True}
            else:  # save on the newest torch (natively where its FSDP runs), resume here
                shutil.rmtree(newest_dcp, ignore_errors=True)
                row["dcp_from_newest"] = dcp_resume(torches[newest], release_dir, newest_dcp, steps, True,
                                                    resume_python=python, save_torchpatch=bool(native["fsdp"].error))
            result["runs"][torch] = row
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _commit() -> str:
    """The commit the table is measured at, and the date."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{sha.stdout.strip()} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d})"


def _cell(run: dict) -> str:
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


def _dcp(resume: Optional[dict]) -> str:
    if resume is None:
        return "not measured"
    if resume.get("saves"):
        return "saves the checkpoint the older torches resume"
    if resume["error"]:
        return f"fails: `{resume['error']}`"
    diff = resume["vs_uninterrupted"]
    return "resumes, equal" if diff is not None and diff <= TOLERANCE else "resumes, DIFFERS"


def markdown(results: List[dict], parallels: Sequence[str] = PARALLELS) -> str:
    """The table: one row per release x torch."""
    lines = ["| torchtitan | torch | natively (FSDP) | " + " | ".join(parallels)
             + " | DCP save + resume | DCP from the newest torch |",
             "|---|---|---|" + "---|" * len(parallels) + "---|---|"]
    for r in results:
        for torch, error in r.get("cannot_start", {}).items():
            lines.append(f"| {r['release']} | {torch} | cannot start with TORCHPATCH=1: `{error}` |"
                         + " |" * (len(parallels) + 2))
        for torch, row in r["runs"].items():
            native = "trains" if not row["native_fsdp_error"] else f"`{row['native_fsdp_error']}`"
            ref = " (reference: native)" if torch == r["reference"] else ""
            lines.append(f"| {r['release']} | {torch}{ref} | {native} | "
                         + " | ".join(_cell(row[p]) for p in parallels)
                         + f" | {_dcp(row['dcp_resume'])} | {_dcp(row.get('dcp_from_newest'))} |")
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
    parser.add_argument("--parallel", action="append", choices=PARALLELS, help="default: all")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/torchtitan.md")
    parser.add_argument("--json", metavar="FILE", help="also write every run's losses and errors as JSON")
    parser.add_argument("--from-json", metavar="FILE", help="print (and --write) the table of an earlier --json, run nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        table = markdown(json.loads(Path(args.from_json).read_text()), args.parallel or PARALLELS)
        print(table)
        if args.write:
            write_page(table)
        return 0
    if not args.torch or not args.release:
        parser.error("--torch and --release are needed (or --from-json)")
    torches, releases = _pairs(args.torch, "torch"), _pairs(args.release, "release")
    parallels = args.parallel or list(PARALLELS)
    results = [survey_release(torches, release, path, args.steps, parallels) for release, path in releases.items()]
    table = markdown(results, parallels)
    print(table)
    print("measured at " + ", ".join(f"{r['release']}: {r['commit']}" for r in results), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        write_page(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
