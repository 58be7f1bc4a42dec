"""X, a computing layer's transients beyond the walk's bytes: profiled, held within each stage's memory rule,
recorded per stage in the plan, and each gpu's largest added to the gpu path's planned figure; W, the math
libraries' workspaces, held apart on every gpu."""

import dataclasses

import pytest
import torch

from partition import make_plan
from partition.errors import PlanInfeasibleError
from partition.plan import Plan, load_plan, save_plan
from partition.rules.activation_choice import choose_activations
from partition.rules.activations import Link
from partition.rules.costmodel import LayerArrays, arena_bytes
from partition.rules.device_peak import planned_device_bytes
from partition.rules.fits import check_layers_fit
from partition.search import _arena_fits
from partition.spec.profile import LayerProfile, Profile, load_profile, save_profile
from topology import cpu_standin


def _profile(workspace: tuple[int, int, int] = (0, 0, 0)) -> Profile:
    def layer(name, n, out, act, x):
        return LayerProfile(name, n, 4 * n, act, out, 0.0, 0.0, 1e-3, 2e-3, workspace_bytes=x)

    a, b, c = workspace
    ls = (layer("a", 40, 16, 64, a), layer("b", 0, 16, 64, b), layer("c", 27, 6, 24, c))
    return Profile("mlp", "cpu-standin", "fp32", 2, 1, ls, input_bytes=32, target_bytes=24)


def _plan(profile: Profile, memory: int = 1 << 20) -> Plan:
    return make_plan(profile, cpu_standin(1, memory), 3, num_stages=3, solver="dp", activations="recompute")


def test_the_plan_holds_the_workspaces_apart_and_adds_its_stages_transients_to_the_gpu_figure():
    base, spent = _plan(_profile()), _plan(dataclasses.replace(_profile((100, 7, 300)), library_bytes=50))
    assert (base.workspace_bytes, spent.workspace_bytes) == (0, 50)
    assert [s.transient_bytes for s in spent.stages] == [100, 7, 300]
    assert spent.gpu_memory_bytes == base.gpu_memory_bytes - 50  # W on every gpu; X within each stage's rule
    assert planned_device_bytes(spent) == [b + 50 + 300 for b in planned_device_bytes(base)]  # the gpu's largest X
    assert planned_device_bytes(spent, standin=True) == planned_device_bytes(base, standin=True)  # ledger: no X


def test_files_keep_the_workspace_and_older_files_read_as_zero(tmp_path):
    profile = _profile((5, 0, 9))
    save_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == profile
    plan = _plan(profile)
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml") == plan and [s.transient_bytes for s in plan.stages] == [5, 0, 9]
    older = plan.to_dict()  # a plan made before stages recorded X_j: the largest held apart on every gpu
    older["workspace_bytes"] = 9
    for stage in older["stages"]:
        del stage["transient_bytes"]
    assert planned_device_bytes(Plan.from_dict(older)) == planned_device_bytes(plan)
    old = dataclasses.replace(profile, layers=tuple(dataclasses.replace(x, workspace_bytes=0) for x in profile.layers))
    d = old.to_dict()
    for layer in d["layers"]:
        del layer["workspace_bytes"]  # a profile written before profiles had X
    assert Profile.from_dict(d) == old


def test_a_negative_workspace_is_refused():
    with pytest.raises(Exception, match="workspace_bytes"):
        _profile((0, -1, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_profile_measures_the_heads_logit_gradient():
    from mobiuspipe.profiling.profiler import measure_profile

    torch.manual_seed(0)
    head = torch.nn.Linear(256, 8192)
    x = torch.randn(4, 128, 256)
    y = torch.randint(0, 8192, (4, 128)).cuda()
    p = measure_profile(
        [head],
        x,
        device="cuda",
        name="head",
        device_name="gpu",
        dtype_name="fp32",
        microbatch_size=4,
        seq_len=128,
        loss_fn=lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        min_repeats=2,
        max_repeats=3,
    )
    logits = 4 * 128 * 8192 * 4
    assert p.layers[0].workspace_bytes >= logits  # the logits' gradient, at least, lives beyond what is saved


def _spread(profile: Profile, memory: int = 1 << 20) -> Plan:
    """Three stages of one layer each on three gpus."""
    return make_plan(profile, cpu_standin(3, memory), 3, num_stages=3, solver="dp", activations="recompute")


def test_each_gpu_holds_apart_only_the_transients_of_its_own_stages():
    base, spent = _spread(_profile()), _spread(_profile((100, 7, 300)))
    assert [s.transient_bytes for s in spent.stages] == [100, 7, 300]
    assert spent.gpu_memory_bytes == base.gpu_memory_bytes  # nothing held apart on every gpu (W = 0 here)
    assert planned_device_bytes(spent) == [b + x for b, x in zip(planned_device_bytes(base), (100, 7, 300))]


def test_the_memory_rule_holds_each_stages_own_transients_apart():
    plan = _plan(_profile())
    acts = [s.activation_bytes for s in plan.stages]  # 80, 96, 46: the middle stage's rule is the tightest
    memory = plan.arena_bytes + max(acts) + 10
    for j in range(3):
        room = memory - plan.arena_bytes - acts[j]
        assert _plan(_profile(_only(j, room)), memory=memory).stages[j].transient_bytes == room
        with pytest.raises(Exception, match="memory|fit|bytes"):
            _plan(_profile(_only(j, room + 1)), memory=memory)


def _only(j: int, x: int) -> tuple[int, int, int]:
    """X of the three layers: x on layer j, 0 on the others."""
    a, b, c = (x if i == j else 0 for i in range(3))
    return a, b, c


def test_the_activation_choice_holds_each_gpus_transients_to_the_budget():
    """On a gpu the choice holds each gpu's walk with its stages' largest X (N_g) to the budget, on the stand-in the
    walk alone (its ledger counts no transients): a budget that holds gpu 0's walk but not with its X keeps less."""
    profile = _profile((5000, 7, 300))
    plan = _spread(profile)
    device: dict[str, Link | None] = {"device": None}
    roomy = choose_activations(plan, profile, 1 << 30, device)
    assert roomy.needs == tuple(p + x for p, x in zip(roomy.peaks, (5000, 7, 300)))
    standin = choose_activations(plan, profile, 1 << 30, device, standin=True)
    assert standin.needs == standin.peaks and standin.policies == roomy.policies
    tight = roomy.needs[0] - 1
    assert choose_activations(plan, profile, tight, device, standin=True).policies == roomy.policies
    held = choose_activations(plan, profile, tight, device)
    assert held.costs[0].held_bytes < roomy.costs[0].held_bytes and held.needs[0] <= tight


def test_the_mip_cuts_pass_the_rule_with_each_stages_transients():
    """_arena_fits, the filter between a MIP cut and a plan, holds each stage's arena, activations and X to G."""
    arr = LayerArrays.of(_profile((0, 40, 0)))
    ranges = [(0, 0), (1, 2)]
    need = arena_bytes(max(arr.params(a, b) for a, b in ranges), max(arr.grads(a, b) for a, b in ranges))
    need += max(arr.activations(a, b) + arr.transients(a, b) for a, b in ranges)
    assert arr.transients(1, 2) == 40 and _arena_fits(arr, ranges, need) and not _arena_fits(arr, ranges, need - 1)


def test_a_layer_whose_transients_alone_overflow_is_named():
    profile = _profile((0, 0, 1000))
    arr = LayerArrays.of(profile)
    alone = arena_bytes(arr.params(2, 2), arr.grads(2, 2)) + arr.activations(2, 2)
    check_layers_fit(arr, profile, alone + 1000, 0)
    with pytest.raises(PlanInfeasibleError, match=r"layer 2 \(c\) alone needs .* 1000 B its backward holds beyond"):
        check_layers_fit(arr, profile, alone + 999, 0)
