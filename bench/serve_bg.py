"""Start ``openrl serve`` in its own session (it outlives the device call that started it, so the
next call on the same warm machine can test against it), wait until it is healthy, or stop it.

Usage (project root, the stack's packages on PYTHONPATH)::

    python3 bench/serve_bg.py start --state-dir S --model NAME=DIR [--port P] [--wait-s 900] [-- EXTRA serve args]
    python3 bench/serve_bg.py warm --state-dir S --base-model NAME [--wait-s 900]
    python3 bench/serve_bg.py stop --state-dir S

``start`` runs ``openrl serve --state-dir S --port P --model NAME=DIR`` exactly as README.md tells a
user (with its defaults: device auto, the vLLM sampler when vLLM is importable), output to
``S/serve.log``, its pid in ``S/serve.pid``; it returns once ``/api/v1/healthz`` answers 200 and
prints one JSON line ``{"base_url", "pid", "start_s"}``. ``warm`` drives one request of each kind
through the unmodified SDK (create a run, forward_backward, save weights for the sampler, sample one
token) and prints the seconds each took, so that tests started afterwards do not pay the workers'
start (the 4B model load, vLLM's compile and CUDA graphs) inside their own timeouts. ``stop`` sends SIGTERM to the serve
process, then SIGKILL to its whole process group after ``--grace-s`` (default 60).

Exit codes: 0 ok; 1 the serve process died or never became healthy (the log's last lines are
printed); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def start(a, extra: list[str]) -> int:
    state = Path(a.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    (state / "ports.json").unlink(missing_ok=True)  # the URL is read from this serve's
    cmd = [sys.executable, "-c", "import sys; from openrl.cli import main; sys.exit(main())", "serve",
           "--state-dir", str(state), "--port", str(a.port)]  # 0: any free port, bound by the serve
    for m in a.model or []:
        cmd += ["--model", m]
    cmd += extra
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    log = open(state / "serve.log", "ab")
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    (state / "serve.pid").write_text(str(p.pid))
    while time.time() - t0 < a.wait_s:
        if p.poll() is not None:
            print(f"openrl serve exited with {p.returncode}; last lines of {state / 'serve.log'}:", file=sys.stderr)
            print("".join((state / "serve.log").read_text(errors="replace").splitlines(True)[-30:]), file=sys.stderr)
            return 1
        try:
            url = json.loads((state / "ports.json").read_text())["gateway"]
        except (OSError, ValueError, KeyError):
            url = None
        if url and healthy(url):
            print(json.dumps({"base_url": url, "pid": p.pid, "start_s": round(time.time() - t0, 1)}), flush=True)
            return 0
        time.sleep(0.5)
    print(f"openrl serve not healthy after {a.wait_s} s (log {state / 'serve.log'})", file=sys.stderr)
    return 1


def warm(a) -> int:
    import tinker
    from tinker import types

    state = Path(a.state_dir)
    url = json.loads((state / "ports.json").read_text())["gateway"]
    key = (state / "api_key").read_text().strip()
    svc = tinker.ServiceClient(base_url=url, api_key=key)
    out: dict = {}
    t = time.time()
    tc = svc.create_lora_training_client(base_model=a.base_model, rank=8, seed=0).result(timeout=a.wait_s)
    out["create_s"] = round(time.time() - t, 1)
    t = time.time()
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    tc.forward_backward([d], "cross_entropy").result(timeout=a.wait_s)
    out["forward_backward_s"] = round(time.time() - t, 1)
    t = time.time()
    sc = tc.save_weights_and_get_sampling_client().result(timeout=a.wait_s)
    out["save_s"] = round(time.time() - t, 1)
    t = time.time()
    sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result(timeout=a.wait_s)
    out["sample_s"] = round(time.time() - t, 1)
    print(json.dumps({"warm": out}), flush=True)
    return 0


def stop(a) -> int:
    pidf = Path(a.state_dir) / "serve.pid"
    if not pidf.exists():
        print(f"no {pidf}: nothing to stop")
        return 0
    pid = int(pidf.read_text())
    t0 = time.time()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    while time.time() - t0 < a.grace_s:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    try:  # whatever is left in its session (a vLLM engine core, a worker)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    pidf.unlink(missing_ok=True)
    print(json.dumps({"stopped": pid, "stop_s": round(time.time() - t0, 1)}))
    return 0


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "warm", "stop"])
    ap.add_argument("--base-model", default="Qwen/Qwen3-4B-Instruct-2507", help="warm: the model to drive")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--model", action="append", help="NAME=DIR (repeatable), as openrl serve --model")
    ap.add_argument("--port", type=int, default=0, help="the gateway's port (default 0: any free port)")
    ap.add_argument("--wait-s", type=float, default=900.0)
    ap.add_argument("--grace-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    return {"start": lambda: start(a, extra), "warm": lambda: warm(a), "stop": lambda: stop(a)}[a.action]()


if __name__ == "__main__":
    sys.exit(main())
