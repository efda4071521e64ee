"""flight-recorder: ``torch.distributed.flight_recorder``, the analyser of flight-recorder dumps
(``fr_trace``), on torch 2.4-2.9.

What breaks:   tooling written for torch >= 2.10 that analyses the flight recorder's dumps
               (``from torch.distributed.flight_recorder.fr_trace import main``, or
               ``components.builder.build_db`` / ``components.loader.read_dir`` ...) dies with
               ``ModuleNotFoundError: No module named 'torch.distributed.flight_recorder'``.
               torch <= 2.9 keeps the analyser in the repository's ``tools/flight_recorder``,
               which the wheel does not ship (2.9's ``torchfrtrace`` command points there and
               fails alike).
Torch:         2.4-2.9 lack the package (2.10 brought it). Their runtimes do write dumps:
               ProcessGroupNCCL's recorder on every one of them (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
               dumps of format "2.1" on 2.4, "2.10" on 2.9: same keys, read alike; a format
               before 2.7 coalesces only point-to-point operations and, before 2.4, leaves
               all-to-all sizes unchecked, as torch's analyser does), and gloo's from 2.9 on
               (``torch._C._distributed_c10d._dump_fr_trace()``, format "2.10"). Gloo's dumps,
               on 2.9 as on 2.15, list no process group in their ``pg_config`` (one empty entry):
               the analyser fails on them with torch's own ``KeyError: ('0', 0)``, here as in
               torch 2.15; with the groups written in, they analyse like NCCL's.
Fix:           serve the package, ``components`` with ``types``, ``utils``, ``builder``,
               ``loader``, ``config_manager`` and ``fr_logger``, and ``fr_trace`` with ``main``:
               torch 2.15's analyser (the same command-line arguments, the same log lines and
               errors, the same database, pickled by ``-o`` as ``(types, db)`` with its classes
               named as torch's), written in :mod:`torchpatch.patches.collectives._flight_recorder`.
               Where it differs: the entry tables (``-j``, coalesced groups) need the tabulate
               package as torch's do, and without it raise ``ModuleNotFoundError`` naming it
               (torch: ``NameError``); the schema in ``types`` spells its field types with
               ``typing`` (``List[List[int]]``, ``Optional[int]``; torch: ``list[list[int]]``,
               ``int | None``). ``python -m torch.distributed.flight_recorder.fr_trace DIR`` runs
               ``main`` as torch's does.
Upstream:      https://github.com/pytorch/pytorch/pull/134788 (flight recorder analyser into torch.distributed)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="flight-recorder",
    summary="torch.distributed.flight_recorder: the flight-recorder dump analyser (fr_trace, components)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/134788",
)

PACKAGE = "torch.distributed.flight_recorder"
COMPONENTS = f"{PACKAGE}.components"
IMPLEMENTATION = "torchpatch.patches.collectives._flight_recorder"

# Where each served name is defined here: "<implementation module>" or "<module>:<its name there>".
SOURCES: Dict[str, str] = {
    **dict.fromkeys(("FlightRecorderLogger", "logger"), "fr_logger"),
    **dict.fromkeys(("Ref", "TypeInfo", "MatchState", "MatchInfo", "Group", "Membership", "Traceback", "Collective",
                     "NCCLCall", "Database", "types", "COLLECTIVES", "_UNEVEN_COLLECTIVES", "P2P", "T"), "records"),
    "Op": "op",
    **dict.fromkeys(("EntryState", "MatchStateRecord"), "entry_state"),
    **dict.fromkeys(("match_one_event", "check_size_alltoall", "check_current_entry_match", "error_analysis"),
                    "matching"),
    **dict.fromkeys(("find_coalesced_group", "find_coalesced_group_with_non_p2p", "match_coalesced_groups",
                     "match_coalesced_groups_with_non_p2p"), "coalesced"),
    "find_coalesced_group_p2p_only": "coalesced:find_coalesced_group",
    "match_coalesced_groups_p2p_only": "coalesced:match_coalesced_groups",
    **dict.fromkeys(("format_frame", "format_frames", "just_print_entries", "check_no_missing_dump_files",
                     "check_version", "get_version_detail", "add_stack_id_in_entries", "align_trace_from_beginning"),
                    "entries"),
    **dict.fromkeys(("build_groups_memberships", "build_collectives", "transform_ft", "build_db", "_tabulate"),
                    "builder"),
    **dict.fromkeys(("read_dump", "read_dir", "_determine_prefix", "_disable_gc", "exp"), "loader"),
    "JobConfig": "config_manager",
    "main": "fr_trace",
}

# Per served module: its ``__all__`` (as torch's), then the other names torch's module holds
# (imported from its siblings, its logger, its constants).
MODULES: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "components.fr_logger": (("FlightRecorderLogger",), ()),
    "components.types": (
        ("Ref", "TypeInfo", "MatchState", "MatchInfo", "Group", "Membership", "Traceback", "Collective", "NCCLCall",
         "Database", "EntryState", "Op", "MatchStateRecord"),
        ("FlightRecorderLogger", "logger", "T", "types", "COLLECTIVES", "_UNEVEN_COLLECTIVES", "P2P")),
    "components.utils": (
        ("add_stack_id_in_entries", "align_trace_from_beginning", "check_current_entry_match",
         "check_no_missing_dump_files", "check_version", "error_analysis", "find_coalesced_group",
         "find_coalesced_group_with_non_p2p", "get_version_detail", "just_print_entries",
         "match_coalesced_groups_with_non_p2p", "match_coalesced_groups", "format_frame", "format_frames",
         "match_one_event", "check_size_alltoall"),
        ("FlightRecorderLogger", "logger", "Collective", "EntryState", "Group", "MatchInfo", "MatchState",
         "MatchStateRecord", "Membership", "Op", "P2P")),
    "components.builder": (
        ("build_groups_memberships", "build_collectives", "transform_ft", "build_db"),
        ("FlightRecorderLogger", "logger", "_tabulate", "Collective", "Database", "EntryState", "Group",
         "MatchStateRecord", "Membership", "NCCLCall", "Op", "Traceback", "add_stack_id_in_entries",
         "align_trace_from_beginning", "check_current_entry_match", "check_no_missing_dump_files", "check_version",
         "error_analysis", "find_coalesced_group_p2p_only", "find_coalesced_group_with_non_p2p", "get_version_detail",
         "just_print_entries", "match_coalesced_groups_p2p_only", "match_coalesced_groups_with_non_p2p")),
    "components.loader": (("read_dump", "read_dir"),
                          ("FlightRecorderLogger", "logger", "exp", "_determine_prefix", "_disable_gc")),
    "components.config_manager": (("JobConfig",), ("FlightRecorderLogger", "logger")),
    "fr_trace": (("main",), ("JobConfig", "build_db", "read_dir", "transform_ft", "types")),
}


def _source(name: str) -> object:
    module, _, attribute = SOURCES[name].partition(":")
    return getattr(importlib.import_module(f"{IMPLEMENTATION}.{module}"), attribute or name)


def _name_as(module: str, names: Tuple[str, ...]) -> None:
    """Give our objects of ``names`` torch's module name: the database's classes pickle as torch's."""
    for name in names:
        value = _source(name)
        if getattr(value, "__module__", "").startswith(IMPLEMENTATION):
            value.__module__ = module


def _fill(module: ModuleType, exported: Tuple[str, ...], others: Tuple[str, ...]) -> None:
    _name_as(f"{PACKAGE}.components.types", MODULES["components.types"][0])  # whichever module comes first
    _name_as(module.__name__, exported)
    for name in exported + others:
        setattr(module, name, _source(name))
    module.__all__ = list(exported)


def _builder(exported: Tuple[str, ...], others: Tuple[str, ...]):
    def build(module: ModuleType) -> None:
        _fill(module, exported, others)
        if "main" in exported:  # ``python -m ...fr_trace DIR``, as torch's ``if __name__ == "__main__"``
            module.__torchpatch_main__ = module.main

    return build


@PATCH.module(PACKAGE)
def build_package(module: ModuleType) -> None:
    """Empty, as torch's: its submodules are imported on their own."""


@PATCH.module(COMPONENTS)
def build_components(module: ModuleType) -> None:
    """Empty, as torch's."""


for _name, (_exported, _others) in MODULES.items():
    PATCH.sets(f"{PACKAGE}.{_name}", _exported + _others)
    PATCH.module(f"{PACKAGE}.{_name}")(_builder(_exported, _others))
