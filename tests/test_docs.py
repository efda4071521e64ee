"""The README is the front door: short, the two commands first, its links alive; the docs' generated
tables, the support chart and the catalogue's index are up to date. (`nox -s docs` builds the manual
itself, with `mkdocs build --strict`.)"""

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.torch_independent  # text and the catalogue's metadata: the same on every torch

README = (REPO / "README.md").read_text()
COMMANDS = ("TORCHPATCH=1 torchrun --nproc_per_node 2 examples/train.py", "nox -s tests")


def test_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250, "the manual goes to docs/: the README is the front door"


def test_readme_starts_with_the_two_commands_and_how_long_they_take():
    first_block = re.search(r"```\w*\n(.*?)```", README, re.S)
    assert first_block and first_block.start() < README.index("\n## "), "the first code block, before any section"
    lines = first_block.group(1).strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith(COMMANDS[0]) and lines[1].endswith(COMMANDS[1]), lines
    timings = README[first_block.end():README.index("\n## ")]
    assert re.search(r"\d+ s\b", timings) and re.search(r"\b[0-9a-f]{7}\b", timings), "timings with their commit"


def test_readme_links_point_at_files_that_exist():
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", README)
    assert any(t.startswith("docs/") for t in targets)
    assert [t for t in targets if not (REPO / t).exists()] == []


def test_docs_tables_chart_and_index_are_generated_from_the_catalogue():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "patch_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
