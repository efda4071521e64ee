"""processgroup-deepcopy: EMA by deepcopy of a model that keeps its ProcessGroup, on 2 real ranks."""

from conftest import RESULT, clean_env, rank_result, run_ranks

SCRIPT = """
import copy, json, pickle, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.group = group

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sp_group = dist.new_group(list(range(world)))  # Open-Sora keeps its SP group like this
        self.blocks = nn.ModuleList([Block(self.sp_group), Block(dist.group.WORLD)])
        self.groups = {"sp": self.sp_group, "all": [dist.group.WORLD, (self.sp_group, 1)]}
    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b.lin(x))
        return x

model = Model()
try:
    ema = copy.deepcopy(model)
except TypeError as exc:
    if rank == 0:
        print(RESULT + json.dumps({"error": str(exc)}))
    raise SystemExit(0)

shared = [ema.sp_group is model.sp_group, ema.blocks[0].group is model.sp_group,
          ema.blocks[1].group is dist.group.WORLD, ema.groups["sp"] is model.sp_group,
          ema.groups["all"][0] is dist.group.WORLD, ema.groups["all"][1][0] is model.sp_group]
p_model, p_ema = list(model.parameters()), list(ema.parameters())
equal = all(torch.equal(a, b) for a, b in zip(p_model, p_ema))
separate = all(a.data_ptr() != b.data_ptr() for a, b in zip(p_model, p_ema))

# One training step moves the model, not the EMA; grads averaged over the copied group.
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
for p in model.parameters():
    dist.all_reduce(p.grad, group=ema.sp_group)
opt.step()
moved = any(not torch.equal(a, b) for a, b in zip(model.parameters(), ema.parameters()))
ema_intact = all(torch.equal(a, b) for a, b in zip(ema.parameters(), p_ema))

t = torch.full((3,), float(rank + 1))
dist.all_reduce(t, group=ema.blocks[0].group)
shallow = copy.copy(model)
try:
    pickle.dumps(model.sp_group)
    pickles = True
except Exception:
    pickles = False
if rank == 0:
    print(RESULT + json.dumps({
        "shared": shared, "equal": equal, "separate": separate, "moved": moved,
        "ema_intact": ema_intact, "all_reduce": t.tolist(), "expect": float(world * (world + 1) / 2),
        "copy_shares": shallow.sp_group is model.sp_group and copy.copy(model.sp_group) is model.sp_group,
        "pickles": pickles,
    }))
dist.destroy_process_group()
""".replace("RESULT", repr(RESULT))


def test_native_deepcopy_fails(tmp_path):
    out = rank_result(run_ranks(SCRIPT, env=clean_env(), tmp_path=tmp_path))
    assert "cannot pickle" in out["error"] and "ProcessGroup" in out["error"]


def test_deepcopy_shares_groups_and_copies_the_rest(tmp_path):
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = rank_result(proc)
    assert out["shared"] == [True] * 6
    assert out["equal"] and out["separate"]
    assert out["moved"] and out["ema_intact"]
    assert out["all_reduce"] == [out["expect"]] * 3
    assert out["copy_shares"]
    assert out["pickles"] is False  # a group still cannot be pickled: save a state_dict


def test_opt_out_restores_the_native_failure(tmp_path):
    env = clean_env(TORCHPATCH="1", TORCHPATCH_PROCESSGROUP_DEEPCOPY="0")
    assert "cannot pickle" in rank_result(run_ranks(SCRIPT, env=env, tmp_path=tmp_path))["error"]
