"""Property tests: generated Hugging Face configs and model names through the checking and loading
path. Each must end in a valid result or a UsageError with a HINT: never another exception, never
a hang. Deterministic (derandomize) so that CI sees the same cases every run: 940 cases in all
(400 configs checked and built as transformers configs, 120 files read, 20 models built on meta,
400 model names loaded)."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from stratagem.advisor.profile.hf_configs import build_hf_config, check_hf_config, read_hf_config  # noqa: E402
from stratagem.advisor.profile.sources import ModelSource, load_model  # noqa: E402
from stratagem.errors import UsageError  # noqa: E402
from fuzz_inputs import HF_CONFIGS as CONFIGS, HF_PLAUSIBLE as PLAUSIBLE  # noqa: E402



def cases(n: int) -> settings:
    """``n`` generated cases, the same every run; slow ones and fixtures are fine."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _is_usage_error(err: UsageError) -> None:
    event("UsageError")
    lines = str(err).splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("HINT:"), str(err)


def _check_sizes_hold(config) -> None:
    """What a config that passed must satisfy, read back from transformers."""
    text = config.get_text_config(decoder=True)
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        value = getattr(text, name, None)
        assert value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1), name


@cases(400)
@given(CONFIGS)
def test_generated_configs_pass_the_checks_or_are_usage_errors(data):
    where = "generated/config.json"
    try:
        check_hf_config(data, where)
        config = build_hf_config(data, where)
    except UsageError as err:
        _is_usage_error(err)
        assert where in str(err)
        return
    event("valid")
    _check_sizes_hold(config)


@cases(120)
@given(st.one_of(CONFIGS.map(lambda c: json.dumps(c).encode()), st.binary(max_size=40),
                 st.text(max_size=40).map(str.encode)))
def test_generated_config_files_read_as_objects_or_usage_errors(tmp_path, contents):
    path = tmp_path / "config.json"
    path.write_bytes(contents)
    try:
        found, data = read_hf_config(str(path))
    except UsageError as err:
        _is_usage_error(err)
        assert str(path) in str(err)
        return
    event("valid")
    assert found == path and isinstance(data, dict)


@cases(20)
@given(PLAUSIBLE.map(lambda c: {**c, "num_hidden_layers": 1, "n_layer": 1}))
def test_plausible_configs_build_a_model_or_are_usage_errors(tmp_path, data):
    path = tmp_path / "generated.json"
    path.write_text(json.dumps(data))
    try:
        source = load_model(f"hf:{path}", seq_len=8)
    except UsageError as err:
        _is_usage_error(err)
        return
    event("valid")
    assert isinstance(source, ModelSource) and source.example_inputs["input_ids"].shape == (1, 8)


# Model names -------------------------------------------------------------------------------

# Stdlib modules are paired only with these attributes: a random one might be os.fork or os.abort.
KNOWN_ATTRS = ["loads", "dumps", "path", "exit", "getcwd", "sqrt", "pi", "nope", "path.join", "", "a.b", "x-y"]
SAFE_ATTRS = ["mlp", "mlp_with_loss", "module_only", "not_a_module", "raises", "exits", "tokens",
              "needs_seq_len", "nope", "torch", "nn.Linear", "mlp.__call__"]
IDENTIFIER = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,8}(\.[A-Za-z_][A-Za-z0-9_]{0,8}){0,2}\Z")
SHAPED_SPECS = st.one_of(
    st.builds("{}:{}".format, st.sampled_from(["json", "os", "os.path", "sys", "math"]), st.sampled_from(KNOWN_ATTRS)),
    st.builds("{}:{}".format, st.just("model_factories"),
              st.one_of(st.sampled_from(SAFE_ATTRS), IDENTIFIER.filter(lambda a: a.split(".")[0] not in
                                                                        ("torch", "nn", "sys")))),
    st.builds("{}:{}".format, st.sampled_from(["no_such_module_q", "no_such.pkg", "", ".rel", "a-b", "1x"]),
              st.one_of(st.sampled_from(SAFE_ATTRS + KNOWN_ATTRS), st.text(max_size=6))),
    st.builds("{}:{}:{}".format, IDENTIFIER, IDENTIFIER, IDENTIFIER),
)


def _load(spec: str, seq_len: int | None) -> None:
    try:
        source = load_model(spec, batch_size=2, seq_len=seq_len)
    except UsageError as err:
        _is_usage_error(err)
        return
    event("valid")
    assert isinstance(source, ModelSource)


@cases(200)
@given(SHAPED_SPECS, st.one_of(st.none(), st.integers(1, 16)))
def test_generated_factory_names_load_or_are_usage_errors(spec, seq_len):
    _load(spec, seq_len)


def _importable_elsewhere(spec: str) -> bool:
    """Whether a random name would import a real module other than the test's factories."""
    if spec.startswith("hf:") or ":" not in spec:
        return False
    top = spec.partition(":")[0].split(".")[0]
    if not top.isidentifier() or top == "model_factories":
        return False
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


@cases(200)
@given(st.one_of(st.text(max_size=24), st.text(max_size=12).map("hf:{}".format),
                 st.from_regex(r"\A[a-z_.:]{0,14}\Z")))
def test_random_model_names_load_or_are_usage_errors(spec):
    assume(not _importable_elsewhere(spec))
    _load(spec, None)

