"""Selective checkpointing as the plugin applies it: what the profile measures a block keeping and
recomputing under each policy, against hand-counted tensors, against a real CPU run of the plugin,
and in the memory model (Llama 3 8B at 8192 tokens)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.flop_formulas import CPU_ATTENTION_FLOPS
from stratagem.advisor.profile.model_profile import policy_field
from stratagem.advisor.profile.profiler import SegmentProfile, profile_model
from stratagem.advisor.profile.counts import PolicyCounts
from stratagem.plan import SELECTIVE_POLICIES, Plan, Workload
from stratagem.plan.checkpointing import PolicyState, keeps_output
from stratagem.plugins.checkpointing import apply_activation_checkpointing

B, S, H, HEADS, VOCAB = 4, 64, 64, 4, 128
WORD = 4  # fp32 bytes
POLICIES = ("none", "selective", "selective-op", "full")


class Block(nn.Module):
    """A pre-norm transformer block: SDPA attention (q, k, v, proj without bias: ``mm``), a GELU
    MLP with biases (``addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.proj = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (m(y).view(b, s, HEADS, h // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layers = nn.Embedding(VOCAB, H), nn.ModuleList(Block() for _ in range(3))
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().square().mean()


@pytest.fixture(scope="module")
def block() -> SegmentProfile:
    """The middle block's profile (fp32, on fake tensors)."""
    profile = profile_model(Model(), (torch.zeros(B, S, dtype=torch.long),), loss_fn=_loss, precision="fp32")
    return profile.blocks[1]


def _kept(block: SegmentProfile, policy: str) -> int:
    """What the profile says a block checkpointed under ``policy`` keeps."""
    if policy == "none":
        return block.saved_bytes
    if policy == "full":
        return block.input_bytes
    return getattr(block, policy_field(policy, "kept_bytes"))


def test_the_policies_decide_by_operator_name_and_matmul_count():
    state = PolicyState("selective-op")
    decisions = [state.keeps(op) for op in ("aten.mm", "aten.gelu", "aten.addmm", "aten.mm",
                                            "aten._scaled_dot_product_flash_attention", "aten.mm")]
    assert decisions == [True, False, False, True, True, False]  # every second matmul recomputed
    assert keeps_output("selective", "aten.mm", 2) and not keeps_output("selective", "aten.bmm", 1)
    assert not keeps_output("selective", "aten._scaled_dot_product_flash_attention_for_cpu", 1)


def test_a_policy_keeps_the_input_and_its_operators_outputs(block):
    """Counted by hand in words of ``b·s·h``: each storage once, parameters left out."""
    bsh, lse, norm_stats = B * S * H * WORD, B * HEADS * S * WORD, 2 * 2 * B * S * WORD
    # no checkpointing: norm1's input and output, q k v (SDPA's inputs), SDPA's output and
    # log-sum-exp, norm2's input and output, fc1's and GELU's outputs (4 wide), the norms' stats
    assert block.saved_bytes == (1 + 1 + 3 + 1 + 1 + 1 + 4 + 4) * bsh + lse + norm_stats
    # selective: the input and every matmul's output: q k v proj, fc1 (4 wide), fc2
    assert block.selective_kept_bytes == (1 + 4 + 4 + 1) * bsh
    # ... less than none by the recomputed operators' saved outputs (norms, SDPA, the residual,
    # GELU), plus the kept outputs that nothing saves (proj, fc2); more than full's input alone
    recomputed, unsaved = (1 + 1 + 1 + 1 + 4) * bsh + lse + norm_stats, 2 * bsh
    assert block.saved_bytes - block.selective_kept_bytes == recomputed - unsaved
    assert block.input_bytes == bsh < block.selective_kept_bytes < block.saved_bytes
    # selective-op: the input, the 1st, 3rd and 5th matmuls (q, v, fc1), SDPA's output and lse
    assert block.selective_op_kept_bytes == (1 + 1 + 1 + 4 + 1) * bsh + lse


def test_a_policy_recomputes_the_operators_it_does_not_keep(block):
    """selective redoes SDPA's forward FLOPs; selective-op the 2nd and 4th matmuls (k, proj; fc2,
    the 6th, comes after the last tensor saved for backward, where recomputation stops)."""
    attention = 4 * B * S * S * H
    assert block.selective_recompute_flops == attention
    assert block.selective_op_recompute_flops == 2 * (2 * B * S * H * H)
    assert block.selective_recompute_op_bytes > 0 and block.selective_recompute_param_op_bytes == 0


class _Created(TorchDispatchMode):
    """Which block created each storage in forward (real tensors)."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.block: int | None = None
        self.created: dict[StorageWeakRef, tuple[int, int]] = {}
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "block", i))
            layer.register_forward_hook(lambda *_: setattr(self, "block", None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if self.block is not None and isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.created.setdefault(StorageWeakRef(storage), (self.block, storage.nbytes()))
        return out


class _Ops(TorchDispatchMode):
    """Operators run, as the profile counts them (no detach, no device query)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func not in (torch.ops.aten.detach.default, torch.ops.prim.device.default)
        return func(*args, **(kwargs or {}))


def _checkpointed(policy: str) -> Model:
    torch.manual_seed(0)
    model = Model()
    apply_activation_checkpointing(model, Plan(activation_checkpointing=policy, block_container="layers"))
    return model


def _kept_for_real(policy: str) -> int:
    """Bytes the middle block keeps after a real forward under the plugin's ``policy``: the
    storages it created that are still alive (not its output, not the weights' views), plus its
    input, which its checkpoint or first norm holds."""
    model, seen = _checkpointed(policy), {}
    model.layers[1].register_forward_hook(lambda _, args, out: seen.update(input=args[0], output=out))
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    with _Created(model) as created:
        loss = _loss(model(torch.randint(0, VOCAB, (B, S))))
    skip = params | {StorageWeakRef(seen["output"].untyped_storage())}
    alive = sum(n for ref, (i, n) in created.created.items() if i == 1 and ref not in skip and not ref.expired())
    loss.backward()
    return alive + seen["input"].untyped_storage().nbytes()


def _backward_cost(policy: str) -> tuple[int, int]:
    """FLOPs and operators of a real backward (with its recomputation) under ``policy``."""
    loss = _loss(_checkpointed(policy)(torch.randint(0, VOCAB, (B, S))))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as flops, _Ops() as ops:
        loss.backward()
    return flops.get_total_flops(), ops.count


@pytest.mark.parametrize("policy", POLICIES)
def test_the_profile_predicts_what_a_real_cpu_block_keeps(block, policy):
    """The plugin's checkpointing run for real on CPU: what autograd and the checkpoint keep
    alive after forward matches the fake-tensor profile (measured equal on torch 2.13)."""
    assert _kept_for_real(policy) == pytest.approx(_kept(block, policy), rel=0.02)


def test_the_profile_predicts_what_a_real_backward_recomputes(block):
    """The three blocks' backward under each selective policy runs, beyond an unchecked one's, the
    FLOPs and operators the profile measured (non-reentrant checkpoint's early stop included)."""
    base_flops, base_ops = _backward_cost("none")
    for policy in ("selective", "selective-op"):
        flops, ops = _backward_cost(policy)
        assert flops - base_flops == 3 * getattr(block, policy_field(policy, "recompute_flops"))
        assert ops - base_ops == 3 * getattr(block, policy_field(policy, "recompute_ops"))


@pytest.fixture(scope="module")
def llama3_8b():
    return profile_spec("llama-3-8b", seq_len=8192)


def _llama_plan(profile, policy: str) -> Plan:
    return Plan(dp_shard=8, zero=3, micro_batch_size=2, activation_checkpointing=policy,
                block_container=profile.block_container)


def test_llama_3_8b_policies_predict_different_memory(llama3_8b):
    """Llama 3 8B, 8 × H100, 8192 tokens, micro-batch 2, FSDP ZeRO-3: each policy its own
    memory, less as it keeps less; recomputing more costs more time."""
    cluster, workload = parse_cluster("8xH100-SXM-80GB"), Workload(global_batch_size=16, seq_len=8192)
    estimates = {p: evaluate(llama3_8b, cluster, workload, _llama_plan(llama3_8b, p)) for p in POLICIES}
    memory = [estimates[p].memory.total for p in POLICIES]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4
    assert 0 < estimates["selective"].time.recompute < estimates["full"].time.recompute


def test_llama_3_8b_selective_op_keeps_half_the_matmuls_and_the_attention(llama3_8b):
    """The 1st, 3rd, 5th and 7th of wq wk wv wo w1 w3 w2 (4096 + 1024 + 14336 + 4096 of 43008
    output widths), SDPA's output and log-sum-exp, and the block's input; in bf16 as FSDP runs it."""
    block = llama3_8b.computed_by(_llama_plan(llama3_8b, "selective-op")).blocks[0]
    tokens, half = 2 * 8192, 2
    widths = sum(linear.out_features for linear in block.linears)
    kept_widths = 4096 + 1024 + 14336 + 4096
    assert widths == 43008 and 0.45 < kept_widths / widths < 0.6
    lse = 2 * 32 * 8192 * 4
    assert block.selective_op_kept_bytes == block.input_bytes + tokens * half * (kept_widths + 4096) + lse
    assert block.selective_kept_bytes == block.input_bytes + tokens * half * widths


def test_the_profile_holds_every_selective_policy_the_plan_names():
    names = {f.name for f in fields(SegmentProfile)}
    assert {policy_field(p, q.name) for p in SELECTIVE_POLICIES for q in fields(PolicyCounts)} <= names


def test_checkpointing_turns_a_hugging_face_key_value_cache_off(caplog):
    """A Hugging Face causal LM caches its keys and values in training where its config says
    ``use_cache``: the cache keeps every layer's through the step and each recompute adds its
    own, so checkpointing freed little. The plugin turns it off and says so; the step then peaks
    as one the user runs with ``use_cache=False``, below one with the cache."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed._tools.mem_tracker import MemTracker

    config = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config.use_cache
    apply_activation_checkpointing(model, Plan(activation_checkpointing="full", block_container="model.layers"))
    assert model.config.use_cache is False
    assert "use_cache = False" in caplog.text
    tokens = torch.randint(0, 128, (2, 256))

    def peak(**kwargs) -> int:
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(input_ids=tokens, labels=tokens, **kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
        return max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())

    assert peak() == peak(use_cache=False) < peak(use_cache=True)
