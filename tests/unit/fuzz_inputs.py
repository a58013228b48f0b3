"""Generated inputs for every boundary a user types into, and the one property they share: each
ends in a clean :class:`~stratagem.errors.UsageError` or a valid result, never another exception.

The property tests (``test_properties.py``) run a few hundred of each per ``make test``;
``bench/fuzz.py`` runs tens of thousands and counts the outcomes. Pytest puts this folder on
``sys.path``; the bench adds it.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from hypothesis import strategies as st

from stratagem.advisor.hardware import gpu_names, network_names
from stratagem.errors import UsageError
from stratagem.plan import Plan

USAGE_ERROR, VALID, CRASH = "usage error", "valid", "traceback"

# -- values of any JSON type, the odd ones weighted up ------------------------------------------

HUGE = st.sampled_from([2**31, 2**31 + 1, 2**63, 2**63 - 1, 10**30, -(10**30)])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-8, 64), HUGE,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["false", "true", "0", "1", "3", "none", "full", "params", "gpipe",
                                     "1f1b", "interleaved-1f1b", "bf16-mixed", "layers", "colwise"]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)

# Values a field of each type plausibly takes, so that generated plans reach the deeper checks.
_PLAUSIBLE = {
    "int": st.one_of(st.integers(1, 8), st.sampled_from([0, -1, 16, 3.0, True])),
    "bool": st.one_of(st.booleans(), st.sampled_from(["false", 0, 1, None])),
    "str": st.sampled_from(["none", "selective", "selective-op", "full", "optimizer", "params", "gpipe", "1f1b",
                            "interleaved-1f1b", "interleaved-zb", "fp32", "bf16-mixed", "bf16-true", "abc", 5]),
    "str | None": st.sampled_from([None, "layers", "", 5, ["layers"]]),
    "tuple[tuple[str, str], ...]": st.one_of(
        st.lists(st.tuples(st.sampled_from(["layers.*.attention.wq", "output", "layers.*.w2"]),
                           st.sampled_from(["colwise", "rowwise", "sequence_parallel", "diagonal"])).map(list),
                 max_size=3),
        st.sampled_from([5, None, "abc", [["a"]], [[1, 2]]])),
    "tuple[int, ...] | None": st.one_of(st.none(), st.lists(st.integers(-1, 6), max_size=5),
                                        st.sampled_from([5, "3,1", [2.0, 2]])),
}


_VALID_PLANS = [Plan(), Plan(dp_replicate=4), Plan(dp_shard=8, zero=3, block_container="layers"),
                Plan(tp=2, sequence_parallel=True, dp_shard=2, zero=2, tp_layout=(("layers.*.attention.wq", "colwise"),)),
                Plan(pp=2, microbatches=4, stage_blocks=(3, 5)),
                Plan(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2, microbatches=4, dp_shard=2, zero=1),
                Plan(dp_shard=1, zero=3, offload="params", activation_checkpointing="full", grad_accum=4)]


@st.composite
def plan_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A dict of Plan fields: a valid plan's, with up to four fields changed to plausible values or
    anything JSON holds, now and then a field Plan does not have, or fields left out."""
    data = draw(st.sampled_from(_VALID_PLANS)).to_dict()
    for field in draw(st.lists(st.sampled_from(fields(Plan)), max_size=4, unique=True)):
        plausible = _PLAUSIBLE.get(str(field.type), JSON_VALUES)
        data[field.name] = draw(st.one_of(plausible, JSON_VALUES) if draw(st.integers(0, 5)) == 0 else plausible)
    for name in draw(st.lists(st.sampled_from(sorted(data)), max_size=3, unique=True)):
        del data[name]  # left to its default
    if draw(st.integers(0, 19)) == 0:
        data[draw(st.text(min_size=1, max_size=8))] = draw(SCALARS)
    return data


def plan_texts() -> st.SearchStrategy[str]:
    """Text a plan file might hold: plan dicts in JSON, wrapped as ``advise --format json`` wraps
    them or not, any JSON value, deep nesting, and text that is no JSON at all."""
    wrapped = plan_dicts().flatmap(lambda d: st.sampled_from([d, {"plan": d}, {"plans": [{"plan": d}]}, {"plans": [d]}]))
    return st.one_of(wrapped.map(json.dumps), JSON_VALUES.map(json.dumps), st.text(max_size=40),
                     st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n),
                     st.sampled_from(['{"plans": [1]}', '{"plans": []}', '{"plan": 5}', "", "{", "null"]))


# -- cluster specs -------------------------------------------------------------------------------

_NAMES = st.sampled_from([*gpu_names(), "H100", "A100", "H200", "cpu", "CPU", "NoSuchGPU", "H100ü", ""])
_COUNTS = st.one_of(st.integers(0, 1100), HUGE, st.sampled_from([-1, 1, 2, 4, 8]))


@st.composite
def cluster_specs(draw: st.DrawFn) -> str:
    """Cluster spec strings: the grammar's pieces recombined with odd counts, names and separators,
    and random text."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(alphabet=string.printable + "üx×", max_size=30))
    counts = draw(st.lists(_COUNTS, max_size=2))
    spec = "".join(f"{n}x" for n in counts) + draw(_NAMES) + draw(st.sampled_from(["", "", "+bridge", "+"]))
    if draw(st.booleans()):
        network = draw(st.sampled_from([*network_names(), "ib", "nvlink", ""]))
        nics = draw(st.one_of(st.just(""), _COUNTS.map(lambda n: f"-x{n}")))
        spec += f":{network}{nics}"
    return spec


# -- Hugging Face configs ------------------------------------------------------------------------

SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
             "num_key_value_heads", "max_position_embeddings", "head_dim", "n_embd", "n_head", "n_layer")
ANY_VALUE = st.one_of(
    st.integers(min_value=-3, max_value=300),
    st.sampled_from([0, 1, 64, 2**18, 2**18 + 1, 2**31, 2**63, 10**30, -64, 10**7]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=5), st.lists(st.integers(-2, 70), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
MODEL_TYPE = st.one_of(st.sampled_from(["llama", "gpt2", "mistral", "qwen2", "vit", "bert", "lama", ""]),
                       st.text(max_size=8), st.integers(), st.none(), st.floats())
# Hugging Face configs that often pass the checks: small powers of two on the types hf: builds.
HF_PLAUSIBLE = st.fixed_dictionaries(
    {"model_type": st.sampled_from(["llama", "gpt2", "mistral", "qwen2"])},
    optional={key: st.sampled_from([1, 2, 4, 8, 16, 32, 64]) for key in SIZE_KEYS},
)
HF_CONFIGS = st.one_of(
    st.fixed_dictionaries({}, optional={"model_type": MODEL_TYPE, **{key: ANY_VALUE for key in SIZE_KEYS}}),
    HF_PLAUSIBLE,
    HF_PLAUSIBLE.flatmap(lambda c: st.fixed_dictionaries({}, optional={k: ANY_VALUE for k in SIZE_KEYS})
                      .map(lambda extra: {**c, **extra})),
)



# -- numbers as the command line takes them -------------------------------------------------------

NUMBER_TEXTS = st.one_of(st.integers(-5, 5000).map(str), HUGE.map(str),
                         st.sampled_from(["0", "-1", "1e9", "1.5", "nan", "inf", "", " 8", "0x10", "9" * 40]))


def classify(call: Callable[[], Any]) -> str:
    """What ``call`` ended in: :data:`VALID`, :data:`USAGE_ERROR`, or (re-raised) anything else."""
    try:
        call()
    except UsageError as err:
        assert str(err).strip(), "a usage error says what is wrong"
        return USAGE_ERROR
    return VALID
