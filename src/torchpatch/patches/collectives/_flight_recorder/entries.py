"""Helpers over the dumps' entries as a whole: stack frames as text, the dump format's version,
every rank present, alignment of the ring buffers, stack ids, and the table of all entries (``-j``)."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Set, Tuple

from .fr_logger import logger
from .op import Op
from .records import Group, Membership

Entries = Dict[int, List[Dict[str, Any]]]


def format_frame(frame: Dict[str, str]) -> str:
    return f"{frame['name']} at {frame['filename']}:{frame['line']}"


def format_frames(frames: List[Dict[str, str]]) -> str:
    return "\n".join(format_frame(frame) for frame in frames)


def tabulate_function() -> Callable[..., str]:
    """The ``tabulate`` package's function, which the entry tables need (as torch's analyser does)."""
    try:
        from tabulate import tabulate
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the flight recorder's entry tables need the tabulate package "
                                  "(pip install tabulate)", name="tabulate") from exc
    return tabulate


def just_print_entries(all_entries: Entries, _groups: Dict[str, Group], _memberships: Dict[str, Set[Any]],
                       _pg_guids: Dict[Tuple[str, int], str], args: argparse.Namespace,
                       stack_id_trace_map: Dict[str, int]) -> None:
    """Log every rank's entries side by side, one column per rank (``args.selected_ranks`` only),
    entries of groups outside ``args.pg_filters`` (names or descriptions) left blank; then, with
    ``args.print_stack_trace``, the table of stack ids. Consumes ``all_entries``."""
    tabulate = tabulate_function()
    ranks = [r for r in sorted(all_entries) if args.selected_ranks is None or r in args.selected_ranks]
    rows = []
    while any(all_entries[rank] for rank in ranks):
        row = []
        for rank in ranks:
            if not all_entries[rank]:
                row.append("")
                continue
            entry = all_entries[rank].pop(0)
            name, desc = entry["process_group"][0], entry["process_group"][1]
            pg_name = _pg_guids[(name, rank)]
            shown = args.pg_filters is None or desc in args.pg_filters or name in args.pg_filters
            row.append(str(Op(entry, _memberships, pg_name)) if shown else "")
        rows.append(row)
    logger.info(tabulate(rows, headers=[f"Rank {rank}" for rank in ranks]))
    if stack_id_trace_map and args.print_stack_trace:
        stacks = [[str(stack_id), frames] for frames, stack_id in sorted(stack_id_trace_map.items(),
                                                                          key=lambda item: item[1])]
        logger.info(tabulate(stacks, headers=["stack_id", "frame_stack"]))


def check_no_missing_dump_files(entries: Dict[int, Any], memberships: List[Membership]) -> None:
    missing = {int(m.global_rank) for m in memberships} - {int(rank) for rank in entries}
    if missing:
        raise AssertionError(f"Missing dump files from ranks {missing}")


def check_version(version_by_ranks: Dict[str, str], version: str) -> None:
    for rank, v in version_by_ranks.items():
        if v != version:
            raise AssertionError(f"Rank {rank} has different version {v} from the given version {version}")


def get_version_detail(version: str) -> Tuple[int, int]:
    """``"major.minor"`` as two ints."""
    parts = version.split(".")
    if len(parts) != 2:
        raise AssertionError(f"Invalid version {parts}")
    major, minor = map(int, parts)
    return major, minor


def add_stack_id_in_entries(entries: Entries) -> Tuple[Entries, Dict[str, int]]:
    """Number the distinct stacks (``str`` of an entry's frames) from 0 in order of appearance and
    set each entry's ``stack_id`` (-1 without frames); also return stack -> id."""
    stack_ids: Dict[str, int] = {}
    for rank_entries in entries.values():
        for entry in rank_entries:
            frames = entry.get("frames", [])
            entry["stack_id"] = stack_ids.setdefault(str(frames), len(stack_ids)) if frames else -1
    return entries, stack_ids


def align_trace_from_beginning(entries: Entries) -> Entries:
    """Drop, on every rank, the entries recorded before the latest first ``record_id`` of any rank
    (the older ones are not in every ring buffer); ranks without entries are ignored."""
    start = max((rank_entries[0]["record_id"] for rank_entries in entries.values() if rank_entries), default=0)
    start = max(start, 0)
    for rank in entries:
        entries[rank] = [entry for entry in entries[rank] if entry["record_id"] >= start]
    return entries
