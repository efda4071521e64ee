"""Generate, from the patches' own metadata: the README's count of the catalogue; the docs' catalogue
tables (one per subsystem, the folder of the patch's module) and their table of known silent bugs
(``patches/_data/silent_bugs.json``); the coverage of the newest public API on older minors
(``tools/api_coverage.py``); the support chart (``tools/support_chart.py``); the catalogue's
index (``patches/_data/index.json``: each module's patch ids with their torch and Python specifiers,
which lets activation import only the patch modules that can apply to the installed torch).

    python tools/patch_table.py            # print the catalogue tables
    python tools/patch_table.py --write    # rewrite them (between their markers), the chart and the index
    python tools/patch_table.py --check    # exit 1 if any is out of date (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import api_coverage
from support_chart import svg

from torchpatch._known_bugs import entries, with_range
from torchpatch._patch import Patch
from torchpatch._registry import DATA, INDEX, _load, builtin_patches, catalogue_modules

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE = "https://github.com/torchpatch/torchpatch/tree/main/src/torchpatch/patches"
INDEX_FILE = ROOT / "src" / "torchpatch" / "patches" / DATA / INDEX
CHART_FILE = DOCS / "assets" / "support-chart.svg"


def subsystems() -> Dict[str, List[Patch]]:
    """The catalogue's patches by subsystem (the folder of their module), in the catalogue's order."""
    out: Dict[str, List[Patch]] = {}
    for name in catalogue_modules():
        out.setdefault(name.split(".", 1)[0], []).extend(_load([name]))
    return out


def index() -> str:
    rows = [f"  {json.dumps(name)}: {json.dumps({p.id: [p.torch, p.python] for p in _load([name])})}"
            for name in catalogue_modules()]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def _row(p: Patch) -> str:
    items = [f"module `{m}`" for m in p.modules] + [f"`{m}.{n}`" for m, n in p.symbols]
    if p.aliases:
        items.append(f"{len(p.aliases)} module aliases")
    provides = "<br>".join(items + ([p.behaviour] if p.behaviour else []))
    python = f" (Python {p.python})" if p.python else ""
    upstream = f"[link]({p.upstream})" if p.upstream else "none (fixed in no release)"
    return f"| `{p.id}` | {p.category} | `{p.torch}`{python} | {provides} | {p.summary} | {upstream} |"


def table() -> str:
    """One table per subsystem, each under its heading."""
    sections = []
    for subsystem, patches in subsystems().items():
        count = f"{len(patches)} patch{'es' if len(patches) > 1 else ''}"
        rows = [f"## {subsystem}", "", f"{count} in [`src/torchpatch/patches/{subsystem}/`]({SOURCE}/{subsystem})", "",
                "| id | category | torch | provides | what it fixes | upstream |", "|---|---|---|---|---|---|"]
        sections.append("\n".join(rows + [_row(p) for p in patches]))
    return "\n\n".join(sections)


def catalogue_size() -> str:
    """The README's paragraph that counts the catalogue."""
    by_subsystem = subsystems()
    return (f"{sum(map(len, by_subsystem.values()))} patches in {len(by_subsystem)} subsystems, each for the torch "
            "versions that need it ([the catalogue](docs/patches/index.md)).")


def bugs_table() -> str:
    rows = ["| bug | torch | what goes wrong (silently) | fixed by | upstream |", "|---|---|---|---|---|"]
    patch_torch = {p.id: p.torch for p in builtin_patches()}  # the modules' own, not the index this run rewrites
    for b in (with_range(entry, patch_torch) for entry in entries()):
        fix = f"`{b['patch']}`" if b["patch"] else f"not fixable: {b['not_fixable']}"
        upstream = f"[link]({b['upstream']})" if b["upstream"] else "none (fixed in no release)"
        rows.append(f"| `{b['id']}` | `{b['torch']}` | {b['what']} | {fix} | {upstream} |")
    return "\n".join(rows)


# page -> {marker name: what goes between its markers}
TABLES: Dict[Path, Dict[str, Callable[[], str]]] = {
    ROOT / "README.md": {"catalogue-size": catalogue_size,
                         "api-coverage": lambda: api_coverage.in_one_line(*api_coverage.coverage())},
    DOCS / "patches" / "index.md": {"patch-table": table},
    DOCS / "silent-bugs.md": {"silent-bugs": bugs_table},
    DOCS / "patches" / "newest-api.md": {"api-coverage": lambda: api_coverage.markdown(*api_coverage.coverage())},
}


def render(text: str, tables: Dict[str, Callable[[], str]]) -> str:
    for name, make in tables.items():
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
    outputs = {page: render(page.read_text(), tables) for page, tables in TABLES.items()}
    outputs.update({INDEX_FILE: index(), CHART_FILE: svg(subsystems())})
    if args.check:
        stale = [str(path.relative_to(ROOT)) for path, text in outputs.items()
                 if not path.exists() or path.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}: run python tools/patch_table.py --write", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
