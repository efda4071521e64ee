"""The flight-recorder analyser behind the ``flight-recorder`` patch: torch >= 2.10's
``torch.distributed.flight_recorder`` (``fr_trace``), pure Python, for a torch that lacks it. Not
a patch (the leading underscore); it never imports torch. One module per job:

- ``fr_logger``: the "Flight Recorder" logger every step reports through;
- ``records``: the flat database's rows (``Group``, ``Collective``, ...) and the match verdicts;
- ``op``: one dump entry parsed (``Op``) and matched against another rank's;
- ``entry_state``: the state of the entry being matched (``EntryState``, ``MatchStateRecord``);
- ``matching``: one entry against the other ranks' and the heuristics that name what is wrong;
- ``coalesced``: coalesced groups (several entries ended by a ``coalesced`` one);
- ``entries``: the helpers over whole dumps (versions, alignment, stack ids, printing);
- ``builder``: groups, memberships and collectives from the dumps: the database;
- ``loader``: reading one dump file per rank; ``config_manager``: the command line;
  ``fr_trace``: ``main``.

The patch serves each of torch's modules (``components.types``, ``components.utils``, ...) with the
names torch's holds, taken from these modules.
"""
