"""The training states that torch 1.13.1, 2.1.2 and 2.4.1 saved (torch.load's default was weights_only=False
there), which tests/test_patch_torch_load_weights_only_globals.py loads on every torch:

    python tools/train_state_fixtures.py --save [--torch 2.4.1[=PYTHON] ...]

writes ``tests/fixtures/train_states/<torch>/state.pt`` and ``values.json`` (its values, as the saving
process printed them; the program is tests/train_state_programs.py's SAVE). PYTHON defaults to the nox
session venv of that torch under ``$NOX_TORCH_VENVS`` or ``~/.cache/torchpatch/nox``. 50 KB a torch (the file
18 KB, its values 31 KB: mostly the RNG states).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from train_state_programs import SAVE  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "train_states"
OLDER = ("1.13.1", "2.1.2", "2.4.1")
VENVS = Path(os.environ.get("NOX_TORCH_VENVS", "~/.cache/torchpatch/nox")).expanduser()


def save(torch: str, python: str) -> Path:
    """Write ``tests/fixtures/train_states/<torch>`` with ``python``'s torch, which must be ``torch``."""
    target = FIXTURES / torch
    target.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    env["PYTHONPATH"] = str(FIXTURES)  # the dataclass's module
    check = f"import torch, sys; sys.exit(torch.__version__.split('+')[0] != {torch!r})"
    if subprocess.run([python, "-c", check], env=env).returncode:
        raise SystemExit(f"{python} is not torch {torch}")
    proc = subprocess.run([python, "-c", SAVE, str(target / "state.pt")], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        raise SystemExit(f"saving on torch {torch} failed:\n{proc.stderr[-3000:]}")
    values = json.loads(proc.stdout.strip().splitlines()[-1])
    (target / "values.json").write_text(json.dumps(values, separators=(",", ":")) + "\n")
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", action="append", metavar="VERSION[=PYTHON]",
                        help=f"a torch version and its venv's python (default: {', '.join(OLDER)}, their nox venvs)")
    parser.add_argument("--save", action="store_true", required=True, help="(re)write the fixtures")
    args = parser.parse_args(argv)
    specs = args.torch or list(OLDER)
    for spec in specs:
        torch, _, python = spec.partition("=")
        python = python or str(VENVS / f"matrix-torch-{torch.replace('.', '-')}" / "bin" / "python")
        print(f"saved {save(torch, python).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
