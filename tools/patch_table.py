"""Generate, from the patches' own metadata, the README's patch table, its table of known silent
bugs (``patches/_data/silent_bugs.json``) and the catalogue's index
(``patches/_data/index.json``: each module's patch ids with their torch and Python specifiers, which lets
activation import only the patch modules that can apply to the installed torch).

    python tools/patch_table.py            # print the table
    python tools/patch_table.py --write    # rewrite it in README.md, between the markers, and the index
    python tools/patch_table.py --check    # exit 1 if either is out of date (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchpatch._known_bugs import entries, with_range
from torchpatch._registry import DATA, INDEX, _load, builtin_patches, catalogue_modules

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INDEX_FILE = ROOT / "src" / "torchpatch" / "patches" / DATA / INDEX
TABLES = {"patch-table": lambda: table(), "silent-bugs": lambda: bugs_table()}


def index() -> str:
    rows = [f"  {json.dumps(name)}: {json.dumps({p.id: [p.torch, p.python] for p in _load([name])})}"
            for name in catalogue_modules()]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def table() -> str:
    rows = ["| id | category | torch | provides | what it fixes | upstream |", "|---|---|---|---|---|---|"]
    for p in builtin_patches():
        items = [f"module `{m}`" for m in p.modules] + [f"`{m}.{n}`" for m, n in p.symbols]
        if p.aliases:
            items.append(f"{len(p.aliases)} module aliases")
        provides = "<br>".join(items + ([p.behaviour] if p.behaviour else []))
        python = f" (Python {p.python})" if p.python else ""
        upstream = f"[link]({p.upstream})" if p.upstream else "none (fixed in no release)"
        rows.append(f"| `{p.id}` | {p.category} | `{p.torch}`{python} | {provides} | {p.summary} | {upstream} |")
    return "\n".join(rows)


def bugs_table() -> str:
    rows = ["| bug | torch | what goes wrong (silently) | fixed by | upstream |", "|---|---|---|---|---|"]
    patch_torch = {p.id: p.torch for p in builtin_patches()}  # the modules' own, not the index this run rewrites
    for b in (with_range(entry, patch_torch) for entry in entries()):
        fix = f"`{b['patch']}`" if b["patch"] else f"not fixable: {b['not_fixable']}"
        upstream = f"[link]({b['upstream']})" if b["upstream"] else "none (fixed in no release)"
        rows.append(f"| `{b['id']}` | `{b['torch']}` | {b['what']} | {fix} | {upstream} |")
    return "\n".join(rows)


def render(text: str) -> str:
    for name, make in TABLES.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, rest = text.split(begin, 1)
        _old, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not (args.write or args.check):
        print(table())
        return 0
    outputs = {README: render(README.read_text()), INDEX_FILE: index()}
    if args.check:
        stale = [path.name for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}: run python tools/patch_table.py --write", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
