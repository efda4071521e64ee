"""``importlib.reload`` of a module that a patch changed: the patch's changes are undone before the
module's body runs again (it then defines everything anew) and done again once it has run."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Dict, List, Set

from ._hooks import ImportWatcher
from ._patch import Patch


@dataclass(eq=False)
class HookRun:
    """One application of a patch to a module (a hook's run, or symbols served), which a
    re-execution (``importlib.reload``) of any module it changed must undo and do again."""

    patch: Patch
    module_name: str  # the module the hook is registered on
    module: ModuleType  # the object the hook received
    apply: Callable[[ModuleType], None]
    undo: Callable[[], None]
    touched: Set[str]  # names of the modules whose objects it changed


class ReloadTracker:
    """The hook runs of one installation, and the modules they changed, watched for re-execution."""

    def __init__(self, watcher: ImportWatcher, live: Callable[[Patch], bool]) -> None:
        self._watcher = watcher
        self._live = live  # whether a patch still stands (has not failed)
        self._runs: List[HookRun] = []
        self._reloading: Dict[str, List[HookRun]] = {}  # module name -> runs to do again after its body
        self._watched: Set[str] = set()

    def ran(self, run: HookRun) -> None:
        """Note ``run``, and watch each module it changed for re-execution."""
        self._runs.append(run)
        for name in run.touched - self._watched:
            self._watched.add(name)
            self._watcher.before(name, self._before_reexec)
            self._watcher.after(name, self._after_reexec)

    def forget(self, patch_id: str) -> None:
        """Drop the runs of a patch that was taken back."""
        self._runs = [r for r in self._runs if r.patch.id != patch_id]

    def clear(self) -> None:
        self._runs.clear()

    def _before_reexec(self, module: ModuleType) -> Callable[[], None]:
        """A module that a patch changed is executed again: undo those changes first (its body
        then defines everything anew), and do them again once the body has run."""
        name = module.__name__
        again = [r for r in self._runs if name in r.touched and self._live(r.patch)]
        for run in reversed(again):
            run.undo()
        self._runs = [r for r in self._runs if r not in again]
        # Hooks registered on this very module run again by themselves, after its body.
        self._reloading[name] = [r for r in again if r.module_name != name]
        return lambda: None

    def _after_reexec(self, module: ModuleType) -> None:
        for run in self._reloading.pop(module.__name__, ()):
            run.apply(run.module)
