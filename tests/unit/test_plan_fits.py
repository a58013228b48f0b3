"""A plan made for another model (or launch) is refused before anything runs, every mismatch
named: by ``check_plan_fits``, by ``apply_plan`` and by ``make_accelerator(plan, model=...)``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from stratagem.errors import UsageError
from stratagem.integrations import accelerate as acc
from stratagem.models import get_preset
from stratagem.plan import Plan
from stratagem.plugins import apply_plan, check_plan_fits

LLAMA_LAYOUT = (("layers.*.attention.wq", "colwise"), ("layers.*.attention.wo", "rowwise"))
GPT2_HF_LAYOUT = (("transformer.h.*.attn.c_attn", "colwise"), ("transformer.h.*.attn.c_proj", "rowwise"))


def llama_tiny():
    return get_preset("llama-tiny").build()  # 4 blocks in 'layers'


def test_a_plan_for_this_model_fits():
    check_plan_fits(llama_tiny(), Plan(tp=2, dp_shard=2, zero=3, block_container="layers", tp_layout=LLAMA_LAYOUT),
                    world_size=4)
    check_plan_fits(llama_tiny(), Plan(pp=2, microbatches=2, block_container="layers", stage_blocks=(3, 1)))
    check_plan_fits(llama_tiny(), Plan())  # names nothing


def test_a_plan_naming_modules_the_model_lacks_names_them_all():
    plan = Plan(tp=2, dp_shard=2, zero=3, block_container="transformer.h", tp_layout=GPT2_HF_LAYOUT)
    with pytest.raises(UsageError) as error:
        check_plan_fits(llama_tiny(), plan)
    message = str(error.value)
    for text in ("was not made for this Transformer", "block_container 'transformer.h' is not one of its submodules",
                 "its module lists: 'layers'", "'transformer.h.*.attn.c_attn', 'transformer.h.*.attn.c_proj'",
                 "HINT: advise for this model"):
        assert text in message


def test_a_plan_for_a_model_held_inside_this_one_says_the_prefix():
    """`advise --emit lightning` for a factory's model names its blocks 'layers'; a LightningModule
    holding that model as 'model' has them at 'model.layers'."""
    from torch import nn

    wrapper = nn.Module()
    wrapper.model = llama_tiny()
    with pytest.raises(UsageError, match=re.escape("as 'model'? Prefix block_container and tp_layout's patterns "
                                                   "with 'model.'")):
        check_plan_fits(wrapper, Plan(tp=2, block_container="layers", tp_layout=LLAMA_LAYOUT))


@pytest.mark.parametrize(("plan", "world_size", "expected"), [
    (Plan(tp=2, block_container="layers", tp_layout=(*LLAMA_LAYOUT, ("layers.*.attention.wqkv", "colwise"))), None,
     "tp_layout names modules it lacks: 'layers.*.attention.wqkv'"),
    (Plan(pp=2, microbatches=2, block_container="layers", stage_blocks=(6, 6)), None,
     "stage_blocks [6, 6] split 12 blocks, but 'layers' holds 4"),
    (Plan(pp=4, pp_virtual=2, microbatches=4, pp_schedule="interleaved-1f1b", block_container="layers"), None,
     "its 8 pipeline stages need at least as many blocks, but 'layers' holds 4"),
    (Plan(block_container="layers.0.attention.wq"), None, "block_container 'layers.0.attention.wq' holds no blocks"),
    (Plan(dp_replicate=8, block_container="layers"), 2,
     "(?s)its degrees multiply to 8 ranks.*but 2 run.*HINT:.*or launch 8 processes"),
])
def test_each_mismatch_is_named(plan, world_size, expected):
    with pytest.raises(UsageError, match=expected if expected.startswith("(?s)") else re.escape(expected)):
        check_plan_fits(llama_tiny(), plan, world_size=world_size)


def test_apply_plan_refuses_a_plan_for_another_model_before_reading_the_mesh():
    plan = Plan(dp_shard=2, zero=3, block_container="transformer.h")
    with pytest.raises(UsageError, match="(?s)'transformer.h' is not one of its submodules.*HINT:"):
        apply_plan(llama_tiny(), plan, None)


def test_make_accelerator_refuses_a_plan_for_another_model_before_building_one(monkeypatch):
    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", lambda **_: pytest.fail("an Accelerator was built"))
    with pytest.raises(UsageError, match="(?s)'transformer.h' is not one of its submodules.*HINT:"):
        acc.make_accelerator(Plan(precision="fp32", block_container="transformer.h"), model=llama_tiny(), cpu=True)
    with pytest.raises(UsageError, match="(?s)Accelerate trains no pipeline parallelism.*HINT:"):
        acc.make_accelerator(Plan(pp=2, microbatches=2, block_container="layers"), model=llama_tiny(), cpu=True)


def test_make_accelerator_takes_the_block_classes_from_the_model(monkeypatch):
    import accelerate

    built = {}

    class Accelerator:  # stands in for accelerate's: records the plugins it is given
        def __init__(self, **kwargs):
            built.update(kwargs)
            self.num_processes, self.distributed_type = 2, SimpleNamespace(value="FSDP")

    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    acc.make_accelerator(Plan(dp_shard=2, zero=3, block_container="layers"), model=llama_tiny())
    assert list(built["fsdp_plugin"].transformer_cls_names_to_wrap) == ["Block"]


def test_apply_plan_refuses_only_what_it_would_read():
    from stratagem.plugins.apply import _as_applied

    ddp = Plan(dp_replicate=2, block_container="transformer.h", tp_layout=GPT2_HF_LAYOUT)  # DDP reads neither
    assert _as_applied(ddp) == Plan(dp_replicate=2)
    check_plan_fits(llama_tiny(), _as_applied(ddp))
    checkpointed = Plan(activation_checkpointing="full", block_container="transformer.h")
    assert _as_applied(checkpointed) == checkpointed
