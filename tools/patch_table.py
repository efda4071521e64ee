"""Generate the README's patch table from the patches' own metadata.

    python tools/patch_table.py            # print the table
    python tools/patch_table.py --write    # rewrite it in README.md, between the markers
    python tools/patch_table.py --check    # exit 1 if README.md is out of date (the tests run this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchpatch._registry import builtin_patches

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- patch-table:begin -->", "<!-- patch-table:end -->"


def table() -> str:
    rows = ["| id | torch | provides | what it fixes | upstream |", "|---|---|---|---|---|"]
    for p in builtin_patches():
        items = [f"module `{m}`" for m in p.modules] + [f"`{m}.{n}`" for m, n in p.symbols]
        if p.aliases:
            items.append(f"{len(p.aliases)} module aliases")
        provides = "<br>".join(items + ([p.behaviour] if p.behaviour else []))
        python = f" (Python {p.python})" if p.python else ""
        rows.append(f"| `{p.id}` | `{p.torch}`{python} | {provides} | {p.summary} | [link]({p.upstream}) |")
    return "\n".join(rows)


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not (args.write or args.check):
        print(table())
        return 0
    current = README.read_text()
    wanted = render(current)
    if args.check:
        if current != wanted:
            print("README.md's patch table is out of date: run python tools/patch_table.py --write", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
