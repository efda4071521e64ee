"""What each patch changed in this process, kept in one place so that it can be taken back whole.

Every change the engine makes on a patch's behalf (a module served in ``sys.modules`` and set on
its parent package, an alias and the children served under it, a served symbol and its cached
value, an attribute wrapped or set by a hook, an ``on_undo`` callback) adds one undo action to that
patch's :class:`Record`. A patch that fails undoes its own record; ``uninstall()`` undoes every
record, newest change first across all patches, so that stacked changes unwind in order.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, Iterable, List, Tuple

Undo = Callable[[], None]


class Record:
    """The undo actions of one patch, in the order its changes were made."""

    def __init__(self, owner: str, sequence: "itertools.count[int]") -> None:
        self.owner = owner
        self._sequence = sequence
        self._actions: List[Tuple[int, Undo]] = []

    def add(self, undo: Undo) -> None:
        self._actions.append((next(self._sequence), undo))

    def undo(self) -> List[str]:
        """Undo everything, newest first; the errors of actions that raised (the rest still run)."""
        actions, self._actions = self._actions, []
        return _run(reversed(actions))


class Journal:
    """The records of one installation, one per patch, sharing one order of changes."""

    def __init__(self) -> None:
        self._sequence = itertools.count()
        self.records: Dict[str, Record] = {}

    def record(self, owner: str) -> Record:
        if owner not in self.records:
            self.records[owner] = Record(owner, self._sequence)
        return self.records[owner]

    def undo_all(self) -> List[str]:
        """Undo every record's changes, newest first across all of them."""
        actions = sorted((a for r in self.records.values() for a in r._actions), key=lambda a: a[0], reverse=True)
        for r in self.records.values():
            r._actions = []
        return _run(actions)


def _run(actions: Iterable[Tuple[int, Undo]]) -> List[str]:
    errors: List[str] = []
    for _seq, undo in actions:
        try:
            undo()
        except Exception as exc:  # one broken undo must not leave the others undone
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors

