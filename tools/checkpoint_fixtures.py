"""Checkpoints across torch versions: the fixtures every torch of the matrix saves, and the table of who
resumes whose (docs/checkpoints.md).

    python tools/checkpoint_fixtures.py --torch 2.4.1=PYTHON ... --save      # (re)write tests/fixtures/checkpoints/<torch>
    python tools/checkpoint_fixtures.py --torch 2.4.1=PYTHON ... [--write]   # every saver x loader; --write: the docs table

PYTHON is a torch venv's interpreter with torchpatch installed (the nox sessions' venvs: ``nox -t
matrix --install-only`` makes them, under ``~/.cache/torchpatch/nox``; ``--torch 2.4.1`` alone finds
``matrix-torch-2-4-1`` there, and 2.13.0 is the ``tests`` session's venv). A saver runs with
TORCHPATCH=1 (torch 2.4 needs it for FSDP2 on CPU), as 2 gloo ranks where torch has FSDP2, else as one
process (tests/checkpoint_programs.py says what is saved). Each loader resumes every fixture in one
process, with TORCHPATCH=1 and natively; the table gives, per saver x loader, each part of the state
(model, optimizer, LR scheduler, the loop's own state) and the one-step comparison with the loader
torch's own ``load_state_dict`` of the same state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "examples")]
from checkpoint_programs import LOAD, SAVE  # noqa: E402
from launch import launch  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
PAGE = REPO / "docs" / "checkpoints.md"
MARKERS = ("<!-- checkpoint-table:start -->", "<!-- checkpoint-table:end -->")
VENVS = Path(os.environ.get("NOX_TORCH_VENVS", "~/.cache/torchpatch/nox")).expanduser()
PARTS = {"load": "dcp.load", "model": "model", "optim": "optimizer", "sched": "scheduler", "loop": "loop"}


def venv_python(torch: str) -> str:
    """The nox session venv of ``torch``: the default torch's is the tests session's."""
    name = "tests" if torch == "2.13.0" else "matrix-torch-" + torch.replace(".", "-")
    return str(VENVS / name / "bin" / "python")


def env(torchpatch: bool) -> Dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    out["OMP_NUM_THREADS"] = "1"
    if torchpatch:
        out["TORCHPATCH"] = "1"
    return out


def has_fsdp2(python: str) -> bool:
    probe = "import torch.distributed._composable.fsdp"
    return subprocess.run([python, "-c", probe], env=env(True), capture_output=True).returncode == 0


def save(torch: str, python: str) -> Path:
    """Write ``tests/fixtures/checkpoints/<torch>`` with ``torch`` (replacing what was there)."""
    target = FIXTURES / torch
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "save.py")
        script.write_text(SAVE)
        out = Path(tmp, "out")
        out.mkdir()
        if has_fsdp2(python):
            ranks = launch(str(script), 2, args=[str(out)], env=env(True), timeout=300, python=python)
            failed = [r.stderr[-3000:] for r in ranks if r.returncode]
        else:
            proc = subprocess.run([python, str(script), str(out)], env=env(True), capture_output=True, text=True)
            failed = [proc.stderr[-3000:]] if proc.returncode else []
        if failed:
            raise SystemExit(f"saving on torch {torch} failed:\n" + "\n".join(failed))
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(out, target)
    return target


def resume(python: str, fixture: Path, torchpatch: bool) -> dict:
    """What the loader program reports for ``fixture`` on ``python``'s torch."""
    proc = subprocess.run([python, "-c", LOAD, str(fixture)], env=env(torchpatch), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _short(error: str, limit: int = 110) -> str:
    return error if len(error) <= limit else error[:limit].rsplit(" ", 1)[0] + " ..."


def verdict(result: dict) -> str:
    """One table cell: every part and the step equal, or what failed (the error's first 110 characters)."""
    if "error" in result:
        return f"fails: `{_short(result['error'])}`"
    failed = {part: why for part, why in result["parts"].items() if why != "ok"}
    if failed:
        return "; ".join(f"{PARTS[part]} fails: `{_short(why)}`" for part, why in failed.items())
    differs = {what: how for what, how in result["step"].items() if how != "same"}
    return "resumes, next step equal" if not differs else "resumes, step DIFFERS: " + ", ".join(sorted(differs))


def fixtures() -> List[Path]:
    return sorted((p for p in FIXTURES.iterdir() if (p / "manifest.json").exists()), key=lambda p: Version(p.name))


def table(torches: Dict[str, str]) -> str:
    savers = fixtures()
    lines = ["| saved by \\ resumed on | " + " | ".join(torches) + " |", "|---" * (len(torches) + 1) + "|"]
    for fixture in savers:
        cells = []
        for torch, python in torches.items():
            served, native = resume(python, fixture, True), resume(python, fixture, False)
            cell = verdict(served)
            if verdict(native) != cell:
                cell += f" (natively: {verdict(native)})"
            cells.append(cell)
            print(f"{fixture.name} -> {torch}: {cell}", file=sys.stderr)
        lines.append(f"| {fixture.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_page(text: str) -> None:
    page = PAGE.read_text()
    start, end = page.index(MARKERS[0]) + len(MARKERS[0]), page.index(MARKERS[1])
    PAGE.write_text(page[:start] + "\n" + text + "\n" + page[end:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", action="append", required=True, metavar="VERSION[=PYTHON]",
                        help="a torch version and its venv's python (default: the nox venv of that version)")
    parser.add_argument("--save", action="store_true", help="write each torch's fixture instead of the table")
    parser.add_argument("--write", action="store_true", help="put the table in docs/checkpoints.md")
    args = parser.parse_args(argv)
    torches = dict(spec.split("=", 1) if "=" in spec else (spec, venv_python(spec)) for spec in args.torch)
    torches = dict(sorted(torches.items(), key=lambda item: Version(item[0])))
    if args.save:
        for torch, python in torches.items():
            print(f"saved {save(torch, python).relative_to(REPO)}")
        return 0
    text = table(torches)
    print(text)
    if args.write:
        write_page(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
