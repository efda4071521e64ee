"""elastic-process-state: ``torch.distributed.elastic.utils.process_state`` and the names that go with it
(``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``, the c10d rendezvous ``DEFAULT_PORT``), torch 2.4-2.12.

What breaks:   code written for torch >= 2.13 does ``from torch.distributed.elastic.utils.process_state
               import read_proc_state`` and dies with ``ModuleNotFoundError: No module named
               'torch.distributed.elastic.utils.process_state'``; ``from
               torch.distributed.elastic.agent.server.local_elastic_agent import
               TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` with ``ImportError``; on 2.4 also ``from
               torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT``.
Torch:         2.13 added the module (Linux process states read from ``/proc``) and the name of the
               environment variable of ``LocalElasticAgent``'s watchdog for workers stuck in
               uninterruptible sleep; 2.5 named the c10d rendezvous port (29400, the literal default
               of 2.4's ``create_backend``).
Fix:           serve the module with ``read_proc_state(pid)`` (the state letter of ``/proc/<pid>/stat``,
               found after the last ``)`` since the command name may hold spaces and parentheses;
               ``None`` where it cannot be read) and ``is_uninterruptible_state(state)`` (a state
               starting with ``D``), and the two constants. Not served: the watchdog itself (2.13's
               ``LocalElasticAgent(uninterruptible_state_timeout=...)`` and its reading of the
               variable, which mark a worker group UNHEALTHY after that many seconds in ``D``): an
               older agent neither takes the argument nor reads the variable.
Upstream:      https://github.com/pytorch/pytorch/pull/184304 (D-state handling in torchelastic, torch 2.13);
               https://github.com/pytorch/pytorch/pull/185414 (its follow-up)
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

from torchpatch import Patch

PATCH = Patch(
    id="elastic-process-state",
    summary="torch.distributed.elastic.utils.process_state, TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT "
    "and the c10d rendezvous DEFAULT_PORT",
    torch=">=2.4,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/184304",
)

MODULE = "torch.distributed.elastic.utils.process_state"


def read_proc_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` (``'R'``, ``'S'``, ``'D'``, ``'Z'``, ...) from
    ``/proc/<pid>/stat``, or ``None`` where it cannot be read (not Linux, no such process, no
    permission, unparsable). Linux only."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    end_of_name = text.rfind(")")
    fields = text[end_of_name + 1:].split() if end_of_name != -1 else []
    return fields[0] if fields else None


def is_uninterruptible_state(state: Optional[str]) -> bool:
    """Whether ``state`` is Linux's uninterruptible sleep (``'D'``, any string starting with it)."""
    return state is not None and state.startswith("D")


PATCH.sets(MODULE, ("read_proc_state", "is_uninterruptible_state"))


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    module.read_proc_state = read_proc_state
    module.is_uninterruptible_state = is_uninterruptible_state
    module.__all__ = ["read_proc_state", "is_uninterruptible_state"]


PATCH.symbol("torch.distributed.elastic.agent.server.local_elastic_agent",
             "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT")(lambda: "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT")
PATCH.symbol("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "DEFAULT_PORT")(lambda: 29400)
