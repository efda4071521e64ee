"""dcp-bytes-io-write-data: ``torch.distributed.checkpoint.planner.BytesIOWriteData`` and
``WriteItem(..., bytes_io_data=...)`` on torch 2.4-2.7.

What breaks:   a custom save planner or storage writer written for torch >= 2.8 that records the
               size of a non-tensor (``BYTE_IO``) write item (``from
               torch.distributed.checkpoint.planner import BytesIOWriteData``;
               ``WriteItem(index=..., type=WriteItemType.BYTE_IO,
               bytes_io_data=BytesIOWriteData(nbytes=n))``) dies with ``ImportError: cannot import
               name 'BytesIOWriteData'`` or ``TypeError: WriteItem.__init__() got an unexpected
               keyword argument 'bytes_io_data'``.
Torch:         2.8 added the dataclass and ``WriteItem``'s field ``bytes_io_data`` (between ``type``
               and ``tensor_data``); torch itself only carries it (read in 2.9.0's and 2.15.0's
               ``planner.py``: nothing in DCP reads it).
Fix:           serve ``BytesIOWriteData`` (a frozen dataclass with ``nbytes: int``), and let
               ``WriteItem`` take ``bytes_io_data`` (by keyword, or third of four positional
               arguments as on 2.8+, or third positional when it is a ``BytesIOWriteData``) and
               carry it as an attribute, ``None`` by default. It is not a dataclass field there:
               ``dataclasses.replace``, ``==`` and ``repr`` of a ``WriteItem`` leave it out.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.8.0/torch/distributed/checkpoint/planner.py
               (``BytesIOWriteData``, torch 2.8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-bytes-io-write-data",
    summary="torch.distributed.checkpoint.planner.BytesIOWriteData and WriteItem(bytes_io_data=...)",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/blob/v2.8.0/torch/distributed/checkpoint/planner.py",
)

MODULE = "torch.distributed.checkpoint.planner"


@dataclass(frozen=True)
class BytesIOWriteData:
    """The size of a ``BYTE_IO`` write item's data."""

    nbytes: int


BytesIOWriteData.__module__ = MODULE


def _take_bytes_io_data(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    bytes_io_data = kwargs.pop("bytes_io_data", None)
    if len(args) == 4 or (len(args) == 3 and isinstance(args[2], BytesIOWriteData)):
        bytes_io_data, args = args[2], args[:2] + args[3:]
    wrapped(*args, **kwargs)
    object.__setattr__(instance, "bytes_io_data", bytes_io_data)


PATCH.symbol(MODULE, "BytesIOWriteData")(lambda: BytesIOWriteData)
PATCH.sets(MODULE + ".WriteItem", ("bytes_io_data",))


@PATCH.on_import(MODULE)
def write_item_takes_bytes_io_data(patcher: Patcher, planner: Any) -> bool:
    if "bytes_io_data" in planner.WriteItem.__dataclass_fields__:
        return False
    patcher.setattr(planner.WriteItem, "bytes_io_data", None)
    patcher.wrap(planner.WriteItem, "__init__", _take_bytes_io_data)
    return True
