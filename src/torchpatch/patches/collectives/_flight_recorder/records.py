"""The flat database the analyser builds (its rows: ``Group``, ``Membership``, ``Traceback``,
``Collective``, ``NCCLCall``; ``Database``; their schema ``types``), the verdict of matching two
entries (``MatchState``, ``MatchInfo``) and the operation names it knows."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any, Dict, Generic, List, NamedTuple, Optional, Set, Tuple, TypeVar, get_type_hints

T = TypeVar("T", bound=NamedTuple)


class Ref(Generic[T]):
    """A reference to a row of table ``T`` (its id)."""


class TypeInfo(NamedTuple):
    """A table's schema: its name and ``(field, type)`` pairs."""

    name: str
    fields: List[Tuple[str, type]]

    @classmethod
    def from_type(cls, c: Any) -> TypeInfo:
        hints = get_type_hints(c)
        return cls(getattr(c, "__name__", str(c)), [(f, t) for f, t in hints.items() if f in c._fields])


class MatchState(Enum):
    """How one rank's entry compares with another's: ``FULLY_MATCHED``; ``COLLECTIVE_TYPE_MISMATCH``
    (different operations); ``SIZE_OR_SYNTAX_MISMATCH`` (input/output sizes, or the collective's
    rules); ``COLLECTIVE_STATE_MISMATCH`` (e.g. completed against scheduled);
    ``COLLECTIVE_DTYPE_MISMATCH``; ``UNDECIDED`` (only all ranks together can tell: all-to-all)."""

    FULLY_MATCHED = auto()
    COLLECTIVE_TYPE_MISMATCH = auto()
    SIZE_OR_SYNTAX_MISMATCH = auto()
    COLLECTIVE_STATE_MISMATCH = auto()
    COLLECTIVE_DTYPE_MISMATCH = auto()
    UNDECIDED = auto()


class MatchInfo:
    """A :class:`MatchState` and, for a mismatch, what differs (``culprit``)."""

    def __init__(self, state: MatchState, culprit: Optional[str] = None) -> None:
        self._state = state
        self.culprit = culprit

    @property
    def state(self) -> MatchState:
        return self._state

    def __str__(self) -> str:
        culprit = getattr(self, "culprit", None)
        return f"Error type: {self._state.name}" + (f", {culprit}" if culprit else "")


class Group(NamedTuple):
    id: str
    desc: str
    size: int


class Membership(NamedTuple):
    group_id: str
    global_rank: int


class Traceback(NamedTuple):
    id: int
    frames: str


class Collective(NamedTuple):
    id: int
    group_id: str
    pass_check: bool
    collective_seq_id: int
    p2p_seq_id: int
    record_id: int
    pg_desc: str
    collective_name: str
    input_sizes: List[List[int]]
    output_sizes: List[List[int]]
    expected_ranks: Set[int]
    collective_state: str
    collective_frames: List[Dict[str, str]]
    input_numel: Optional[int] = None
    output_numel: Optional[int] = None
    missing_ranks: Optional[Set[int]] = None
    mismatch_collectives: Optional[Dict[int, "Collective"]] = None
    type_of_mismatch: Optional[MatchInfo] = None


class NCCLCall(NamedTuple):
    id: int
    collective_id: Ref[Collective]
    group_id: str
    global_rank: int
    traceback_id: Ref[Traceback]
    collective_type: str
    sizes: List[List[int]]


class Database(NamedTuple):
    groups: List[Group]
    memberships: List[Membership]
    tracebacks: List[Traceback]
    collectives: List[Collective]
    ncclcalls: List[NCCLCall]


types = [TypeInfo.from_type(t) for t in (Database, NCCLCall, Collective, Traceback, Membership, Group)]

# The operations a dump entry may name (``<backend>:<operation>``): collectives, point-to-point,
# and the ``coalesced`` entry that ends a coalesced group.
COLLECTIVES = {
    "broadcast", "_broadcast_oop", "reduce", "_reduce_oop", "all_gather", "all_gather_single", "all_gather_v",
    "all_reduce", "_all_gather_base", "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_v", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "gather", "scatter", "all_to_all",
    "all_to_all_single", "all_to_all_v_single", "all_reduce_barrier", "barrier", "split", "new_window",
    "allreduce_coalesced", "allgather_coalesced", "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced",
}
# Collectives whose per-rank sizes may differ: only the totals over the group are checked.
_UNEVEN_COLLECTIVES = {"all_to_all", "all_to_all_single"}
P2P = {"send", "recv"}
