"""torch-six: the ``torch._six`` module that torch 2.0 removed, torch 2.0 and later.

What breaks:   ``from torch._six import inf, string_classes`` in older apex, DeepSpeed and Megatron
               code dies with ``ModuleNotFoundError: No module named 'torch._six'``.
Torch:         2.0 and later (1.x has the module; there the native one is used).
Fix:           serve a ``torch._six`` module with the names old code imports from it.
Upstream:      https://github.com/pytorch/pytorch/pull/94709 (removal of torch._six)
"""

import collections.abc
import math
from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="torch-six",
    summary="torch._six (inf, nan, string_classes, int_classes, container_abcs, with_metaclass) for pre-2.0 code",
    torch=">=2.0",
    upstream="https://github.com/pytorch/pytorch/pull/94709",
)


def with_metaclass(meta: type, *bases: type) -> type:
    """Create a base class with a metaclass (the six idiom torch._six carried)."""

    class metaclass(meta):  # type: ignore[misc, valid-type]
        def __new__(cls, name, this_bases, d):  # noqa: ANN001
            return meta(name, bases, d)

        @classmethod
        def __prepare__(cls, name, this_bases):  # noqa: ANN001
            return meta.__prepare__(name, bases)

    return type.__new__(metaclass, "temporary_class", (), {})


PATCH.sets("torch._six", ("inf", "nan", "string_classes", "int_classes", "container_abcs", "with_metaclass"))


@PATCH.module("torch._six")
def build(module: ModuleType) -> None:
    module.inf = math.inf
    module.nan = math.nan
    module.string_classes = (str, bytes)
    module.int_classes = int
    module.container_abcs = collections.abc
    module.with_metaclass = with_metaclass
