"""The model registry's user overlay (<state>/models.toml), ``openrl models add/remove/list``,
``--model NAME=DIR``, the ``dtype`` key, and the directory check of openrl/modelcheck.py.

Uses the tiny model the session builds (conftest's ``models_dir`` fixture); nothing is mocked
except, in the ``serve`` wiring test, the embedded stack itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
import types
from pathlib import Path

import pytest

from openrl import cli
from openrl.model import registry
from openrl.model.modelcheck import ModelDirError, validate_model_dir
from openrl.model.registry import (
    DTYPE_NAMES,
    ModelRegistry,
    RegistryError,
    _dump_toml,
    add_model,
    overlay_path,
    remove_model,
)

NAME = "org/tiny-added"


@pytest.fixture(autouse=True)
def _no_env_registry(monkeypatch):
    monkeypatch.delenv("OPENRL_MODEL_REGISTRY", raising=False)


@pytest.fixture
def tiny(models_dir) -> Path:
    """The session's built tiny model (what `openrl models build` makes)."""
    return models_dir / "tiny-qwen3"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def copy_without(src: Path, dst: Path, *skip: str) -> Path:
    """``dst`` with symlinks to every file of ``src`` except ``skip``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


# -- openrl models add / list / remove ----------------------------------------------------------


def test_add_list_and_the_workers_load_it(tiny, tmp_path, capsys, monkeypatch):
    state = tmp_path / "state"
    rc, out, err = run_cli(capsys, "models", "add", NAME, tiny, "--dtype", "bfloat16",
                           "--max-context-length", "2048", "--state-dir", state)
    assert rc == 0, err
    assert NAME in out and str(state / "models.toml") in out
    assert overlay_path(state / "models") == state / "models.toml"
    written = tomllib.loads((state / "models.toml").read_text())
    assert written["models"][NAME] == {"path": str(tiny), "dtype": "bfloat16", "max_context_length": 2048}

    rc, out, _ = run_cli(capsys, "models", "list", "--json", "--state-dir", state)
    rows = {r["model_name"]: r for r in json.loads(out)}
    assert rows[NAME]["dtype"] == "bfloat16" and rows[NAME]["path"] == str(tiny)
    assert rows[NAME]["max_context_length"] == 2048 and rows[NAME]["source"] == str(state / "models.toml")
    assert rows["Qwen/Qwen3-0.6B"]["dtype"] == "auto"  # the packaged entries are still there
    rc, out, _ = run_cli(capsys, "models", "list", "--state-dir", state)
    (line,) = [ln for ln in out.splitlines() if ln.startswith(NAME)]
    assert line.split("\t")[:3] == [NAME + "*", "2048", "bfloat16"] and line.endswith("present")

    # what the gateway, trainer and sampler do: OPENRL_HOME=<state>, models_dir=$OPENRL_HOME/models
    monkeypatch.setenv("OPENRL_HOME", str(state))
    for reg in (ModelRegistry.load(None, models_dir=state / "models"), ModelRegistry.load()):
        e = reg.resolve(NAME)
        assert (e.path, e.tokenizer_id, e.dtype, e.max_context_length) == (tiny, str(tiny), "bfloat16", 2048)
        assert not e.build and e.trainable and e.sampleable
        assert reg.overlay == state / "models.toml" and reg.overlay_names == {NAME}
        assert "Qwen/Qwen3-4B-Instruct-2507" in reg
        assert {"model_name": NAME, "max_context_length": 2048, "trainable": True, "sampleable": True} in reg.capabilities()

    # the overlay also goes on top of an $OPENRL_MODEL_REGISTRY file
    custom = tmp_path / "custom.toml"
    custom.write_text('[models."org/other"]\npath = "x"\n')
    monkeypatch.setenv("OPENRL_MODEL_REGISTRY", str(custom))
    reg = ModelRegistry.load(None, models_dir=state / "models")
    assert reg.names() == ["org/other", NAME] and reg.source == custom
    assert ModelRegistry.load(None, models_dir=state / "models", overlay=False).names() == ["org/other"]

    rc, out, _ = run_cli(capsys, "models", "remove", NAME, "--state-dir", state)
    assert rc == 0 and "removed" in out
    assert NAME not in ModelRegistry.load(None, models_dir=state / "models")
    rc, _, err = run_cli(capsys, "models", "remove", NAME, "--state-dir", state)
    assert rc == 1 and f"{NAME!r} is not in the user registry" in err


def test_overlay_replaces_a_packaged_name_in_place(tiny, tmp_path):
    mdir = tmp_path / "models"
    base = ModelRegistry.load(models_dir=mdir)
    e = add_model("Qwen/Qwen3-0.6B", tiny, models_dir=mdir)
    assert e.path == tiny and not e.build
    reg = ModelRegistry.load(models_dir=mdir)
    assert reg.names() == base.names()  # same order, same names
    assert reg.resolve("Qwen/Qwen3-0.6B").path == tiny
    assert reg.resolve("Qwen/Qwen3-8B").path == mdir / "tiny-qwen3"
    remove_model("Qwen/Qwen3-0.6B", models_dir=mdir)
    assert ModelRegistry.load(models_dir=mdir).resolve("Qwen/Qwen3-0.6B").path == mdir / "tiny-qwen3"
    # adding twice replaces the entry
    add_model(NAME, tiny, models_dir=mdir, max_context_length=100)
    add_model(NAME, tiny, models_dir=mdir, dtype="float16")
    e = ModelRegistry.load(models_dir=mdir).resolve(NAME)
    assert (e.dtype, e.max_context_length) == ("float16", 4096)


def test_registry_file_that_is_the_overlay_is_read_once(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('[models."a"]\npath = "a"\n')
    reg = ModelRegistry.load(f, models_dir=tmp_path / "models")
    assert reg.names() == ["a"] and reg.overlay is None


def test_invalid_overlay_names_its_file(tmp_path, tiny):
    (tmp_path / "models.toml").write_text('[models."a"]\npath = "a"\ndtype = "bf16"\n')
    with pytest.raises(RegistryError, match=r"models\.toml: models\.'a'\.dtype: must be one of auto, bfloat16"):
        ModelRegistry.load(models_dir=tmp_path / "models")
    with pytest.raises(RegistryError, match=r"models\.toml"):
        add_model(NAME, tiny, models_dir=tmp_path / "models")  # refuses to build on a broken file
    (tmp_path / "models.toml").write_text("not toml [")
    with pytest.raises(RegistryError, match="is not valid TOML"):
        ModelRegistry.load(models_dir=tmp_path / "models")


def test_add_refuses_bad_names_and_values_without_writing(tiny, tmp_path, capsys):
    mdir = tmp_path / "models"
    for kw in ({"dtype": "bf16"}, {"max_context_length": 0}):
        with pytest.raises(RegistryError):
            add_model(NAME, tiny, models_dir=mdir, **kw)
    for bad in ("", " padded"):
        with pytest.raises(RegistryError, match="non-empty string"):
            add_model(bad, tiny, models_dir=mdir)
    colon = tmp_path / "a:b"
    colon.symlink_to(tiny)
    with pytest.raises(RegistryError, match="contains ':'"):
        add_model(NAME, colon, models_dir=mdir)
    assert not (tmp_path / "models.toml").exists()
    with pytest.raises(SystemExit) as ex:  # argparse: --dtype has choices
        cli.main(["models", "add", NAME, str(tiny), "--dtype", "bf16", "--state-dir", str(tmp_path)])
    assert ex.value.code == 2 and "invalid choice: 'bf16'" in capsys.readouterr().err


def test_overlay_writer_escapes_and_reads_back():
    data = {
        "defaults": {"max_context_length": 8, "trainable": False},
        "models": {'we"ird\\name\tü\x7f': {"path": "/p/with \"quotes\" and \\ and é", "dtype": "auto"},
                   "plain_key-1": {"path": "x", "sampleable": True}},
    }
    text = _dump_toml(data, "<test>")
    assert tomllib.loads(text) == data
    assert "[models.plain_key-1]" in text and '\\u007f' in text


# -- dtype ----------------------------------------------------------------------------------------


def test_dtype_names_match_openrl_device():
    from openrl.model import device

    assert DTYPE_NAMES == device.DTYPE_NAMES


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_dtype_values(tmp_path, dtype):
    f = tmp_path / "r.toml"
    f.write_text(f'[defaults]\ndtype = "{dtype}"\n\n[models."a"]\npath = "a"\n\n[models."b"]\npath = "b"\ndtype = "float32"\n')
    reg = ModelRegistry.load(f, models_dir=tmp_path / "m")
    assert reg.resolve("a").dtype == dtype and reg.resolve("b").dtype == "float32"


def test_dtype_default_is_auto(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[models."a"]\npath = "a"\n')
    assert ModelRegistry.load(f, models_dir=tmp_path / "m").resolve("a").dtype == "auto"


@pytest.mark.parametrize(
    "body, key",
    [
        ('[models."x"]\npath = "a"\ndtype = "bf16"\n', "models.'x'.dtype"),
        ('[models."x"]\npath = "a"\ndtype = 16\n', "models.'x'.dtype"),
        ('[models."x"]\npath = "a"\ndtype = "BFloat16"\n', "models.'x'.dtype"),
        ('[defaults]\ndtype = "half"\n', "defaults.dtype"),  # reported even with no entries
    ],
)
def test_dtype_invalid(tmp_path, body, key):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(RegistryError) as err:
        ModelRegistry.load(f, models_dir=tmp_path)
    assert str(f) in str(err.value) and key in str(err.value)


# -- validate_model_dir ---------------------------------------------------------------------------


def test_the_built_model_is_valid(tiny):
    validate_model_dir(tiny)


def _non_causal(tiny: Path, dst: Path, config: dict) -> Path:
    copy_without(tiny, dst, "config.json")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tiny, d: d.mkdir() or d, "has no config.json"),
        (lambda tiny, d: copy_without(tiny, d, "model.safetensors"),
         "has no weights (model.safetensors, model.safetensors.index.json, pytorch_model.bin"),
        (lambda tiny, d: copy_without(tiny, d, "tokenizer.json", "tokenizer_config.json"),
         "has no tokenizer (tokenizer.json"),
        (lambda tiny, d: copy_without(tiny, d, "tokenizer.json"),
         "has no tokenizer: tokenizer_config.json but no tokenizer.json and no vocabulary file"),
        (lambda tiny, d: _non_causal(tiny, d, {"model_type": "bert", "architectures": ["BertModel"]}),
         "config.json's architectures ['BertModel'] is not a causal LM"),
        (lambda tiny, d: _non_causal(tiny, d, {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}),
         "config.json's model_type 't5' is not a causal LM"),
        (lambda tiny, d: _non_causal(tiny, d, {"model_type": "no-such-arch"}),
         "config.json does not load with transformers.AutoConfig"),
        (lambda tiny, d: (d.parent.mkdir(exist_ok=True), d.write_text("x"), d)[-1], "is not a directory"),
        (lambda tiny, d: d, "does not exist"),
    ],
    ids=["empty", "no-weights", "no-tokenizer", "no-vocab", "bert", "t5", "bad-config", "file", "missing"],
)
def test_invalid_dirs_are_refused(tiny, tmp_path, capsys, make, message):
    d = make(tiny, tmp_path / "cand")
    with pytest.raises(ModelDirError) as err:
        validate_model_dir(d)
    assert message in str(err.value) and str(d) in str(err.value)
    # the CLI says the same and writes nothing
    state = tmp_path / "state"
    rc, _, out = run_cli(capsys, "models", "add", NAME, d, "--state-dir", state)
    assert rc == 1 and message in out
    assert not overlay_path(state / "models").exists()


def test_a_config_that_passed_is_not_loaded_again(tiny, tmp_path, monkeypatch):
    """``checked``: the config check (transformers' AutoConfig, seconds of imports on a GPU host
    before ``openrl serve --model`` starts its workers) runs once per config.json content; a
    changed config, or one that failed, is checked again; the file-name checks run every time."""
    from openrl.model import modelcheck

    d = copy_without(tiny, tmp_path / "m", "config.json")
    (d / "config.json").write_bytes((tiny / "config.json").read_bytes())
    checked = tmp_path / "models" / ".checked-configs.json"
    calls = []
    real = modelcheck._check_config
    monkeypatch.setattr(modelcheck, "_check_config", lambda p: (calls.append(p), real(p)))
    validate_model_dir(d, checked=checked)
    validate_model_dir(d, checked=checked)
    assert calls == [d] and len(json.loads(checked.read_text())) == 1
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))  # changed: checked, refused
    with pytest.raises(ModelDirError, match="does not load with transformers.AutoConfig"):
        validate_model_dir(d, checked=checked)
    with pytest.raises(ModelDirError, match="does not load with transformers.AutoConfig"):
        validate_model_dir(d, checked=checked)  # a failure is never remembered
    assert len(calls) == 3
    (d / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (d / "model.safetensors").unlink()  # the weights are looked for every time
    with pytest.raises(ModelDirError, match="has no weights"):
        validate_model_dir(d, checked=checked)
    assert len(calls) == 3
    checked.write_text("not json")  # an unreadable memo: check again, and rewrite it
    (d / "model.safetensors").symlink_to(tiny / "model.safetensors")
    validate_model_dir(d, checked=checked)
    assert len(calls) == 4 and len(json.loads(checked.read_text())) == 1


def test_sharded_weights(tiny, tmp_path):
    d = copy_without(tiny, tmp_path / "sharded", "model.safetensors")
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00001-of-00002.safetensors").symlink_to(tiny / "model.safetensors")
    with pytest.raises(ModelDirError, match=r"names shards that are missing: \['model-00002-of-00002.safetensors'\]"):
        validate_model_dir(d)
    (d / "model-00002-of-00002.safetensors").symlink_to(tiny / "model.safetensors")
    validate_model_dir(d)


def test_tokenizer_config_with_vocab_and_bin_weights(tiny, tmp_path):
    d = copy_without(tiny, tmp_path / "slow", "tokenizer.json", "model.safetensors")
    (d / "vocab.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"")
    validate_model_dir(d)


# -- --model NAME=DIR on serve / run --------------------------------------------------------------


def test_model_spec_parsing():
    assert cli.model_spec("Qwen/Qwen3-4B=/models/q=4b") == ("Qwen/Qwen3-4B", "/models/q=4b")
    for bad in ("no-equals", "=/dir", "name=", " = "):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=DIR"):
            cli.model_spec(bad)
    p = cli.build_parser()
    args = p.parse_args(["serve", "--model", "a=/x", "--model", "b=/y"])
    assert args.model == [("a", "/x"), ("b", "/y")]
    assert p.parse_args(["serve"]).model == []
    args = p.parse_args(["run", "--model", "a=/x", "script.py", "--", "--steps", "2"])
    assert (args.model, args.script) == ([("a", "/x")], "script.py")
    assert args.script_args[-2:] == ["--steps", "2"]  # _cmd_run drops a leading "--" argparse may keep


def test_model_spec_bad_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ex:
        cli.build_parser().parse_args(["serve", "--model", "nodir"])
    assert ex.value.code == 2 and "expected NAME=DIR" in capsys.readouterr().err


@pytest.fixture
def fake_embedded(monkeypatch):
    """openrl.transport.embedded replaced by a recorder: serve / run return before starting a stack
    (after waiting for ``args.model_check``, the deferred ``--model`` config check, as the stack does
    once its processes are spawned)."""
    seen: list[tuple[str, argparse.Namespace, dict]] = []

    def record(kind):
        def f(args):
            ov = overlay_path(args.state_dir / "models")
            seen.append((kind, args, tomllib.loads(ov.read_text()) if ov.exists() else {}))
            if args.model_check is not None:
                args.model_check()
            return 0
        return f

    fake = types.ModuleType("openrl.transport.embedded")
    fake.main, fake.run_script = record("serve"), record("run")
    monkeypatch.setitem(sys.modules, "openrl.transport.embedded", fake)
    import openrl.transport

    monkeypatch.setattr(openrl.transport, "embedded", fake, raising=False)
    return seen


def test_serve_and_run_register_before_the_stack_starts(tiny, tmp_path, capsys, fake_embedded):
    state = tmp_path / "state"
    rc, _, err = run_cli(capsys, "--state-dir", state, "serve", "--no-build",
                         "--model", f"{NAME}={tiny}", "--model", f"Qwen/Qwen3-8B={tiny}")
    assert rc == 0, err
    ((kind, args, overlay),) = fake_embedded
    assert kind == "serve" and set(overlay["models"]) == {NAME, "Qwen/Qwen3-8B"}  # written before the stack
    assert f"{NAME}: {tiny}" in err and "overrides the entry" in err
    assert ModelRegistry.load(models_dir=state / "models").resolve(NAME).path == tiny

    fake_embedded.clear()
    script = tmp_path / "s.py"  # openrl run checks that the script exists before it starts anything
    script.write_text("")
    rc, _, err = run_cli(capsys, "run", "--state-dir", state, "--model", f"org/second={tiny}", script, "--", "-x")
    assert rc == 0, err
    ((kind, args, overlay),) = fake_embedded
    assert kind == "run" and args.script_args == ["-x"]
    assert set(overlay["models"]) == {NAME, "Qwen/Qwen3-8B", "org/second"}


def test_serve_with_an_invalid_model_does_not_start(tmp_path, capsys, fake_embedded):
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, "--state-dir", tmp_path / "state", "serve", "--model", f"x={tmp_path / 'empty'}")
    assert rc == 1 and "has no config.json" in err
    assert fake_embedded == []


def test_a_deferred_config_check_that_fails_puts_the_overlay_back(tiny, tmp_path, capsys, fake_embedded):
    """``--model``'s AutoConfig check runs beside the start (openrl/cli/model_check.py): the entry
    is written first; when the check fails, the command fails naming it and every entry it wrote
    is put back as it was (an entry it replaced, one it added)."""
    bad = tmp_path / "t5"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (bad / "model.safetensors").write_bytes(b"")
    (bad / "tokenizer.json").write_text("{}")
    state = tmp_path / "state"
    add_model(NAME, tiny, models_dir=state / "models", dtype="float32")
    before = tomllib.loads(overlay_path(state / "models").read_text())["models"]
    rc, _, err = run_cli(capsys, "--state-dir", state, "serve", "--no-build",
                         "--model", f"{NAME}={bad}", "--model", f"org/new={tiny}")
    assert rc == 1 and f"--model {NAME}={bad}: " in err and "model_type 't5' is not a causal LM" in err, err
    ((_, _, during),) = fake_embedded
    assert during["models"][NAME]["path"] == str(bad)  # written before the stack started
    assert tomllib.loads(overlay_path(state / "models").read_text())["models"] == before
    assert "registered in" not in err  # announced only once the check passed


def test_overlay_entries_and_their_restore(tiny, tmp_path):
    mdir = tmp_path / "models"
    add_model(NAME, tiny, models_dir=mdir, max_context_length=1024)
    saved = registry.overlay_entries([NAME, "org/none"], models_dir=mdir)
    assert saved == {NAME: {"path": str(tiny), "dtype": "auto", "max_context_length": 1024}, "org/none": None}
    add_model(NAME, tiny, models_dir=mdir, dtype="bfloat16")
    add_model("org/none", tiny, models_dir=mdir)
    registry.restore_overlay_entries(saved, models_dir=mdir)
    assert tomllib.loads(overlay_path(mdir).read_text())["models"] == {NAME: saved[NAME]}


def test_the_config_check_process(tiny, tmp_path):
    """``python -m openrl.model.modelcheck``: 0 when every config passes (then remembered), 3 and
    one JSON line naming the first failure."""
    import subprocess

    from openrl.model import modelcheck

    checked = tmp_path / "checked.json"
    bad = copy_without(tiny, tmp_path / "bad", "config.json")
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    assert modelcheck.config_check_needed(tiny, checked)
    ok = subprocess.run([sys.executable, "-m", "openrl.model.modelcheck", "--checked", str(checked), str(tiny)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout == "", ok.stderr
    assert not modelcheck.config_check_needed(tiny, checked)
    no = subprocess.run([sys.executable, "-m", "openrl.model.modelcheck", "--checked", str(checked), str(tiny), str(bad)],
                        capture_output=True, text=True, timeout=120)
    assert no.returncode == 3, no.stderr
    failed = json.loads(no.stdout)
    assert failed["path"] == str(bad) and "does not load with transformers.AutoConfig" in failed["error"]


# -- the embedded stack serves an added model -----------------------------------------------------


def test_stack_serves_a_model_added_to_the_overlay(tmp_path_factory, models_dir, tiny):
    """gateway, trainer and sampler all see <state>/models.toml: a run on the added name trains
    and samples through the unmodified SDK."""
    import tinker
    from tinker import types as tt

    from conftest import _make_stack

    s = _make_stack(tmp_path_factory, models_dir)
    add_model(NAME, tiny, models_dir=s.state_dir / "models", max_context_length=1024)
    with s:
        service = tinker.ServiceClient(base_url=s.base_url, api_key=s.api_key)
        rest = tinker.RestClient(base_url=s.base_url, api_key=s.api_key)
        caps = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
        assert caps[NAME].max_context_length == 1024
        tc = service.create_lora_training_client(base_model=NAME, rank=4, seed=0).result()
        datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]),
                         loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
        assert "loss:sum" in tc.forward_backward([datum], "cross_entropy").result().metrics
        tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(tt.ModelInput.from_ints([1, 2]), 1, tt.SamplingParams(max_tokens=4)).result()
        assert len(out.sequences[0].tokens) >= 1
        assert Path(tc.get_info().model_data.tokenizer_id) == tiny

