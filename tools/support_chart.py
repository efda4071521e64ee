"""The support chart: torch's minor versions against the catalogue's subsystems (the folders of
``src/torchpatch/patches``), each cell native, served, missing or not servable (``docs/index.md``
defines the four), drawn as SVG from the catalogue, the inventories and ``not_backportable.json``.
``tools/patch_table.py`` writes it (``--write``) and checks it (``--check``).
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Dict, List, Sequence, Tuple

from torchpatch import _versions
from torchpatch._check.base import MISSING, NATIVE, PATCHED, not_backportable
from torchpatch._check.inventory import Inventory, InventoryView, all_inventories
from torchpatch._check.resolve import Resolver
from torchpatch._check.serving import Serving
from torchpatch._config import Config
from torchpatch._patch import Patch

# not_backportable.json names torch's features, not the catalogue's folders: the subsystem of each
# entry (an entry missing here stops the chart until it is placed)
FEATURE_SUBSYSTEM = {
    "torch.distributed._composable.fsdp": "fsdp",
    "torch.distributed.fsdp.fully_shard": "fsdp",
    "torch.distributed.tensor.experimental.context_parallel": "dtensor",
    "torch.distributed._symmetric_memory": "collectives",
    "torch.distributed._dist2": "collectives",
    "torch.uint16": "core",
    "torch.uint32": "core",
    "torch.uint64": "core",
    "torch.profiler._pattern_matcher": "profiler",
    "torch.cuda._annotate_cuda_graph_trace": "profiler",
    "torch.distributed.checkpoint.protocol": "checkpoint",
}
STATES = {  # state: (fill, text colour, mark after the number of patches)
    "native": ("#e4e8ec", "#2d333a", ""),
    "served": ("#2f78b7", "#ffffff", ""),
    "missing": ("#f2b632", "#2d333a", "!"),
    "not servable": ("#c23b2e", "#ffffff", "\u00d7"),
}
CELL_W, CELL_H, LABEL_W, HEAD_H, PAD = 42, 24, 150, 26, 8
FONT = 'font-family="DejaVu Sans, Verdana, sans-serif" font-size="12"'


@dataclass
class Cell:
    """One subsystem on one torch release."""

    applying: List[str]  # ids of its patches whose torch (and Python) specifiers admit the release
    missing: List[str]  # public names its patches serve elsewhere, missing here and served by none
    not_servable: List[str]  # its features of not_backportable.json that this release lacks

    @property
    def state(self) -> str:
        if self.not_servable:
            return "not servable"
        if self.missing:
            return "missing"
        return "served" if self.applying else "native"


def minor_releases() -> List[Inventory]:
    """The newest inventoried release of each torch minor, oldest first."""
    newest: Dict[Tuple[int, ...], Inventory] = {}
    for inv in all_inventories():
        newest[(_versions.release(inv.version) or ())[:2]] = inv
    return list(newest.values())


def public_names(patches: Sequence[Patch]) -> List[str]:
    """The public names (no dotted part starts with ``_``) that the patches serve on some torch:
    shim modules, aliases, symbols and the names they declare with ``Patch.sets``."""
    names = set()
    for p in patches:
        names.update(p.modules)
        names.update(alias for alias, _target, _torch in p.aliases)
        names.update(f"{module}.{name}" for module, name in p.symbols)
        names.update(f"{module}.{name}" for module, name, _torch in p.hook_symbols)
    return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


def features_by_subsystem(subsystems: Sequence[str]) -> Dict[str, List[Dict[str, str]]]:
    """not_backportable.json's entries under their subsystems; ValueError for one not placed."""
    out: Dict[str, List[Dict[str, str]]] = {}
    for entry in not_backportable():
        subsystem = FEATURE_SUBSYSTEM.get(entry["name"])
        if subsystem not in subsystems:
            raise ValueError(f"not_backportable.json's {entry['name']}: give it a subsystem of the catalogue "
                             f"({', '.join(subsystems)}) in FEATURE_SUBSYSTEM of tools/support_chart.py")
        out.setdefault(subsystem, []).append(entry)
    return out


def cells(subsystems: Dict[str, List[Patch]]) -> Dict[Tuple[str, str], Cell]:
    """(subsystem, release) -> its cell, for the newest inventoried release of every torch minor."""
    everything = [p for patches in subsystems.values() for p in patches]
    features = features_by_subsystem(list(subsystems))
    inventories = all_inventories()
    out: Dict[Tuple[str, str], Cell] = {}
    for inv in minor_releases():
        resolver = Resolver(InventoryView(inv, inventories), inv.version,
                            Serving.for_torch(inv.version, everything, Config()))
        for subsystem, patches in subsystems.items():
            out[subsystem, inv.version] = Cell(
                applying=[p.id for p in patches if _versions.matches(p.torch, inv.version)
                          and _versions.matches(p.python, inv.python)],
                missing=[n for n in public_names(patches) if resolver.resolve(n).status == MISSING],
                not_servable=[f"{e['what']} (torch {e['torch']})" for e in features.get(subsystem, ())
                              if resolver.resolve(e["name"]).status not in (NATIVE, PATCHED)
                              and not _versions.matches(e["torch"], inv.version)])
    return out


def _listed(items: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _title(subsystem: str, version: str, cell: Cell) -> str:
    """What a cell says when hovered."""
    lines = [f"{subsystem} on torch {version}: {cell.state}"]
    if cell.not_servable:
        lines.append(f"not servable: {_listed(cell.not_servable)}")
    if cell.missing:
        lines.append(f"missing, served by no patch here: {_listed(cell.missing)}")
    lines.append(f"patches that apply: {_listed(cell.applying)}" if cell.applying else "no patch applies")
    return escape("\n".join(lines))


def _box(x: int, y: int, fill: str) -> str:
    return f'<rect x="{x}" y="{y}" width="{CELL_W - 2}" height="{CELL_H - 2}" rx="3" fill="{fill}"/>'


def svg(subsystems: Dict[str, List[Patch]]) -> str:
    """The chart as an SVG document."""
    releases = minor_releases()
    table = cells(subsystems)
    width = LABEL_W + CELL_W * len(releases) + PAD
    legend_y = HEAD_H + CELL_H * len(subsystems) + 2 * PAD
    height = legend_y + 2 * CELL_H + PAD
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" {FONT}>',
           "<title>torchpatch: what each torch minor version has, per subsystem of the catalogue</title>",
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    for col, inv in enumerate(releases):
        minor = ".".join(inv.version.split(".")[:2])
        x = LABEL_W + col * CELL_W + CELL_W // 2
        out.append(f'<text x="{x}" y="{HEAD_H - 8}" text-anchor="middle" font-weight="bold">'
                   f"<title>torch {inv.version}</title>{minor}</text>")
    for row, subsystem in enumerate(subsystems):
        y = HEAD_H + row * CELL_H
        out.append(f'<text x="{LABEL_W - PAD}" y="{y + CELL_H // 2 + 4}" text-anchor="end">{subsystem}</text>')
        for col, inv in enumerate(releases):
            cell = table[subsystem, inv.version]
            fill, ink, mark = STATES[cell.state]
            x = LABEL_W + col * CELL_W
            number = str(len(cell.applying)) if cell.applying else ""
            out.append(f'<g><title>{_title(subsystem, inv.version, cell)}</title>'
                       f"{_box(x + 1, y + 1, fill)}"
                       f'<text x="{x + CELL_W // 2}" y="{y + CELL_H // 2 + 4}" text-anchor="middle" fill="{ink}">'
                       f"{number}{mark}</text></g>")
    x = PAD
    for state, (fill, ink, mark) in STATES.items():
        out.append(f"{_box(x, legend_y, fill)}"
                   f'<text x="{x + CELL_W // 2 - 1}" y="{legend_y + CELL_H // 2 + 3}" text-anchor="middle" '
                   f'fill="{ink}">{mark}</text>'
                   f'<text x="{x + CELL_W + 4}" y="{legend_y + CELL_H // 2 + 3}">{state}</text>')
        x += CELL_W + 12 + 9 * len(state)
    out.append(f'<text x="{PAD}" y="{legend_y + CELL_H + 16}">the number: patches of the subsystem that apply '
               f"there (Python {releases[-1].python}); each minor is its newest inventoried release</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
