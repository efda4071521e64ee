"""Matching one entry across the ranks of its group, and the heuristics that say what went wrong
when it does not match (a rank missing, all-to-all totals, sizes/types/states, not enough dumps)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Set, Tuple

from .entries import Entries, format_frames
from .entry_state import MatchStateRecord
from .fr_logger import logger
from .op import Op
from .records import MatchInfo, MatchState

MATCHED = (MatchState.FULLY_MATCHED, MatchState.UNDECIDED)


def match_one_event(event_a: Dict[Any, Any], event_b: Dict[Any, Any], memberships: Dict[str, Set[Any]],
                    pg_name: str) -> MatchInfo:
    """``event_a``'s verdict on ``event_b`` (both of group ``pg_name``)."""
    return Op(event_a, memberships, pg_name).match(Op(event_b, memberships, pg_name))


def check_size_alltoall(alltoall_cases: List[Dict[str, Any]]) -> Tuple[bool, int, int]:
    """Whether the all-to-all entries' first inputs and first outputs hold different totals of
    elements; and both totals."""
    total_in = sum(math.prod(e["input_sizes"][0]) for e in alltoall_cases)
    total_out = sum(math.prod(e["output_sizes"][0]) for e in alltoall_cases)
    return total_in != total_out, total_in, total_out


def check_current_entry_match(all_entries: Entries, _pg_guids: Dict[Tuple[str, int], str], pg_info: Tuple[str, str],
                              current_entry: Dict[str, Any], _memberships: Dict[str, Set[Any]],
                              mismatch: Dict[str, int], match_record: MatchStateRecord) -> None:
    """Look for ``current_entry`` on each other expected rank: its first entry of the same group
    (guid and description) with the same collective sequence id. A match (while the group has no
    mismatch yet) makes the rank found, anything else a candidate, with the verdict as its error."""
    pg_name, desc = pg_info[0], pg_info[1]
    seq_id = match_record.entry_state.collective_seq_id
    for rank in match_record.expected_ranks.intersection(set(match_record.other_ranks)):
        for index, entry in enumerate(all_entries[rank]):
            if (_pg_guids[(entry["process_group"][0], rank)] != pg_name or entry["process_group"][1] != desc
                    or entry["collective_seq_id"] != seq_id):
                continue
            info = match_one_event(current_entry, entry, _memberships, pg_name)
            if info.state in MATCHED and mismatch[pg_name] == 0:
                match_record.found_ranks.add(rank)
                match_record.found_idx[rank] = index
                match_record.has_undecided_case = info.state == MatchState.UNDECIDED
            else:
                match_record.candidate_ranks.add(rank)
                match_record.candidate_idx[rank] = index
                if info.state not in MATCHED:
                    match_record.errors.add((rank, info))
            break


def _found_become_candidates(record: MatchStateRecord) -> None:
    record.candidate_ranks.update(record.found_ranks)
    record.candidate_idx.update(record.found_idx)
    record.found_idx.clear()
    record.found_ranks.clear()


def _candidates_become_found(record: MatchStateRecord) -> None:
    record.found_ranks.update(record.candidate_ranks)
    record.found_idx.update(record.candidate_idx)
    record.candidate_idx.clear()
    record.candidate_ranks.clear()


def error_analysis(all_entries: Entries, match_record: MatchStateRecord, dumps_ranks: Set[int], first_rank: int,
                   current_entry: Dict[str, Any], mismatch: Dict[str, int], version: Tuple[int, int],
                   pg_name: str) -> None:
    """Decide what the matching of ``current_entry`` found, log it, and count a mismatch of the
    group where there is one: some expected ranks (with dumps) never joined; an all-to-all whose
    totals differ (dump format 2.4 on); entries that differ; or, undecided, dumps missing. A match
    leaves every rank found; anything else leaves them all candidates."""
    record, state = match_record, match_record.entry_state
    seen = record.candidate_ranks | record.found_ranks
    if seen != record.expected_ranks and record.expected_ranks - seen <= dumps_ranks:
        mismatch[pg_name] += 1
        state.log(logger, "Not all ranks joining collective, sequence number: %s", format_frames,
                  missing_ranks=record.expected_ranks - seen)
        _found_become_candidates(record)
    elif len(record.candidate_ranks) == 1 and record.expected_ranks.issubset(dumps_ranks):
        if record.has_undecided_case:
            cases = [current_entry] + [all_entries[rank][record.found_idx[rank]] for rank in record.found_ranks]
            failed, total_in, total_out = check_size_alltoall(cases)
            if version[0] <= 2 and version[1] <= 3:  # sizes of all-to-all are only recorded from 2.4 on
                failed = False
            if failed:
                mismatch[pg_name] += 1
                state.log(logger, "Input/output mismatch in the collective sequence number: %s", format_frames,
                          total_numel=(total_in, total_out))
                _found_become_candidates(record)
                record.errors.add((first_rank, MatchInfo(MatchState.SIZE_OR_SYNTAX_MISMATCH)))
                return
        _candidates_become_found(record)
    elif record.errors:
        mismatch[pg_name] += 1
        state.log(logger, "Collective sequence number: %s has errors", format_frames, errors=record.errors)
        _found_become_candidates(record)
    else:
        _found_become_candidates(record)
        if record.expected_ranks - dumps_ranks:
            mismatch[pg_name] += 1
            logger.info("We cannot decide what's wrong with this collective entry because we missed FR dumps from "
                        "ranks (%s) so we don't have enough information. If you want to debug further use -j to "
                        "dump all raw trace", str(record.expected_ranks - dumps_ranks))
        else:
            logger.info("No errors found for this collective entry, There could be some other reasons why we see "
                        "collective timeout.")
