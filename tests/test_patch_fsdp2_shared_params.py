"""fsdp2-shared-params: tied weights in separate FSDP2 groups.

On 2 real ranks (gloo), a small LM whose output projection shares the embedding's weight (5 rows: uneven
over 2 ranks) trains 3 SGD steps under FSDP2 and is compared with the same model trained on one process
on both ranks' data in the same run. With the embedding and the output layer in separate
``fully_shard`` groups, torch 2.4 and 2.9 natively (and with the patch switched off) train without an
error to weights far from the reference (the tie is broken); with TORCHPATCH=1 the first forward raises
torch 2.13's ``ValueError`` ("... is shared with a parameter already managed by another FSDP group"). The
supported layouts (both modules in the root's group; ``fully_shard([emb, out])`` where FSDP2 takes a
list) train to the reference with or without the patch. Torch 2.13+ raises natively; the patch is not
applied there.
"""

import pytest

from conftest import (
    clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range,
    torch_matches, where_patch_applies
)

RANKS = """
import copy, datetime, json, torch, torch.nn as nn, torch.distributed as dist
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
torch.manual_seed(0)

class LM(nn.Module):
    def __init__(self, vocab=5, dim=4):
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.emb(ids))))

model = LM().double()
ids, targets = torch.randint(0, 5, (W, 3, 6)), torch.randint(0, 5, (W, 3, 6))

def loss(m, r):
    return nn.functional.cross_entropy(m(ids[r]).flatten(0, 1), targets[r].flatten())

ref = copy.deepcopy(model)  # the reference: one process, every rank's batch, the mean of the losses
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
for _ in range(3):
    ref_opt.zero_grad()
    sum(loss(ref, r) for r in range(W)).div(W).backward()
    ref_opt.step()

def separate(m):
    for sub in (m.emb, m.mid, m.out):
        fully_shard(sub, mesh=mesh)

def root_group(m):  # emb and out stay in the root's group
    fully_shard(m.mid, mesh=mesh)

def listed(m):  # one group over both tied modules (FSDP2 takes a list from torch 2.6)
    fully_shard([m.emb, m.out], mesh=mesh)
    fully_shard(m.mid, mesh=mesh)

layouts = {"separate": separate, "root_group": root_group}
if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6):
    layouts["listed"] = listed
out = {}
for name, wrap in layouts.items():
    m = copy.deepcopy(model)
    wrap(m)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    try:
        for _ in range(3):
            opt.zero_grad()
            loss(m, rank).backward()
            opt.step()
    except ValueError as exc:
        out[name] = "shared-param error" if "is shared with a parameter already managed by another FSDP group" in str(exc) else str(exc)
        continue
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    # float64; the sharded run averages gradients across ranks, the reference sums the ranks' losses / W:
    # the same numbers up to the order of a few float64 additions (<< 1e-12), against ~1e-1 when the tie breaks
    diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
    out[name] = "reference" if diff < 1e-12 else f"diverged by {diff:.3g}"
""" + gathered_tail("fsdp2-shared-params")


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


def supported(out: dict) -> dict:
    """The supported layouts' results (both tied modules in one FSDP group)."""
    layouts = {k: v for k, v in out.items() if k != "separate"}
    assert set(layouts) == ({"root_group", "listed"} if torch_matches(">=2.6") else {"root_group"}), out
    return layouts


@where_patch_applies("fsdp2-shared-params", "FSDP2 does not compare parameters across groups")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_SHARED_PARAMS": "0"}], ids=["unset", "opted-out"])
def test_native_breaks_the_tie_silently(tmp_path, env):
    if not env and torch_matches("<2.5"):
        pytest.skip("torch 2.4's FSDP2 runs on CPU only with torchpatch (fsdp2-cpu)")
    for out in run(tmp_path, **env):
        assert out.pop("status") is None
        assert out.pop("separate").startswith("diverged by "), out
        assert set(supported(out).values()) == {"reference"}, out


@through_patch_range("fsdp2-shared-params", "FSDP2 on CPU")
def test_shared_param_across_groups_raises(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("fsdp2-shared-params") else None)
        assert out.pop("separate") == "shared-param error", out
        assert set(supported(out).values()) == {"reference"}, out
