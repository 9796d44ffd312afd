"""Gateway CPU time per future round trip, with many futures in flight.

    python bench/gateway_cpu.py [--futures 2000] [--rounds 2] [--port P] [--state-dir DIR] [--json OUT]

Starts the embedded stack (its own state dir and port), makes one sampling client through the
real ``tinker`` SDK, and per round starts ``--futures`` ``sample()`` calls at once
(``max_tokens=1``, a 3-token prompt; the SDK runs them concurrently up to its
``sample_max_concurrent_requests`` of 2,000) and waits for all of them. Each future costs the
gateway one ``/asample`` and at least one ``/retrieve_future`` (a long poll).

Measured per round, from ``/proc/<pid>/stat`` (utime + stime) of the gateway process only:
gateway CPU seconds ÷ futures = CPU per future round trip (target ≤ 1 ms). Also reported:
wall time, futures per second, the HTTP requests the gateway served (from its Prometheus
``/metrics`` when present) and the CPU seconds of the other processes of the stack.

``--profile`` runs ``py-spy record`` on the gateway during the last round and prints the
functions with the most samples (needs ``pip install py-spy`` and ptrace permission).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of one process (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def requests_served(base_url: str) -> dict[str, float] | None:
    """The gateway's HTTP requests so far by route, from its Prometheus ``/metrics``
    (``openrl_gateway_requests_total``); None when it exports none."""
    import httpx

    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except Exception:  # noqa: BLE001
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^openrl_gateway_requests_total\{([^}]*)\}\s+(\S+)$", line)
        if m:
            route = (re.search(r'route="([^"]*)"', m.group(1)) or [None, "?"])[1]
            out[route] = out.get(route, 0.0) + float(m.group(2))
    return out or None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--futures", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--models", default=os.environ.get("OPENRL_TEST_MODELS"), help="a built models dir to reuse")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tinker
    from tinker import types

    from openrl.transport.embedded import Stack

    state = Path(args.state_dir or tempfile.mkdtemp(prefix="openrl-bench-gw-"))
    state.mkdir(parents=True, exist_ok=True)
    if args.models and not (state / "models").exists():
        (state / "models").symlink_to(Path(args.models), target_is_directory=True)
    stack = Stack(state_dir=state, port=args.port).start()  # 0: any free port
    rows = []
    try:
        gw = next(p for p in stack.procs if "functions.gateway" in p.args)
        others = [p for p in stack.procs if p is not gw]
        svc = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
        sc = svc.create_sampling_client(base_model=BASE_MODEL).result()
        prompt = types.ModelInput.from_ints([1, 2, 3])
        params = types.SamplingParams(max_tokens=1)
        sc.sample(prompt, 1, params).result()  # warm the sampler
        for rnd in range(args.rounds):
            prof = None
            if args.profile and rnd == args.rounds - 1:
                out = state / "py-spy.txt"
                prof = subprocess.Popen(["py-spy", "record", "-p", str(gw.pid), "-f", "raw", "-o", str(out), "-r", "200"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                time.sleep(1.0)
            req0 = requests_served(stack.base_url)
            c0, o0, t0 = cpu_s(gw.pid), sum(cpu_s(p.pid) for p in others), time.monotonic()
            futs = [sc.sample(prompt, 1, params) for _ in range(args.futures)]
            res = [f.result() for f in futs]
            wall = time.monotonic() - t0
            c1, o1 = cpu_s(gw.pid), sum(cpu_s(p.pid) for p in others)
            req1 = requests_served(stack.base_url)
            assert len(res) == args.futures and all(len(r.sequences) == 1 for r in res)
            row = {"round": rnd + 1, "futures": args.futures, "wall_s": round(wall, 2),
                   "futures_per_s": round(args.futures / wall, 1),
                   "gateway_cpu_s": round(c1 - c0, 3),
                   "gateway_cpu_ms_per_future": round(1000 * (c1 - c0) / args.futures, 3),
                   "other_cpu_s": round(o1 - o0, 2)}
            if req0 is not None and req1 is not None:
                per = {r: int(req1[r] - req0.get(r, 0)) for r in req1 if req1[r] - req0.get(r, 0) > 0}
                row["gateway_requests"] = per
                row["requests_per_future"] = round(sum(per.values()) / args.futures, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if prof is not None:
                prof.send_signal(2)
                prof.wait(timeout=60)
                _print_profile(state / "py-spy.txt")
    finally:
        stack.stop()
    info = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    print(json.dumps(info))
    return 0


def _print_profile(path: Path, top: int = 25) -> None:
    """Self and inclusive sample counts per function from a py-spy raw (collapsed) file."""
    if not path.exists():
        print("no py-spy output", flush=True)
        return
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        n = int(n)
        total += n
        frames = stack.split(";")
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        self_[frames[-1]] = self_.get(frames[-1], 0) + n
    print(f"py-spy: {total} samples", flush=True)
    for name, d in (("self", self_), ("inclusive", incl)):
        print(f"-- top {top} by {name}")
        for f, n in sorted(d.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{100 * n / total:5.1f}%  {f}")


if __name__ == "__main__":
    sys.exit(main())
