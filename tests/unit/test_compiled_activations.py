"""What a compiled block keeps for backward (profile/compiled.py): the profile traces each kind of
block as torch.compile does, and compiled plans' memory follows it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.profiler import profile_model
from stratagem.models import get_preset
from stratagem.plan import Plan, Workload
from test_compile_plugin import Blocks  # pytest puts this folder on sys.path


def _saved_by_torch_compile(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes ``block`` compiled by torch.compile (inductor's decompositions and partitioner, no
    code generated) saves for backward on real tensors: each storage once, parameters not."""
    params = {StorageWeakRef(p.untyped_storage()) for p in block.parameters()}
    saved: dict[StorageWeakRef, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params:
            saved.setdefault(ref, tensor)
        return tensor

    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.compile(block, backend="aot_eager_decomp_partition")(x)
    torch._dynamo.reset()
    return sum(tensor.untyped_storage().nbytes() for tensor in saved.values())


def test_the_profile_counts_what_torch_compile_saves():
    """The profile's trace on fake tensors against torch.compile itself on real ones, block by
    block: a ResNet's bottlenecks (BatchNorm's running statistics updated in place, ReLU's
    backward kept as a mask)."""
    preset = get_preset("resnet-tiny")
    torch.manual_seed(0)
    model = preset.build()
    (images,), _ = preset.make_batch(2)
    profile = profile_model(model, (images,), loss_fn=lambda out: out.sum(), precision="fp32",
                            reuse_identical_blocks=False)
    x = model.stem(images)
    for block, measured in zip(model.layers, profile.blocks):
        x = x.detach().requires_grad_()
        assert measured.compiled_saved_bytes == _saved_by_torch_compile(block, x), measured.name
        x = block(x)


def test_compiled_blocks_keep_less_and_compiled_plans_need_less_memory():
    """llama-tiny: the partitioner recomputes norms' and activations' outputs in backward."""
    profile = profile_spec("llama-tiny", seq_len=64)
    block = profile.blocks[0]
    assert 0 < block.compiled_saved_bytes < block.saved_bytes
    cluster = parse_cluster("1xH100-SXM-80GB")
    workload = Workload(global_batch_size=8, seq_len=64)
    eager = evaluate(profile, cluster, workload, Plan(micro_batch_size=8, block_container="layers"))
    compiled = evaluate(profile, cluster, workload, Plan(micro_batch_size=8, block_container="layers", compile=True))
    fewer = sum(b.saved_bytes - b.compiled_saved_bytes for b in profile.blocks) * 8 / profile.batch_size
    assert eager.memory.activations - compiled.memory.activations == pytest.approx(fewer)


def test_cpu_profiles_measure_no_compiled_activations():
    assert all(b.compiled_saved_bytes == 0 for b in profile_spec("llama-tiny", seq_len=64, kernels="cpu").blocks)


def test_hugging_face_layers_are_traced_on_their_own_arguments(tmp_path):
    """A Qwen2's decoder layers are traced on what they take as they run (position embeddings,
    position ids); a cache they fill is left out (tests/unit/test_tp_layout.py)."""
    pytest.importorskip("transformers")
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_spec(f"hf:{tmp_path / 'config.json'}", batch_size=2, seq_len=32, cache=False)
    assert not [note for note in profile.notes if "compiled plans keep" in note]
    assert all(0 < b.compiled_saved_bytes <= b.saved_bytes for b in profile.blocks)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_step_that_runs_the_layers_with_their_cache_is_told_each_compiles_apart(use_cache):
    """A training step that calls a Hugging Face Llama as the config has it (use_cache=True) hands
    every layer the cache, on whose layer index dynamo specializes (bench/compile_graphs.py: 6 graphs
    for 6 layers, 1 without it); the profile says so and how to turn it off. The trace cannot take
    the cache, so the compiled layers are priced with their eager bytes (on one H100 a Llama's
    compiled layers with their cache kept what eager ones keep), and that is said too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 16))
    profile = profile_model(model, {"input_ids": ids, "labels": ids, "use_cache": use_cache}, precision="bf16-mixed")
    said = [note for note in profile.notes if "key/value cache" in note]
    eager = [note for note in profile.notes if "compiled plans keep the eager step's activations" in note]
    if use_cache:
        assert len(said) == 1 and "3 blocks" in said[0] and "use_cache=False" in said[0], profile.notes
        # what the layers keep compiled with the cache was not traced: priced eager, and said
        assert len(eager) == 1 and "DynamicCache" in eager[0] and not any(b.compiled_saved_bytes for b in profile.blocks)
    else:
        assert not said and not eager and all(b.compiled_saved_bytes for b in profile.blocks)


class _Counting(nn.Module):
    """A block that keeps a running total in a plain tensor attribute, which AOTAutograd cannot
    trace (it mutates a tensor that is not an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.total = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.detach().sum())
        return self.linear(x)


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Counting(), _Counting()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_block_the_trace_cannot_take_is_priced_eager_and_the_profile_says_so():
    profile = profile_model(_Counted(), (torch.randn(4, 8),), precision="fp32")
    assert [note for note in profile.notes if "compiled plans keep the eager step's activations" in note]
    assert all(b.compiled_saved_bytes == 0 for b in profile.blocks)


@pytest.mark.parametrize("batch", [2, 3])
def test_activations_shaped_like_a_weight_are_activations(batch):
    """Autocast's copies of the weights are told apart by what they are computed from, not by
    their shape: at 2 × 8 tokens the second Linear's 16-bit input, [16, 32], is shaped like its
    weight, and counts as an activation all the same (in proportion to the tokens)."""
    def per_token(tokens_per_sample: int) -> float:
        profile = profile_model(Blocks(), (torch.randn(batch, tokens_per_sample, 16),), precision="bf16-mixed")
        return profile.blocks[0].compiled_saved_bytes / (batch * tokens_per_sample)

    assert per_token(8) == per_token(7) > 0


class _Handle:
    """An object deepcopy refuses (it holds a lock)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()


class _TakesHandle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, handle: _Handle) -> torch.Tensor:
        return self.linear(x) if handle.lock is not None else x


class _WithHandle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_TakesHandle() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        handle = _Handle()
        for layer in self.layers:
            x = layer(x, handle=handle)
        return x


def test_blocks_called_with_objects_that_cannot_be_copied_still_profile():
    """The profile keeps each block's call to run it again; an object deepcopy refuses is kept as
    it is, and the blocks are measured compiled all the same."""
    profile = profile_model(_WithHandle(), (torch.randn(4, 8),), precision="fp32")
    assert all(block.compiled_saved_bytes > 0 for block in profile.blocks)
