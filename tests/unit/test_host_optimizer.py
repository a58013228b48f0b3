"""An offloaded plan's optimizer steps fused on the host (plugins/host_optimizer.py), unless the
caller named an implementation; one built already is made fused before its first step only."""

from __future__ import annotations

import pytest
import torch

from stratagem.plan import Plan
from stratagem.plugins.host_optimizer import fuse_host_optimizer, host_optimizer_options

OFFLOADED = Plan(dp_shard=1, zero=3, offload="params")
ON_DEVICE = Plan(dp_shard=2, zero=3)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(8, 8))]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_an_offloaded_plan_builds_its_optimizer_fused(cls):
    options = host_optimizer_options(OFFLOADED, cls, {"lr": 1e-3})
    assert options == {"lr": 1e-3, "fused": True}
    optimizer = cls(_params(), **options)
    assert all(group["fused"] for group in optimizer.param_groups)


def test_what_the_caller_named_or_the_device_plan_stays():
    assert host_optimizer_options(ON_DEVICE, torch.optim.AdamW, {"lr": 1e-3}) == {"lr": 1e-3}
    assert host_optimizer_options(OFFLOADED, torch.optim.AdamW, {"foreach": False}) == {"foreach": False}
    assert host_optimizer_options(OFFLOADED, torch.optim.AdamW, {"fused": False}) == {"fused": False}
    assert host_optimizer_options(OFFLOADED, torch.optim.RMSprop, {"lr": 1e-3}) == {"lr": 1e-3}
    # DTensor shards no fused SGD kernel (``_fused_sgd_``): FSDP's offloaded SGD steps one tensor at a time
    assert host_optimizer_options(OFFLOADED, torch.optim.SGD, {"lr": 1e-3}) == {"lr": 1e-3}


def test_a_built_optimizer_is_fused_before_its_first_step_and_steps_as_one_built_fused():
    """Lightning and Fabric hand the strategy the optimizer the user built: made fused in place,
    it steps as one built fused (the same values); after a step, or where the user chose, it stays."""
    torch.manual_seed(0)
    flipped, built = _params(), _params()
    with torch.no_grad():
        for a, b in zip(flipped, built):
            b.copy_(a)
    first = torch.optim.AdamW(flipped, lr=1e-2)
    second = torch.optim.AdamW(built, lr=1e-2, fused=True)
    assert fuse_host_optimizer(first, OFFLOADED) and first.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in flipped]
        for params in (flipped, built):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
        first.step()
        second.step()
    for a, b in zip(flipped, built):
        assert torch.equal(a, b)
    stepped = torch.optim.AdamW(_params(), lr=1e-2)
    for param in stepped.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    stepped.step()
    assert not fuse_host_optimizer(stepped, OFFLOADED)  # its states exist
    chosen = torch.optim.AdamW(_params(), lr=1e-2, foreach=False)
    assert not fuse_host_optimizer(chosen, OFFLOADED)
    assert not fuse_host_optimizer(torch.optim.AdamW(_params()), ON_DEVICE)


@pytest.mark.parametrize(("optimizer", "noted"), [("adamw", True), ("sgd", False)])
def test_advice_with_an_offloaded_plan_says_its_host_step_is_priced_fused(optimizer, noted):
    """A user's own training loop builds its own optimizer: the advice says the host step is priced
    fused and what to pass; SGD, which steps one tensor at a time either way, gets no such note."""
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.advisor.search.advice import advise
    from stratagem.plan import Workload

    profile = profile_spec("gpt2-tiny", seq_len=32)
    advice = advise(profile, parse_cluster("1xH100"), Workload(global_batch_size=4, seq_len=32, optimizer=optimizer),
                    constraints={"offload": "params"}, top=1)
    assert advice.best.plan.offloads
    assert any("fused=True" in note for note in advice.notes) == noted
