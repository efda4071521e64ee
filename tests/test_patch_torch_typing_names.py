"""torch-typing-names: ``torch.Any`` & co. set to typing's objects where torch lacks them; torch's
own names, and the speed of every other ``torch.X`` lookup, untouched."""

from conftest import clean_env, run_json, torch_matches

NAMES = ["Any", "Callable", "Dict", "List", "Optional", "Set", "Tuple", "Union"]

# Which of the names each torch has in its own namespace (checked on 1.13.1, 2.1.2, 2.4.1, 2.9.0, 2.13.0).
if torch_matches("<2.0"):
    NATIVE = ["Any", "Callable", "Set", "Union"]
elif torch_matches("<2.5"):
    NATIVE = NAMES
else:
    NATIVE = []

PROBE = """
import json, typing, torch
names = %r
missing = {}
for n in names:
    try:
        missing[n] = getattr(torch, n) is not getattr(typing, n)
    except AttributeError as exc:
        missing[n] = str(exc)
print(json.dumps(missing))
""" % (NAMES,)

USE = """
import json, sys, typing, timeit, torch, torchpatch
names = %r
own_getattr = vars(torch).get("__getattr__")

def scatter(x: torch.Optional[torch.List[int]], *, f: torch.Callable[..., torch.Any] = print) -> torch.Dict[str, torch.Tuple[int, ...]]:
    return {}

hints = typing.get_type_hints(scatter)
out = {
    "same": {n: getattr(torch, n) is getattr(typing, n) for n in names},
    "hints": hints == {"x": typing.Optional[typing.List[int]], "f": typing.Callable[..., typing.Any],
                       "return": typing.Dict[str, typing.Tuple[int, ...]]},
    "status": torchpatch.status()["torch-typing-names"],
    "type_is_torchscript": torch.Type is torch._C.Type,
}
# Other attributes: the same objects, and no module __getattr__ added by the patch (one would stop
# CPython specialising every torch.X lookup). The timing itself is for the report, not asserted.
ns = {"torch": torch}
out["lookups"] = [timeit.timeit(e, globals=ns, number=100_000) >= 0 for e in ("torch.nn", "torch.float32")]
out["objects"] = torch.nn is sys.modules["torch.nn"] and torch.float32 is vars(torch)["float32"]
out["getattr_unchanged"] = vars(torch).get("__getattr__") is own_getattr
set_by_patch = [n for n in names if n in vars(torch)]
torchpatch.uninstall()
out["after_uninstall"] = sorted(n for n in names if n in vars(torch))
out["getattr_after_uninstall"] = vars(torch).get("__getattr__") is own_getattr
print(json.dumps(out))
""" % (NAMES,)


def test_native_names():
    """The failure (or, on torch <= 2.4, the leaked names) without torchpatch."""
    out = run_json(PROBE)
    assert sorted(n for n, v in out.items() if v is False) == sorted(NATIVE)
    for name in set(NAMES) - set(NATIVE):
        assert out[name] == f"module 'torch' has no attribute '{name}'"


def test_served_as_typing_objects():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["same"] == {n: True for n in NAMES}
    assert out["hints"] is True
    assert out["status"] == ("not needed" if NATIVE == NAMES else "applied")
    assert out["type_is_torchscript"] is True  # torch.Type is TorchScript's, never typing.Type
    assert out["lookups"] == [True, True] and out["objects"] is True
    assert out["getattr_unchanged"] is True and out["getattr_after_uninstall"] is True
    assert out["after_uninstall"] == sorted(NATIVE)  # only torch's own names remain


def test_opt_out_restores_the_failure():
    env = clean_env(TORCHPATCH="1", TORCHPATCH_TORCH_TYPING_NAMES="0")
    out = run_json(PROBE, env=env)
    assert sorted(n for n, v in out.items() if v is False) == sorted(NATIVE)
