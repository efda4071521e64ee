"""The entry being matched across ranks: ``EntryState`` (what it says, how it is reported, the
rows it becomes) and ``MatchStateRecord`` (which ranks matched it so far, which did not, and why)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .fr_logger import FlightRecorderLogger
from .records import Collective, MatchInfo, NCCLCall

Errors = Set[Tuple[int, MatchInfo]]


def _pg_desc(process_group: Tuple[str, str]) -> str:
    """``name:desc``, or the name alone where the group has no description."""
    name, desc = process_group[0], process_group[1]
    return name if desc == "undefined" else f"{name}:{desc}"


class EntryState:
    """One rank's dump ``entry``, to be found on each of ``expected_ranks``."""

    def __init__(self, entry: Dict[str, Any], expected_ranks: Set[int]) -> None:
        self.pg_name, self.desc = entry["process_group"][0], entry["process_group"][1]
        self.pg_desc = _pg_desc(entry["process_group"])
        self.profiling_name = entry["profiling_name"]
        self.collective_seq_id = entry["collective_seq_id"]
        self.p2p_seq_id = entry["p2p_seq_id"]
        self.record_id = entry["record_id"]
        self.input_sizes = entry["input_sizes"]
        self.output_sizes = entry["output_sizes"]
        self.collective_state = entry["state"]
        self.collective_frames = entry.get("frames", [])
        self.expected_ranks = expected_ranks
        self.missing_ranks: Set[int]
        self.input_numel: int
        self.output_numel: int
        self.errors: Errors

    def log(self, logger: FlightRecorderLogger, logger_msg: str, frame_formatter: Any,
            total_numel: Optional[Tuple[int, int]] = None, errors: Optional[Errors] = None,
            missing_ranks: Optional[Set[int]] = None) -> None:
        """Report the entry under ``logger_msg`` (formatted with its sequence id), with what was found
        missing or wrong; remember those findings for :meth:`to_collective`."""
        logger.info(logger_msg, self.collective_seq_id)
        logger.info("internal record id: %s", self.record_id)
        logger.info("group info: %s", self.pg_desc)
        logger.info("collective: %s", self.profiling_name)
        if missing_ranks:
            self.missing_ranks = missing_ranks
            logger.info("missing ranks: %s", missing_ranks)
        if total_numel:
            self.input_numel, self.output_numel = total_numel
            logger.info("total input numel: %d", total_numel[0])
            logger.info("total output numel: %d", total_numel[1])
        logger.info("input sizes: %s", self.input_sizes)
        logger.info("output sizes: %s", self.output_sizes)
        logger.info("world size: %d", len(self.expected_ranks))
        logger.info("expected ranks: %s", self.expected_ranks)
        logger.info("collective state: %s", self.collective_state)
        if errors:
            self.errors = errors
            logger.info("error msg: %s", ", ".join(f"Culprit rank {rank}; {info}" for rank, info in errors))
        logger.info("collective stack trace: \n %s", frame_formatter(self.collective_frames))

    def _row(self, entry: Dict[str, Any], id: int, pass_check: bool, **extra: Any) -> Collective:
        return Collective(id=id, group_id=entry["process_group"][0], record_id=entry["record_id"],
                          pg_desc=_pg_desc(entry["process_group"]), pass_check=pass_check,
                          collective_seq_id=entry["collective_seq_id"], p2p_seq_id=entry["p2p_seq_id"],
                          collective_name=entry["profiling_name"], input_sizes=entry["input_sizes"],
                          output_sizes=entry["output_sizes"], expected_ranks=self.expected_ranks,
                          collective_state=entry["state"], collective_frames=entry.get("frames", []), **extra)

    def to_collective(self, id: int, errors: Optional[Errors] = None, idx_map: Optional[Dict[int, int]] = None,
                      all_entries: Optional[Dict[int, List[Dict[str, Any]]]] = None) -> Collective:
        """The ``Collective`` row: passed, or (with ``errors``) failed, holding each culprit rank's
        own entry (``all_entries[rank][idx_map[rank]]``) with its verdict."""
        own = {"process_group": (self.pg_name, self.desc), "record_id": self.record_id,
               "collective_seq_id": self.collective_seq_id, "p2p_seq_id": self.p2p_seq_id,
               "profiling_name": self.profiling_name, "input_sizes": self.input_sizes,
               "output_sizes": self.output_sizes, "state": self.collective_state, "frames": self.collective_frames}
        missing = getattr(self, "missing_ranks", None)
        if not errors:
            return self._row(own, id, True, missing_ranks=missing)
        if idx_map is None:
            raise AssertionError("idx_map is None")
        if all_entries is None:
            raise AssertionError("all_entries is None")
        mismatches = {rank: self._row(all_entries[rank][idx_map[rank]], id, False, type_of_mismatch=info)
                      for rank, info in errors}
        return self._row(own, id, False, input_numel=getattr(self, "input_numel", None),
                         output_numel=getattr(self, "output_numel", None), missing_ranks=missing,
                         mismatch_collectives=mismatches)

    def to_nccl_call(self, all_entries: Dict[int, List[Dict[str, Any]]], idx_map: Dict[int, int],
                     nccl_call_id: int, collective_id: Any) -> List[NCCLCall]:
        """One ``NCCLCall`` row per rank of ``idx_map``, ids from ``nccl_call_id`` on; each rank's
        entry (at ``idx_map[rank]``) leaves ``all_entries``."""
        calls = []
        for offset, (rank, index) in enumerate(idx_map.items()):
            all_entries[rank].pop(index)
            calls.append(NCCLCall(id=nccl_call_id + offset, collective_id=collective_id, group_id=self.pg_name,
                                  global_rank=rank, traceback_id=0, collective_type=self.profiling_name,
                                  sizes=self.input_sizes))
        return calls


class MatchStateRecord:
    """Where the matching of ``entry_state`` stands: ``found_ranks`` (matched, at ``found_idx`` in
    their entries), ``candidate_ranks`` (seen but not matched, at ``candidate_idx``), ``errors``
    (rank, verdict), and whether an all-to-all left the verdict to the totals."""

    def __init__(self, expected_ranks: Set[int], other_ranks: List[int], entry_state: EntryState,
                 candidate_ranks: Set[int], candidate_idx: Dict[int, int], found_ranks: Set[int],
                 found_idx: Dict[int, int], errors: Errors) -> None:
        self.expected_ranks = expected_ranks
        self.other_ranks = other_ranks
        self.entry_state = entry_state
        self.candidate_ranks = candidate_ranks
        self.candidate_idx = candidate_idx
        self.found_ranks = found_ranks
        self.found_idx = found_idx
        self.errors = errors
        self.has_undecided_case = False

    def reset_for_coalesced(self, entry_state: EntryState, candidate_ranks: Set[int]) -> None:
        """Start over for the next entry of a coalesced group."""
        self.entry_state = entry_state
        self.candidate_ranks = candidate_ranks
        self.candidate_idx = {}
        self.found_ranks = set()
        self.found_idx = {}
        self.errors = set()
