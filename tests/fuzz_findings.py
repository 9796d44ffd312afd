"""The route fuzzer's example database: requests that once broke the gateway, kept in the repo.

``tests/data/fuzz_findings.jsonl`` holds one request a line (``{"route", "method", "path",
"body_b64", "headers", "was", "found"}``) with the fuzz fixture's ids written as placeholders
(``{ss}``, ``{run}``, ``{ckpt}``, ...), so that a later run with other ids sends the same
request. ``tests/stack/test_fuzz_routes.py`` replays every line in CI (deterministic: no
randomness there), and appends the shrunk failing request of a fuzz test to the file named by
``$OPENRL_FUZZ_FINDINGS`` (``bench/fuzz_routes.sh`` sets it to this file during its long
randomized run). A hypothesis example database proper is not used: hypothesis ignores it
when ``derandomize`` is on, which CI needs.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
from pathlib import Path

import httpx

FILE = Path(__file__).resolve().parent / "data" / "fuzz_findings.jsonl"
#: Request headers a finding keeps (the API key is the fixture's and is added on replay).
KEPT_HEADERS = ("content-type", "content-encoding", "x-openrl-internal-token")


def load(path: Path = FILE) -> list[dict]:
    """The findings in ``path`` (none when the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _encode(text: str, ids: dict[str, str]) -> str:
    for name, value in sorted(ids.items(), key=lambda kv: -len(kv[1])):  # longest first: ids nest
        if value:
            text = text.replace(value, "{" + name + "}")
    return text


def _decode(text: str, ids: dict[str, str]) -> str:
    for name, value in ids.items():
        text = text.replace("{" + name + "}", value)
    return text


def from_request(request: httpx.Request, route: str, was: str, ids: dict[str, str]) -> dict:
    """A finding of ``request`` (ids replaced by placeholders); ``was``: what went wrong."""
    body = _encode(request.content.decode("latin-1"), ids).encode("latin-1")
    path = _encode(request.url.raw_path.decode("ascii"), ids)
    return {"route": route, "method": request.method, "path": path,
            "body_b64": base64.b64encode(body).decode(),
            "headers": {k: request.headers[k] for k in KEPT_HEADERS if k in request.headers},
            "was": was[:300], "found": datetime.date.today().isoformat()}


def record(finding: dict) -> None:
    """Append ``finding`` to ``$OPENRL_FUZZ_FINDINGS`` (nothing when unset), once."""
    target = os.environ.get("OPENRL_FUZZ_FINDINGS")
    if not target:
        return
    path = Path(target)
    key = (finding["method"], finding["path"], finding["body_b64"], json.dumps(finding["headers"], sort_keys=True))
    for old in load(path):
        if (old["method"], old["path"], old["body_b64"], json.dumps(old["headers"], sort_keys=True)) == key:
            return
    with path.open("a") as fh:
        fh.write(json.dumps(finding, sort_keys=True) + "\n")


def replay(client: httpx.Client, base_url: str, finding: dict, ids: dict[str, str]) -> httpx.Response:
    """Send ``finding`` again with this run's ids."""
    body = _decode(base64.b64decode(finding["body_b64"]).decode("latin-1"), ids).encode("latin-1")
    return client.request(finding["method"], base_url + _decode(finding["path"], ids), content=body,
                          headers=finding["headers"])
