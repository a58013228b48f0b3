"""What compiling the blocks changes in the cost model: the bytes and kernels a fusing compiler
leaves (profile/fusion.py), the search offering it on accelerators only, and the compile time
reported apart from the step."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from stratagem.advisor.cost.compute import COMPILE_SECONDS_PER_BLOCK_KIND
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.profile.fusion import COLUMN_KERNELS, FusionTracker, Read, region_of, sums_across_rows
from stratagem.advisor.report.render import render_markdown
from stratagem.advisor.search.advice import advise
from stratagem.advisor.search.enumeration import COMPILE_ON_CPU
from stratagem.cli import build_parser, main
from stratagem.cli.common import compile_constraints
from stratagem.plan import Workload

FORWARD = ("block", False)
BACKWARD = ("block", True)


class _Storages:
    """Tensors of ``size`` bytes each, kept alive, and their storages' weak references."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def __call__(self, size: int) -> tuple[StorageWeakRef, int]:
        self._tensors.append(torch.empty(size, dtype=torch.uint8))
        return StorageWeakRef(self._tensors[-1].untyped_storage()), size


def test_a_chain_between_gemms_is_one_kernel_moving_what_enters_and_leaves_it():
    new = _Storages()
    x, h, y, w, out = new(100), new(100), new(100), new(40), new(10)
    tracker = FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[x], writes=[h])
    tracker.op(FORWARD, fusible=True, reads=[h, x], writes=[y])  # x again: read once by the kernel
    tracker.op(FORWARD, fusible=False, reads=[y, w], writes=[out])  # a GEMM reads y: it leaves
    assert tracker.fused() == {FORWARD: (200, 2)}  # x in, y out; the chain's kernel and the GEMM


def test_what_backward_or_saving_needs_leaves_the_kernel():
    new = _Storages()
    x, h, y = new(100), new(100), new(100)
    saved, read_back = FusionTracker(), FusionTracker()
    for tracker in (saved, read_back):
        tracker.op(FORWARD, fusible=True, reads=[x], writes=[h])
        tracker.op(FORWARD, fusible=True, reads=[h], writes=[y])
    saved.saved(h[0])
    read_back.op(BACKWARD, fusible=True, reads=[h], writes=[new(100)])
    assert saved.fused()[FORWARD] == (300, 1)  # x in; h saved and y unread, both written
    assert read_back.fused()[FORWARD] == (300, 1)
    assert read_back.fused()[BACKWARD] == (200, 1)  # h in, the gradient out


def test_independent_chains_are_separate_kernels():
    new = _Storages()
    tracker = FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[new(8)], writes=[new(8)])
    tracker.op(FORWARD, fusible=True, reads=[new(8)], writes=[new(8)])
    assert tracker.fused() == {FORWARD: (32, 2)}


def test_a_sum_over_the_tokens_reads_again_in_kernels_of_its_own():
    new = _Storages()
    x, h, g, w, out, bias_grad = new(100), new(100), new(100), new(40), new(10), new(4)
    kept, leaving = FusionTracker(), FusionTracker()
    for tracker in (kept, leaving):
        tracker.op(BACKWARD, fusible=True, reads=[x], writes=[h])
        tracker.op(BACKWARD, fusible=True, reads=[h], writes=[g])
        tracker.op(BACKWARD, fusible=False, reads=[g, w], writes=[out])  # a GEMM reads g: it leaves
    kept.op(BACKWARD, fusible=True, reads=[h], writes=[bias_grad], sums=[bias_grad])
    leaving.op(BACKWARD, fusible=True, reads=[g], writes=[bias_grad], sums=[bias_grad])
    # x in, g and the sum out; the sum's kernels recompute h from x, or read g where it is written anyway
    assert kept.fused()[BACKWARD] == (100 + 100 + 4 + 100, 1 + 1 + COLUMN_KERNELS)
    assert leaving.fused()[BACKWARD] == (100 + 100 + 4 + 100, 1 + 1 + COLUMN_KERNELS)


def test_what_is_read_after_a_gemm_it_feeds_is_written_before_it():
    """The residual stream: x + f(x) where f runs a GEMM on a chain of x. One kernel cannot run both
    before the GEMM (the chain) and after it (the add): the chain writes x's sum, the add reads it."""
    new = _Storages()
    x, h, w, y, out = new(100), new(100), new(40), new(100), new(100)
    tracker = FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[x], writes=[h])  # x + 1, say
    tracker.op(FORWARD, fusible=False, reads=[h, w], writes=[y])  # the GEMM
    tracker.op(FORWARD, fusible=True, reads=[h, y], writes=[out])  # h + GEMM(h)
    # x in and h out (first kernel); h and y in, out out (second); and the GEMM
    assert tracker.fused() == {FORWARD: (100 + 100 + 100 + 100 + 100, 3)}


def test_what_an_in_place_operator_writes_again_is_written_once():
    new = _Storages()
    x, mask = new(100), new(50)
    tracker = FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[x], writes=[mask])  # dropout's mask drawn
    tracker.op(FORWARD, fusible=True, reads=[mask], writes=[mask])  # and scaled in place
    tracker.saved(mask[0])
    assert tracker.fused() == {FORWARD: (100 + 50, 1)}


def test_a_kernel_reads_the_slices_of_a_storage_it_reads_as_what_they_cover():
    # a partial rotary embedding: the quarter of each head it rotates, the halves of that quarter
    # it swaps, and the rest of the head, all slices of the Q/K/V GEMM's output
    qkv, new = torch.empty(2, 8, 3, 64), _Storages()  # [tokens, heads, q/k/v, head width], fp32
    q = qkv[:, :, 0]
    rotated, rest = q[..., :16], q[..., 16:]
    ref = StorageWeakRef(qkv.untyped_storage())

    def read(t: torch.Tensor) -> Read:
        return Read(ref, t.numel() * t.element_size(), region_of(t))

    out, tracker = new(q.numel() * 4), FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[read(rotated)], writes=[h := new(rotated.numel() * 4)])
    tracker.op(FORWARD, fusible=True, reads=[read(rotated[..., 8:]), read(rotated[..., :8]), h], writes=[g := new(1)])
    tracker.op(FORWARD, fusible=True, reads=[g, read(rest)], writes=[out])
    tracker.op(FORWARD, fusible=False, reads=[out], writes=[new(10)])
    assert tracker.fused()[FORWARD] == (2 * q.numel() * 4, 2)  # all of q read once, q written; and the GEMM


def test_a_cast_of_what_was_cast_already_is_that_cast():
    new = _Storages()
    x, first, second, w = new(100), new(50), new(50), new(40)
    tracker = FusionTracker()
    tracker.op(FORWARD, fusible=True, reads=[x], writes=[first], cast=("bf16", (10,)))
    tracker.op(FORWARD, fusible=False, reads=[first, w], writes=[new(10)])
    tracker.op(FORWARD, fusible=True, reads=[x], writes=[second], cast=("bf16", (10,)))  # autocast's second cast
    tracker.op(FORWARD, fusible=False, reads=[second, w], writes=[new(10)])
    assert tracker.fused() == {FORWARD: (100 + 50, 3)}  # one cast kernel and two GEMMs


def test_sums_reading_a_tensor_in_common_share_their_first_kernel():
    new = _Storages()
    g, x = new(100), new(100)
    tracker = FusionTracker()
    weight_grad, bias_grad = new(4), new(4)
    tracker.op(BACKWARD, fusible=True, reads=[g, x], writes=[weight_grad], sums=[weight_grad])
    tracker.op(BACKWARD, fusible=True, reads=[g], writes=[bias_grad], sums=[bias_grad])
    # g and x read once by the shared kernel, the two sums written; one shared kernel, one each to finish
    assert tracker.fused() == {BACKWARD: (100 + 100 + 4 + 4, 1 + 2 * (COLUMN_KERNELS - 1))}


class _Layer(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64, bias=bias), nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, layer: Callable[[], nn.Module], cache: Callable[[], object] | None = None) -> None:
        super().__init__()
        self.layers, self.cache = nn.ModuleList(layer() for _ in range(2)), cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = (self.cache(),) if self.cache else ()  # one per step, as a Hugging Face model makes it
        for layer in self.layers:
            x = layer(x, *extra)
        return x


def test_a_bias_gradient_is_a_sum_over_the_tokens_in_kernels_of_its_own():
    x = torch.randn(4, 16, 32)
    biased, plain = (profile_model(_Stack(lambda: _Layer(bias)), (x,), precision="fp32").blocks[0] for bias in (True, False))
    assert biased.bwd_fused_ops - plain.bwd_fused_ops == COLUMN_KERNELS
    # GELU's gradient, [4, 16, 64] in fp32, is read again (the GEMM that takes it writes it anyway)
    assert biased.bwd_fused_op_bytes - plain.bwd_fused_op_bytes == 4 * 16 * 64 * 4 + 64 * 4


@pytest.mark.parametrize(("shape", "out", "across"), [
    ((4, 16, 32), (32,), True),  # a bias's gradient
    ((4, 16, 32), (1, 1, 32), True),
    ((4, 8, 6, 6), (1, 8, 1, 1), True),  # BatchNorm's statistics, kept dimensions
    ((4, 8, 6, 6), (8,), True),  # and their gradients' sums
    ((4, 16, 32), (4, 32), True),  # a mean over the tokens
    ((4, 16, 32), (4, 16, 1), False),  # a row's (LayerNorm's statistics)
    ((4, 16, 32), (4, 16), False),
    ((4, 16, 32), (), False),  # a loss
    ((4, 16, 32), (4, 15, 32), False),  # a slice
    ((32, 32), (32,), True),  # sizes coincide (OPT's [tokens, width]): a bias's gradient
])
def test_a_sum_across_rows_is_one_over_a_dimension_before_one_it_keeps(shape, out, across):
    assert sums_across_rows([torch.empty(shape)], torch.empty(out)) is across


class _ConvBlock(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1, bias=False), norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


def test_compiled_batch_norms_statistics_read_the_convolutions_output_again():
    """BatchNorm's statistics reduce over the batch and the image, keeping the channels: inductor
    computes them in kernels of their own, and the normalisation's kernel reads the convolution's
    output again (bench/inductor_kernels.py, ResNet's blocks). GroupNorm's over one group reduce
    each sample's row and fuse with it. (Without running statistics, whose updates are kernels too.)"""
    x = torch.randn(4, 8, 6, 6)
    batch, group = (profile_model(_Stack(lambda: _ConvBlock(norm)), (x,), precision="fp32").blocks[0]
                    for norm in (lambda: nn.BatchNorm2d(8, track_running_stats=False), lambda: nn.GroupNorm(1, 8)))
    assert batch.fwd_fused_ops - group.fwd_fused_ops == COLUMN_KERNELS
    # the output read again; the mean and variance of 8 channels written and read
    assert batch.fwd_fused_op_bytes - group.fwd_fused_op_bytes == x.numel() * 4 + 2 * 2 * 8 * 4


class _Normed(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(32) if norm else nn.Identity(), nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        h = self.proj(self.norm(x))
        if cache is not None:  # a Hugging Face cache, which the compiled trace cannot take
            cache.update(h[:, None], h[:, None], 0)
        return x + h


@pytest.mark.parametrize("traced", [True, False])
def test_compiled_an_rms_norm_fuses_with_the_cast_before_the_gemm(traced):
    """Eager, ``torch.rms_norm`` is one kernel of its own on a GPU (profile/fused.py); compiled, its
    operators join the kernel that casts the GEMM's input to bf16: no kernel more than without it.
    So counted on the graphs inductor lowers, and on the eager step's operators where that trace
    fails (blocks called with a cache)."""
    x = torch.randn(4, 16, 32)
    cache = None if traced else pytest.importorskip("transformers").DynamicCache
    profiles = [profile_model(_Stack(lambda: _Normed(norm), cache), (x,)) for norm in (True, False)]
    assert all(any("the eager step's activations" in n for n in p.notes) != traced for p in profiles)
    normed, plain = (p.blocks[0] for p in profiles)
    assert normed.fwd_ops > plain.fwd_ops and normed.fwd_fused_ops == plain.fwd_fused_ops
    # its operators are counted, in fewer bytes than its eager kernel moves; backward, its weight's
    # gradient is a sum over the tokens, in kernels of its own
    assert 0 < normed.fwd_fused_op_bytes - plain.fwd_fused_op_bytes < normed.fwd_op_bytes - plain.fwd_op_bytes
    assert normed.bwd_fused_ops >= plain.bwd_fused_ops + COLUMN_KERNELS


@pytest.fixture(scope="module")
def gpt2():
    return profile_spec("gpt2", seq_len=1024)


def test_a_profiled_block_moves_fewer_bytes_in_fewer_kernels_fused(gpt2):
    for block in gpt2.blocks:
        for direction in ("fwd", "bwd"):
            eager, fused = getattr(block, f"{direction}_op_bytes"), getattr(block, f"{direction}_fused_op_bytes")
            assert 0 < fused < eager
            assert 0 < getattr(block, f"{direction}_fused_ops") < getattr(block, f"{direction}_ops")


def test_gpus_get_compiled_plans_that_are_faster_and_pay_compilation_once(gpt2):
    cluster, workload = parse_cluster("8xA100"), Workload(global_batch_size=64, seq_len=1024)
    advice = advise(gpt2, cluster, workload, top=50)
    compiled = [e for e in advice.plans if e.plan.compile]
    assert compiled and COMPILE_ON_CPU not in advice.notes
    for estimate in compiled:
        eager = evaluate(gpt2, cluster, workload, dataclasses.replace(estimate.plan, compile=False))
        assert estimate.time.step_seconds < eager.time.step_seconds
        assert estimate.time.compile_once == COMPILE_SECONDS_PER_BLOCK_KIND  # GPT-2: one kind of block
        assert eager.time.compile_once == 0
    best = next(e for e in advice.plans if e.plan.compile)
    assert "compiling its blocks once, before the first step" in render_markdown(
        dataclasses.replace(advice, plans=(best, *advice.plans)))


def test_a_compiled_plan_runs_the_embedding_and_head_eager(gpt2):
    # the compile plugin compiles blocks only: the head's cross-entropy on 50,257-wide logits moves
    # what it moves eager (the fused count of those operators is never run)
    cluster, workload = parse_cluster("1xH100-SXM-80GB"), Workload(global_batch_size=8, seq_len=1024)
    plan = dataclasses.replace(advise(gpt2, cluster, workload, top=1).plans[0].plan, compile=True)
    compiled = rank_step(gpt2, cluster=cluster, workload=workload, plan=plan)
    eager = rank_step(gpt2, cluster=cluster, workload=workload, plan=dataclasses.replace(plan, compile=False))
    head = gpt2.head
    assert head.fwd_fused_op_bytes < head.fwd_op_bytes  # what the old pricing took
    for direction in ("fwd", "bwd"):
        for total in (compiled.run_bytes, compiled.launched, eager.run_bytes, eager.launched):
            assert total(direction) > total(direction, blocks_only=True)
        assert compiled.run_bytes(direction) - compiled.run_bytes(direction, blocks_only=True) == pytest.approx(
            eager.run_bytes(direction) - eager.run_bytes(direction, blocks_only=True))
        assert compiled.launched(direction) - compiled.launched(direction, blocks_only=True) == (
            eager.launched(direction) - eager.launched(direction, blocks_only=True))
        assert compiled.run_bytes(direction, blocks_only=True) < eager.run_bytes(direction, blocks_only=True)


def test_cpu_ranks_get_no_compiled_plans_and_are_told_why():
    profile = profile_spec("gpt2-tiny", seq_len=32, kernels="cpu")
    advice = advise(profile, parse_cluster("2xcpu"), Workload(global_batch_size=4, seq_len=32), top=50)
    assert advice.plans and not any(e.plan.compile for e in advice.plans)
    assert COMPILE_ON_CPU in advice.notes


def test_advise_no_compile_leaves_compiled_plans_out(capsys):
    args = ["advise", "--model", "gpt2-tiny", "--cluster", "8xA100", "--global-batch-size", "32", "--top", "20",
            "--json"]
    assert main(args) == 0
    assert any(plan["plan"]["compile"] for plan in json.loads(capsys.readouterr().out)["plans"])
    assert main([*args, "--no-compile"]) == 0
    assert not any(plan["plan"]["compile"] for plan in json.loads(capsys.readouterr().out)["plans"])


@pytest.mark.parametrize("command", ["advise", "verify"])
def test_verify_takes_no_compile_as_advise_does(command):
    """``verify --no-compile`` searches as ``advise --no-compile`` does (the constraint both hand
    the search): a GPU's compiled plan whose compilation outruns the run (a ResNet's blocks at
    several sizes) can be left out; without the flag, nothing is constrained."""
    parse = build_parser().parse_args
    assert compile_constraints(parse([command, "--model", "resnet-101", "--no-compile"])) == {"compile": False}
    assert compile_constraints(parse([command, "--model", "resnet-101"])) == {}
