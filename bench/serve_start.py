"""``openrl serve --model NAME=DIR`` on a new state dir, two checkouts in one job: seconds from the
command to its first worker spawned (``serve_to_workers``), to ``/api/v1/healthz``, and to the
first ``forward_backward`` answered through the unmodified SDK.

    python bench/serve_start.py --model-dir ~/.openrl/models/tiny-qwen3 --base /tmp/wt-base [--runs 3]

``--base`` is a checkout of the commit to compare against (``git worktree add /tmp/wt-base REV``);
this checkout is "head". Starts alternate (base, head, base, ...) so a drifting machine hits both
alike. Every start gets a new state dir, so ``--model``'s config check is never remembered (the
first start a user makes on a machine). Device: ``--device`` (default cpu). One JSON object a line
on stdout: ``{"checkout", "run", "serve_to_workers_s", "healthy_s", "first_forward_backward_s"}``,
then a summary line per checkout (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HEAD = Path(__file__).resolve().parent.parent


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def one_start(root: Path, model_dir: str, device: str, timeout_s: float) -> dict:
    """One ``openrl serve`` from checkout ``root`` on a new state dir; stopped before returning.

    Raises:
        RuntimeError: the serve exited or missed ``timeout_s`` (its log's tail in the message).
    """
    state = Path(tempfile.mkdtemp(prefix="serve-start-"))
    env = {**os.environ, "PYTHONPATH": str(root), "TINKER_TELEMETRY": "0", "OPENRL_HOME": str(state)}
    cmd = [sys.executable, "-m", "openrl.cli", "serve", "--state-dir", str(state), "--port", "0", "--no-build",
           "--device", device, "--idle-timeout", "0", "--model", f"bench/model={model_dir}"]
    t0 = time.monotonic()
    with open(state / "serve.log", "wb") as log:
        p = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = None
        while url is None or not _healthy(url):
            if p.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"serve from {root} did not come up: {(state / 'serve.log').read_text()[-2000:]}")
            try:
                url = json.loads((state / "ports.json").read_text()).get("gateway")
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        healthy = time.monotonic() - t0
        import tinker
        from tinker import types

        svc = tinker.ServiceClient(base_url=url, api_key=(state / "api_key").read_text().strip())
        tc = svc.create_lora_training_client(base_model="bench/model", rank=8).result()
        tokens = list(range(10, 42))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        tc.forward_backward([datum], "cross_entropy").result()
        first_fb = time.monotonic() - t0
        startup = json.loads((state / "ports.json").read_text()).get("startup", {})
        return {"serve_to_workers_s": round(startup.get("serve_to_workers", float("nan")), 3),
                "healthy_s": round(healthy, 3), "first_forward_backward_s": round(first_fb, 3)}
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="a Hugging Face model directory (e.g. the built tiny-qwen3)")
    ap.add_argument("--base", required=True, help="checkout of the commit to compare against")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout-s", type=float, default=300)
    a = ap.parse_args()
    rows: dict[str, list[dict]] = {"base": [], "head": []}
    for run in range(a.runs):
        for name, root in (("base", Path(a.base).resolve()), ("head", HEAD)):
            rec = one_start(root, a.model_dir, a.device, a.timeout_s)
            rows[name].append(rec)
            print(json.dumps({"checkout": name, "run": run, **rec}), flush=True)
    for name, recs in rows.items():
        print(json.dumps({"checkout": name, "median": {k: statistics.median(r[k] for r in recs) for k in recs[0]}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
