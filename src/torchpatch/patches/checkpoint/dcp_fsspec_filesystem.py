"""dcp-fsspec-filesystem: ``torch.distributed.checkpoint.fsspec_filesystem`` (``FsspecReader``,
``FsspecWriter``), also exported from ``torch.distributed.checkpoint``, on torch 2.4-2.14.

What breaks:   checkpointing to object stores written for torch 2.15
               (``from torch.distributed.checkpoint import FsspecWriter`` or
               ``from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader``) dies with
               ``ImportError: cannot import name 'FsspecWriter' from 'torch.distributed.checkpoint'``
               / ``ModuleNotFoundError: No module named
               'torch.distributed.checkpoint.fsspec_filesystem'``.
Torch:         2.15 made the private ``_fsspec_filesystem`` public. The older module is not the
               same API, so it is not aliased: none of 2.4-2.14's ``FsspecWriter`` takes
               ``cache_staged_state_dict`` (the sixth positional argument on 2.15, where theirs is
               ``overwrite``); 2.4-2.6 take no fsspec storage options (``**kwargs``) and open files
               through ``fsspec.open`` inside a transaction; the module imports ``fsspec`` at load.
Fix:           serve the module with 2.15's classes, written here on the installed
               ``FileSystemWriter``/``FileSystemReader``: 2.15's signatures (``**kwargs`` go to
               ``fsspec.core.url_to_fs``), files opened with the file system's ``open`` and a
               partly written file removed on an error, ``validate_checkpoint_id`` false without
               fsspec; fsspec itself is needed when a reader or writer is made, as on 2.15.
               ``_extensions`` (torch >= 2.7) and ``serialization_format`` (>= 2.8) are passed on
               where the installed writer takes them; elsewhere anything but their default raises
               ``TypeError`` naming the torch that has it.
Upstream:      https://github.com/pytorch/pytorch/pull/188698 (``fsspec_filesystem`` public; issue
               https://github.com/pytorch/pytorch/issues/188772)
"""

from __future__ import annotations

import inspect
import io
import os
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from torchpatch import Patch

PATCH = Patch(
    id="dcp-fsspec-filesystem",
    summary="torch.distributed.checkpoint.fsspec_filesystem (FsspecReader, FsspecWriter) with torch 2.15's signatures",
    torch=">=2.4,<2.15",
    upstream="https://github.com/pytorch/pytorch/pull/188698",
)

MODULE = "torch.distributed.checkpoint.fsspec_filesystem"
NAMES = ("FsspecReader", "FsspecWriter")
PATH = Union[str, "os.PathLike[str]"]
# FileSystemWriter arguments older torches lack, with the torch that brought each
_SINCE = {"_extensions": "2.7", "serialization_format": "2.8"}


def _file_system_base() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class _FileSystem(FileSystemBase):
        """A checkpoint file system on any fsspec URL (``init_path`` picks the implementation)."""

        def __init__(self) -> None:
            self.fs: Any = None

        @contextmanager
        def create_stream(self, path: PATH, mode: str) -> Iterator[io.IOBase]:
            if self.fs is None:
                raise AssertionError("fs should not be None")
            path = os.fspath(path)
            with self.fs.open(path, mode) as stream:
                try:
                    yield stream
                except BaseException:
                    if any(ch in mode for ch in "w+a"):
                        try:
                            self.rm_file(path)
                        except Exception:
                            pass
                    raise

        def concat_path(self, path: PATH, suffix: str) -> PATH:
            return os.path.join(path, suffix)

        def init_path(self, path: PATH, **kwargs: Any) -> PATH:
            from fsspec.core import url_to_fs

            self.fs, _ = url_to_fs(path, **kwargs)
            return path

        def rename(self, path: PATH, new_path: PATH) -> None:
            self.fs.rename(path, new_path)

        def mkdir(self, path: PATH) -> None:
            self.fs.makedirs(path, exist_ok=True)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: PATH) -> bool:
            if isinstance(checkpoint_id, Path):
                return False
            try:
                from fsspec.core import url_to_fs
            except ImportError:
                return False
            try:
                url_to_fs(checkpoint_id)
            except ValueError:
                return False
            return True

        def exists(self, path: PATH) -> bool:
            return self.fs.exists(path)

        def rm_file(self, path: PATH) -> None:
            self.fs.rm(path)

        def ls(self, path: PATH) -> List[str]:
            return self.fs.ls(path, detail=False)

    return _FileSystem


def _newer_writer_kwargs(base: type, given: Dict[str, Any]) -> Dict[str, Any]:
    """The newer ``FileSystemWriter`` arguments in ``given`` that are set, for the installed
    ``base``; one it lacks must hold its default (``serialization_format=TORCH_SAVE`` is one)."""
    accepted = inspect.signature(base.__init__).parameters
    out = {}
    for name, value in given.items():
        if not value:
            continue
        if name in accepted:
            out[name] = value
        elif getattr(value, "value", None) != "torch_save":
            raise TypeError(f"FsspecWriter({name}=...) needs torch >= {_SINCE[name]}: this torch's "
                            f"FileSystemWriter has no {name}")
    return out


def _classes() -> tuple:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    file_system = _file_system_base()

    class FsspecWriter(FileSystemWriter):
        """A ``FileSystemWriter`` on any fsspec URL; ``**kwargs`` are fsspec storage options."""

        def __init__(self, path: PATH, single_file_per_rank: bool = True, sync_files: bool = True,
                     thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                     cache_staged_state_dict: bool = False, overwrite: bool = True,
                     _extensions: Optional[Sequence[Any]] = None, serialization_format: Any = None,
                     **kwargs: Any) -> None:
            newer = _newer_writer_kwargs(FileSystemWriter, {"_extensions": _extensions,
                                                            "serialization_format": serialization_format})
            super().__init__(path=path, single_file_per_rank=single_file_per_rank, sync_files=sync_files,
                             thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                             cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite, **newer)
            self.fs = file_system()
            self.path = self.fs.init_path(path, **kwargs)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: PATH) -> bool:
            return file_system.validate_checkpoint_id(checkpoint_id)

    class FsspecReader(FileSystemReader):
        """A ``FileSystemReader`` on any fsspec URL; ``**kwargs`` are fsspec storage options."""

        def __init__(self, path: PATH, **kwargs: Any) -> None:
            super().__init__(path)
            self.fs = file_system()
            self.path = self.fs.init_path(path, **kwargs)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: PATH) -> bool:
            return file_system.validate_checkpoint_id(checkpoint_id)

    for cls in (FsspecWriter, FsspecReader):
        cls.__module__ = MODULE
    return FsspecReader, FsspecWriter


PATCH.sets(MODULE, NAMES)


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    module.FsspecReader, module.FsspecWriter = _classes()
    module.__all__ = list(NAMES)


def _from_module(name: str) -> Any:
    def factory() -> Any:
        import importlib

        return getattr(importlib.import_module(MODULE), name)

    return factory


for _name in NAMES:
    PATCH.symbol("torch.distributed.checkpoint", _name)(_from_module(_name))
