"""Coalesced groups: a run of entries of one group sharing one sequence id (point-to-point ones
their ``p2p_seq_id``), ended by a ``coalesced`` entry. Dump formats before 2.7 coalesce only
point-to-point operations; from 2.7 on collectives too."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Set, Tuple

from .entries import get_version_detail, tabulate_function
from .entry_state import EntryState, MatchStateRecord
from .fr_logger import logger
from .matching import check_current_entry_match, error_analysis
from .op import Op
from .records import P2P, Collective, Group, MatchState

Guids = Dict[Tuple[str, int], str]
RankEvents = Dict[Any, List[Tuple[int, Dict[str, Any]]]]  # rank -> [(index in its dump, entry)]


def _leading_group(pg_name: str, entries: List[Dict[str, Any]], _pg_guids: Guids,
                   rank: int) -> List[Tuple[int, Dict[str, Any]]]:
    """The entries of group ``pg_name`` from its first one on that share its sequence id, with
    their indices (entries of other groups in between are stepped over)."""
    found: List[Tuple[int, Dict[str, Any]]] = []
    seq_id = None
    for index, entry in enumerate(entries):
        if _pg_guids[(entry["process_group"][0], rank)] != pg_name:
            continue
        own_id = entry["p2p_seq_id"] if entry["is_p2p"] else entry["collective_seq_id"]
        if seq_id is None:
            seq_id = own_id
        elif own_id != seq_id:
            break
        found.append((index, entry))
    return found


def find_coalesced_group(pg_name: str, entries: List[Dict[str, Any]], _pg_guids: Guids,
                         rank: int) -> List[Tuple[int, Dict[str, Any]]]:
    """The coalesced group ``entries`` start with in group ``pg_name`` (format < 2.7: it must end
    with ``nccl:coalesced``), or [] where the first entry stands alone."""
    found = _leading_group(pg_name, entries, _pg_guids, rank)
    if len(found) < 2:
        return []
    if found[-1][1]["profiling_name"] != "nccl:coalesced":
        raise AssertionError
    return found


def find_coalesced_group_with_non_p2p(pg_name: str, entries: List[Dict[str, Any]], _pg_guids: Guids,
                                      rank: int) -> List[Tuple[int, Dict[str, Any]]]:
    """As :func:`find_coalesced_group` for format 2.7 on, where collectives coalesce too; an NCCL
    group not ended by a ``*_coalesced`` entry is logged as an error."""
    found = _leading_group(pg_name, entries, _pg_guids, rank)
    if len(found) < 2:
        return []
    name = found[-1][1]["profiling_name"]
    if name.startswith("nccl:") and not name.endswith("_coalesced"):
        logger.error("Rank %s does not have a coalesced end.", rank)
    return found


def _ops(all_rank_events: RankEvents, memberships: Dict[str, Set[Any]], _pg_guids: Guids) -> Dict[Any, List[Op]]:
    return {rank: [Op(e, memberships, _pg_guids[(e["process_group"][0], rank)]) for _, e in events]
            for rank, events in all_rank_events.items()}


def _visualize(match: bool, all_rank_events: RankEvents, memberships: Dict[str, Set[Any]], _pg_guids: Guids) -> None:
    """Log "Match" or "MISMATCH" and the group's operations, one column per rank. As torch does,
    each cell looks its group up under (group name, the entry's index in its dump), left empty
    where that is no key, and the table ends with one empty row."""
    lengths = [len(ops) for ops in _ops(all_rank_events, memberships, _pg_guids).values()]
    table = []
    for i in range(max(lengths, default=0) + 1):
        row = []
        for rank, length in zip(all_rank_events, lengths):
            if i >= length:
                row.append(None)
                continue
            index, event = all_rank_events[rank][i]
            key = (event["process_group"][0], index)
            row.append(Op(event, memberships, _pg_guids[key]) if key in _pg_guids else None)
        table.append(row)
    logger.info("%s \n", "Match" if match else "MISMATCH")
    logger.info("%s", tabulate_function()(table))


def _first_ranks(all_ops: Dict[Any, List[Op]]) -> Iterator[Any]:
    """The first rank of ``all_ops`` with operations left, as long as there is one (ranks without
    any leave ``all_ops``)."""
    while all_ops:
        first_rank = next(iter(all_ops))
        if all_ops[first_rank]:
            yield first_rank
        else:
            all_ops.pop(first_rank)


def _pair_first_p2p(all_ops: Dict[Any, List[Op]], first_rank: Any, memberships: Dict[str, Set[Any]]) -> bool:
    """Pair ``first_rank``'s first operation with its peer's first matching one, both then leaving
    ``all_ops``: the peer's operations are searched in order up to the first one from or to
    ``first_rank``'s side (sends to one peer keep their order). False where none matches."""
    op = all_ops[first_rank][0]
    peer_ops = all_ops[sorted(memberships[op.pg_name])[op.dst]]
    for i, other in enumerate(peer_ops):
        if op.match(other).state == MatchState.FULLY_MATCHED:
            all_ops[first_rank].pop(0)
            peer_ops.pop(i)
            return True
        if op.dst == other.src:
            return False
    return False


def match_coalesced_groups(all_rank_events: RankEvents, group_size: int, groups: Dict[str, Group],
                           memberships: Dict[str, Set[Any]], _pg_guids: Guids) -> bool:
    """Whether every rank's coalesced point-to-point operations find their peers' (format < 2.7).
    Each rank's operations may come in any order, except that those between two given ranks keep
    theirs; the result is logged with the table of operations."""
    all_ops = _ops(all_rank_events, memberships, _pg_guids)
    for ops in all_ops.values():
        if not ops:
            return False
        if ops[-1].type != "coalesced":
            raise AssertionError
        ops.pop()
    for first_rank in _first_ranks(all_ops):
        if all_ops[first_rank][0].type not in P2P:
            raise NotImplementedError("coalesced collective ops")
        if not _pair_first_p2p(all_ops, first_rank, memberships):
            _visualize(False, all_rank_events, memberships, _pg_guids)
            return False
    _visualize(True, all_rank_events, memberships, _pg_guids)
    return True


def match_coalesced_groups_with_non_p2p(all_rank_events: RankEvents, pg_info: Tuple[str, str],
                                        memberships: Dict[str, Set[Any]], _pg_guids: Guids, mismatch: Dict[str, int],
                                        dumps_ranks: Set[int], version: str, collectives: List[Collective],
                                        match_record: MatchStateRecord) -> bool:
    """Whether a coalesced group matches across ranks (format 2.7 on). Point-to-point groups pair
    as :func:`match_coalesced_groups` does; a group of collectives is matched entry by entry like
    single collectives (logging what is wrong), and its first failing entry is appended to
    ``collectives``, failed."""
    all_ops = _ops(all_rank_events, memberships, _pg_guids)
    is_p2p = any(op.type in P2P for ops in all_ops.values() for op in ops)
    pg_name = pg_info[0]
    for rank, ops in all_ops.items():
        if not ops:
            logger.error("Rank %s has an empty op list.", rank)
        elif ops[-1].type == "coalesced" and is_p2p:
            ops.pop()
    for first_rank in _first_ranks(all_ops):
        if is_p2p:
            if not _pair_first_p2p(all_ops, first_rank, memberships):
                _visualize(False, all_rank_events, memberships, _pg_guids)
                return False
            continue
        entries = {rank: [e for _, e in events] for rank, events in all_rank_events.items()}
        current_entry = entries[first_rank][0]
        all_ops[first_rank].pop(0)
        match_record.reset_for_coalesced(EntryState(current_entry, match_record.expected_ranks), {first_rank})
        check_current_entry_match(entries, _pg_guids, pg_info, current_entry, memberships, mismatch, match_record)
        error_analysis(entries, match_record, dumps_ranks, first_rank, current_entry, mismatch,
                       get_version_detail(version), pg_info[0])
        if match_record.found_ranks == match_record.expected_ranks and mismatch[pg_name] == 0:
            for rank in match_record.found_ranks:
                all_rank_events[rank].pop(0 if rank == first_rank else match_record.found_idx[rank])
                if rank != first_rank:
                    all_ops[rank].pop(0)
            continue
        logger.debug("Non-matching collective inside coalesced group")
        idx_map = {rank: 0 if rank == first_rank else match_record.candidate_idx[rank]
                   for rank in match_record.candidate_ranks}
        collectives.append(match_record.entry_state.to_collective(len(collectives), errors=match_record.errors,
                                                                  idx_map=idx_map, all_entries=entries))
        return False
    if is_p2p:
        _visualize(True, all_rank_events, memberships, _pg_guids)
    return True
