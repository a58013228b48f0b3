"""load_model: presets, factories and Hugging Face configs, and the errors for bad names."""

from __future__ import annotations

import json
import warnings

import pytest
from torch._subclasses.fake_tensor import FakeTensor

from stratagem.advisor.profile.sources import load_model
from stratagem.advisor.profile.cache import profile_spec
from stratagem.errors import UsageError

LLAMA_2_7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "hidden_act": "silu",
}


def test_factory_gets_the_batch_size_and_allocates_nothing():
    source = load_model("model_factories:mlp", batch_size=3)
    assert isinstance(next(source.module.parameters()), FakeTensor)
    assert source.example_inputs[0].shape == (3, 16)
    profile = profile_spec("model_factories:mlp", batch_size=3, precision="fp32")
    assert profile.num_params == 16 * 64 + 64 + 64 * 16 + 16 and profile.batch_size == 3


def test_factory_may_bring_its_loss_closing_over_tensors():
    profile = profile_spec("model_factories:mlp_with_loss", precision="fp32")
    assert not any("sum of the outputs" in n for n in profile.notes)
    assert profile.head.fwd_flops == 0 and profile.flops_per_step > 0


def test_a_factory_s_own_batch_and_a_told_layout_are_what_the_profile_counts():
    """A factory without batch_size chose four samples: the profile is of four, per sample as the
    one told two. One told batch_size and seq_len is profiled at those, whatever its layout."""
    told, own = profile_spec("model_factories:mlp", precision="fp32"), profile_spec("model_factories:mlp_four_samples",
                                                                                   precision="fp32")
    assert (told.batch_size, own.batch_size) == (2, 4) and own.flops_per_step == 2 * told.flops_per_step
    assert "declares no batch_size parameter: profiled at the 4 samples its inputs hold, not the 2" in own.notes[0]
    first = profile_spec("model_factories:sequence_first", seq_len=16, precision="fp32")
    assert (first.batch_size, first.seq_len) == (2, 16)
    assert profile_spec("model_factories:sequence_first", precision="fp32").seq_len == 8  # its own default
    assert "dimension 0 (16) is not the batch of 2" in first.pp_unavailable  # a pipeline would split the sequence
    with pytest.raises(UsageError, match="declares no seq_len parameter: --seq-len does not apply"):
        profile_spec("model_factories:mlp", seq_len=16)


def test_a_factory_s_loss_or_keyword_inputs_leave_pipelines_out():
    """A loss closing over the batch's targets cannot be applied per micro-batch (verify had
    broadcast or failed); pipeline stages take positional inputs."""
    assert "whole batch's output" in profile_spec("model_factories:mlp_with_targets", precision="fp32").pp_unavailable
    assert "keyword" in profile_spec("model_factories:mlp_keyword_inputs", precision="fp32").pp_unavailable
    from stratagem.advisor.profile.cache import _pipeline_refusal

    assert _pipeline_refusal(load_model("model_factories:tokens", batch_size=2)) is None  # no loss, positional


def test_parameters_without_a_gradient_leave_ddp_out():
    """DDP fails the second step when a parameter got no gradient in the first (verify's DDP plans
    of such a model had all failed); FSDP's plans remain, and a DDP plan given by hand is refused."""
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.advice import advise
    from stratagem.advisor.search.targets import model_excludes
    from stratagem.plan import Plan, Workload

    profile = profile_spec("model_factories:mlp_with_unused", precision="fp32")
    assert profile.ddp_unavailable.startswith("aux.weight, aux.bias get no gradient")
    assert profile_spec("model_factories:mlp", precision="fp32").ddp_unavailable is None
    cluster = parse_cluster("4xA100")
    advice = advise(profile, cluster, Workload(global_batch_size=8, precision="fp32"), target="any")
    assert advice.plans and not any(e.plan.uses_ddp for e in advice.plans)
    assert any(note.startswith("No DDP plans") for note in advice.notes)
    assert model_excludes(profile, cluster, Plan(dp_replicate=4, micro_batch_size=2, precision="fp32")).startswith(
        "no DDP")


def test_blocks_on_2d_activations_get_tensor_but_not_sequence_parallelism():
    """Sequence parallelism shards dimension 1 of the blocks' inputs: a [batch, width] input has
    none (verify's tp2+sp plan of such a model had failed with a matmul shape error)."""
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.advice import advise
    from stratagem.advisor.search.targets import model_excludes
    from stratagem.plan import Plan, Workload

    profile = profile_spec("model_factories:feed_forwards", precision="fp32")
    assert profile.sp_unavailable == "the blocks' inputs ([2, 16]) have no sequence dimension for it to split"
    cluster = parse_cluster("8xA100")
    advice = advise(profile, cluster, Workload(global_batch_size=64, precision="fp32"), constraints={"tp": 2})
    assert advice.plans and not any(e.plan.sequence_parallel for e in advice.plans)
    assert any(note.startswith("No sequence-parallel plans") for note in advice.notes)
    plan = Plan(tp=2, dp_replicate=4, sequence_parallel=True, micro_batch_size=16, precision="fp32")
    assert model_excludes(profile, cluster, plan).startswith("no sequence parallelism")


def test_blocks_whose_class_other_modules_share_leave_accelerate_s_fsdp_out():
    """Accelerate wraps FSDP units by class name: here every nn.Sequential, the stem too, where the
    plan's units are the blocks; its FSDP plans would train something other than what was costed."""
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.advice import advise
    from stratagem.plan import Workload

    profile = profile_spec("model_factories:stem_and_blocks", precision="fp32")
    assert profile.class_wrap_extra == "Sequential: stem"
    assert profile_spec("model_factories:mlp_with_unused", precision="fp32").class_wrap_extra is None
    cluster, workload = parse_cluster("8xA100"), Workload(global_batch_size=64, precision="fp32")
    fsdp = {"zero": (2, 3)}
    assert advise(profile, cluster, workload, target="any", constraints=fsdp).plans
    with pytest.raises(UsageError, match="(?s)wraps units by class name.*HINT: --target any"):
        advise(profile, cluster, workload, target="accelerate", constraints=fsdp)
    assert not any(e.plan.uses_fsdp for e in advise(profile, cluster, workload, target="accelerate").plans)


def test_a_factory_that_deep_copies_fake_parameters_profiles_without_torch_s_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model("model_factories:encoder", batch_size=2)
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]


@pytest.mark.parametrize("spec, message", [
    ("model_factories:module_only", "example inputs"),
    ("model_factories:not_a_module", "must return"),
    ("model_factories:nope", "cannot load factory"),
    ("no_such_pkg.mod:f", "cannot load factory"),
    ("hf:/no/such/dir", "no Hugging Face config"),
])
def test_bad_model_specs_are_usage_errors(spec, message):
    with pytest.raises(UsageError, match=message):
        load_model(spec)


def test_hugging_face_config_builds_the_causal_lm_on_meta(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B_CONFIG))
    source = load_model(f"hf:{tmp_path}", seq_len=128)
    assert sum(p.numel() for p in source.module.parameters()) == 6_738_415_616
    tiny = dict(LLAMA_2_7B_CONFIG, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=3, vocab_size=100)
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    profile = profile_spec(f"hf:{tmp_path / 'config.json'}", batch_size=2, seq_len=32)
    assert profile.block_container == "model.layers" and len(profile.blocks) == 3
    assert profile.blocks[2].measured_as == "model.layers.0"
    assert (profile.num_heads, profile.num_kv_heads) == (4, 2)
    assert profile.head.fwd_flops >= 2 * 2 * 32 * 64 * 100  # the LM head, and the loss after it
    assert profile.head.saved_bytes > 0


def test_a_model_type_without_sdpa_is_built_with_eager_attention_and_says_so(tmp_path):
    pytest.importorskip("transformers")
    bloom = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    source = load_model(f"hf:{tmp_path}", batch_size=2, seq_len=32)
    assert source.module.config._attn_implementation == "eager"  # BLOOM's ALiBi has no SDPA path
    assert any("BloomForCausalLM has no SDPA attention" in note for note in source.notes)
    profile = profile_spec(f"hf:{tmp_path}", batch_size=2, seq_len=32)
    assert any("runs eager" in note for note in profile.notes)
    # the scores and their product with the values: two batched GEMMs of 2·s²·d per head and sample
    assert profile.blocks[0].attention_fwd_flops == 2 * (2 * 2 * 32 * 32 * 64)


def test_a_config_that_names_its_attention_is_built_on_it(tmp_path):
    """A config.json's ``attn_implementation`` stands (transformers 4.x's ``from_dict`` drops it
    unless handed it): a Llama that asks for eager attention writes its scores out."""
    pytest.importorskip("transformers")
    tiny = dict(LLAMA_2_7B_CONFIG, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=100)
    for attention in ("eager", "sdpa"):
        (tmp_path / "config.json").write_text(json.dumps({**tiny, "attn_implementation": attention}))
        assert load_model(f"hf:{tmp_path}", batch_size=2, seq_len=32).module.config._attn_implementation == attention


def test_a_model_without_attention_gets_no_note_about_it_and_one_about_its_reference_kernels(tmp_path):
    """Mamba has no SDPA path because it has no attention: no note says its attention runs eager.
    Its selective scan and convolution run transformers' reference PyTorch path in the profile
    (mamba_ssm's kernels are CUDA-only), and the profile says so: through transformers 5's
    fallback wrappers, which are put back, or transformers 4's mixer choosing ``slow_forward``."""
    pytest.importorskip("transformers")
    from transformers.models.mamba import modeling_mamba

    mamba = {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 100, "state_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(mamba))
    source = load_model(f"hf:{tmp_path}", batch_size=2, seq_len=8)
    assert not any("attention" in note for note in source.notes)
    wrapper = getattr(modeling_mamba, "mamba_selective_scan", None)
    profile = profile_spec(f"hf:{tmp_path}", batch_size=2, seq_len=8)
    (note,) = [note for note in profile.notes if "reference PyTorch path" in note]
    if wrapper is None:  # transformers 4.x
        assert "MambaMixer profiled through slow_forward" in note and "mamba-ssm, causal-conv1d" in note
        return
    assert "selective_scan_fn" in note and "causal_conv1d_fn" in note and "mamba_ssm" in note
    assert modeling_mamba.mamba_selective_scan is wrapper


def test_a_sequence_longer_than_learned_positions_is_a_usage_error_and_an_encoder_says_how_it_is_built(tmp_path):
    """BERT learns 64 positions here: 128 tokens have none (it had failed with a reshape error); it
    is profiled as the causal language model transformers builds of it, and says so."""
    pytest.importorskip("transformers")
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    with pytest.raises(UsageError, match="(?s)--seq-len 128 is longer than the 64 positions.*HINT: --seq-len 64"):
        load_model(f"hf:{tmp_path}", batch_size=2, seq_len=128)
    source = load_model(f"hf:{tmp_path}", batch_size=2, seq_len=64)
    assert source.module.config.is_decoder
    assert any("masked language models too" in note and "BertLMHeadModel" in note for note in source.notes)
