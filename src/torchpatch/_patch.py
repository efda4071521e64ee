"""How a patch is declared: :class:`Patch` and the :class:`Patcher` that records what it changed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple


_ID = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
# What a patch is for: "compatibility" (code written for another torch runs here: a missing module,
# symbol or feature, a removed name, a behaviour that fails loudly) or "correctness" (this torch runs
# the code but silently computes a wrong result, which the patch makes right).
CATEGORIES = ("compatibility", "correctness")
_MISSING = object()
_CALL = object()

ModuleBuilder = Callable[[ModuleType], None]
SymbolFactory = Callable[[], Any]
ImportHook = Callable[["Patcher", ModuleType], Optional[bool]]


def switch_name(patch_id: str) -> str:
    """The per-patch switch: ``TORCHPATCH_<ID>``, id upper-cased, ``-`` → ``_``."""
    return "TORCHPATCH_" + patch_id.upper().replace("-", "_")


class Patcher:
    """Changes a behaviour patch makes to live objects, recorded so that each can be undone.

    A hook receives one and uses :meth:`wrap` and :meth:`setattr` instead of assigning directly;
    :meth:`undo` restores every original, in reverse order.

    A hook may keep its patcher and change more through it after it has returned (a wrap installed
    on the first use of a feature, off the hot path until then): each such later change joins the
    patch's record when it is made, so it is undone with the patch, in order with every change made
    since (another patch's wrap of the same attribute included), and on a reload of the module. Once
    the patcher's changes have been undone (the patch taken back, or its hook run again), a change
    through it raises ``RuntimeError``.
    """

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []
        self._later: Optional[Callable[[Callable[[], None]], None]] = None
        self._undone = False

    def settle(self, record: Callable[[Callable[[], None]], None]) -> None:
        """Engine side, once the hook has returned: from now on each change is recorded through
        ``record(undo)`` as it is made (and undone by :meth:`undo` too, for a reload)."""
        self._later = record

    def _live(self) -> None:
        if self._undone:
            raise RuntimeError("torchpatch: this patcher's changes were taken back (the patch was uninstalled, "
                               "failed, or applied again): it cannot change anything more")

    def _note(self, entry: Tuple[Any, str, Any]) -> None:
        if self._later is None:
            self._undo.append(entry)
            return
        later = Patcher()
        later._undo.append(entry)
        self._undo.append((later.undo, "", _CALL))  # a reload undoes it with the rest of the hook's run
        self._later(later.undo)  # the patch's record undoes it in its place among all changes

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering what ``owner`` itself held before."""
        self._live()
        previous = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, name, value)
        self._note((owner, name, previous))

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> Any:
        """Wrap ``owner.name`` with a wrapt ``wrapper(wrapped, instance, args, kwargs)``."""
        import wrapt  # only when a patch wraps something: keeps activation light

        original = vars(owner).get(name) if isinstance(owner, type) else None
        if original is None:
            original = getattr(owner, name)
        proxy = wrapt.FunctionWrapper(original, wrapper)
        self.setattr(owner, name, proxy)
        return proxy

    def on_undo(self, restore: Callable[[], None]) -> None:
        """Call ``restore()`` on :meth:`undo`, in order with the rest: for a change that is not an
        attribute (a switch kept in C++, a registry entry)."""
        self._live()
        self._note((restore, "", _CALL))

    @property
    def changed(self) -> bool:
        return bool(self._undo)

    def modules_changed(self) -> Set[str]:
        """Names of the modules whose namespace (or whose classes) this patcher changed: a reload
        of one of them redefines what was changed, so the engine applies the hook again."""
        names: Set[str] = set()
        for owner, _name, previous in self._undo:
            if previous is _CALL:
                continue
            if isinstance(owner, ModuleType):
                names.add(owner.__name__)
            elif isinstance(owner, type) and isinstance(getattr(owner, "__module__", None), str):
                names.add(owner.__module__)
        return names

    def undo(self) -> None:
        self._undone = True
        while self._undo:
            owner, name, previous = self._undo.pop()
            if previous is _CALL:
                owner()
            elif previous is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, previous)


@dataclass(frozen=True)
class Error:
    """An error a patch makes go away, as users see it: ``pattern``, a regular expression searched in
    one line of a message or log (rank prefixes stripped), specific to this error; ``example``, the
    message as the patch's native-failure test really meets it (``ExceptionType: message`` on one line;
    a long one may end in ``...``), which the pattern must match (tests/test_explain_fixes.py holds
    both to what the test raised, ``_data/native_errors.json``)."""

    pattern: str
    example: str


@dataclass
class Patch:
    """One entry of the catalogue.

    ``torch`` is a version specifier (``">=2.0"``, ``">=2.1,<2.5"``) checked against the installed
    torch's base version; ``python`` likewise against the interpreter. A patch only ever *adds* what
    the installed torch lacks: shim modules are served only for modules that do not exist, symbols
    only where the attribute is missing, and behaviour hooks say ``False`` when torch already has
    the fix. ``category`` is one of :data:`CATEGORIES`. ``errors``: the :class:`Error` s that users
    see without the patch (what ``torchpatch explain`` recognises; names the patch serves need none).
    """

    id: str
    summary: str
    torch: str
    upstream: str
    requires: Tuple[str, ...] = ()
    python: str = ""
    behaviour: str = ""
    category: str = "compatibility"
    errors: Tuple[Error, ...] = ()
    modules: Dict[str, ModuleBuilder] = field(default_factory=dict, repr=False)
    aliases: List[Tuple[str, str, str]] = field(default_factory=list, repr=False)  # (name, target, torch)
    symbols: Dict[Tuple[str, str], SymbolFactory] = field(default_factory=dict, repr=False)
    hook_symbols: List[Tuple[str, str, str]] = field(default_factory=list, repr=False)  # (module, name, torch)
    init_params: List[Tuple[str, str]] = field(default_factory=list, repr=False)  # (class, "name=default")
    import_hooks: List[Tuple[str, ImportHook]] = field(default_factory=list, repr=False)
    import_time_hooks: List[Tuple[str, ImportHook]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"patch id {self.id!r} is not kebab-case")
        if self.category not in CATEGORIES:
            raise ValueError(f"patch {self.id}: category {self.category!r} is not one of {', '.join(CATEGORIES)}")
        self.requires = tuple(self.requires)
        self.errors = tuple(self.errors)

    @property
    def env_name(self) -> str:
        return switch_name(self.id)

    @property
    def provides(self) -> List[str]:
        """What the patch serves, in words: modules, ``module.symbol`` names, behaviours."""
        out = [f"module {name}" for name in self.modules]
        out += [f"module {name} (= {target})" for name, target, _torch in self.aliases]
        out += [f"{module}.{name}" for module, name in self.symbols]
        if self.behaviour:
            out.append(self.behaviour)
        return out

    # -- declaring what the patch does ---------------------------------------------------------
    def module(self, name: str) -> Callable[[ModuleBuilder], ModuleBuilder]:
        """Serve ``name`` where it does not exist: the function fills the new, empty module."""

        def register(build: ModuleBuilder) -> ModuleBuilder:
            self.modules[name] = build
            return build

        return register

    def alias(self, name: str, target: str, torch: str = "") -> None:
        """Serve module ``name``, where it does not exist, as the very module ``target``; with
        ``torch``, only on the torch versions that specifier admits (within the patch's own)."""
        self.aliases.append((name, target, torch))

    def symbol(self, module: str, name: str) -> Callable[[SymbolFactory], SymbolFactory]:
        """Serve ``module.name`` where the module exists without it: the function makes the
        object, once, on first access."""

        def register(factory: SymbolFactory) -> SymbolFactory:
            self.symbols[(module, name)] = factory
            return factory

        return register

    def sets(self, module: str, names: Iterable[str], torch: str = "") -> None:
        """Declare that this patch sets ``module.<name>``, for each of ``names``, where torch lacks
        it (with ``torch``, only on the versions that specifier admits): names a hook sets, the names
        a module builder puts in the module it serves, and ``"module.Class"`` members. This serves
        nothing by itself: it lets ``torchpatch check`` see them (a name in a served module that is
        not declared is never reported as served)."""
        self.hook_symbols += [(module, name, torch) for name in names]

    def takes(self, cls: str, params: Iterable[str]) -> None:
        """Declare that this patch makes ``cls(...)`` (a dotted class name) take ``params`` as the newest
        torch's ``__init__`` does: each ``"name=default"`` is optional with the patch, a new keyword where
        this torch's ``__init__`` lacks it. This changes nothing by itself: it lets ``torchpatch check``
        see that a call using them works."""
        self.init_params += [(cls, param) for param in params]

    def on_import(self, module: str) -> Callable[[ImportHook], ImportHook]:
        """Run ``hook(patcher, module)`` after ``module`` is imported (at once if it already is).
        The hook returns ``False`` when the installed torch needs no fix."""

        def register(hook: ImportHook) -> ImportHook:
            self.import_hooks.append((module, hook))
            return hook

        return register

    def during_import(self, module: str) -> Callable[[ImportHook], ImportHook]:
        """Run ``hook(patcher, module)`` on the new module object *before* its code executes, for
        fixes that must act while the module's own body runs (a post-import hook would be too
        late when the body itself raises). What the hook changes through ``patcher`` is undone
        as soon as the body has run."""

        def register(hook: ImportHook) -> ImportHook:
            self.import_time_hooks.append((module, hook))
            return hook

        return register
