"""The torchpatch catalogue: one module per patch, each defining ``PATCH``.

A patch module reads top to bottom as: what breaks (the error users see), on which torch versions,
the fix, the upstream change; then the code. Patch modules must not import torch at module level:
their hooks run when the torch module they target is imported. Copy ``torch_six.py`` to start one.
"""

# The newest torch the catalogue was tested on (the newest of the nox matrix). On a newer one
# ``torchpatch doctor`` warns: the patches whose version range is open-ended apply there untested.
NEWEST_TESTED_TORCH = "2.15.0"
