"""Weight downloads as tinker-cookbook 0.6.1 runs them: ``tinker_cookbook.weights.download()``
unmodified, through the real ``tinker`` SDK, against the embedded stack (``stack`` fixture:
nats-server, gateway, trainer, sampler processes; ``file://`` storage).

The cookbook's flow for a training checkpoint: ``create_training_client_from_state`` →
``save_weights_external(..., age_encryption_recipients=[a fresh X25519 key])`` →
``get_external_weights_urls`` → a TTL update → GET every signed URL (each name must end in
``.age``) → ``pyrage`` decryption → delete of the export. The downloaded adapter is then
loaded with ``peft.PeftModel.from_pretrained`` on the same tiny base model directory the
server uses, and its logprobs are compared with the server's ``forward``. Adapters here keep
the SDK's default ``train_unembed=True``, so the ``lm_head`` LoRA is part of what PEFT loads.

Nothing is mocked; the only direct storage access is the expiry test, which moves a
manifest's ``expires_unix`` into the past instead of sleeping through a TTL.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import BASE_MODEL

pyrage = pytest.importorskip("pyrage")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
weights = pytest.importorskip("tinker_cookbook.weights")

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13, 576, 3974, 13876, 38835]
ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json"}
TOL = 1e-4  # |Δ logprob| server (float32, CPU) vs PEFT (float32, CPU); measured 1.9e-6


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def rest(svc):
    return svc.create_rest_client()


@pytest.fixture(scope="module")
def trained(svc):
    """A rank-4 run (train_unembed left at the SDK's default, True) after two SFT steps, and
    the server's logprobs of SEQ under it."""
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    for _ in range(2):
        tc.forward_backward([_datum(SEQ)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    lp = tc.forward([_datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return {"tc": tc, "logprobs": np.asarray(lp.tolist(), dtype=np.float64)}


@pytest.fixture(scope="module")
def base_dir(models_dir) -> Path:
    from openrl.model.registry import ModelRegistry

    return Path(ModelRegistry.load(None, models_dir=models_dir).resolve(BASE_MODEL).path)


@pytest.fixture()
def cookbook_env(monkeypatch, api_key):
    """The cookbook builds its own clients: the key comes from TINKER_API_KEY, as for users."""
    monkeypatch.setenv("TINKER_API_KEY", api_key)


def _peft_logprobs(base_dir: Path, adapter_dir: Path | None) -> np.ndarray:
    """Logprobs of SEQ[1:] given SEQ[:-1] under the HF base model (+ the PEFT adapter)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQ[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0]
    return lp.double().numpy()


def _storage_dir(stack, tinker_path: str) -> Path:
    run, kind, name = tinker_path[len("tinker://"):].split("/")
    return Path(stack.state_dir) / "storage" / run / kind / name


def test_cookbook_download_of_a_training_checkpoint_loads_in_peft(trained, rest, stack, base_dir, tmp_path,
                                                                  cookbook_env):
    """The cookbook's whole encrypted flow, unmodified; the adapter (with its lm_head LoRA)
    loads in PEFT and reproduces the server's logprobs; the temporary export is deleted."""
    state = trained["tc"].save_state("dl-state").result().path
    out = tmp_path / "adapter"
    assert weights.download(tinker_path=state, output_dir=str(out), base_url=stack.base_url) == str(out)
    assert {p.name for p in out.iterdir()} == ADAPTER_FILES  # decrypted, .age dropped, no staging left

    cfg = json.loads((out / "adapter_config.json").read_text())
    assert "lm_head" in cfg["target_modules"] and cfg["r"] == 4
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "adapter_model.safetensors")))
    assert {"base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"} <= keys

    ours = _peft_logprobs(base_dir, out)
    np.testing.assert_allclose(ours, trained["logprobs"], atol=TOL, rtol=0)
    base = _peft_logprobs(base_dir, None)
    assert np.abs(base - trained["logprobs"]).max() > 10 * TOL  # the comparison can tell adapters apart

    # the cookbook deleted its temporary export (tinker://<new run>/external_weights/download)
    left = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")]


def test_export_to_own_identity_is_ciphertext_at_rest_and_decrypts(trained, rest, stack, tmp_path, cookbook_env):
    """save_weights_external to the caller's own X25519 recipient: stored and served as .age
    only; the right identity decrypts to the exact adapter, another one cannot."""
    me = pyrage.x25519.Identity.generate()
    ext = trained["tc"].save_weights_external(
        "enc-own", age_encryption_recipients=[str(me.to_public())]).result().path
    stored = _storage_dir(stack, ext)
    manifest = json.loads((stored / "manifest.json").read_text())
    assert set(manifest["files"]) == {f + ".age" for f in ADAPTER_FILES}
    assert manifest["encryption"] == {"scheme": "age", "recipients": [str(me.to_public())]}
    assert {p.name for p in stored.iterdir()} == {"manifest.json"} | set(manifest["files"])

    out = tmp_path / "enc"
    weights.download(tinker_path=ext, output_dir=str(out), base_url=stack.base_url)  # external path: files as served
    got = {p.name for p in out.iterdir()}
    assert got == {f + ".age" for f in ADAPTER_FILES}
    plain = {p.name[:-4]: pyrage.decrypt(p.read_bytes(), [me]) for p in out.iterdir()}
    cfg = json.loads(plain["adapter_config.json"])
    assert cfg["r"] == 4 and "lm_head" in cfg["target_modules"]
    from safetensors.torch import load as st_load

    assert "base_model.model.lm_head.lora_B.weight" in st_load(plain["adapter_model.safetensors"])
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt((out / "adapter_config.json.age").read_bytes(), [pyrage.x25519.Identity.generate()])

    # the TTL update the cookbook makes, then a delete: URLs and new signatures are refused
    rest.set_checkpoint_ttl_from_tinker_path(ext, 3600).result()
    urls = rest.get_external_weights_urls(ext).result().urls
    assert set(urls) == set(manifest["files"])
    rest.delete_checkpoint_from_tinker_path(ext).result()
    for url in urls.values():
        assert httpx.get(url).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(ext).result()


def test_expired_export_is_refused(trained, rest, stack):
    """An export whose TTL passed answers 404 for its URLs and for new ones."""
    from openrl.storage import TinkerPath, open_storage

    me = pyrage.x25519.Identity.generate()
    ext = trained["tc"].save_weights_external(
        "enc-expiring", ttl_seconds=3600, age_encryption_recipients=[str(me.to_public())]).result().path
    urls = rest.get_external_weights_urls(ext).result().urls
    assert all(httpx.get(u).status_code == 200 for u in urls.values())
    store = open_storage(stack.storage)
    m = store.manifest(TinkerPath.parse(ext))
    m["expires_unix"] = time.time() - 1  # as if the hour had passed (no sleep)
    store.write_manifest(TinkerPath.parse(ext), m)
    for url in urls.values():
        assert httpx.get(url).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(ext).result()


@pytest.mark.parametrize("recipients, field", [
    (["age1notakey"], "age_encryption_recipients[0]"),
    (["ssh-ed25519 AAAAnotakey"], "age_encryption_recipients[0]"),
    (["AGE-SECRET-KEY-1QQQQ"], "age_encryption_recipients[0]"),
    ([], "age_encryption_recipients"),
    ([str(pyrage.x25519.Identity.generate().to_public())] * 11, "age_encryption_recipients"),
])
def test_bad_recipients_are_a_400_naming_the_field(trained, recipients, field):
    """A bad recipient list fails at once with 400 naming the field; the run keeps working."""
    tc = trained["tc"]
    with pytest.raises(tinker.BadRequestError) as err:
        tc.save_weights_external("bad", age_encryption_recipients=recipients).result()
    assert field in str(err.value)
    assert "AGE-SECRET-KEY-1QQQQ" not in str(err.value)
    # the rejected request's seq_id was skipped: the next call of the run is answered
    lp = tc.forward([_datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(np.asarray(lp.tolist()), trained["logprobs"], atol=1e-6)
