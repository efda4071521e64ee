"""``torchpatch check``, members and constructor calls: the members used on values whose torch class
the code makes evident, checked against the classes the inventories record (``classes``), and the
calls of torch classes against their ``__init__``. The fixture (tests/fixtures/check/members) is
checked against inventoried torches with the real command; the inference and the signature check
are also taken apart on small sources."""

import json
import textwrap

import pytest

from conftest import HERE, clean_env, torchpatch_command
from torchpatch import Patch
from torchpatch._check import check as run_check
from torchpatch._check import choose_target
from torchpatch._check.inventory import Inventory, InventoryView, all_inventories
from torchpatch._check.scan import scan_file
from torchpatch._check.signature import CallShape, Signature
from torchpatch._check.target import Target
from torchpatch._config import Config

FIXTURES = HERE / "fixtures" / "check"
MEMBERS = FIXTURES / "members"
MESH = "torch.distributed.device_mesh.DeviceMesh"
STAGE_INIT = "torch.distributed.pipelining.PipelineStage.__init__"
OFF = clean_env(TORCHPATCH_DISABLE="*")


def report(*args, env=None):
    proc = torchpatch_command("check", *args, "--no-import", "--json", env=env, cwd=FIXTURES)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def rows(data):
    return {r["name"]: r for r in data["rows"]}


def test_mesh_flatten_unflatten_and_pipeline_stage_input_args_are_served_on_2_4():
    data = report(MEMBERS, "--torch", "2.4.1")
    found = rows(data)
    flatten = found[f"{MESH}._flatten"]  # mesh["dp_shard", "cp"]._flatten("dp"): the slice of a mesh is a mesh
    assert flatten["kind"] == "patched" and flatten["locations"] == [{"file": "members/parallel.py", "line": 9}]
    assert flatten["patches"] == ["device-mesh-flatten"]  # declared with Patch.sets on the class's dotted name
    no_flatten = rows(report(MEMBERS, "--torch", "2.4.1", env=clean_env(TORCHPATCH_DEVICE_MESH_FLATTEN="0")))
    assert no_flatten[f"{MESH}._flatten"]["kind"] == "unresolved"
    assert "2.4.1" not in no_flatten[f"{MESH}._flatten"]["exists_in"] and "2.13.0" in no_flatten[f"{MESH}._flatten"]["exists_in"]
    stage = found[STAGE_INIT]  # input_args is required on 2.4 (the call that passes it is fine), optional with a patch
    assert (stage["kind"], stage["patches"]) == ("patched", ["pipeline-stage-inference"])  # declared with Patch.takes
    assert stage["locations"] == [{"file": "members/parallel.py", "line": 25}]
    stage = rows(report(MEMBERS, "--torch", "2.4.1", env=clean_env(TORCHPATCH_PIPELINE_STAGE_INFERENCE="0")))[STAGE_INIT]
    assert stage["kind"] == "unresolved" and stage["locations"] == [{"file": "members/parallel.py", "line": 25}]
    assert stage["note"].startswith("missing required argument 'input_args': torch 2.4.1's __init__ is (self, submodule,")
    assert "2.4.1" not in stage["exists_in"] and "2.13.0" in stage["exists_in"]
    guard = ['if hasattr(mesh, "_unflatten") (members/parallel.py:19)']
    unflatten = found[f"{MESH}._unflatten"]  # behind hasattr(mesh, "_unflatten"), served on 2.4 (torchtitan 0.2.2/0.3.0)
    assert (unflatten["kind"], unflatten["patches"], unflatten["guards"]) == ("patched", ["device-mesh-unflatten"], guard)
    off = rows(report(MEMBERS, "--torch", "2.4.1", env=clean_env(TORCHPATCH_DEVICE_MESH_UNFLATTEN="0")))
    assert (off[f"{MESH}._unflatten"]["kind"], off[f"{MESH}._unflatten"]["guards"]) == ("guarded", guard)
    # what 2.4 has: methods (get_local_rank came with 2.2), and what __init__ keeps on the instance
    for member in ("get_local_rank", "get_group", "size", "device_type", "mesh_dim_names"):
        assert found[f"{MESH}.{member}"]["kind"] == "native", member
    assert found["torch.distributed.pipelining.stage.PipelineStage.is_first"]["kind"] == "native"
    assert not [n for n in found if n.endswith(".submod")]  # an instance attribute no inventory records: no row
    assert data["counts"]["unresolved"] == 0 and data["exit"] == 0


def test_the_same_code_is_clean_on_2_13():
    data = report(MEMBERS, "--torch", "2.13.0")
    assert data["exit"] == 0 and data["counts"]["unresolved"] == data["counts"]["guarded"] == 0
    found = rows(data)
    assert found[f"{MESH}._flatten"]["kind"] == found[f"{MESH}._unflatten"]["kind"] == "native"
    assert STAGE_INIT not in found


def test_on_2_1_the_served_device_mesh_module_is_followed_to_torchs_own_class():
    """torch 2.1's DeviceMesh lives in torch.distributed._tensor.device_mesh; dtensor-public serves
    torch.distributed.device_mesh as that module, so the members are checked on 2.1's class."""
    found = rows(report(MEMBERS, "--torch", "2.1.2"))
    old = "torch.distributed._tensor.device_mesh.DeviceMesh"
    for member in ("_flatten", "get_local_rank", "get_group"):
        assert found[f"{old}.{member}"]["kind"] == "unresolved", member
    have = found[f"{old}.get_local_rank"]["exists_in"]
    assert "2.1.2" not in have and "2.4.1" in have
    assert found[f"{old}.size"]["kind"] == "native"
    off = rows(report(MEMBERS, "--torch", "2.1.2", env=OFF))  # no module, no class: members are not checked
    assert not [n for n in off if "DeviceMesh." in n]


def scan(tmp_path, source, classes=("DeviceMesh", "DTensor", "ProcessGroup", "PipelineStage")):
    path = tmp_path / "code.py"
    path.write_text(textwrap.dedent(source))
    found = scan_file(str(path), "code.py", frozenset(classes))
    assert found is not None and not found.error, found
    return found


def members(found):
    return {(member, line) for _receiver, member, line, _guards in found.members}


def test_the_class_of_a_value_is_inferred_per_scope_in_source_order(tmp_path):
    found = scan(tmp_path, """\
        from typing import Optional
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.tensor import DTensor

        MESH = init_device_mesh("cpu", (2,))

        def a(mesh: Optional[DeviceMesh], other: "DeviceMesh", x, *args: DeviceMesh):
            mesh.get_group()
            other.size()
            MESH.get_rank()
            args.count(1)
            if isinstance(x, DTensor):
                x.full_tensor()
            x.shape
            mesh = mesh.get_group()
            mesh.rank()

        def b(mesh, y: "DeviceMesh | None"):
            mesh.get_group()
            y.ndim
            y, z = 1, 2
            y.ndim
            dist.new_group().rank()
            init_device_mesh("cpu", (2, 2))["dp"].get_coordinate()
            MESH = None
            MESH.get_rank()
        """)
    assert members(found) == {("get_group", 9), ("size", 10), ("get_rank", 11), ("full_tensor", 14),
                              ("get_group", 16), ("rank", 17), ("ndim", 21), ("rank", 24), ("get_coordinate", 25)}
    receivers = {(member, line): receiver for receiver, member, line, _g in found.members}
    assert receivers[("rank", 17)] == ("call", ("attr", ("inst", MESH), "get_group"))
    assert receivers[("get_coordinate", 25)] == (
        "item", ("call", ("name", "torch.distributed.device_mesh.init_device_mesh")))
    assert receivers[("rank", 24)] == ("call", ("name", "torch.distributed.new_group"))


def test_calls_of_torch_classes_are_recorded_with_their_arguments(tmp_path):
    found = scan(tmp_path, """\
        import torch
        from torch.distributed.pipelining import PipelineStage

        def make(m, *a, **k):
            PipelineStage(m, 0, 2, "cpu")
            PipelineStage(m, 0, *a, input_args=(1,))
            PipelineStage(m, **k)
            torch.nn.Linear(2, 2)
        """)
    assert [(callee[1], shape, line) for callee, shape, line, _g in found.calls] == [
        ("torch.distributed.pipelining.PipelineStage", CallShape(4, ()), 5),
        ("torch.distributed.pipelining.PipelineStage", CallShape(2, ("input_args",), star=True), 6),
        ("torch.distributed.pipelining.PipelineStage", CallShape(1, (), starstar=True), 7),
    ]  # torch.nn.Linear: no class whose members are known


def test_signatures_as_inventories_record_them():
    sig = Signature.parse("(self, a, b=(1, 2), /, c='x, y', *args, d, e=<object object at 0x7f>, **kw)")
    assert sig is not None
    assert sig.positional == ("a", "b", "c") and sig.keyword == {"c", "d", "e"} and sig.required == {"a", "d"}
    assert sig.varargs and sig.varkw and sig.names == {"a", "b", "c", "d", "e"}
    stage = Signature.parse("(self, submodule, stage_index, num_stages, device, input_args, output_args=None)")
    assert stage.problems(CallShape(4, ())) == ["missing required argument 'input_args'"]
    assert stage.problems(CallShape(4, ("input_args",))) == []
    assert stage.problems(CallShape(7, ("nope",))) == [
        "7 positional arguments, at most 6", "unexpected keyword argument 'nope'"]
    assert stage.problems(CallShape(2, (), star=True)) == []  # how many *args hold is not known
    assert stage.problems(CallShape(2, (), starstar=True)) == []  # nor which keywords **kwargs hold
    served = stage.widened(["input_args=None", "get_mesh=None"])  # what patches add (Patch.takes)
    assert served.problems(CallShape(4, ("get_mesh",))) == [] and served.problems(CallShape(5, ())) == []
    assert served.text == "(self, submodule, stage_index, num_stages, device, input_args, output_args=None, *, get_mesh=None)"
    assert served.problems(CallShape(4, ("dw_builder",))) == ["unexpected keyword argument 'dw_builder'"]
    assert Signature.parse("(a, b)").positional == ("b",)  # the first parameter is the instance
    assert Signature.parse("") is None and Signature.parse("()") is None


def test_inventories_without_classes_check_no_members():
    """Inventories taken before members were recorded still check names, and say nothing of members."""
    new = choose_target("2.4.1", live=False).inventory
    assert new.classes
    data = {"torch": new.version, "python": new.python, "modules": new.modules, "failing": new.failing,
            "walked": list(new.walked), "walk_skips": sorted(new.walk_skips)}
    old = Inventory(data)
    result = run_check([str(MEMBERS)], Target("2.4.1", None, "old", InventoryView(old, all_inventories()), old))
    names = {r["name"]: r["kind"] for r in result["rows"]}
    assert names[f"{MESH}"] == names["torch.distributed.device_mesh.init_device_mesh"] == "native"
    assert not [n for n in names if n.startswith(f"{MESH}.") or n.endswith(".__init__")]
    assert result["exit"] == 0


@pytest.fixture
def flatten_patch():
    patch = Patch(id="mesh-flatten", summary="DeviceMesh._flatten on torch 2.4", torch=">=2.4,<2.5",
                  upstream="https://example.invalid")
    patch.sets(MESH, ("_flatten",))  # a member set on a class is declared with the class's dotted name
    return patch


def test_a_member_is_patched_only_where_a_patch_declares_it(flatten_patch):
    def flatten(cfg):
        report = run_check([str(MEMBERS)], choose_target("2.4.1", live=False), patches=[flatten_patch], cfg=cfg)
        return {r["name"]: r for r in report["rows"]}[f"{MESH}._flatten"]

    row = flatten(Config())
    assert row["kind"] == "patched" and row["patches"] == ["mesh-flatten"]
    assert row["how"] == [f"{MESH}._flatten served by mesh-flatten"]
    row = flatten(Config(disable=["mesh-flatten"]))
    assert row["kind"] == "unresolved" and "patch mesh-flatten would serve it but is off" in row["note"]
    report = run_check([str(MEMBERS)], choose_target("2.13.0", live=False), patches=[flatten_patch], cfg=Config())
    assert {r["name"]: r["kind"] for r in report["rows"]}[f"{MESH}._flatten"] == "native"  # not for 2.13
