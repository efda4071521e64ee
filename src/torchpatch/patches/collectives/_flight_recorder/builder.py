"""The flat database from the dumps: groups and memberships from the process-group configs, then
collectives matched greedily across ranks (``build_collectives``), and ``build_db`` over it all."""

from __future__ import annotations

import argparse
import ast
import copy
import os
import sys
from typing import Any, Dict, List, Set, Tuple

from .coalesced import (find_coalesced_group, find_coalesced_group_with_non_p2p, match_coalesced_groups,
                        match_coalesced_groups_with_non_p2p)
from .entries import (Entries, add_stack_id_in_entries, align_trace_from_beginning, check_no_missing_dump_files,
                      check_version, get_version_detail, just_print_entries)
from .entry_state import EntryState, MatchStateRecord
from .fr_logger import logger
from .matching import check_current_entry_match, error_analysis
from .op import Op
from .records import Collective, Database, Group, Membership, NCCLCall, Traceback

try:
    from tabulate import tabulate as _tabulate
except ModuleNotFoundError:
    logger.warning("tabulate is not installed. Proceeding without it.")

    def _tabulate(data: Any, headers: Any = None) -> Any:  # the tables of -v, untabulated
        return data

Guids = Dict[Tuple[str, int], str]


def build_groups_memberships(pg_config: Any) -> Tuple[List[Group], Dict[Any, Group], List[Membership],
                                                      Dict[str, Set[Any]], Dict[Tuple[str, int], str]]:
    """From ``pg_config`` (global rank -> {group name: {"desc": ..., "ranks": "[0, 1, ...]"}}): the
    ``Group`` and ``Membership`` tables, the same indexed (by group guid: the name and a hash of
    its ranks, split groups sharing names), and (group name, global rank) -> guid. The ranks that
    dump one group must agree on its description and members."""
    groups: List[Group] = []
    memberships: List[Membership] = []
    by_guid: Dict[Any, Group] = {}
    members: Dict[str, Set[Any]] = {}
    guids: Guids = {}
    for global_rank, configs in pg_config.items():
        for pg_uid, config in configs.items():
            desc = config["desc"]
            ranks = ast.literal_eval(config["ranks"])
            guid = pg_uid + str(hash(frozenset(ranks)))
            guids[(pg_uid, global_rank)] = guid
            if isinstance(ranks, str):  # written twice encoded
                ranks = ast.literal_eval(ranks)
            if guid not in by_guid:
                by_guid[guid] = Group(id=guid, desc=desc, size=len(ranks))
                groups.append(by_guid[guid])
                memberships += [Membership(group_id=guid, global_rank=rank) for rank in ranks]
                members[guid] = set(ranks)
            elif by_guid[guid].desc != desc:
                raise AssertionError(f"mismatch in desc {by_guid[guid].desc} vs {desc} for group {guid}")
            elif members[guid] != set(ranks):
                raise AssertionError(f"mismatch in membership for group {guid} {members[guid]} vs {set(ranks)}")
    return groups, by_guid, memberships, members, guids


def _coalesced_peers(group: List[Tuple[int, Dict[str, Any]]], rank: int, memberships: Dict[str, Set[Any]],
                     pg_name: str) -> List[Any]:
    """The peers of ``rank``'s point-to-point operations in its coalesced ``group``, checking that
    each send leaves from, and each receive arrives at, ``rank``."""
    peers = []
    for _, entry in group:
        op = Op(entry, memberships, pg_name)
        if op.type == "send":
            if op._src_g != rank:
                raise AssertionError(f"Send src error: {rank} expected but {op._src_g} is set")
            peers.append(op._dst_g)
        elif op.type == "recv":
            if op._dst_g != rank:
                raise AssertionError(f"Recv dst error: {rank} expected but {op._dst_g} is set")
            peers.append(op._src_g)
    return peers


def build_collectives(all_entries: Entries, _groups: Dict[str, Group], _memberships: Dict[str, Set[Any]],
                      _pg_guids: Guids, version: str, mismatch_cap: int = 10,
                      ) -> Tuple[List[Traceback], List[Collective], List[NCCLCall]]:
    """Match the ranks' entries (global rank -> its dump's entries, consumed) into ``Collective``
    rows (passed, or failed with what was wrong) and one ``NCCLCall`` row per rank and entry.

    Greedily: the first entry of the first rank with entries is looked for on the other members
    of its group; found everywhere it is a collective, otherwise a failed one, and the group's
    mismatches are counted (after one, its later entries are no longer paired). A coalesced group
    is matched as a whole. Stops once a group has more than ``mismatch_cap`` mismatches."""
    collectives: List[Collective] = []
    nccl_calls: List[NCCLCall] = []
    mismatch = {_groups[g].id: 0 for g in _groups}
    dumps_ranks = {int(key) for key in all_entries}
    while all_entries:
        first_rank, *other_ranks = all_entries
        entries = all_entries[first_rank]
        if not entries:
            all_entries.pop(first_rank)
            continue
        current_entry = entries[0]
        desc = current_entry["process_group"][1]
        pg_name = _pg_guids[(current_entry["process_group"][0], first_rank)]
        expected_ranks = set(_memberships[pg_name])
        match_record = MatchStateRecord(expected_ranks=expected_ranks, other_ranks=other_ranks,
                                        entry_state=EntryState(current_entry, expected_ranks),
                                        candidate_ranks={first_rank}, candidate_idx={}, found_ranks=set(),
                                        found_idx={}, errors=set())
        major, minor = get_version_detail(version)
        before_2_7 = major <= 2 and minor < 7
        find_group = find_coalesced_group if before_2_7 else find_coalesced_group_with_non_p2p
        coalesced = find_group(pg_name, entries, _pg_guids, first_rank)
        if len(coalesced) > 1:
            # Each member's group, starting from every expected rank and following point-to-point peers.
            pending, done = set(expected_ranks), set()
            groups_by_rank: Dict[int, List[Tuple[int, Dict[str, Any]]]] = {}
            while pending:
                rank = pending.pop()
                done.add(rank)
                group = find_group(pg_name, all_entries[rank], _pg_guids, rank) if rank in all_entries else []
                groups_by_rank[rank] = group
                pending.update(p for p in _coalesced_peers(group, rank, _memberships, pg_name) if p and p not in done)
            if before_2_7:
                match = match_coalesced_groups(groups_by_rank, group_size=_groups[pg_name].size, groups=_groups,
                                               memberships=_memberships, _pg_guids=_pg_guids)
            else:
                match = match_coalesced_groups_with_non_p2p(
                    copy.deepcopy(groups_by_rank), pg_info=(pg_name, desc), memberships=_memberships,
                    _pg_guids=_pg_guids, mismatch=mismatch, dumps_ranks=dumps_ranks, version=version,
                    collectives=collectives, match_record=match_record)
            if match and mismatch[pg_name] == 0:
                collectives.append(match_record.entry_state.to_collective(len(collectives)))
            else:
                mismatch[pg_name] += 1
            for rank, group in groups_by_rank.items():
                idx_map = {rank: index for index, _ in reversed(group)}  # the group's first index
                calls = match_record.entry_state.to_nccl_call(all_entries, idx_map, len(nccl_calls),
                                                              collectives[-1].id if match else None)
                nccl_calls.extend(reversed(calls))
                for r, index in idx_map.items():  # the rest of the group (as long as the first rank's)
                    for _ in range(1, len(coalesced)):
                        try:
                            all_entries[r].pop(index)
                        except IndexError:  # a rank that did not schedule all of it
                            pass
        else:
            check_current_entry_match(all_entries, _pg_guids, (pg_name, desc), current_entry, _memberships,
                                      mismatch, match_record)
            error_analysis(all_entries, match_record, dumps_ranks, first_rank, current_entry, mismatch,
                           (major, minor), pg_name)
            if match_record.found_ranks == expected_ranks and mismatch[pg_name] == 0:
                collectives.append(match_record.entry_state.to_collective(len(collectives)))
                idx_map = {r: 0 if r == first_rank else match_record.found_idx[r] for r in match_record.found_ranks}
                collective_id = collectives[-1].id
            else:
                logger.debug("appending a non-matching collective")
                idx_map = {r: 0 if r == first_rank else match_record.candidate_idx[r]
                           for r in match_record.candidate_ranks}
                collectives.append(match_record.entry_state.to_collective(
                    len(collectives), errors=match_record.errors, idx_map=idx_map, all_entries=all_entries))
                collective_id = None
            nccl_calls.extend(match_record.entry_state.to_nccl_call(all_entries, idx_map, len(nccl_calls),
                                                                    collective_id))
        if mismatch[pg_name] > mismatch_cap:
            logger.error("Too many mismatches for process_group %s: %s aborting", pg_name, desc)
            break
    return [], collectives, nccl_calls


def transform_ft(details: Dict[str, Dict[str, Any]], group_world_size: int) -> Dict[str, Dict[str, Any]]:
    """For torchft's dumps (one replica group's ranks per dump set): shift the ranks of each dump's
    ``default_pg`` by its replica's first global rank (``rank // group_world_size`` replicas)."""
    for dump in details.values():
        for config in dump["pg_config"].values():
            if config["desc"] == "default_pg":
                first_rank = dump["rank"] // group_world_size * group_world_size
                config["ranks"] = f"{[r + first_rank for r in ast.literal_eval(config['ranks'])]}"
    return details


def build_db(details: Dict[str, Dict[str, Any]], args: argparse.Namespace, version: str) -> Database:
    """The ``Database`` of the dumps (``read_dir``'s ``details``, all of format ``version``); with
    ``args.just_print_entries``, log the entries instead and exit (status 0). Without
    ``args.allow_incomplete_ranks`` every member of every group must have a dump."""
    if args.verbose:
        os.environ["FR_TRACE_VERBOSE_OUTPUT"] = "1"
    entries = {dump["rank"]: dump["entries"] for dump in details.values()}
    check_version({dump["rank"]: dump["version"] for dump in details.values()}, version)
    pg_config = {dump["rank"]: dump["pg_config"] for dump in details.values()}
    entries = align_trace_from_beginning(entries)
    stack_id_trace_map: Dict[str, int] = {}
    if args.just_print_entries:
        entries, stack_id_trace_map = add_stack_id_in_entries(entries)
    groups, _groups, memberships, _memberships, _pg_guids = build_groups_memberships(pg_config)
    logger.debug("built groups, memberships")
    if args.just_print_entries:
        just_print_entries(entries, _groups, _memberships, _pg_guids, args, stack_id_trace_map)
        sys.exit(0)
    if not args.allow_incomplete_ranks:
        check_no_missing_dump_files(entries, memberships)
    tracebacks, collectives, nccl_calls = build_collectives(entries, _groups, _memberships, _pg_guids, version,
                                                            args.mismatch_cap)
    logger.debug("built collectives, nccl_calls")
    if args.verbose:
        for title, rows, row_type in (("Groups", groups, Group), ("Memberships", memberships, Membership),
                                      ("Collectives", collectives, Collective), ("NCCLCalls", nccl_calls, NCCLCall)):
            logger.debug(title)
            logger.debug(_tabulate(rows, headers=row_type._fields))
    return Database(tracebacks=tracebacks, collectives=collectives, ncclcalls=nccl_calls, groups=groups,
                    memberships=memberships)
