"""torch-six: ``torch._six`` served on torch >= 2.0; torch 1.13's own module untouched."""

from conftest import clean_env, run_json, run_py, where_patch_applies, where_patch_does_not_apply

USE = """
import json, math, collections.abc, torch
from torch._six import inf, nan, string_classes, int_classes, container_abcs, with_metaclass
class Meta(type):
    pass
class Base(with_metaclass(Meta, object)):
    pass
print(json.dumps({
    "inf": inf == math.inf, "nan": math.isnan(nan),
    "strings": isinstance("a", string_classes) and isinstance(b"a", string_classes),
    "ints": int_classes is int, "abcs": container_abcs.Mapping is collections.abc.Mapping,
    "metaclass": type(Base) is Meta and Base.__mro__[1:] == (object,),
    "served_by": getattr(torch._six, "__torchpatch__", None),
}))
"""


@where_patch_applies("torch-six", "torch 2.0 removed torch._six")
def test_native_failure():
    proc = run_py("import torch._six")
    assert "ModuleNotFoundError: No module named 'torch._six'" in proc.stderr


@where_patch_applies("torch-six")
def test_served():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out == {"inf": True, "nan": True, "strings": True, "ints": True, "abcs": True,
                   "metaclass": True, "served_by": "torch-six"}


@where_patch_does_not_apply("torch-six", "where torch has torch._six, it stays torch's")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torch._six, torchpatch
        print(json.dumps({"file": torch._six.__file__, "status": torchpatch.status().get("torch-six"),
                          "served_by": getattr(torch._six, "__torchpatch__", None)}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["file"].endswith("torch/_six.py") and out["served_by"] is None and out["status"] is None


@where_patch_does_not_apply("torch-six", "the reference: torch 1.13's own torch._six")
def test_shim_matches_the_native_module():
    out = run_json(
        """
        import json, types, torch._six as native
        from torchpatch.patches.core import torch_six
        shim = types.ModuleType("shim")
        torch_six.build(shim)
        class M(type):
            pass
        same = {n: getattr(shim, n) == getattr(native, n) for n in ("inf", "string_classes")}
        same["nan"] = str(shim.nan) == str(native.nan)
        made = [type("C", (impl.with_metaclass(M, object),), {}) for impl in (shim, native)]
        same["with_metaclass"] = [(type(c), c.__mro__[1:]) for c in made] == [(M, (object,))] * 2
        print(json.dumps(same))
        """
    )
    assert out == {"inf": True, "string_classes": True, "nan": True, "with_metaclass": True}
