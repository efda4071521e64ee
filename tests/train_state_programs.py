"""The programs of the weights-only loading fixtures (tests/fixtures/train_states/<torch>/, written by
tools/train_state_fixtures.py, loaded by tests/test_patch_torch_load_weights_only_globals.py): a training
state with globals that torch.load(weights_only=True) refuses, saved by an older torch, and its values."""

CONFIG_MODULE = "tp_trainstate_cfg"  # tests/fixtures/train_states/tp_trainstate_cfg.py: the state's dataclass

# Every value of a state as JSON (tensors and arrays as lists, tuples as lists, objects as their fields).
PLAIN = """
import dataclasses, json

def plain(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return {"dataclass": type(x).__name__, **plain(dataclasses.asdict(x))}
    if type(x).__name__ == "Namespace":
        return {"Namespace": plain(vars(x))}
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x
"""

# Model and optimizer state dicts, numpy, python and torch RNG states, an argparse.Namespace, a dataclass of
# a module of its own: torch.save'd to argv[1]; prints its values (PLAIN).
SAVE = PLAIN + """
import argparse, random, sys, numpy as np, torch
from tp_trainstate_cfg import TrainConfig

torch.manual_seed(0); random.seed(0); np.random.seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(3, 4)).sum().backward()
opt.step()
np.random.rand(3); random.random(); torch.rand(3)
state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
         "args": argparse.Namespace(lr=1e-3, epochs=10, data="/data"),
         "config": TrainConfig(lr=1e-3, batch_size=16, name="demo"),
         "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}
torch.save(state, sys.argv[1])
print(json.dumps(plain(state)))
"""
