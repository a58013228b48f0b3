"""Every model a user names ends in a ModelSource or one UsageError (rule + HINT), never a
traceback or a hang: Hugging Face configs that transformers would choke on, and factories that
cannot be imported, called or that fail themselves."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.sources import load_model
from stratagem.cli import main
from stratagem.errors import UsageError

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64, "n_positions": 32,
             "bos_token_id": 0, "eos_token_id": 0}


def _usage_error(spec: str, *patterns: str, **kwargs) -> str:
    """load_model(spec) raises one UsageError matching every pattern, ending in a HINT line."""
    with pytest.raises(UsageError) as caught:
        load_model(spec, **kwargs)
    message = str(caught.value)
    for pattern in patterns:
        assert pattern in message, message
    assert message.splitlines()[-1].startswith("HINT:"), message
    return message


# Hugging Face configs ----------------------------------------------------------------------

@pytest.fixture
def write_config(tmp_path):
    def write(contents: object, name: str = "config.json") -> str:
        path = tmp_path / name
        path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
        return str(path)
    pytest.importorskip("transformers")
    return write


@pytest.mark.parametrize("text, says", [
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("\"llama\"", "holds a JSON str, not an object"),
])
def test_hf_malformed_or_empty_json_is_a_usage_error(write_config, text, says):
    path = write_config(text)
    _usage_error(f"hf:{path}", path, says)


def test_hf_config_without_model_type(write_config):
    path = write_config({k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    _usage_error(f"hf:{path}", path, "has no model_type")


@pytest.mark.parametrize("model_type, says", [
    ("lama", "did you mean llama"),
    ("zzz-not-a-model", "is not a model type this transformers knows"),
    (7, "model_type must be a string"),
    ("vit", "has no causal language model"),
])
def test_hf_unknown_model_type(write_config, model_type, says):
    path = write_config(dict(TINY_LLAMA, model_type=model_type))
    _usage_error(f"hf:{path}", path, says)


def test_hf_heads_not_dividing_the_hidden_size(write_config):
    path = write_config(dict(TINY_LLAMA, num_attention_heads=5, num_key_value_heads=5))
    _usage_error(f"hf:{path}", path, "num_attention_heads (5) does not divide hidden_size (64)")
    gpt2 = write_config(dict(TINY_GPT2, n_head=5), "gpt2.json")
    _usage_error(f"hf:{gpt2}", "num_attention_heads (5) does not divide hidden_size (32)")


def test_hf_heads_against_the_model_types_default_hidden_size(write_config):
    path = write_config({"model_type": "llama", "num_attention_heads": 5, "num_hidden_layers": 1})
    _usage_error(f"hf:{path}", path, "5")


def test_hf_key_value_heads_not_dividing_the_heads(write_config):
    path = write_config(dict(TINY_LLAMA, num_key_value_heads=3))
    _usage_error(f"hf:{path}", "num_key_value_heads (3) does not divide num_attention_heads (4)")


@pytest.mark.parametrize("value, says", [
    ("64", 'got "64" (str)'),
    (float("nan"), "got NaN (float)"),
    (64.0, "got 64.0 (float)"),
    (True, "got true (bool)"),
    (0, "must be a positive integer, got 0"),
    (-64, "must be a positive integer, got -64"),
    (None, "expected int, got NoneType"),  # transformers' own check, wrapped
])
def test_hf_hidden_size_must_be_a_positive_integer(write_config, value, says):
    path = write_config(dict(TINY_LLAMA, hidden_size=value, num_hidden_layers=1))
    _usage_error(f"hf:{path}", path, "hidden_size", says)


@pytest.mark.parametrize("key, value", [
    ("num_hidden_layers", 10**7), ("hidden_size", 2**40), ("vocab_size", 10**30), ("intermediate_size", 2**31),
])
def test_hf_sizes_beyond_any_model_are_refused_at_once(write_config, key, value):
    path = write_config(dict(TINY_LLAMA, **{key: value}))
    started = time.perf_counter()
    _usage_error(f"hf:{path}", path, key, "the most stratagem accepts")
    assert time.perf_counter() - started < 5  # refused before anything is built


def test_hf_what_transformers_still_raises_names_the_file(write_config):
    # rope_scaling that transformers' own validation refuses: not one of our checks
    path = write_config(dict(TINY_LLAMA, rope_parameters={"rope_type": "no-such-rope"}))
    _usage_error(f"hf:{path}", path, "transformers cannot")


def test_hf_reads_the_file_named_not_the_folders_config_json(write_config):
    write_config("{broken")  # the folder's config.json
    other = write_config(TINY_GPT2, "other_name.json")
    source = load_model(f"hf:{other}", seq_len=8)
    assert type(source.module).__name__ == "GPT2LMHeadModel" and source.name == f"hf:{other}"
    profile = profile_spec(f"hf:{other}", seq_len=16, precision="fp32")
    assert len(profile.blocks) == 2 and profile.num_heads == 4


def test_hf_a_folder_reads_its_config_json(write_config):
    path = write_config(TINY_LLAMA)
    source = load_model(f"hf:{path.rsplit('/', 1)[0]}", seq_len=8)
    assert type(source.module).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("path", ["/no/such/dir", "a" * 5000, "/root/../" + "b" * 300, "x\0y"])
def test_hf_paths_that_name_no_file(path):
    message = _usage_error(f"hf:{path}")
    assert len(message) < 400  # a 5,000-character name is shortened


def test_hf_a_directory_named_config_json(tmp_path):
    (tmp_path / "config.json").mkdir()
    _usage_error(f"hf:{tmp_path}", "no Hugging Face config")


# Factories ---------------------------------------------------------------------------------

USER_FACTORIES = """
    import sys
    import torch
    from torch import nn

    def tokens(batch_size: int = 1, seq_len: int = 16):
        model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50))
        return model, (torch.randint(0, 50, (batch_size, seq_len)),)

    def needs_seq_len(batch_size, seq_len):
        return tokens(batch_size, seq_len)

    def needs_width(width, batch_size=1):
        return tokens(batch_size)

    def boom(batch_size=1):
        raise RuntimeError("no weights at /data/ckpt")

    def exits():
        sys.exit(3)

    def interrupted():
        raise KeyboardInterrupt

    def bad_inputs():
        return nn.Linear(2, 2), 42

    def bad_loss():
        return nn.Linear(2, 2), (torch.randn(1, 2),), "mse"

    not_callable = 5
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A user module, 'user_factories', importable from a temporary folder."""
    (tmp_path / "user_factories.py").write_text(textwrap.dedent(USER_FACTORIES))
    (tmp_path / "user_broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "user_raises_on_import.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "user_exits_on_import.py").write_text("import sys\nsys.exit('bye')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("user_factories", "user_broken", "user_raises_on_import", "user_exits_on_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("user_factories", "user_broken", "user_raises_on_import", "user_exits_on_import"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("spec, says", [
    ("pkg.module:", "names no factory"),
    (":f", "names no module"),
    ("my-pkg:f", "is not a dotted Python name"),
    ("pkg:f(1)", "is not a dotted Python name"),
])
def test_factory_spec_without_a_module_or_name(spec, says):
    _usage_error(spec, repr(spec), says)


def test_factory_module_with_a_syntax_error(factories):
    _usage_error("user_broken:f", "user_broken:f", "user_broken.py:1 has a syntax error")


def test_factory_module_that_fails_on_import(factories):
    _usage_error("user_raises_on_import:f", "importing user_raises_on_import raised RuntimeError: needs a GPU")
    _usage_error("user_exits_on_import:f", "SystemExit", "'bye'")


def test_factory_that_is_not_callable():
    _usage_error("os:path", "'os:path' is not callable (it is of type module)")


def test_factory_attribute_not_callable_in_user_module(factories):
    _usage_error("user_factories:not_callable", "is not callable (it is of type int)")


def test_factory_with_the_wrong_signature():
    _usage_error("json:loads", "'json:loads' requires 's'", "only batch_size and seq_len")


def test_factory_requiring_an_unsupplied_argument(factories):
    _usage_error("user_factories:needs_width", "requires 'width'")


def test_factory_that_raises_reports_its_exception(factories):
    _usage_error("user_factories:boom", "factory 'user_factories:boom' raised RuntimeError: no weights at /data/ckpt",
                 "call user_factories.boom(batch_size=1) yourself")


def test_factory_calling_sys_exit_is_a_usage_error(factories):
    _usage_error("sys:exit", "factory 'sys:exit' raised SystemExit", "not exit")
    _usage_error("user_factories:exits", "SystemExit (it called sys.exit(3))")


def test_factory_keyboard_interrupt_still_propagates(factories):
    with pytest.raises(KeyboardInterrupt):
        load_model("user_factories:interrupted")


def test_factory_returning_bad_inputs_or_loss(factories):
    _usage_error("user_factories:bad_inputs", "example inputs of type int")
    _usage_error("user_factories:bad_loss", "a loss of type str, not a callable")


def test_factory_keeps_its_own_seq_len_default(factories):
    """No --seq-len: the factory's default (16) stands; None is not passed over it."""
    source = load_model("user_factories:tokens", batch_size=3)
    assert source.example_inputs[0].shape == (3, 16)
    assert load_model("user_factories:tokens", batch_size=2, seq_len=4).example_inputs[0].shape == (2, 4)
    assert profile_spec("user_factories:tokens", precision="fp32").seq_len == 16


def test_factory_requiring_seq_len_without_one_says_so(factories):
    _usage_error("user_factories:needs_seq_len", "requires seq_len and none was given", "--seq-len")
    assert load_model("user_factories:needs_seq_len", seq_len=8).example_inputs[0].shape == (1, 8)


def test_cli_prints_one_line_and_exits_2(factories, write_config, capsys):
    """The command line: no traceback, status 2, for a factory that exits and a broken config."""
    assert main(["advise", "--model", "sys:exit", "--cluster", "2xcpu"]) == 2
    err = capsys.readouterr().err
    assert "SystemExit" in err and "HINT:" in err and "Traceback" not in err
    path = write_config("{not json")
    assert main(["advise", "--model", f"hf:{path}", "--cluster", "2xcpu"]) == 2
    err = capsys.readouterr().err
    assert path in err and "HINT:" in err and "Traceback" not in err


@pytest.mark.parametrize("spec, says", [
    ("model_factories:frozen", "the step's loss is int 0: no trainable parameter reaches it"),
    ("model_factories:sparse_embedding", "makes sparse gradients"),
])
def test_a_model_with_nothing_to_train_or_sparse_gradients_says_so(spec, says):
    """Both had read 'failed on its example inputs' with a hint to check the inputs' shapes."""
    with pytest.raises(UsageError, match=says) as caught:
        profile_spec(spec, precision="fp32")
    assert "HINT:" in str(caught.value) and "check that the inputs fit" not in str(caught.value)
