"""pipelining-activation-liveness: torch 2.15's ``analyze_pipeline_activation_liveness`` and
``PipelineActivationLiveness`` on torch 2.4-2.14.

Without torchpatch the import fails. With it (and natively on 2.15) the same script, on the same
schedules built by the installed torch for 2 pipeline ranks of a fake process group, checks every
result against the schedule's own action list (each lifetime from its forward to its full or weight
backward, overlapping lifetimes in different slots, as few slots as lifetimes overlap at most), the
slot IDs torch 2.15 gives, a hand-written action list with bubbles, a split backward and a compound
action, and 2.15's errors; on torch 2.15 the patch stays out of the way.
"""

from conftest import clean_env, only_torch, run_json, run_py, through_patch_range, where_patch_applies

IMPORT = "from torch.distributed.pipelining.schedules import analyze_pipeline_activation_liveness"


@where_patch_applies("pipelining-activation-liveness", "torch 2.4-2.14 have pipelining without the analysis")
def test_native_import_error():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'analyze_pipeline_activation_liveness'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = r"""
import dataclasses, json, types, torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import PipelineActivationLiveness, analyze_pipeline_activation_liveness

W, N_MB = 2, 4
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
out = {"same_in_package": pipelining.analyze_pipeline_activation_liveness is analyze_pipeline_activation_liveness
                          and pipelining.PipelineActivationLiveness is PipelineActivationLiveness}

def kind(action):
    value = getattr(action.computation_type, "value", None)
    return value if isinstance(value, str) else str(action.computation_type)

def leaves(action):
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    return [leaf for sub in subs for leaf in leaves(sub)] if subs else [action]

def reference(order, tracked, n):
    # Lifetimes read off the list: first forward to the backward that frees (a W where there is one, else B).
    first, last = {}, {}
    for position, action in enumerate(order):
        for a in leaves(action):
            key = (a.stage_index, a.microbatch_index)
            if a.stage_index in tracked and kind(a) == "F":
                first[key] = position
            if a.stage_index in tracked and kind(a) in ("B", "W"):
                last[key] = max(last.get(key, -1), position)
    return {(s, mb): (first[(s, mb)], last[(s, mb)]) for s in tracked for mb in range(n)}

def check(result, order, tracked, granularity, n):
    # Everything the 2.15 docstring promises, computed from the action list itself.
    ref = reference(order, tracked, n)
    if granularity == "microbatch":
        ref = {(s, mb): (min(ref[(t, mb)][0] for t in tracked), max(ref[(t, mb)][1] for t in tracked))
               for s, mb in ref}
    slots = dict(result.slot_by_stage_and_microbatch)
    problems = []
    if {k: result.get_activation_lifetime(*k) for k in ref} != ref:
        problems.append("lifetimes")
    if set(slots) != set(ref) or any(result.slot_for(*k) != v for k, v in slots.items()):
        problems.append("keys")
    spans = {}
    for k, (start, end) in ref.items():  # one interval per slot owner: a microbatch, or a pair
        spans[k[1] if granularity == "microbatch" else k] = (start, end, slots[k])
    items = list(spans.values())
    for i, (s1, e1, slot1) in enumerate(items):
        for s2, e2, slot2 in items[i + 1:]:
            if slot1 == slot2 and s1 <= e2 and s2 <= e1:
                problems.append(f"overlap in slot {slot1}")
    live = max(sum(s <= p <= e for s, e, _ in items) for p in range(len(order)))
    if result.num_slots != live or set(slots.values()) != set(range(live)):
        problems.append(f"num_slots {result.num_slots}, max live {live}")
    return problems

placements = {"ScheduleInterleaved1F1B": [0, 2], "ScheduleLoopedBFS": [0, 2], "ScheduleInterleavedZeroBubble": [0, 2],
              "ScheduleZBVZeroBubble": [0, 3], "ScheduleDualPipeV": [0, 3]}
for name, mine in placements.items():
    cls = getattr(schedules, name, None)
    if cls is None:
        continue
    stages = [PipelineStage(nn.Linear(4, 4), s, 2 * W, torch.device("cpu"), input_args=torch.zeros(2, 4),
                            output_args=torch.zeros(2, 4)) for s in mine]
    schedule = cls(stages, n_microbatches=N_MB, loss_fn=nn.MSELoss())
    order = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    for granularity in ("stage_microbatch", "microbatch"):
        result = analyze_pipeline_activation_liveness(schedule, pp_rank=0, stage_indices=mine, granularity=granularity)
        out[f"{name}/{granularity}"] = {
            "problems": check(result, order[0], mine, granularity, N_MB),
            "slots": [result.slot_for(s, mb) for s in mine for mb in range(N_MB)],
            "fields": [result.pp_rank, result.granularity, list(result.stage_indices), result.num_microbatches]}

# A hand-written list: a bubble, a split backward (I then W), and where the compound action exists
# (torch >= 2.9) a backward and a forward at the same position, which therefore cannot share a slot.
_Action = schedules._Action
if hasattr(_Action, "from_str"):
    def plan(text):
        return [None if cell == "-" else _Action.from_str(cell) for cell in text.split()]

    def fake(order, n):
        return types.SimpleNamespace(pipeline_order={0: order}, _n_microbatches=n)

    order = plan("0F0 0B0 0F1 0I1 - 0F2 0W1 0B2 0F3 0B3")
    result = analyze_pipeline_activation_liveness(fake(order, 4), pp_rank=0, stage_indices=[0],
                                                  granularity="stage_microbatch")
    out["hand"] = {"problems": check(result, order, [0], "stage_microbatch", 4),
                   "slots": [result.slot_for(0, mb) for mb in range(4)],
                   "lifetimes": [list(result.get_activation_lifetime(0, mb)) for mb in range(4)]}
    if hasattr(schedules._ComputationType, "OVERLAP_F_B"):
        both = _Action(-1, schedules._ComputationType.OVERLAP_F_B, None, tuple(plan("0B0 0F1")))
        result = analyze_pipeline_activation_liveness(fake(plan("0F0") + [both] + plan("0B1"), 2), pp_rank=0,
                                                      stage_indices=[0], granularity="stage_microbatch")
        out["compound"] = [result.num_slots, [list(result.get_activation_lifetime(0, mb)) for mb in range(2)]]

    errors = {}
    cases = {"granularity": (plan("0F0 0B0"), {"granularity": "step"}),
             "empty": (plan("0F0 0B0"), {"stage_indices": []}),
             "unique": (plan("0F0 0B0"), {"stage_indices": [0, 0]}),
             "rank": (plan("0F0 0B0"), {"pp_rank": 1}),
             "missing": (plan("0F0 0B0"), {"stage_indices": [0, 1]}),
             "twice": (plan("0F0 0F0 0B0"), {}),
             "range": (plan("0F0 0B0 0F5"), {}),
             "no_input": (plan("0F0 0W0"), {}),
             "order": (plan("0B0 0F0"), {})}
    for label, (order, kwargs) in cases.items():
        args = {"pp_rank": 0, "stage_indices": [0], "granularity": "stage_microbatch", **kwargs}
        try:
            analyze_pipeline_activation_liveness(fake(order, 1), **args)
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    try:
        result.slot_for(5, 0)
    except ValueError as exc:
        out["slot_for_error"] = str(exc)
    try:
        result.num_slots = 0
    except dataclasses.FrozenInstanceError:
        out["frozen"] = True
    try:
        hash(result)
    except TypeError:
        out["unhashable"] = True
import torchpatch
out["status"] = torchpatch.status().get("pipelining-activation-liveness")
print(json.dumps(out))
"""

# The slot IDs torch 2.15 gives (the same assertions run there natively), per schedule: stage-
# microbatch granularity, then microbatch, in (stage, microbatch) order of the rank's stages.
SLOTS_2_15 = {
    "ScheduleInterleaved1F1B": ([0, 1, 4, 2, 2, 3, 3, 0], [0, 1, 2, 3, 0, 1, 2, 3]),
    "ScheduleLoopedBFS": ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 3]),
    "ScheduleInterleavedZeroBubble": ([0, 1, 2, 3, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]),
    "ScheduleZBVZeroBubble": ([0, 1, 2, 3, 3, 3, 0, 0], [0, 1, 2, 3, 0, 1, 2, 3]),
    "ScheduleDualPipeV": ([0, 1, 2, 4, 3, 3, 3, 0], [0, 1, 2, 3, 0, 1, 2, 3]),
}


@through_patch_range("pipelining-activation-liveness", "pipelining came with torch 2.4")
def test_analysis_matches_schedule_and_torch_2_15():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["same_in_package"] is True
    analysed = {key.split("/")[0] for key in out if "/" in key}
    assert {"ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble"} <= analysed, analysed
    for name in analysed:
        per_pair, per_mb = out[f"{name}/stage_microbatch"], out[f"{name}/microbatch"]
        assert per_pair["problems"] == [] and per_mb["problems"] == [], (name, per_pair, per_mb)
        assert (per_pair["slots"], per_mb["slots"]) == SLOTS_2_15[name], name
        assert per_mb["fields"][:2] == [0, "microbatch"] and per_mb["fields"][3] == 4
    if "hand" not in out:  # torch 2.4's _Action has no from_str
        return
    # lifetimes (0,1) (2,6) (5,7) (8,9): the third overlaps the second, the fourth reuses slot 0
    assert out["hand"] == {"problems": [], "slots": [0, 0, 1, 0], "lifetimes": [[0, 1], [2, 6], [5, 7], [8, 9]]}
    if "compound" in out:
        assert out["compound"] == [2, [[0, 1], [1, 2]]]
    errors = out["errors"]
    assert errors["granularity"] == "Unsupported activation granularity: step"
    assert errors["empty"] == "stage_indices must not be empty"
    assert errors["unique"] == "stage_indices must be unique"
    assert errors["rank"] == "Rank 1 is not present in the pipeline schedule"
    assert errors["missing"] == "Forward actions do not match tracked activations; missing=[(1, 0)], extra=[]"
    assert errors["twice"] == "Activation lifetime (0, 0) has multiple forwards"
    assert errors["range"] == "Action 0F5 has a microbatch outside [0, 1)"
    assert errors["no_input"] == "Activation lifetimes have weight backward without input backward: [(0, 0)]"
    assert errors["order"] == "Activation lifetime (0, 0) ends before its forward"
    assert out["slot_for_error"] == "No activation slot exists for stage 5, microbatch 0"
    assert out["frozen"] is True and out["unhashable"] is True


@only_torch(">=2.15", "torch has the analysis: nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torchpatch
        from torch.distributed.pipelining.schedules import analyze_pipeline_activation_liveness as f
        print(json.dumps({"module": f.__module__, "status": torchpatch.status().get("pipelining-activation-liveness")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"module": "torch.distributed.pipelining.schedules", "status": None}
