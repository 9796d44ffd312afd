"""``openrl adapters import DIR --base-model NAME``: import a PEFT LoRA adapter trained elsewhere.

The command speaks the gateway's REST API as any client would (the SDK 0.39 upload routes,
:mod:`functions.gateway.routes_imports`): it reads the adapter's ``adapter_config.json`` for the
LoRA shape, starts an upload, PUTs ``adapter_config.json`` and ``adapter_model.safetensors`` to
their signed URLs, and finishes the upload; the gateway checks the adapter against the base
model (rank, target groups, every tensor's shape) and stores it. It prints the
``tinker://<run>/external_weights/imported`` path, which
``ServiceClient.create_training_client_from_state`` (continue training) and
``create_sampling_client(model_path=...)`` take. ``--json`` prints ``{"tinker_path", "upload_id",
"lora_config"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from openrl.cli.status import GatewayError, _api_key, _base_url
from openrl.model.adapter_check import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

TIMEOUT_S = 600.0  # a large adapter's PUT, or the gateway's check of it


def _lora_config(adapter_dir: Path) -> dict:
    """The ``lora_config`` of an ``adapter_config.json`` (rank and target groups).

    Raises:
        GatewayError: the file is missing or not a LoRA config (the message says which).
    """
    from openrl.errors import UserError
    from openrl.model.lora.config import LoraSpec

    path = adapter_dir / ADAPTER_CONFIG_NAME
    try:
        spec = LoraSpec.from_peft_config(json.loads(path.read_text()))
    except FileNotFoundError:
        raise GatewayError(f"{path}: missing (a PEFT adapter directory holds {ADAPTER_CONFIG_NAME} and "
                           f"{ADAPTER_WEIGHTS_NAME})") from None
    except (ValueError, UserError) as exc:
        raise GatewayError(f"{path}: {getattr(exc, 'message', exc)}") from None
    return {"rank": spec.rank, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed}


def _check(r: httpx.Response, what: str) -> dict:
    if r.status_code >= 400:
        try:
            body = r.json()
            detail = body.get("detail") or body
        except ValueError:
            detail = r.text[:300]
        raise GatewayError(f"{what}: HTTP {r.status_code}: {detail}")
    return r.json()


def import_adapter(base_url: str, api_key: str | None, adapter_dir: Path, base_model: str,
                   project_id: str | None = None) -> dict:
    """Upload the adapter in ``adapter_dir`` for ``base_model``; returns ``{"tinker_path",
    "upload_id", "lora_config"}``.

    Raises:
        GatewayError: a missing file, an unreachable gateway, or the gateway's refusal (its
            ``detail`` names the field, file or tensor).
    """
    adapter_dir = Path(adapter_dir)
    weights = adapter_dir / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        raise GatewayError(f"{weights}: missing (convert an adapter_model.bin with PEFT's save_pretrained "
                           "(safe_serialization=True) first)")
    lora = _lora_config(adapter_dir)
    headers = {"X-API-Key": api_key} if api_key else {}
    try:
        with httpx.Client(base_url=base_url, timeout=TIMEOUT_S, headers=headers) as http:
            start = _check(http.post("/api/v1/external_weights_upload_start",
                                     json={"base_model": base_model, "lora_config": lora,
                                           "destination_project_id": project_id}), "upload start")
            for name, url in start["urls"].items():
                url = url["url"] if isinstance(url, dict) else url
                with open(adapter_dir / name, "rb") as f:
                    _check(httpx.put(url, content=f.read(), timeout=TIMEOUT_S,
                                     headers={"Content-Type": "application/octet-stream"}), f"upload of {name}")
            done = _check(http.post("/api/v1/external_weights_upload_finish", json={"upload_id": start["upload_id"]}),
                          "upload finish")
    except httpx.HTTPError as exc:
        raise GatewayError(f"cannot reach the gateway at {base_url}: {exc}") from exc
    return {"tinker_path": done["tinker_path"], "upload_id": start["upload_id"], "lora_config": lora}


def cmd_import(args: argparse.Namespace) -> int:
    """``openrl adapters import``: print the imported adapter's tinker:// path."""
    try:
        out = import_adapter(_base_url(args), _api_key(args), Path(args.dir), args.base_model, args.project_id)
    except GatewayError as exc:
        print(f"openrl adapters import: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out) if args.json else out["tinker_path"])
    return 0


def configure(sub, common: argparse.ArgumentParser) -> None:
    """Add ``adapters import`` to the ``openrl`` parser (see :func:`openrl.cli.command`)."""
    a = sub.add_parser("adapters", parents=[common], help="import LoRA adapters trained elsewhere")
    asub = a.add_subparsers(dest="adapters_command", metavar="{import}", required=True)
    p = asub.add_parser("import", parents=[common], help="upload a PEFT adapter directory; prints its tinker:// path")
    p.add_argument("dir", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--base-model", required=True, help="registered base-model name the adapter was trained on")
    p.add_argument("--project-id", default=None, help="project of the new run that holds the adapter")
    p.add_argument("--base-url", default=None,
                   help="gateway URL (default $TINKER_BASE_URL, <state>/ports.json, http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="API key (default $TINKER_API_KEY or <state>/api_key)")
    p.add_argument("--json", action="store_true", help="print {tinker_path, upload_id, lora_config} as JSON")
    p.set_defaults(func=cmd_import)
