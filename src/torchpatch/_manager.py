"""Installing and uninstalling: arming each enabled patch's hooks, fail-safe, and reporting."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import _versions
from ._config import Config, Decision, decide
from ._hooks import ImportWatcher, ShimFinder, SymbolServer
from ._patch import Patch, Patcher
from ._registry import all_patches, applicable_builtin_patches, with_plugins

__version__ = "0.1.0"
log = logging.getLogger("torchpatch")

APPLIED, NOT_NEEDED, FAILED, WAITING = "applied", "not needed", "failed", "waiting for its module"


class PatchError(RuntimeError):
    """A patch failed while applying and ``TORCHPATCH_STRICT=1`` asked for an error."""


@dataclass
class PatchPlan:
    """A patch, whether it applies to this torch and Python, and whether the flags have it on."""

    patch: Patch
    applies: bool
    applies_reason: str
    decision: Decision

    @property
    def active(self) -> bool:
        return self.applies and self.decision.enabled


def _applicability(torch: str, python: str, torch_version: Optional[str]) -> Tuple[bool, str]:
    """Whether a patch for ``torch`` (and ``python``) specifiers applies here, and why."""
    if torch_version is None:
        return False, "torch is not installed"
    if not _versions.matches(torch, torch_version):
        return False, f"for torch {torch}"
    if python and not _versions.matches(python, _versions.python_version()):
        return False, f"for Python {python}"
    return True, f"torch {torch}" + (f", Python {python}" if python else "")


def plan(environ: Optional[Mapping[str, str]] = None, cfg: Optional[Config] = None, *,
         only_applicable: bool = False) -> List[PatchPlan]:
    """Every known patch with its applicability and on/off decision, for the installed torch.

    ``only_applicable`` (what :func:`install` uses): built-in patches that cannot apply to the
    installed torch and Python are left out, their modules not even imported (the catalogue's
    index says which); the flags may still name them.
    """
    cfg = cfg or Config.from_environ(os.environ if environ is None else environ)
    version = _versions.torch_version()
    if only_applicable:
        builtin, left_out = applicable_builtin_patches(lambda torch, python: _applicability(torch, python, version)[0])
        patches = with_plugins(builtin, cfg.strict, taken=left_out)
    else:
        patches, left_out = all_patches(cfg.strict), []
    applicability = {p.id: _applicability(p.torch, p.python, version) for p in patches}
    inapplicable = {i for i, (applies, _) in applicability.items() if not applies}
    decisions = decide(cfg, patches, inapplicable.union(left_out), left_out)
    return [PatchPlan(p, *applicability[p.id], decisions[p.id]) for p in patches]


def _configure_logging(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("torchpatch: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.CRITICAL + 1 if level == "off" else getattr(logging, level.upper()))


class _Installation:
    """Everything one ``install()`` changed, so that ``uninstall()`` can take it all back."""

    def __init__(self, cfg: Config, plans: List[PatchPlan]) -> None:
        self.cfg = cfg
        self.plans = plans
        self.watcher = ImportWatcher()
        self.shims = ShimFinder(self.watcher.alias_packages)
        self.watcher.alias_child = self.shims.alias_child
        self.symbols = SymbolServer()
        self.patchers: List[Tuple[str, Patcher]] = []  # (patch id, its changes), in order
        self.status: Dict[str, str] = {}
        self.shim_modules: List[str] = []

    # -- fail-safe application -------------------------------------------------------------
    def _fail(self, patch: Patch, where: str, exc: BaseException) -> None:
        """Log once, mark the patch failed and take back what it did; raise if strict."""
        for patch_id, patcher in self.patchers:
            if patch_id == patch.id:
                patcher.undo()
        if self.status.get(patch.id) != FAILED:
            self.status[patch.id] = FAILED
            log.warning(
                "patch %s failed while applying to %s and was skipped (%s: %s); "
                "set TORCHPATCH_STRICT=1 to make this an error",
                patch.id, where, type(exc).__name__, exc,
            )
        if self.cfg.strict:
            raise PatchError(f"torchpatch patch {patch.id} failed while applying to {where}: {exc}") from exc

    def _mark(self, patch: Patch, status: str) -> None:
        """Record progress: a patch once applied (or failed) stays so."""
        if self.status.get(patch.id) not in (APPLIED, FAILED):
            self.status[patch.id] = status
            if status == APPLIED:
                log.debug("applied %s", patch.id)

    def _live(self, patch: Patch) -> bool:
        return self.status.get(patch.id) != FAILED

    def arm(self, patch: Patch) -> None:
        self.status[patch.id] = WAITING
        for name, build in patch.modules.items():
            self.shims.shims[name] = self._shim_builder(patch, name, build)
        for name, target, torch in patch.aliases:
            if name not in self.shims.aliases and _versions.matches(torch, _versions.torch_version()):
                self.shims.aliases[name] = self._alias_resolver(patch, name, target)
        by_module: Dict[str, Dict[str, Callable[[], Any]]] = {}
        for (module, name), factory in patch.symbols.items():
            by_module.setdefault(module, {})[name] = self._symbol_factory(patch, module, name, factory)
        for module, names in by_module.items():
            self.watcher.after(module, self._symbol_hook(patch, names))
        for module, hook in patch.import_time_hooks:
            self.watcher.before(module, self._import_time_hook(patch, module, hook))
        for module, hook in patch.import_hooks:
            self.watcher.after(module, self._import_hook(patch, module, hook))

    def _shim_builder(self, patch: Patch, name: str, build: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        def run(module: ModuleType) -> None:
            if not self._live(patch):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            try:
                module.__torchpatch__ = patch.id  # type: ignore[attr-defined]
                build(module)
            except Exception as exc:
                self._fail(patch, f"module {name}", exc)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name) from exc
            self.shim_modules.append(name)
            self._mark(patch, APPLIED)

        return run

    def _alias_resolver(self, patch: Patch, name: str, target: str) -> Callable[[], ModuleType]:
        def resolve() -> ModuleType:
            if self._live(patch):
                try:
                    module = importlib.import_module(target)
                except ModuleNotFoundError as exc:
                    if exc.name is None or not (target == exc.name or target.startswith(exc.name + ".")):
                        self._fail(patch, f"module {name} (= {target})", exc)
                    # else: the other name is missing too on this torch, so there is nothing to serve
                except Exception as exc:
                    self._fail(patch, f"module {name} (= {target})", exc)
                else:
                    self.shim_modules.append(name)
                    self._mark(patch, APPLIED)
                    return module
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return resolve

    def _symbol_factory(self, patch: Patch, module: str, name: str, factory: Callable[[], Any]) -> Callable[[], Any]:
        def make() -> Any:
            if self._live(patch):
                try:
                    return factory()
                except Exception as exc:
                    self._fail(patch, f"{module}.{name}", exc)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return make

    def _symbol_hook(self, patch: Patch, names: Dict[str, Callable[[], Any]]) -> Callable[[ModuleType], None]:
        def hook(module: ModuleType) -> None:
            if not self._live(patch):
                return
            try:
                served = self.symbols.serve(module, names)
            except Exception as exc:
                self._fail(patch, module.__name__, exc)
                return
            self._mark(patch, APPLIED if served else NOT_NEEDED)

        return hook

    def _run_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]], module: ModuleType) -> Optional[Patcher]:
        """Run one hook fail-safe; its Patcher (status recorded) or None if skipped or failed."""
        if not self._live(patch):
            return None
        patcher = Patcher()
        try:
            result = hook(patcher, module)
        except Exception as exc:
            patcher.undo()
            self._fail(patch, where, exc)
            return None
        self._mark(patch, NOT_NEEDED if result is False else APPLIED)
        return patcher

    def _import_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], None]:
        def run(module: ModuleType) -> None:
            patcher = self._run_hook(patch, where, hook, module)
            if patcher is not None:
                self.patchers.append((patch.id, patcher))

        return run

    def _import_time_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], Callable[[], None]]:
        def run(module: ModuleType) -> Callable[[], None]:
            patcher = self._run_hook(patch, where, hook, module)
            return patcher.undo if patcher is not None else (lambda: None)

        return run

    # -- whole installation ----------------------------------------------------------------
    def start(self) -> None:
        sys.meta_path.insert(0, self.watcher)
        sys.meta_path.append(self.shims)
        for p in self.plans:
            if p.active:
                self.arm(p.patch)

    def stop(self) -> None:
        for finder in (self.watcher, self.shims):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        while self.patchers:
            self.patchers.pop()[1].undo()
        self.symbols.withdraw_all()
        for name in self.shim_modules + list(self.shims.alias_packages):
            sys.modules.pop(name, None)

    def summary(self) -> str:
        applied = sorted(i for i, s in self.status.items() if s == APPLIED)
        failed = sorted(i for i, s in self.status.items() if s == FAILED)
        line = (
            f"{__version__} on torch {_versions.torch_version() or '(none)'}, "
            f"Python {_versions.python_version()}: applied {', '.join(applied) or 'none'}"
        )
        if failed:
            line += f"; failed and skipped {', '.join(failed)}"
        return line


_lock = threading.RLock()
_current: Optional[_Installation] = None


def _log_summary() -> None:
    """At exit, one line: versions and what was applied; rank 0 only, and only where torch was used."""
    inst = _current
    if inst is not None and "torch" in sys.modules and os.environ.get("RANK", "0") == "0":
        log.info("%s", inst.summary())


def install(environ: Optional[Mapping[str, str]] = None) -> None:
    """Apply the catalogue to this process, whatever ``TORCHPATCH`` says; opt-outs still apply.

    Idempotent: the start-up hook, a sitecustomize and explicit calls together install once.
    Nothing is imported from torch here: each patch applies when its torch module is imported
    (or at once, if that module already is).
    """
    global _current
    with _lock:
        if _current is not None:
            return
        cfg = Config.from_environ(os.environ if environ is None else environ)
        _configure_logging(cfg.log_level)
        plans = plan(cfg=cfg, only_applicable=True)
        for warning in cfg.warnings:
            log.warning("%s", warning)
        inst = _Installation(cfg, plans)
        _current = inst
        try:
            inst.start()
        except Exception:
            _current = None
            inst.stop()
            raise
        atexit.register(_log_summary)


def uninstall() -> None:
    """Take back everything :func:`install` did: finders, wrappers, served symbols and shims."""
    global _current
    with _lock:
        inst, _current = _current, None
        if inst is not None:
            atexit.unregister(_log_summary)
            inst.stop()


def is_installed() -> bool:
    return _current is not None


def status() -> Dict[str, str]:
    """Patch id -> applied / not needed / failed / waiting for its module, for armed patches."""
    return dict(_current.status) if _current is not None else {}


def _activate_at_startup() -> None:
    """Called by the start-up hook when ``TORCHPATCH`` is on: never breaks the process unless
    ``TORCHPATCH_STRICT=1``."""
    try:
        install()
    except Exception as exc:
        if Config.from_environ().strict:
            raise
        sys.stderr.write(f"torchpatch: activation failed, continuing without torchpatch: {exc}\n")
