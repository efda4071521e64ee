"""What torch's factories return: the table that lets ``torchpatch check`` know the torch class of a
value the code makes, so that the members it uses on that value can be checked.

Each key names, by its qualified name in the module that defines it, a way to get a value:

- ``"f()"``: calling the function ``f``;
- ``"C.m()"``: calling the method (or classmethod) ``m`` of class ``C``;
- ``"C[]"``: indexing an instance of ``C`` (``mesh["dp"]``);
- ``"C.p"``: reading the attribute (property) ``p`` of an instance of ``C``.

The value is the name of the class of what it returns, looked up in the namespace of the module
that defines the function or class (where its return annotation would be), or else the one class
of the inventory with that name. Calling a class makes an instance of it; that needs no entry.
Entries for what a torch version lacks simply never match there.
"""

from __future__ import annotations

from typing import Dict, FrozenSet

RETURNS: Dict[str, str] = {
    # device meshes
    "init_device_mesh()": "DeviceMesh",
    "DeviceMesh[]": "DeviceMesh",
    "DeviceMesh._flatten()": "DeviceMesh",
    "DeviceMesh._unflatten()": "DeviceMesh",
    "DeviceMesh.from_group()": "DeviceMesh",
    "DeviceMesh.get_group()": "ProcessGroup",
    # DTensor
    "distribute_tensor()": "DTensor",
    "DTensor.from_local()": "DTensor",
    "DTensor.redistribute()": "DTensor",
    "DTensor.device_mesh": "DeviceMesh",
    # process groups
    "new_group()": "ProcessGroup",
    "_get_default_group()": "ProcessGroup",
}

# Functions whose calls make torch values: the scanner looks for their names where they are imported.
FUNCTIONS: FrozenSet[str] = frozenset(key[:-2] for key in RETURNS if key.endswith("()") and "." not in key)
