"""Flags from the environment, and the decision for each patch: on or off, and why."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Dict, List, Mapping, Optional, Sequence

from _torchpatch_startup import flag_warning, parse_flag

from ._patch import switch_name

if TYPE_CHECKING:
    from ._patch import Patch

RESERVED = ("TORCHPATCH", "TORCHPATCH_DISABLE", "TORCHPATCH_ENABLE", "TORCHPATCH_STRICT", "TORCHPATCH_LOG",
            "TORCHPATCH_REPORT", "TORCHPATCH_REPORT_ARGV",
            "TORCHPATCH_CHECK_TIMEOUT")  # the last one is read by `torchpatch check`, not at run time
LOG_LEVELS = ("debug", "info", "warning", "off")


def shown(value: str) -> str:
    """A value from the environment as output shows it: as is where it is plain text, else quoted with
    escapes (a newline or a terminal escape in a variable must not forge lines of output)."""
    return value if value and value.isprintable() and value == value.strip() else repr(value)


def _id_list(value: Optional[str]) -> List[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


@dataclass
class Config:
    """What the ``TORCHPATCH*`` variables say."""

    disable: List[str] = field(default_factory=list)
    enable: Optional[List[str]] = None
    switches: Dict[str, bool] = field(default_factory=dict)  # TORCHPATCH_<ID> -> on/off
    strict: bool = False
    log_level: str = "info"
    report_dir: str = ""  # TORCHPATCH_REPORT: where each process writes its report ("": none)
    report_argv: bool = True  # TORCHPATCH_REPORT_ARGV: the report holds the command line
    warnings: List[str] = field(default_factory=list)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Config":
        cfg = cls(disable=_id_list(environ.get("TORCHPATCH_DISABLE")))
        if "TORCHPATCH_ENABLE" in environ:
            cfg.enable = _id_list(environ["TORCHPATCH_ENABLE"])
            if not cfg.enable:
                cfg.warnings.append(
                    "TORCHPATCH_ENABLE is set but names no patch, so every patch is off; unset it to "
                    "use the catalogue, or name ids (TORCHPATCH_ENABLE=a,b; '*' for all)"
                )
        if cfg.enable and cfg.disable:
            both = (list(cfg.disable) if "*" in cfg.enable
                    else [i for i in cfg.enable if i in cfg.disable or "*" in cfg.disable])
            if both:
                cfg.warnings.append(
                    f"TORCHPATCH_ENABLE and TORCHPATCH_DISABLE both name {', '.join(map(shown, both))} ('*' names every id): "
                    "TORCHPATCH_ENABLE wins and turns on what it names (a TORCHPATCH_<ID> switch beats both "
                    "lists); name each id in one list only"
                )
        cfg.strict = cfg._flag("TORCHPATCH_STRICT", environ.get("TORCHPATCH_STRICT", "0")) is True
        level = environ.get("TORCHPATCH_LOG", "info").strip().lower()
        if level not in LOG_LEVELS:
            cfg.warnings.append(f"ignoring TORCHPATCH_LOG={level!r}: use one of {', '.join(LOG_LEVELS)}")
            level = "info"
        cfg.log_level = level
        cfg.report_dir = environ.get("TORCHPATCH_REPORT", "").strip()
        if cfg.report_dir and "TORCHPATCH_REPORT_ARGV" in environ:  # a value it cannot read leaves argv out
            cfg.report_argv = cfg._flag("TORCHPATCH_REPORT_ARGV", environ["TORCHPATCH_REPORT_ARGV"]) is True
        for name, value in environ.items():
            if name.startswith("TORCHPATCH_") and name not in RESERVED:
                flag = cfg._flag(name, value)
                if flag is not None:
                    cfg.switches[name] = flag
        return cfg

    def _flag(self, name: str, value: str) -> Optional[bool]:
        """``parse_flag``, with a warning (logged later, under TORCHPATCH_LOG) for a bad value."""
        flag = parse_flag(value)
        if flag is None:
            self.warnings.append(flag_warning(name, value))
        return flag


@dataclass
class Decision:
    enabled: bool
    reason: str
    firm: bool = False  # named explicitly (TORCHPATCH_<ID>, or by id in TORCHPATCH_DISABLE)


def decide(cfg: Config, patches: Sequence[Patch], inapplicable: Collection[str] = (),
           left_out: Collection[str] = ()) -> Dict[str, Decision]:
    """On/off for every patch with the reason, resolving ``requires`` both ways.

    A requirement that does not apply to the installed torch (``inapplicable``) is no requirement
    there: a patch may need another only on the torch versions where both apply. ``left_out``: ids
    of patches not loaded because they cannot apply here; the flags may still name them.

    Precedence: ``TORCHPATCH_<ID>`` beats ``TORCHPATCH_ENABLE`` beats ``TORCHPATCH_DISABLE``.
    Enabling a patch enables what it requires; turning off a required patch turns off its
    dependents (and says so). Unknown ids become warnings naming the valid ids.
    """
    by_id = {p.id: p for p in patches}
    known = set(by_id) | set(left_out)
    valid = ", ".join(sorted(known))
    for source, ids in (("TORCHPATCH_DISABLE", cfg.disable), ("TORCHPATCH_ENABLE", cfg.enable or [])):
        unknown = [i for i in ids if i != "*" and i not in known]
        if unknown:
            cfg.warnings.append(f"{source} names unknown patch id(s) {', '.join(map(shown, unknown))}; valid ids: {valid}")
    env_names = {switch_name(i): i for i in known}
    unknown_switches = [name for name in cfg.switches if name not in env_names]
    if unknown_switches:
        cfg.warnings.append(
            f"unknown variable(s) {', '.join(map(shown, sorted(unknown_switches)))}; per-patch switches are "
            f"{', '.join(sorted(env_names))}"
        )

    out: Dict[str, Decision] = {}
    for p in patches:
        if p.env_name in cfg.switches:
            on = cfg.switches[p.env_name]
            out[p.id] = Decision(on, f"{p.env_name}={'1' if on else '0'}", firm=True)
        elif cfg.enable is not None:
            on = "*" in cfg.enable or p.id in cfg.enable
            out[p.id] = Decision(on, "in TORCHPATCH_ENABLE" if on else "not in TORCHPATCH_ENABLE", firm=on)
        elif p.id in cfg.disable:
            out[p.id] = Decision(False, "in TORCHPATCH_DISABLE", firm=True)
        elif "*" in cfg.disable:
            out[p.id] = Decision(False, "TORCHPATCH_DISABLE=*")
        else:
            out[p.id] = Decision(True, "on by default")

    # Enabling a patch explicitly enables what it needs, unless that was named off explicitly.
    changed = True
    while changed:
        changed = False
        for p in patches:
            if not (out[p.id].enabled and out[p.id].firm):
                continue
            for need in p.requires:
                if need in inapplicable:
                    continue
                d = out.get(need)
                if d is not None and not d.enabled and not d.firm:
                    out[need] = Decision(True, f"needed by {p.id}", firm=True)
                    changed = True
    # A patch whose requirement is off is off too.
    changed = True
    while changed:
        changed = False
        for p in patches:
            if not out[p.id].enabled:
                continue
            off = [need for need in p.requires
                   if need not in inapplicable and (need not in out or not out[need].enabled)]
            if off:
                out[p.id] = Decision(False, f"needs {', '.join(off)}, which is off")
                if all(need in out for need in off):
                    cfg.warnings.append(f"turning off {off[0]} also turns off {p.id}, which needs it")
                changed = True
    return out
