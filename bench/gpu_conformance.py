"""The GPU conformance run (issue 22 item 6): ``tests/stack`` against a running ``openrl serve``
(on the H200: a Qwen3-4B-shaped bf16 model, the vLLM sampler), with the bf16 bounds of
``tests/tolerances.py``, in one device call. Writes ``gpu-conformance.md`` (a pass / fail /
skip table per test with each skip's or failure's first line, the device, date, commit,
precision and bounds, the measured values next to them) into ``--out``, with the raw
``results.jsonl``, ``measures.jsonl``, ``junit.xml`` and ``pytest.log``. docs/gpu-conformance.md
says how to run it and keeps the results.

Usage (repository root; on the GPU machine ``python3`` with the stack's wheels on PYTHONPATH)::

    # a serve started here, with the keys and limits the keyed tests need, stopped at the end
    python3 bench/gpu_conformance.py --state-dir /tmp/conf-state --out OUT --commit C --budget-s 540 \\
        --serve "--model Qwen/Qwen3-4B-Instruct-2507=/tmp/q4b --idle-timeout 0"
    # or a serve started by hand: first its environment, then the serve, then the run
    eval "$(python3 bench/gpu_conformance.py --state-dir S --print-env)"
    openrl serve --state-dir S ... &
    python3 bench/gpu_conformance.py --state-dir S --out OUT

The same file is the pytest plugin of the run (``-p gpu_conformance``): it writes one JSON
line per test to ``$CONFORMANCE_RESULTS`` and skips tests not started by
``$CONFORMANCE_DEADLINE`` (unix seconds). Only the standard library and pytest at import.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# core semantics first, then new files (e.g. test_reference_peft.py), the service's edges, the
# examples, and last the files whose tests start stacks of their own (skipped, bar unit tests)
CORE = ["test_e2e_sdk", "test_compat_sdk", "test_compat_sdk_matrix", "test_batch_invariance", "test_stack_packing",
        "test_sample_train_mismatch", "test_two_d_targets_sdk", "test_surface", "test_max_tokens_and_peft",
        "test_stable_reinforce", "test_weights_download"]
# (in CI's order: the keyed tests expect test_auth to see the other key's first runs)
EDGES = ["test_auth", "test_cli_status", "test_errors", "test_fair_share", "test_fuzz_routes", "test_load",
         "test_metrics", "test_signed_urls", "test_tracing"]
EXAMPLES = ["test_cookbook", "test_cookbook_recipes", "test_recipes", "test_sweep", "test_autoresearch"]
OWN_STACKS = ["test_faults", "test_supervisor", "test_scale_to_zero", "test_gateway_replicas", "test_trainer_resume",
              "test_chaos_soak"]
MARGIN_S = 90  # of --budget-s: no test starts later; pytest is killed at MARGIN_S - 20 before the end, then the
# report is written and the serve stopped (up to 50 s)


# ----------------------------------------------------------------------------- the plugin
_phases: dict[str, dict] = {}


def _reason(report) -> str:
    """First line of why a phase was skipped or failed."""
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (file, line, "Skipped: why")
        return str(lr[2]).removeprefix("Skipped: ").splitlines()[0] if lr[2] else ""
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.strip().splitlines()[0]
    text = str(getattr(report, "longreprtext", "") or lr or "").strip()
    lines = [x for x in text.splitlines() if x.startswith("E ")] or text.splitlines()
    return lines[0].removeprefix("E ").strip() if lines else ""


def _write(rec: dict) -> None:
    path = os.environ.get("CONFORMANCE_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def pytest_collection_finish(session) -> None:
    """Record every collected test (those never reached show as "not run")."""
    for item in session.items:
        _write({"nodeid": item.nodeid, "outcome": "collected"})


def pytest_collectreport(report) -> None:
    """A module that failed to import is an error; one skipped whole (``importorskip``) a skip."""
    if report.failed or (report.skipped and report.nodeid.endswith(".py")):
        _write({"nodeid": report.nodeid, "outcome": "error" if report.failed else "skipped", "phase": "collect",
                "reason": _reason(report)})


def pytest_runtest_setup(item) -> None:
    deadline = float(os.environ.get("CONFORMANCE_DEADLINE") or 0)
    if deadline and time.time() > deadline:
        pytest.skip("budget: not started (the run's --budget-s was spent)")


def pytest_runtest_logreport(report) -> None:
    st = _phases.setdefault(report.nodeid, {"duration": 0.0})
    st["duration"] += report.duration
    if report.when == "call" or report.outcome != "passed":
        if st.get("outcome") in (None, "passed"):
            st["outcome"] = {"passed": "passed", "skipped": "skipped"}.get(report.outcome, "failed")
            if report.outcome == "failed" and report.when != "call":
                st["outcome"] = "error"
            st["phase"] = report.when
            st["reason"] = "" if report.outcome == "passed" else _reason(report)
    if report.when == "teardown":
        st = _phases.pop(report.nodeid)
        _write({"nodeid": report.nodeid, "outcome": st.get("outcome", "passed"), "phase": st.get("phase", "call"),
                "reason": st.get("reason", ""), "duration_s": round(st["duration"], 2)})


# ----------------------------------------------------------------------------- the run
def _order(files: list[str] | None) -> list[str]:
    """tests/stack files in run order (CORE, new files, EDGES, EXAMPLES, OWN_STACKS)."""
    have = sorted(p.stem for p in (TESTS / "stack").glob("test_*.py"))
    if files:
        return [str(TESTS / "stack" / (f if f.endswith(".py") else f + ".py")) for f in files]
    known = CORE + EDGES + EXAMPLES + OWN_STACKS
    order = [f for f in CORE if f in have] + [f for f in have if f not in known] + \
        [f for f in EDGES + EXAMPLES + OWN_STACKS if f in have]
    return [str(TESTS / "stack" / f"{f}.py") for f in order]


def _device_name(given: str | None) -> str:
    if given:
        return given
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except Exception:  # noqa: BLE001 - fall through to nvidia-smi / the CPU
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
        if out:
            return out.splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _versions() -> str:
    import importlib.metadata as md

    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "vllm", "transformers", "tinker"):
        try:
            parts.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(parts)


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if out.returncode == 0:
            return out.stdout.strip() + (" (+ local changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def conformance_env(state: Path) -> dict[str, str]:
    """Write ``<state>/conformance.json`` with fresh keys and return the environment the serve
    needs for the keyed tests (tests/fixtures_keys.py ``serve_env``) and the tracing test."""
    sys.path.insert(0, str(TESTS))
    from external_stack import write_conformance
    from fixtures_keys import new_keys, serve_env

    keys = new_keys(user="")
    env = {**serve_env(keys), "OPENRL_TRACE_FILE": str(state / "traces.jsonl")}
    write_conformance(state, {"other": keys.other, "admin": keys.admin, "quota": keys.quota}, env)
    return env


def start_serve(state: Path, serve_args: str, env: dict[str, str], log: Path, timeout_s: float) -> subprocess.Popen:
    """Start ``openrl serve --state-dir STATE [--port P] SERVE_ARGS`` (own process group, output to
    ``log``) and wait until its gateway answers ``/api/v1/healthz``.

    Raises:
        RuntimeError: the serve exited or was not healthy within ``timeout_s`` seconds.
    """
    state.mkdir(parents=True, exist_ok=True)
    (state / "ports.json").unlink(missing_ok=True)  # wait for this serve's
    args = shlex.split(serve_args)
    cmd = [sys.executable, "-m", "openrl.cli", "serve", "--state-dir", str(state), *args]
    if "--port" not in args:
        cmd += ["--port", "0"]  # any free port, bound by the serve; its URL is read from ports.json
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env, "TINKER_TELEMETRY": "0"}, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"openrl serve exited with {proc.returncode} (see {log})")
            try:
                url = json.loads((state / "ports.json").read_text())["gateway"]
                with urllib.request.urlopen(url + "/api/v1/healthz", timeout=2) as r:
                    if r.status == 200:
                        return proc
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(1)
        raise RuntimeError(f"openrl serve not healthy after {timeout_s:.0f} s (see {log})")
    except BaseException:
        stop_serve(proc)
        raise


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM the serve (it stops its workers and nats-server); SIGKILL its group after 40 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _status(state: Path) -> str:
    """The workers' device / dtype / backend as ``openrl status --json`` reports them."""
    try:
        url = json.loads((state / "ports.json").read_text())["gateway"]
        key = (state / "api_key").read_text().strip()
        out = subprocess.run([sys.executable, "-m", "openrl.cli", "status", "--json", "--state-dir", str(state),
                              "--base-url", url, "--api-key", key], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        workers = json.loads(out.stdout).get("workers", [])
        return "; ".join(f"{w.get('consumer')}: {w.get('device')} {w.get('dtype')} {w.get('backend')}"
                         for w in workers) or "n/a"
    except (OSError, ValueError, KeyError, subprocess.SubprocessError):
        return "n/a"


class _Stopped(Exception):
    """SIGTERM / SIGINT reached the runner (e.g. the device call's ``timeout``)."""


def _on_signal(signum, frame) -> None:
    raise _Stopped(signal.Signals(signum).name)


def run_pytest(files: list[str], out: Path, env: dict[str, str], test_timeout: int, kill_at: float,
               extra: list[str]) -> int:
    """pytest on ``files`` (results into ``out``); killed at ``kill_at`` (unix s) or when the runner
    gets SIGTERM / SIGINT. Returns its exit code (124: killed at ``kill_at``, 143: stopped by a signal)."""
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider", "-p", "gpu_conformance",
           f"--timeout={test_timeout}", f"--junitxml={out / 'junit.xml'}", "-q", "-rN", "--no-header", *extra]
    with (out / "pytest.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(10.0, kill_at - time.time()))
        except (subprocess.TimeoutExpired, _Stopped) as e:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124 if isinstance(e, subprocess.TimeoutExpired) else 143


def _cell(text: str, n: int = 180) -> str:
    text = " ".join(str(text).split())
    return (text[: n - 1] + "…" if len(text) > n else text).replace("|", "\\|")


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


def report(out: Path, head: dict, tolerances: dict) -> tuple[str, dict]:
    """gpu-conformance.md from ``results.jsonl`` and ``measures.jsonl`` in ``out``; returns (text, counts)."""
    rows: dict[str, dict] = {}
    for line in (out / "results.jsonl").read_text().splitlines() if (out / "results.jsonl").exists() else []:
        r = json.loads(line)
        if r["outcome"] == "collected":
            rows.setdefault(r["nodeid"], {"outcome": "not run", "reason": "pytest stopped before it (budget)"})
        else:
            rows[r["nodeid"]] = r
    meas = [json.loads(x) for x in (out / "measures.jsonl").read_text().splitlines()] \
        if (out / "measures.jsonl").exists() else []
    counts = {k: sum(r["outcome"] == k for r in rows.values()) for k in ("passed", "failed", "error", "skipped", "not run")}
    ok = counts["failed"] == counts["error"] == 0
    lines = [f"## GPU conformance: {head['device']}, {head['date']}, commit {head['commit']}", "",
             f"**{'PASS' if ok else 'FAIL'}**: {counts['passed']} passed, {counts['failed']} failed, "
             f"{counts['error']} errors, {counts['skipped']} skipped, {counts['not run']} not run "
             f"(of {len(rows)}) in {head['wall_s']:.0f} s", "",
             f"- device: {head['device']} ({head['versions']})",
             f"- workers: {head['workers']}",
             f"- stack: {head['stack']}",
             f"- precision: {tolerances['precision']} (`OPENRL_TEST_PRECISION`), per-test timeout {head['timeout']} s, "
             f"budget {head['budget']} s, pytest exit code {head['rc']}", "",
             "### Bounds and what was measured (tests/tolerances.py)", "",
             "| field | bound | measured max (min for a yes/no field) | measurements | over the bound |",
             "|---|---:|---:|---:|---:|"]
    for field, bound in tolerances.items():
        if field == "precision":
            continue
        mine = [m for m in meas if m["name"] in (field, f"loss/{field}")]
        vals = [m["value"] for m in mine if m["name"] == field]
        if isinstance(bound, bool):  # a fraction that should be 1.0 where the bound is True
            over = sum(1 for m in mine if m.get("bound") is not None and m["value"] < m["bound"])
            worst = min(vals) if vals else None
        else:
            over = sum(1 for m in mine if m.get("bound") is not None and m["value"] > m["bound"])
            worst = max(vals) if vals else None
        lines.append(f"| {field} | {_fmt(bound)} | {_fmt(worst)} | {len(mine)} | {over} |")
    lines += ["", "### Tests", "", "| test | result | s | first line of the reason |", "|---|---|---:|---|"]
    for nodeid, r in rows.items():
        name = nodeid.removeprefix("tests/stack/")
        lines.append(f"| `{_cell(name, 120)}` | {r['outcome']} | {_fmt(r.get('duration_s'))} | {_cell(r.get('reason', ''))} |")
    lines += ["", "### Measured values", "", "| test | name | value | bound | detail |", "|---|---|---:|---:|---|"]
    for m in meas:
        detail = {k: v for k, v in m.items() if k not in ("name", "value", "bound", "precision", "time", "test")}
        lines.append(f"| `{_cell(m.get('test', '').removeprefix('tests/stack/'), 90)}` | {m['name']} | "
                     f"{_fmt(m['value'])} | {_fmt(m.get('bound'))} | {_cell(json.dumps(detail), 140)} |")
    return "\n".join(lines) + "\n", counts


def main(argv: list[str] | None = None) -> int:
    """Run the conformance suite (see the module doc). Returns 0 when nothing failed, 1 otherwise,
    2 when the serve could not be started."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dir", required=True, type=Path, help="state dir of the (running) openrl serve")
    ap.add_argument("--out", type=Path, default=Path("gpu-conformance"), help="where the report and raw files go")
    ap.add_argument("--commit", help="commit under test (default: git rev-parse HEAD, where there is git)")
    ap.add_argument("--device-name", help="device in the report (default: torch / nvidia-smi / the CPU)")
    ap.add_argument("--budget-s", type=float, default=540, help="wall seconds for everything (default 540)")
    ap.add_argument("--test-timeout", type=int, default=300, help="per-test timeout in seconds (pytest-timeout)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], help="tolerances (default: bf16 with CUDA, else fp32)")
    ap.add_argument("--serve", metavar="ARGS", help="start `openrl serve --state-dir STATE ARGS` (with the keyed "
                    "tests' environment) and stop it at the end; without it the serve must be running")
    ap.add_argument("--serve-timeout", type=float, default=300, help="seconds for the serve to become healthy")
    ap.add_argument("--print-env", action="store_true", help="write STATE/conformance.json and print the `export` "
                    "lines for an `openrl serve` started by hand, then exit")
    ap.add_argument("--files", nargs="*", help="test files (names in tests/stack) instead of all, in this order")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    if not args.print_env and args.budget_s <= MARGIN_S:  # every test would be skipped as "budget"
        ap.error(f"--budget-s {args.budget_s:g} leaves no time for tests: no test starts in the last "
                 f"{MARGIN_S} s of the budget (give more than {MARGIN_S})")
    t0 = time.time()
    signal.signal(signal.SIGTERM, _on_signal)  # stop pytest and the serve, still write the report
    signal.signal(signal.SIGINT, _on_signal)
    state = args.state_dir.expanduser().resolve()
    if args.print_env:
        for k, v in conformance_env(state).items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for f in ("results.jsonl", "measures.jsonl"):
        (out / f).unlink(missing_ok=True)
    serve = None
    stack_desc = f"`openrl serve --state-dir {state}` (started elsewhere)"
    if args.serve is not None:
        env = conformance_env(state)
        try:
            serve = start_serve(state, args.serve, env, out / "serve.log", args.serve_timeout)
        except (RuntimeError, _Stopped) as e:
            print(f"gpu_conformance: {e}", file=sys.stderr)
            return 2
        stack_desc = f"`openrl serve --state-dir {state} {args.serve}` (started by this run, up in {time.time() - t0:.0f} s)"
        print(f"[{time.time() - t0:.0f}s] serve healthy", flush=True)
    precision = args.precision
    if precision is None:
        try:
            import torch

            precision = "bf16" if torch.cuda.is_available() else "fp32"
        except ImportError:
            precision = "fp32"
    deadline = t0 + args.budget_s - MARGIN_S
    env = {**os.environ, "OPENRL_TEST_STACK_STATE": str(state), "OPENRL_TEST_PRECISION": precision,
           "OPENRL_TEST_MEASURES": str(out / "measures.jsonl"), "CONFORMANCE_RESULTS": str(out / "results.jsonl"),
           "CONFORMANCE_DEADLINE": str(deadline), "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)}
    extra = list(args.pytest_args)
    if tuple(int(x) for x in pytest.__version__.split(".")[:2]) < (8, 4):
        extra += ["-p", "no:asyncio"]  # pytest-asyncio (carried for the async tests) needs pytest >= 8.4
    try:
        rc = run_pytest(_order(args.files), out, env, args.test_timeout, t0 + args.budget_s - MARGIN_S + 20, extra)
        workers = _status(state) if (serve is None or serve.poll() is None) else "n/a (the serve had exited)"
        os.environ["OPENRL_TEST_PRECISION"] = precision
        sys.path.insert(0, str(TESTS))
        import tolerances

        head = {"device": _device_name(args.device_name), "versions": _versions(), "commit": _commit(args.commit),
                "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "stack": stack_desc,
                "workers": workers, "timeout": args.test_timeout, "budget": f"{args.budget_s:.0f}", "rc": rc,
                "wall_s": time.time() - t0}
        text, counts = report(out, head, tolerances.as_dict())
        (out / "gpu-conformance.md").write_text(text)
        print(text.split("### Tests")[0])
        print(f"report: {out / 'gpu-conformance.md'}", flush=True)
    finally:
        if serve is not None:
            stop_serve(serve)
    return 0 if counts["failed"] == counts["error"] == 0 and rc in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
