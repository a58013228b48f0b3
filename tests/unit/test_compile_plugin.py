"""``compile`` in the Plan: each block through torch.compile, the same numbers as eager."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._inductor.graph import GraphLowering
from torch.fx.experimental.symbolic_shapes import has_free_symbols
from torch.utils.data import DataLoader, TensorDataset

from stratagem.advisor.cost.convolutions import symbolic_kinds
from stratagem.advisor.cost.stages import rank_stages
from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.search.targets import accelerate_excludes, deepspeed_excludes
from stratagem.errors import UsageError
from stratagem.integrations.planning import partial_batch_note
from stratagem.plan import Plan
from stratagem.plugins import apply_compile, check_applicable


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_compiled_blocks_train_as_eager_ones_and_keep_their_names():
    torch.manual_seed(0)
    eager = Blocks()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, Plan(compile=True, block_container="layers"))
    x = torch.randn(4, 16)
    for model in (eager, compiled):
        model(x).square().sum().backward()
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_is_a_bool_named_in_the_plan_and_needs_blocks():
    assert Plan(compile=True, block_container="layers").name == "single compiled mb=1"
    with pytest.raises(UsageError, match="Plan.compile must be true or false"):
        Plan(compile="yes")
    with pytest.raises(UsageError, match="compile=true compiles each block"):
        check_applicable(Plan(compile=True))
    apply_compile(Blocks(), Plan())  # off: nothing to do, no blocks needed


def test_runtimes_that_cannot_compile_per_block_leave_it_out():
    plan = Plan(compile=True, block_container="layers")
    assert "torch.compile" in accelerate_excludes(plan) and "torch.compile" in deepspeed_excludes(plan)


class Indexed(nn.Module):
    """A block that reads its own index in forward, as a Hugging Face decoder layer reads ``layer_idx``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (self.index + 1)


def test_every_block_compiles_past_dynamos_eight_graphs_per_code_object():
    from torch._dynamo.utils import counters

    model = nn.Module()
    model.layers = nn.ModuleList(Indexed(i) for i in range(10))
    apply_compile(model, Plan(compile=True, block_container="layers"))
    before = counters["stats"]["unique_graphs"]
    x = torch.randn(2, 8)
    for layer in model.layers:
        x = layer(x)
    x.sum().backward()
    assert counters["stats"]["unique_graphs"] - before == 10  # none left eager


class Pictures(nn.Module):
    """Blocks of one class whose stride-2 ones halve the picture and double the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ConvNormReLU(80, 1), ConvNormReLU(160, 2), ConvNormReLU(160, 1),
                                     ConvNormReLU(320, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ConvNormReLU(nn.Module):
    """A convolution, its BatchNorm and a ReLU."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels // stride, channels, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


def test_the_cost_model_knows_which_compiled_convolutional_blocks_inductor_leaves_nchw(monkeypatch):
    """One class at three input sizes, compiled block by block as the plugin does: dynamo traces
    the third and fourth graphs with symbolic shapes (the picture's size has changed) and inductor
    leaves their convolutions NCHW (torch 2.13's ``decide_layout_opt`` skips symbolic shapes),
    paying cuDNN's layout transforms, as ``symbolic_kinds`` predicts from the profile. Each graph
    holding a convolution is asked with CPU's oneDNN off, which would lay it out channels-last
    whatever its shapes; channels over 64, below which inductor keeps NCHW anyway; nothing from
    inductor's caches, whose graphs are not lowered again. The compiled blocks train as the eager
    ones."""
    decided = []
    real = GraphLowering.decide_layout_opt

    def spy(gm: torch.fx.GraphModule, *, is_inference: bool) -> bool:
        result = real(gm, is_inference=is_inference)
        if any(node.target is torch.ops.aten.convolution.default for node in gm.graph.nodes):
            decided.append(result)
        return result

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(spy))
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # a cached graph is not lowered
    torch.manual_seed(0)
    eager = Pictures()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, Plan(compile=True, block_container="layers"))
    x = torch.randn(2, 80, 16, 16)
    with torch.backends.mkldnn.flags(enabled=False):
        for model in (eager, compiled):
            model(x).square().sum().backward()
    profile = profile_model(Pictures(), (x,), batch_size=2)
    stage = rank_stages(profile, Plan(compile=True, block_container="layers"))[0]
    assert symbolic_kinds(stage) == {"layers.2", "layers.3"}
    assert decided == [True, True, False, False]
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        # a channels-last convolution sums in another order: within 1e-5 of the gradient's largest element
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5 * a.grad.abs().max().item(), msg=name)


class Widen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x))


def test_after_a_smaller_batch_every_later_call_runs_the_symbolic_graph():
    """What ``partial_batch_note`` warns of, as torch 2.13 does it: a block compiled at batch 4
    compiles again at 3 with a symbolic batch size, and the calls at 4 after it run that graph."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        values = [node.meta.get("example_value") for node in gm.graph.nodes]
        graph = {"symbolic": any(isinstance(v, torch.Tensor) and has_free_symbols(v) for v in values), "calls": 0}
        graphs.append(graph)

        def run(*args: Any) -> Any:
            graph["calls"] += 1
            return gm(*args)
        return run

    block = Widen()
    block.compile(backend=backend)
    for batch in (4, 4, 3, 4, 4):
        block(torch.randn(batch, 8))
    assert graphs == [{"symbolic": False, "calls": 2}, {"symbolic": True, "calls": 3}]


def test_a_compiled_plan_warns_of_a_smaller_last_batch():
    plan = Plan(compile=True, block_container="layers", micro_batch_size=4)
    data = TensorDataset(torch.zeros(10, 8))
    note = partial_batch_note(DataLoader(data, batch_size=4), plan)
    assert note is not None and note.startswith("each epoch's last training batch holds 2 samples where the others "
                                                "hold 4") and "HINT: DataLoader(..., drop_last=True)" in note
    assert "holds 1 samples" in partial_batch_note(DataLoader(data, batch_size=4), dataclasses.replace(plan, dp_shard=2,
                                                                                                      zero=3))
    assert partial_batch_note(DataLoader(data, batch_size=4, drop_last=True), plan) is None
    assert partial_batch_note(DataLoader(data, batch_size=5), plan) is None
    assert partial_batch_note(DataLoader(data, batch_size=4), dataclasses.replace(plan, compile=False)) is None
