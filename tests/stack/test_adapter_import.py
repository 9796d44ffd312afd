"""Importing a PEFT adapter trained elsewhere (SDK 0.39's external-weights upload routes, and
``openrl adapters import``) and ``search_checkpoints``, against the embedded stack.

The SDK 0.38 pinned here has neither method, so the routes are driven with raw HTTP shaped as
tinker 0.39 / 0.40's reference docs give them; what they produce is then used through the real
SDK (``create_training_client_from_state``, ``create_sampling_client``). The adapter is made by
the real ``peft`` library on the offline base model, with random (non-zero) ``lora_B`` and
``lora_alpha`` 16 (not Tinker's 32), so both its weights and its scaling must arrive intact:
the server's logprobs must equal PEFT's own forward of the same adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import BASE_MODEL
from tolerances import TOL

peft = pytest.importorskip("peft")
import transformers  # noqa: E402

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def base_dir(stack) -> Path:
    """The stack's own base-model directory (its registry under ``<state>/models``, with the
    ``models.toml`` overlay), so an external stack's model is the one the adapter is made for."""
    from openrl.model.registry import ModelRegistry

    return Path(ModelRegistry.load(None, models_dir=Path(stack.state_dir) / "models").resolve(BASE_MODEL).path)


def _peft_model(base_dir: Path, adapter_dir: Path | None = None, seed: int = 0):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        return peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    m = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


def _logprobs(model) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQ[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0].double().numpy()


@pytest.fixture(scope="module")
def adapter(base_dir, tmp_path_factory, request) -> tuple[Path, np.ndarray]:
    """A PEFT adapter directory made by peft itself, and PEFT's logprobs of SEQ under it."""
    d = tmp_path_factory.mktemp("peft-adapter")
    m = _peft_model(base_dir)
    # adapter_config.json + adapter_model.safetensors; without save_embedding_layers=False PEFT would
    # also store a full copy of the tied lm_head (test_bad_adapters_are_refused_naming_the_field)
    m.save_pretrained(str(d), save_embedding_layers=False)
    assert {p.name for p in d.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    limit = int(getattr(request.getfixturevalue("stack"), "serve_env", {}).get("OPENRL_MAX_BODY_BYTES") or 0)
    size = (d / "adapter_model.safetensors").stat().st_size
    if limit and size > limit:  # the conformance serve keeps keyed_stack's 2 MiB body limit
        pytest.skip(f"external stack: its body limit ({limit} bytes) is below this model's adapter ({size} bytes)")
    return d, _logprobs(_peft_model(base_dir, d))


@pytest.fixture(scope="module")
def http(stack, api_key):
    with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": api_key}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


LORA = {"rank": 4, "train_attn": True, "train_mlp": True, "train_unembed": True}


def _upload(http, adapter_dir: Path, lora=LORA, files=("adapter_config.json", "adapter_model.safetensors"),
            headers=None) -> httpx.Response:
    r = http.post("/external_weights_upload_start", json={"base_model": BASE_MODEL, "lora_config": lora,
                                                          "destination_project_id": "imports"}, headers=headers)
    assert r.status_code == 200, r.text
    start = r.json()
    for f in files:
        url = start["urls"][f]
        url = url["url"] if isinstance(url, dict) else url
        put = httpx.put(url, content=(adapter_dir / f).read_bytes())  # no API key: the URL is signed
        assert put.status_code == 200, put.text
    return http.post("/external_weights_upload_finish", json={"upload_id": start["upload_id"]})


@pytest.fixture(scope="module")
def imported(http, adapter) -> str:
    r = _upload(http, adapter[0])
    assert r.status_code == 200, r.text
    path = r.json()["tinker_path"]
    assert path.startswith("tinker://") and path.endswith("/external_weights/imported")
    return path


def test_imported_adapter_samples_and_trains_as_peft_computes_it(svc, imported, adapter):
    _, want = adapter
    # sampling from it: the sampler's prompt logprobs are PEFT's (weights and lora_alpha 16 intact)
    sc = svc.create_sampling_client(model_path=imported)
    got = np.array(sc.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()[1:], dtype=np.float64)
    np.testing.assert_allclose(got, want, atol=TOL.reference_logprob, rtol=0)
    # continuing training from it: the new run starts at the adapter's weights, then trains
    tc = svc.create_training_client_from_state(imported).result()
    assert tc.get_info().model_data is not None
    d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                    loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    first = tc.forward([d], "cross_entropy").result()
    np.testing.assert_allclose(np.asarray(first.loss_fn_outputs[0]["logprobs"].tolist()), want,
                               atol=TOL.reference_logprob, rtol=0)
    for _ in range(2):
        tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([d], "cross_entropy").result().metrics["loss:sum"]
    assert after < first.metrics["loss:sum"]
    # the continued run's own snapshot keeps the adapter's scaling (alpha 16)
    snap = tc.save_weights_for_sampler("continued").result().path
    info = svc.create_rest_client().get_weights_info_by_tinker_path(snap).result()
    assert info.lora_rank == 4 and info.base_model == BASE_MODEL


def test_upload_url_shape_follows_the_sdk_version(http):
    plain = http.post("/external_weights_upload_start", json={"base_model": BASE_MODEL, "lora_config": LORA}).json()
    assert set(plain["urls"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert all(isinstance(u, str) for u in plain["urls"].values()) and plain["expires"].endswith("Z")  # 0.39
    new = http.post("/external_weights_upload_start", json={"base_model": BASE_MODEL, "lora_config": LORA},
                    headers={"X-Stainless-Package-Version": "0.40.0"}).json()
    assert all(set(u) == {"url", "headers"} for u in new["urls"].values())  # 0.40's ExternalWeightsUploadURL


def test_bad_adapters_are_refused_naming_the_field(http, adapter, tmp_path, stack):
    from safetensors.torch import load_file, save_file

    src, _ = adapter
    # declared rank != the adapter's
    r = _upload(http, src, lora={**LORA, "rank": 8})
    assert r.status_code == 400 and r.json()["field"] == "lora_config.rank", r.text
    # a file never uploaded
    r = _upload(http, src, files=("adapter_config.json",))
    assert r.status_code == 400 and r.json()["field"] == "adapter_model.safetensors", r.text
    # a tensor of the wrong shape (an adapter for another model), a NaN, an unknown target group
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    t = load_file(str(src / "adapter_model.safetensors"))
    k = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    save_file({**t, k: torch.zeros(4, t[k].shape[1] + 1)}, str(bad / "adapter_model.safetensors"))
    r = _upload(http, bad)
    assert r.status_code == 400 and r.json()["field"] == "adapter_model.safetensors" and "shape" in r.json()["detail"]
    save_file({**t, k: torch.full_like(t[k], float("nan"))}, str(bad / "adapter_model.safetensors"))
    r = _upload(http, bad)
    assert r.status_code == 400 and "NaN" in r.json()["detail"], r.text
    cfg = json.loads((src / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    (bad / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    r = _upload(http, bad, lora=LORA)
    assert r.status_code == 400 and r.json()["field"] == "adapter_config.json", r.text
    # a full lm_head weight beside the LoRA tensors (PEFT's default save on a tied lm_head)
    save_file({**t, "base_model.model.lm_head.base_layer.weight": torch.zeros(3, 3)}, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    r = _upload(http, bad)
    assert r.status_code == 400 and "save_embedding_layers=False" in r.json()["detail"], r.text
    # a tampered upload URL, another key's upload id
    start = http.post("/external_weights_upload_start", json={"base_model": BASE_MODEL, "lora_config": LORA}).json()
    url = start["urls"]["adapter_config.json"]
    assert httpx.put(url[:-4] + "0000", content=b"{}").status_code == 403
    other = httpx.post(stack.base_url + "/api/v1/external_weights_upload_finish", json={"upload_id": start["upload_id"]},
                       headers={"X-API-Key": "tml-not-configured"})
    assert other.status_code == 401
    assert http.post("/external_weights_upload_finish", json={"upload_id": "f" * 32}).status_code == 404


def test_openrl_adapters_import_cli(stack, api_key, adapter, svc):
    src, want = adapter
    out = subprocess.run([sys.executable, "-m", "openrl.cli", "adapters", "import", str(src), "--base-model",
                          BASE_MODEL, "--base-url", stack.base_url, "--api-key", api_key, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["lora_config"] == LORA and res["tinker_path"].endswith("/external_weights/imported")
    got = svc.create_sampling_client(model_path=res["tinker_path"]).compute_logprobs(
        types.ModelInput.from_ints(SEQ)).result()[1:]
    np.testing.assert_allclose(np.array(got, dtype=np.float64), want, atol=TOL.reference_logprob, rtol=0)
    bad = subprocess.run([sys.executable, "-m", "openrl.cli", "adapters", "import", str(src), "--base-model",
                          "nope/no-such-model", "--base-url", stack.base_url, "--api-key", api_key],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "base_model" in bad.stderr


def test_search_checkpoints_filters_and_cursor(svc, http, imported):
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0,
                                         user_metadata={"exp": "search"}).result()
    names = [f"s{i}" for i in range(5)]
    for n in names:
        tc.save_weights_for_sampler(n).result()
    best = tc.save_state("state0", user_metadata={"tag": "best"}).result().path
    mine = {f"tinker://{tc.model_id}/sampler_weights/{n}" for n in names}

    def search(**body):
        r = http.post("/checkpoints/search", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    # paging with the cursor: every sampler checkpoint once, newest first, pages of 2
    seen, cursor = [], None
    while True:
        page = search(checkpoint_type="sampler", limit=2, **({"cursor": cursor} if cursor else {}))
        assert len(page["checkpoints"]) <= 2
        seen += page["checkpoints"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    paths = [c["tinker_path"] for c in seen]
    assert len(paths) == len(set(paths)) and mine <= set(paths)
    times = [c["time"] for c in seen]
    assert times == sorted(times, reverse=True)
    assert all(c["checkpoint_type"] == "sampler" for c in seen)
    # filters: user_metadata (every pair), type, base model (an empty list matches nothing), project
    assert [c["tinker_path"] for c in search(user_metadata={"tag": "best"}, limit=200)["checkpoints"]] == [best]
    assert search(user_metadata={"tag": "best", "other": "x"}, limit=200)["checkpoints"] == []
    assert {c["tinker_path"] for c in search(checkpoint_type="external", limit=200)["checkpoints"]} >= {imported}
    assert search(base_models=[], limit=200)["checkpoints"] == []
    assert search(base_models=["Qwen/Qwen3-0.6B"], limit=200)["checkpoints"] == []
    assert {c["tinker_path"] for c in search(project_ids=["imports"], limit=200)["checkpoints"]} >= {imported}
    assert not mine & {c["tinker_path"] for c in search(project_ids=["imports"], limit=200)["checkpoints"]}
    # bad input: a limit out of range, a cursor that is not a time, another owner without admin
    assert http.post("/checkpoints/search", json={"limit": 0}).json()["field"] == "limit"
    r = http.post("/checkpoints/search", json={"cursor": {"last_created_at": "yesterday", "last_checkpoint_uuid": "x"}})
    assert r.status_code == 400 and r.json()["field"] == "cursor.last_created_at"
    assert http.post("/checkpoints/search", json={"owner": {"type": "all"}}).status_code == 400
