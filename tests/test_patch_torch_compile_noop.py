"""torch-compile-noop: ``torch.compile`` on torch 1.13 returns the module or function itself (one
warning per process), so training runs eagerly with the results of the uncompiled model."""

from conftest import clean_env, run_json, run_py, where_patch_applies, where_patch_does_not_apply

USE = """
import json, warnings, torch, torchpatch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
reference.load_state_dict(model.state_dict())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = torch.compile(model)

    @torch.compile
    def loss_fn(out, y):
        return torch.nn.functional.mse_loss(out, y)

    @torch.compile(mode="max-autotune", dynamic=True)
    def scale(x):
        return 2 * x
losses = []
for net in (compiled, reference):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        loss = loss_fn(net(x), y) if net is compiled else torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses.append(loss.item())
try:
    torch.compile(model, mode="default", options={"max_autotune": True})
except RuntimeError as exc:
    both = str(exc)
print(json.dumps({
    "same_object": compiled is model, "keys": sorted(compiled.state_dict())[:1], "losses_equal": losses[0] == losses[1],
    "weights_equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())),
    "scale": scale(torch.ones(2)).tolist(), "warnings": [str(w.message) for w in caught],
    "both": both, "status": torchpatch.status().get("torch-compile-noop"),
}))
"""


@where_patch_applies("torch-compile-noop", "torch 2.0 brought torch.compile")
def test_native_failure():
    proc = run_py("import torch; torch.compile(torch.nn.Linear(2, 2))")
    assert "AttributeError: module 'torch' has no attribute 'compile'" in proc.stderr


@where_patch_applies("torch-compile-noop")
def test_served_returns_the_model():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["same_object"] and out["keys"] == ["0.bias"]  # not wrapped: no _orig_mod. prefix
    assert out["losses_equal"] and out["weights_equal"] and out["scale"] == [2.0, 2.0]
    assert len(out["warnings"]) == 1 and out["warnings"][0].startswith("torch.compile needs torch >= 2.0 (TorchDynamo)")
    assert out["both"] == "Either mode or options can be specified, but both can't be specified at the same time."
    assert out["status"] == "applied"


@where_patch_applies("torch-compile-noop")
def test_disable_is_silent():
    out = run_json(
        """
        import json, warnings, torch
        m = torch.nn.Linear(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same = torch.compile(m, disable=True) is m
        print(json.dumps({"same": same, "warnings": len(caught)}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"same": True, "warnings": 0}


@where_patch_does_not_apply("torch-compile-noop", "torch's own torch.compile is left alone")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torchpatch
        print(json.dumps({"module": torch.compile.__module__, "status": torchpatch.status().get("torch-compile-noop")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"module": "torch", "status": None}
