"""``Op``: one dump entry parsed (``<backend>:<operation>[ <src>-><dst> | <dst><-<src>]``) and its
verdict against the entry another rank recorded at the same place."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Set

from .fr_logger import logger
from .records import _UNEVEN_COLLECTIVES, COLLECTIVES, P2P, MatchInfo, MatchState

# The communication libraries whose names the recorders write; another name is only warned about.
KNOWN_BACKENDS = {"nccl", "ncclx", "nccl2", "nccl-lazy", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl", "c10d"}
GATHERS = ("all_gather", "_all_gather_base", "all_gather_into_tensor_coalesced")
SCATTERS = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")


class Op:
    """The operation of one dump entry (``event``) of process group ``pg_name`` (its hashed guid,
    the key of ``memberships``). Point-to-point operations know their peers: ``src``/``dst``, group
    ranks (``src`` is None for a receive from any source, written ``<-?``)."""

    def __init__(self, event: Dict[Any, Any], memberships: Dict[str, Set[Any]], pg_name: str) -> None:
        self.profiling_name = event["profiling_name"]
        backend, colon, name = self.profiling_name.rpartition(":")
        if not colon:
            raise AssertionError(f"name formatting error? {self.profiling_name} is not '<comm_lib>:<op>'")
        if backend not in KNOWN_BACKENDS:
            logger.warning("unrecognized comm library '%s' in profiling name '%s'", backend, self.profiling_name)
        parts = name.split(" ")
        kind = parts[0]
        peers = parts[1] if len(parts) == 2 else None
        self.state = event["state"]
        self.pg_name = pg_name
        self.original_pg_name, self.pg_desc = event["process_group"]
        if kind not in COLLECTIVES | P2P | {"coalesced"}:
            raise AssertionError(f"{kind} is not a supported operation")
        self.type = kind
        self._src: Optional[int] = -1
        self._dst = -1
        if kind in P2P:
            if not isinstance(peers, str):
                raise AssertionError
            if kind == "send":
                src, dst = peers.split("->")
            else:
                dst, src = peers.split("<-")
            self._src, self._dst = (None if src == "?" and kind == "recv" else int(src)), int(dst)
        ranks = sorted(memberships[pg_name])
        self._src_g = None if self._src is None else ranks[self._src]
        self._dst_g = ranks[self._dst]
        self.pg_size = len(memberships[pg_name])
        sized = kind in P2P | COLLECTIVES
        self.input_sizes = event["input_sizes"] if sized else None
        self.output_sizes = event["output_sizes"] if sized else None
        self.collective_seq_id = event["collective_seq_id"]
        self.stack_id = event.get("stack_id", -1)
        self.p2p_seq_id = event["p2p_seq_id"]
        self.input_dtypes = event["input_dtypes"]
        self.output_dtypes = event["output_dtypes"]
        self.time_created_ns = event["time_created_ns"]
        self.collective_frames = event.get("frames", [])
        self.is_verbose = os.getenv("FR_TRACE_VERBOSE_OUTPUT", "0") == "1"

    @property
    def src(self) -> Optional[int]:
        if self.type not in P2P:
            raise AssertionError("can't get src of non-p2p op")
        return self._src

    @property
    def dst(self) -> int:
        if self.type not in P2P:
            raise AssertionError("can't get dst of non-p2p op")
        return self._dst

    def __repr__(self) -> str:
        peers = f"s={self._src_g} d={self._dst_g}" if self.type in P2P else ""
        if not self.is_verbose:
            return f"{self.type}({peers + ', ' if peers else ''}input_sizes={self.input_sizes}, state={self.state})"
        seq_id = self.p2p_seq_id if self.type in P2P else self.collective_seq_id
        fields = (f"timestamp_created={self.time_created_ns}", peers, f"input_sizes={self.input_sizes}",
                  f"output_sizes={self.output_sizes}", f"input_dtypes={self.input_dtypes}",
                  f"output_dtypes={self.output_dtypes}", f"collective_seq_id | p2p_seq_id={seq_id}",
                  f"pg_name={self.pg_name}", f"pg_description={self.pg_desc}", f"pg_size={self.pg_size}",
                  f"stack_id={self.stack_id}", f"state={self.state}")
        return f"{self.type}({', '.join(f for f in fields if f)})"

    def dtype_mismatch(self, other: Op) -> bool:
        """Whether the dtypes differ where the collective needs them alike: input against output
        (not scatter, gather, broadcast), inputs across ranks (not scatter, broadcast), outputs
        across ranks (not gather); empty first buffers are not compared."""
        return bool(
            (self.type not in ("scatter", "gather", "broadcast") and set(self.input_dtypes) != set(self.output_dtypes)
             and self.input_sizes[0] and self.output_sizes[0])
            or (self.type not in ("scatter", "broadcast") and set(self.input_dtypes) != set(other.input_dtypes)
                and self.input_sizes[0] and other.input_sizes[0])
            or (self.type != "gather" and set(self.output_dtypes) != set(other.output_dtypes)
                and self.output_sizes[0] and other.output_sizes[0]))

    def _gathered_numel_matches(self, gathered: List[List[int]], shard: List[List[int]]) -> bool:
        """Whether ``gathered`` holds group-size copies of ``shard``: one flat buffer (the native
        backends) or one shard-shaped buffer per rank (c10d's recorder hook)."""
        if math.prod(gathered[0]) == math.prod(shard[0]) * self.pg_size:
            return True
        total = sum(math.prod(s) for s in gathered)
        return len(gathered) == self.pg_size * len(shard) and total == sum(math.prod(s) for s in shard) * self.pg_size

    def match(self, other: Op) -> MatchInfo:
        """This entry against ``other``, another rank's entry at the same place."""
        if self.type in P2P:
            peer = "recv" if self.type == "send" else "send"
            sent, received = (self.input_sizes, other.output_sizes) if self.type == "send" else (
                other.input_sizes, self.output_sizes)
            same_src = self._src is None or other._src is None or self._src == other._src
            matched = other.type == peer and same_src and self.dst == other.dst and sent == received
            return MatchInfo(MatchState.FULLY_MATCHED if matched else MatchState.SIZE_OR_SYNTAX_MISMATCH)
        if self.type in COLLECTIVES:
            return self._match_collective(other)
        if self.type == "coalesced":
            return MatchInfo(MatchState.FULLY_MATCHED if other.type == self.type else MatchState.SIZE_OR_SYNTAX_MISMATCH)
        return MatchInfo(MatchState.FULLY_MATCHED)

    def _match_collective(self, other: Op) -> MatchInfo:
        size = MatchState.SIZE_OR_SYNTAX_MISMATCH
        if self.type != other.type:
            return MatchInfo(MatchState.COLLECTIVE_TYPE_MISMATCH, f"Expected collective type: '{self.type}' does "
                             f"not match found collective type: '{other.type}'")
        if self.type not in _UNEVEN_COLLECTIVES | {"scatter"} and self.input_sizes != other.input_sizes:
            return MatchInfo(size, f"Expected input sizes: '{self.input_sizes}' does not match found input sizes: "
                             f"'{other.input_sizes}'")
        if self.type not in _UNEVEN_COLLECTIVES | {"gather"} and self.output_sizes != other.output_sizes:
            return MatchInfo(size, f"Expected output sizes: '{self.output_sizes}' does not match found output sizes: "
                             f"'{other.output_sizes}'")
        if self.type in ("all_reduce", "allreduce_coalesced") and self.input_sizes != other.output_sizes:
            return MatchInfo(size, f"Expected input sizes: '{self.input_sizes}' does not match found output sizes: "
                             f"'{other.output_sizes}'")
        if self.type in GATHERS and not self._gathered_numel_matches(other.output_sizes, self.input_sizes):
            return MatchInfo(size, f"Found input numel '{math.prod(other.input_sizes[0])} * pg size {self.pg_size}' "
                             f"does not match output numel '{math.prod(other.output_sizes[0])}'")
        if self.type in SCATTERS and not self._gathered_numel_matches(other.input_sizes, self.output_sizes):
            return MatchInfo(size, f"Found input numel '{math.prod(other.input_sizes[0])}' does not match output "
                             f"numel '{math.prod(other.output_sizes[0])} * pg size {self.pg_size}'")
        if self.dtype_mismatch(other):
            return MatchInfo(MatchState.COLLECTIVE_DTYPE_MISMATCH, f"Expected dtypes: '{set(self.input_dtypes)}' "
                             f"does not match found dtype: '{set(self.output_dtypes)}/{set(other.input_dtypes)}/"
                             f"{set(other.output_dtypes)}'")
        if self.state != other.state:
            return MatchInfo(MatchState.COLLECTIVE_STATE_MISMATCH,
                             f"Expected state: '{self.state}' does not match found state: '{other.state}'")
        return MatchInfo(MatchState.UNDECIDED if self.type in _UNEVEN_COLLECTIVES else MatchState.FULLY_MATCHED)

