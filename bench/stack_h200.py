"""The product as a user runs it: ``openrl serve`` driven by the unmodified tinker SDK.

    python bench/stack_h200.py [--sections sft,sample,rl,sweep,cold] [--shapes fixed,varied] [--model-dir DIR]
                               [--out DIR] [--tiny] [--device auto|cuda|cpu] [--budget-s S]
    python bench/stack_h200.py --make-model DIR [--tokenizer-from DIR]   (Qwen3-4B shapes, random bf16)

The stack starts the way the README tells a user: ``openrl serve --port P --state-dir D
[--model NAME=DIR] [--device ...]`` as a subprocess (``python -c "import sys; from openrl.cli
import main; sys.exit(main())" serve ...``; an ``OPENRL_MODEL_REGISTRY`` TOML file instead of
``--model`` / ``OPENRL_DEVICE`` instead of ``--device`` where this checkout's CLI lacks them),
the bench waits for ``GET /api/v1/healthz``, reads ``D/api_key`` and talks to it only through
``tinker.ServiceClient(base_url=..., api_key=...)``, with threads for concurrency. Everything
else is the stack's defaults (trainer and sampler on CUDA with bf16 base weights when CUDA is
there, the vLLM sampler when it is installed). The base model name is
``Qwen/Qwen3-4B-Instruct-2507``, served from ``--model-dir`` (``--tiny``: the project's built
tiny model, the packaged registry's default).

Sections (``--sections``; sft, sample, rl and sweep share one stack, started once):
  sft     1/2/4/8 concurrent training runs (LoRA rank 32, train_unembed=False); a step is
          ``forward_backward([1 x 1024 tokens], "cross_entropy")`` + ``optim_step``, both
          submitted before waiting (the SDK's pipelined pattern); warm-up steps, then timed
          steps between two barriers: tokens/s = runs x 1024 x steps / wall. The trainer's
          ``openrl_trainer_packed_runs`` histogram (its Prometheus URL from ``D/ports.json``)
          is read before and after the timed steps: mean runs per forward_backward pass.
  sample  8 snapshots (``save_weights_and_get_sampling_client`` of 8 runs), then 128 concurrent
          ``sample`` requests spread over them (request i on snapshot i % 8), each one prompt of
          64 random tokens x 128 new tokens (temperature 1, ``stop=[]``: nothing stops early);
          ``e2e = tokens / wall``, ``decode = b (n - 1) / (t - t1)`` with t1 the same requests
          with max_tokens=1, best of ``--reps``. Then, after the stack is stopped, the same
          engine the sampler function builds (``SamplerEngine(model, device, dtype, backend)``:
          vLLM on CUDA, the transformers backend with ``--tiny``), called directly with the
          same 8 adapters from the storage directory and the same jobs (a subprocess of this
          script, ``--direct``): stack / direct ratio.
  rl      1 and 8 concurrent runs; a step is save_weights_and_get_sampling_client -> 4 prompts
          x 4 samples x 128 tokens -> forward_backward(importance_sampling: target_tokens,
          the sampler's logprobs, group-normalised advantages of random rewards) + optim_step;
          median step time and its parts (save, sample, train) over the timed steps.
  sweep   ``examples/autoresearch`` with 8 experiments one after another vs all at once against the
          stack (``bench/stack_shapes.py: s_sweep``): wall times and their ratio.
  cold    time from starting ``openrl serve`` (a new state dir) to the first finished
          forward_backward and to the first sample (``--no-cold-sample``: trainer only), then the
          first routed request (``first_routed``; ``--no-cold-routed`` skips it); then
          stop and start again on the same state dir (warm caches) and measure again.
          ``--from-sleep S``: the starts run with ``OPENRL_SLEEP_AFTER=S``; after the last one, wait
          until both workers are asleep and time the next forward_backward and sample (idle -> first
          answer with the processes kept); ``--from-zero S`` then does the same after scale to zero.

``--shapes fixed,varied`` (default both): ``varied`` adds to sft and rl the rows of
``bench/stack_shapes.py`` (``sft_varied``, ``rl_varied``): lengths and datum counts drawn per
request from seeded ``random.Random`` s (prompts 32-512 tokens, completions up to 256 new tokens
with stop token ids, 1-16 datums a request; ``--tiny``: smaller). Every sft / rl row, fixed and
varied, carries ``busy``: the trainer's and sampler's ``openrl_busy_seconds_total`` increase over
the timed steps, per step (s) and as a fraction of the wall time.

Output: one JSON line per measurement on stdout and in ``OUT/stack.jsonl``; a markdown summary
in ``OUT/stack.md`` (also printed). ``--budget-s`` makes every section skip what would start
after the budget (the JSON lines written so far stay); SIGTERM (``timeout``) stops the stack
by its process group before exiting.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stack_shapes as shapes  # noqa: E402
from openrl.transport.local_servers import PortHold  # noqa: E402  (a port nothing else takes: see its doc)

BASE = "Qwen/Qwen3-4B-Instruct-2507"
LO, HI = 1000, 150000  # token ids away from the special tokens (Qwen vocabulary: 151,936)
OUT: Path | None = None
T_START = time.time()
DEADLINE: float | None = None
RECORDS: list[dict] = []
PROFILE_DIR: Path | None = None
STACKS: tuple[Path, float] | None = None  # --stacks: (dir of the raw dumps, seconds between dumps)


def log(**kw) -> None:
    kw.setdefault("t", round(time.time() - T_START, 1))
    RECORDS.append(kw)
    line = json.dumps(kw, default=str)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "stack.jsonl", "a") as f:
            f.write(line + "\n")


def left() -> float:
    return float("inf") if DEADLINE is None else DEADLINE - time.time()


def tmo(cap: float, floor: float = 30.0) -> float:
    """A wait limit: the budget left, between ``floor`` and ``cap`` seconds."""
    return max(floor, min(cap, left()))


def enough(need_s: float, what: str) -> bool:
    """Whether ``need_s`` seconds are left in the budget; logs a skip otherwise."""
    if left() >= need_s:
        return True
    log(what="skipped", part=what, need_s=need_s, left_s=round(left(), 1))
    return False


# ------------------------------------------------------------------------------ the stack


_CLI_FLAGS: set[str] | None = None


def cli_flags() -> set[str]:
    """Which of ``--model`` / ``--device`` this checkout's ``openrl serve`` accepts."""
    global _CLI_FLAGS
    if _CLI_FLAGS is None:
        out = subprocess.run([sys.executable, "-c", "import sys; from openrl.cli import main; sys.exit(main())",
                              "serve", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
        _CLI_FLAGS = {f for f in ("--model", "--device") if f in out}
    return _CLI_FLAGS


class Serve:
    """One ``openrl serve`` subprocess (own process group), started as a user starts it."""

    live: list["Serve"] = []

    def __init__(self, state: Path, model_dir: Path | None, device: str, tag: str, idle_timeout: float | None = None,
                 sleep_after: float | None = None):
        self.state, self.model_dir, self.device, self.tag = Path(state), model_dir, device, tag
        self.idle_timeout = idle_timeout  # OPENRL_IDLE_TIMEOUT (None: the default, 300 s)
        self.sleep_after = sleep_after  # OPENRL_SLEEP_AFTER (None: the default, off)
        # the gateway's port, held for this object's life: every start of this serve binds it
        self._port = PortHold()
        self.port = self._port.port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start; return the seconds until ``/api/v1/healthz`` answers 200."""
        import httpx

        self.state.mkdir(parents=True, exist_ok=True)
        flags = cli_flags()
        cmd = [sys.executable, "-c", "import sys; from openrl.cli import main; sys.exit(main())", "serve",
               "--port", str(self.port), "--state-dir", str(self.state)]
        env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        if PROFILE_DIR is not None or STACKS is not None:  # the hooks of bench/profile_site/sitecustomize.py
            env["PYTHONPATH"] = str(ROOT / "bench" / "profile_site") + os.pathsep + env["PYTHONPATH"]
        if PROFILE_DIR is not None:  # cProfile the sampler worker
            env["OPENRL_BENCH_PROFILE"] = str(PROFILE_DIR)
        if STACKS is not None:  # sampled stacks of every process
            env["OPENRL_BENCH_STACKS"] = str(STACKS[0] / self.tag)
            env["OPENRL_BENCH_STACKS_EVERY"] = str(STACKS[1])
        if self.model_dir is not None:
            if "--model" in flags:
                cmd += ["--model", f"{BASE}={self.model_dir}"]
            else:  # this checkout's CLI has no --model yet: a registry file
                reg = self.state / "bench_registry.toml"
                reg.write_text(f'[defaults]\nmax_context_length = 4096\n\n[models."{BASE}"]\n'
                               f'path = "{self.model_dir}"\nbuild = false\n')
                env["OPENRL_MODEL_REGISTRY"] = str(reg)
        if self.idle_timeout is not None:
            env["OPENRL_IDLE_TIMEOUT"] = str(self.idle_timeout)
        if self.sleep_after is not None:
            env["OPENRL_SLEEP_AFTER"] = str(self.sleep_after)
        if self.device != "auto":
            if "--device" in flags:
                cmd += ["--device", self.device]
            else:
                env["OPENRL_DEVICE"] = self.device
        logf = open(self.state.parent / f"serve_{self.tag}.log", "ab")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        Serve.live.append(self)
        (self.state.parent / f"serve_{self.tag}.pid").write_text(str(self.proc.pid))
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"openrl serve exited with {self.proc.returncode} (log {logf.name})")
            if time.time() - t0 > tmo(600):
                raise TimeoutError("openrl serve not healthy in time")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def api_key(self) -> str:
        return (self.state / "api_key").read_text().strip()

    def metrics_url(self, name: str) -> str | None:
        try:
            return json.loads((self.state / "ports.json").read_text())["metrics"].get(name)
        except (OSError, KeyError, ValueError):
            return None

    def stop(self, timeout_s: float = 60.0) -> float:
        """SIGTERM ``openrl serve`` (it stops its workers and nats-server), SIGKILL its
        process group after ``timeout_s``; return the seconds it took."""
        t0 = time.time()
        p = self.proc
        if p is None:
            return 0.0
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left in its group (a worker's vLLM engine core, ...)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        if self in Serve.live:
            Serve.live.remove(self)
        return time.time() - t0


def _kill_all() -> None:
    for s in list(Serve.live):
        if s.proc is not None:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


atexit.register(_kill_all)


def _on_term(signum, frame):  # `timeout` sends SIGTERM: unwind, stop the stack, keep the JSON lines
    raise SystemExit(f"signal {signum}")


def service(s: Serve):
    import tinker

    return tinker.ServiceClient(base_url=s.url, api_key=s.api_key())


def scrape(url: str | None) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} (empty on failure)."""
    if not url:
        return {}
    import httpx

    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def packed_runs(before: dict, after: dict) -> dict:
    """Passes and mean runs per pass of ``openrl_trainer_packed_runs`` between two scrapes."""
    n = after.get("openrl_trainer_packed_runs_count", 0) - before.get("openrl_trainer_packed_runs_count", 0)
    s = after.get("openrl_trainer_packed_runs_sum", 0) - before.get("openrl_trainer_packed_runs_sum", 0)
    buckets = {}
    for k, v in after.items():
        if k.startswith("openrl_trainer_packed_runs_bucket"):
            le = k.split('le="', 1)[1].split('"', 1)[0]
            d = v - before.get(k, 0)
            if d:
                buckets[le] = int(d)
    return {"passes": int(n), "mean_runs_per_pass": round(s / n, 2) if n else None, "cumulative_le": buckets}


# ------------------------------------------------------------------------------ data


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LO, HI) for _ in range(n)]


def sft_datum(rng: random.Random, T: int):
    from tinker import types

    ids = rand_ids(rng, T + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * T})


def new_runs(svc, k: int, rank: int) -> list:
    return [svc.create_lora_training_client(base_model=BASE, rank=rank, train_unembed=False).result()
            for _ in range(k)]


def train_step(tc, datums, loss: str = "cross_entropy", lr: float = 1e-4) -> None:
    from tinker import types

    f1 = tc.forward_backward(datums, loss)
    f2 = tc.optim_step(types.AdamParams(learning_rate=lr))
    f1.result()
    f2.result()


def wait_all(futs, timeout: float | None = None) -> tuple[list, list[float]]:
    """Results of SDK futures and each one's completion time (time.time())."""
    done_at: list[float] = [0.0] * len(futs)
    cfs = []
    for i, f in enumerate(futs):
        cf = f.future() if hasattr(f, "future") else None
        if cf is not None:
            cf.add_done_callback(lambda _, i=i: done_at.__setitem__(i, time.time()))
        cfs.append(cf)
    out = []
    for i, f in enumerate(futs):
        out.append(f.result(timeout=timeout))
        if not done_at[i]:
            done_at[i] = time.time()
    return out, done_at


# ------------------------------------------------------------------------------ sections


def s_sft(svc, s: Serve, a) -> None:
    runs_list = [int(x) for x in a.sft_runs.split(",")]
    rng = random.Random(1)
    t = time.time()
    clients = new_runs(svc, max(runs_list), a.rank)
    log(what="sft_setup", runs=len(clients), create_s=round(time.time() - t, 2))
    murl = s.metrics_url("trainer")
    for n in (runs_list if "fixed" in a.shapes else []):
        if not enough(a.sft_need_s * (n / 8 + 0.5), f"sft runs={n}"):
            break
        tcs = clients[:n]
        datums = [[sft_datum(rng, a.tokens)] for _ in tcs]
        marks = shapes.Marks(H, s)  # busy seconds of the timed steps (barrier action)
        bar = threading.Barrier(n + 1, action=marks)
        steps: dict[int, list[float]] = {i: [] for i in range(n)}
        errors: list[str] = []

        def worker(i: int) -> None:
            try:
                for _ in range(a.warmup):
                    train_step(tcs[i], datums[i])
                bar.wait(timeout=tmo(900, 60))
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    train_step(tcs[i], datums[i])
                    steps[i].append(time.perf_counter() - t0)
                bar.wait(timeout=tmo(900, 60))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                bar.abort()

        th = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        t_w = time.time()
        for x in th:
            x.start()
        try:
            bar.wait(timeout=tmo(900, 60))
            t0 = time.perf_counter()
            warm_s = time.time() - t_w
            m0 = scrape(murl)
            bar.wait(timeout=tmo(900, 60))
            wall = time.perf_counter() - t0
        except threading.BrokenBarrierError:
            log(what="sft", runs=n, error=errors[:3] or "barrier broken (timeout)")
            continue
        m1 = scrape(murl)
        tok = n * a.tokens * a.steps
        per = [x for v in steps.values() for x in v]
        log(what="sft", runs=n, tokens_per_run_step=a.tokens, steps=a.steps, warmup_s=round(warm_s, 2),
            wall_s=round(wall, 3), tokens_per_s=round(tok / wall, 1), step_s_median=round(statistics.median(per), 4),
            step_s_all=[round(x, 3) for x in per][:16], packed=packed_runs(m0, m1),
            busy=marks.busy(a.steps))
    if "varied" in a.shapes:
        shapes.s_sft_varied(H, svc, s, a, clients)


def _round(scs, prompts, new_tokens: int, timeout: float):
    from tinker import types

    sp = types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[])
    t0 = time.time()
    futs = [scs[i % len(scs)].sample(types.ModelInput.from_ints(p), 1, sp) for i, p in enumerate(prompts)]
    res, done = wait_all(futs, timeout=timeout)
    dt = time.time() - t0
    ntok = sum(len(sq.tokens) for r in res for sq in r.sequences)
    return dt, ntok, [d - t0 for d in done], t0


def s_sample(svc, s: Serve, a, ctx: dict) -> None:
    from tinker import types

    rng = random.Random(2)
    t = time.time()
    tcs = new_runs(svc, a.snapshots, a.rank)
    for tc in tcs:  # one step each: B != 0, every adapter differs from the base model
        train_step(tc, [sft_datum(rng, 64)], lr=1e-3)
    t_runs = time.time() - t
    saves, scs = [], []
    for tc in tcs:
        t0 = time.time()
        scs.append(tc.save_weights_and_get_sampling_client().result())
        saves.append(time.time() - t0)
    ctx["runs"] = tcs  # the rl section reuses these runs (trainer memory)
    ctx["adapters"] = find_adapters(s.state / "storage", t, len(scs))  # for the direct engine, later
    log(what="sample_setup", snapshots=len(scs), runs_s=round(t_runs, 2),
        save_s=[round(x, 3) for x in saves], adapter_dirs=len(ctx["adapters"]))
    b, n = a.concurrency, a.new_tokens
    prompts = [rand_ids(rng, a.prompt_tokens) for _ in range(b)]
    t0 = time.time()  # one request first: the cold-start row "openrl serve -> first sample"
    scs[0].sample(types.ModelInput.from_ints(prompts[0]), 1,
                  types.SamplingParams(max_tokens=8, stop=[])).result(timeout=tmo(900))
    log(what="first_sample", wait_s=round(time.time() - t0, 2),
        since_serve_s=round(time.time() - ctx.get("serve_t0", T_START), 2), vllm_cache="empty (new state dir)")
    t0 = time.time()
    dt, ntok, _, _ = _round(scs, prompts, 8, timeout=tmo(900, 60))
    log(what="sample_warmup", requests=b, max_tokens=8, s=round(dt, 2), first_round_incl_engine_start=True)
    ctx["sample_warmup_s"] = round(time.time() - t0, 2)
    best = None
    t1s = []
    for _ in range(2):
        if not enough(30, "sample t1"):
            return
        t1s.append(_round(scs, prompts, 1, timeout=tmo(600))[0])
    t1 = min(t1s)
    for r in range(a.reps):
        if not enough(30 if best is None else 2 * best[0], f"sample rep {r}"):
            break
        dt, ntok, done, t0 = _round(scs, prompts, n, timeout=tmo(600))
        if best is None or dt < best[0]:
            best = (dt, ntok, done, t0)
    if best is None:
        return
    dt, ntok, done, t0 = best
    rec = dict(what="sample_stack", requests=b, snapshots=len(scs), prompt_tokens=a.prompt_tokens, new_tokens=n,
               tokens=ntok, s=round(dt, 3), t1_s=round(t1, 3), e2e_tokens_per_s=round(ntok / dt, 1),
               decode_tokens_per_s=round(b * (n - 1) / max(dt - t1, 1e-6), 1),
               done_s_p50=round(statistics.median(done), 3), done_s_min=round(min(done), 3),
               done_s_max=round(max(done), 3))
    if ntok != b * n:
        rec["note"] = f"expected {b * n} tokens"
    log(**rec)
    ctx["stack"] = rec
    if a.breakdown:
        breakdown(s, t0, t0 + dt)  # requests accepted during the best round


def breakdown(s: Serve, t_from: float, t_to: float) -> None:
    """Diagnostics (not the SDK): the futures bucket's accept / take-up / answer times of the
    sample requests of one round (gateway -> JetStream -> sampler -> result)."""
    try:
        rows = [(t0, ts, t1) for op, t0, ts, t1 in shapes.future_times(s, t_from - 0.02, t_to) if op == "sample"]
    except Exception as e:  # noqa: BLE001
        log(what="sample_breakdown", error=f"{type(e).__name__}: {e}")
        return
    if not rows:
        log(what="sample_breakdown", error="no records")
        return

    def q(xs):
        xs = sorted(xs)
        return {"min": round(xs[0], 3), "p50": round(xs[len(xs) // 2], 3), "max": round(xs[-1], 3)}

    log(what="sample_breakdown", requests=len(rows),
        accepted_after_start_s=q([r[0] - t_from for r in rows]),
        queued_s=q([r[1] - r[0] for r in rows]),          # gateway accept -> sampler takes it up
        handled_s=q([r[2] - r[1] for r in rows]),         # sampler: engine + result write
        answered_after_start_s=q([r[2] - t_from for r in rows]))


def s_rl(svc, s: Serve, a, ctx: dict) -> None:
    from tinker import types

    runs_list = [int(x) for x in a.rl_runs.split(",")]
    clients = list(ctx.get("runs") or [])[:max(runs_list)]  # the sample section's runs, if it ran
    clients += new_runs(svc, max(runs_list) - len(clients), a.rank)
    P, G, S, n = a.prompt_tokens, a.rl_prompts, a.rl_samples, a.rl_new_tokens

    def step(tc, rng: random.Random) -> dict:
        t0 = time.perf_counter()
        sc = tc.save_weights_and_get_sampling_client().result()
        t1 = time.perf_counter()
        sp = types.SamplingParams(max_tokens=n, temperature=1.0, stop=[])
        prompts = [rand_ids(rng, P) for _ in range(G)]
        res, _ = wait_all([sc.sample(types.ModelInput.from_ints(p), S, sp) for p in prompts], timeout=600)
        t2 = time.perf_counter()
        datums = []
        for p, r in zip(prompts, res):
            rewards = [rng.random() for _ in r.sequences]
            mu = sum(rewards) / len(rewards)
            sd = statistics.pstdev(rewards) or 1.0
            for sq, rw in zip(r.sequences, rewards):
                toks, lps = list(sq.tokens), list(sq.logprobs)
                full = p + toks
                adv = (rw - mu) / sd
                datums.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * (len(p) - 1) + lps,
                                    "advantages": [0.0] * (len(p) - 1) + [adv] * len(toks)}))
        train_step(tc, datums, "importance_sampling", lr=1e-5)
        t3 = time.perf_counter()
        return {"step": t3 - t0, "save": t1 - t0, "sample": t2 - t1, "train": t3 - t2,
                "tokens": sum(len(sq.tokens) for r in res for sq in r.sequences)}

    for N in (runs_list if "fixed" in a.shapes else []):
        if not enough(a.rl_need_s, f"rl runs={N}"):
            break
        tcs = clients[:N]
        rows: list[dict] = []
        errors: list[str] = []
        marks = shapes.Marks(H, s)  # busy seconds of the timed steps (barrier action)
        bar = threading.Barrier(N + 1, action=marks)

        def worker(i: int) -> None:
            rng = random.Random(100 + i)
            try:
                for _ in range(a.warmup):
                    step(tcs[i], rng)
                bar.wait(timeout=tmo(900, 60))
                for _ in range(a.rl_steps):
                    rows.append(step(tcs[i], rng))
                bar.wait(timeout=tmo(900, 60))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                bar.abort()

        th = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(N)]
        for x in th:
            x.start()
        try:
            bar.wait(timeout=tmo(900, 60))
            t0 = time.perf_counter()
            bar.wait(timeout=tmo(900, 60))
            wall = time.perf_counter() - t0
        except threading.BrokenBarrierError:
            log(what="rl", runs=N, error=errors[:3] or "barrier broken (timeout)")
            continue
        med = {k: round(statistics.median(r[k] for r in rows), 3) for k in ("step", "save", "sample", "train")}
        log(what="rl", runs=N, steps=a.rl_steps, prompts=G, samples=S, new_tokens=n, wall_s=round(wall, 2),
            median_s=med, steps_per_s=round(N * a.rl_steps / wall, 3),
            sampled_tokens_per_s=round(sum(r["tokens"] for r in rows) / wall, 1),
            step_s=shapes.quantiles([r["step"] for r in rows]), busy=marks.busy(a.rl_steps),
            **({"ops": marks.ops()} if a.breakdown else {}))
    if "varied" in a.shapes:
        shapes.s_rl_varied(H, svc, s, a, clients)


def s_cold(a) -> None:
    """``openrl serve`` -> first forward_backward [-> first sample]: on a new state dir (cold caches), then
    again on it (warm). ``--cold-reuse-main``: only the warm start, on the main sections' state dir (its vLLM
    compile cache is warm from them)."""
    if a.cold_reuse_main:
        state, phases = Path(a.state_dir) / "main", ("warm",)
    else:
        state, phases = Path(a.state_dir) / "cold", ("cold", "warm")
        if state.exists():
            import shutil

            shutil.rmtree(state)
    rng = random.Random(3)
    for phase in phases:
        if not enough(a.cold_need_s, f"cold {phase}"):
            return
        s = Serve(state, a.model, a.device, f"cold_{phase}", idle_timeout=a.from_zero or None,
                  sleep_after=a.from_sleep or None)
        rec: dict = {"what": "cold", "phase": phase}
        t0 = time.time()
        try:
            rec["healthy_s"] = round(s.start(), 2)
            svc = service(s)
            tc = svc.create_lora_training_client(base_model=BASE, rank=a.rank, train_unembed=False).result()
            rec["run_created_s"] = round(time.time() - t0, 2)
            tc.forward_backward([sft_datum(rng, a.tokens)], "cross_entropy").result()
            rec["first_forward_backward_s"] = round(time.time() - t0, 2)
            sc = None
            if a.cold_sample:
                from tinker import types

                sc = tc.save_weights_and_get_sampling_client().result()
                sc.sample(types.ModelInput.from_ints(rand_ids(rng, a.prompt_tokens)), 1,
                          types.SamplingParams(max_tokens=16, stop=[])).result(timeout=tmo(900))
                rec["first_sample_s"] = round(time.time() - t0, 2)
                if a.cold_routed:
                    rec.update(first_routed(svc, rng, a))
            rec["phases"] = startup_phases(s)
            if a.from_sleep and phase == phases[-1] and enough(a.cold_need_s + a.from_sleep, "cold from sleep"):
                log(**rec)
                rec = {"what": "cold", "phase": "from sleep"}
                rec.update(from_sleep(s, tc, sc, a, rng))
            if a.from_zero and phase == phases[-1] and enough(a.cold_need_s + a.from_zero, "cold from zero"):
                log(**rec)
                rec = {"what": "cold", "phase": "from zero"}
                rec.update(from_zero(s, tc, sc, a, rng))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:  # also on SIGTERM (SystemExit): stop the stack, keep what was measured
            rec["stop_s"] = round(s.stop(), 2)
            log(**rec)


def first_routed(svc, rng, a) -> dict:
    """Issue 32 item 3's request on a stack that just answered its first sample: a run with the SDK's
    default ``train_unembed=True`` (an lm_head LoRA), one cross_entropy step, its snapshot, then
    ``sample(num_samples=2, include_prompt_logprobs=True, topk_prompt_logprobs=3)``: with vLLM
    the sampler routes it to its transformers backend, started on this first need. Seconds from
    that request to its answer: ``{"first_routed_sample_s"}``, or ``{"first_routed_error"}``."""
    from tinker import types

    try:
        tc = svc.create_lora_training_client(base_model=BASE, rank=a.rank).result()
        tc.forward_backward([sft_datum(rng, a.tokens)], "cross_entropy").result(timeout=tmo(600))
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=tmo(600))
        sc = tc.save_weights_and_get_sampling_client().result(timeout=tmo(600))
        t = time.time()
        r = sc.sample(types.ModelInput.from_ints(rand_ids(rng, a.prompt_tokens)), 2,
                      types.SamplingParams(max_tokens=16, stop=[]), include_prompt_logprobs=True,
                      topk_prompt_logprobs=3).result(timeout=tmo(600))
        got = {"first_routed_sample_s": round(time.time() - t, 2)}
        if not r.prompt_logprobs or not r.topk_prompt_logprobs:
            got["first_routed_error"] = "the answer has no prompt logprobs"
        return got
    except Exception as e:  # noqa: BLE001 - measured: the row says what failed
        return {"first_routed_error": f"{type(e).__name__}: {str(e)[:300]}"}


def startup_phases(s: Serve) -> dict:
    """``openrl_startup_seconds{phase}`` of the trainer and sampler processes now running
    (``openrl.observe.startup``), and the serve process's own from ``<state>/ports.json``:
    ``{"serve": {phase: s}, "trainer": {phase: s}, "sampler": {...}}``."""
    out = {}
    try:
        served = json.loads((s.state / "ports.json").read_text()).get("startup") or {}
    except (OSError, ValueError):
        served = {}
    if served:
        out["serve"] = {k: round(v, 2) for k, v in served.items()}
    for name in ("trainer", "sampler"):
        got = {k.split('phase="', 1)[1].split('"', 1)[0]: round(v, 2) for k, v in scrape(s.metrics_url(name)).items()
               if k.startswith("openrl_startup_seconds{")}
        if got:
            out[name] = got
    return out


def supervisor_states(s: Serve) -> dict:
    """``{process name: state}`` from ``<state>/supervisor.json`` (``openrl status``'s source)."""
    try:
        doc = json.loads((s.state / "supervisor.json").read_text())
    except (OSError, ValueError):
        return {}
    return {p["name"]: p["state"] for p in doc.get("processes", [])}


def first_answers(tc, sc, a, rng) -> dict:
    """Seconds to the next forward_backward and (with a sampling client) the next 16-token sample:
    ``{"first_forward_backward_s", "first_sample_s"}``."""
    from tinker import types

    rec = {}
    t0 = time.time()
    tc.forward_backward([sft_datum(rng, a.tokens)], "cross_entropy").result(timeout=tmo(900))
    rec["first_forward_backward_s"] = round(time.time() - t0, 2)
    if sc is not None:
        t1 = time.time()
        sc.sample(types.ModelInput.from_ints(rand_ids(rng, a.prompt_tokens)), 1,
                  types.SamplingParams(max_tokens=16, stop=[])).result(timeout=tmo(900))
        rec["first_sample_s"] = round(time.time() - t1, 2)
    return rec


def sleep_states(s: Serve) -> dict:
    """``{function: its worker record's sleep dict}`` from ``GET /api/v1/status`` (``{}`` on failure)."""
    import httpx

    try:
        r = httpx.get(f"{s.url}/api/v1/status", headers={"X-API-Key": s.api_key()}, timeout=10)
        return {w["function"]: w.get("sleep") or {} for w in r.json().get("workers", [])}
    except Exception:  # noqa: BLE001 - the gateway restarting: ask again
        return {}


def from_sleep(s: Serve, tc, sc, a, rng) -> dict:
    """Wait until the trainer and (with a sampler client) the sampler are asleep
    (``OPENRL_SLEEP_AFTER``: weights in host memory, processes kept), then time the next
    forward_backward and sample; each worker's own wake seconds come from its record."""
    want = ("trainer", "sampler") if sc is not None else ("trainer",)
    t = time.time()
    while time.time() - t < a.from_sleep + 90:
        st = sleep_states(s)
        if all((st.get(f) or {}).get("state") == "asleep" for f in want):
            break
        time.sleep(0.5)
    else:
        return {"error": f"not asleep after {time.time() - t:.0f} s: {sleep_states(s)}"}
    rec: dict = {"idle_until_asleep_s": round(time.time() - t, 1)}
    rec.update(first_answers(tc, sc, a, rng))
    rec["sleep"] = sleep_states(s)
    return rec


def from_zero(s: Serve, tc, sc, a, rng) -> dict:
    """Wait until the stack scaled its trainer and sampler to zero (``--idle-timeout``), then time
    the next forward_backward (trainer start + run restore) and sample (sampler start + adapter)."""
    t = time.time()
    while time.time() - t < a.from_zero + 90:
        st = supervisor_states(s)
        if st and all(v == "scaled to zero" for k, v in st.items() if k.startswith(("trainer", "sampler"))):
            break
        time.sleep(0.5)
    else:
        return {"error": f"not scaled to zero after {time.time() - t:.0f} s: {supervisor_states(s)}"}
    rec: dict = {"idle_until_zero_s": round(time.time() - t, 1)}
    rec.update(first_answers(tc, sc, a, rng))
    rec["phases"] = startup_phases(s)
    return rec


def profile_report(d: Path) -> None:
    """The sampler worker's cProfile (its event-loop thread) as text: OUT/sampler_profile.txt."""
    import io
    import pstats

    profs = sorted(d.glob("sampler_*.prof"), key=lambda p: p.stat().st_mtime)
    if not profs:
        log(what="sampler_profile", error="no profile written (worker killed before exit?)")
        return
    buf = io.StringIO()
    st = pstats.Stats(str(profs[-1]), stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    (OUT / "sampler_profile.txt").write_text(buf.getvalue())
    log(what="sampler_profile", file=str(OUT / "sampler_profile.txt"), total_s=round(st.total_tt, 2))


# ------------------------------------------------------------------------------ direct engine


def find_adapters(storage: Path, since: float, k: int) -> list[Path]:
    found = [p.parent for p in storage.rglob("adapter_config.json")
             if "sampler_weights" in p.parts and p.stat().st_mtime >= since - 1]
    found.sort(key=lambda p: p.stat().st_mtime)
    return found[-k:]


def direct_main(a) -> None:
    """``--direct``: the sampler function's engine in this process, no stack."""
    import asyncio

    import torch

    from functions.sampler.engine import SamplerEngine
    from openrl.contract.payloads import Sample, SamplingParams

    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    kind = a.direct_backend or ("auto" if dev.startswith("cuda") else "hf")
    adapters = [Path(x) for x in a.adapters.split(",")] if a.adapters else []
    if not dev.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # as the stack's sampler (openrl.model.runtime)

    async def go():
        t = time.time()
        rows = int(a.direct_rows or 0)
        eng = SamplerEngine(Path(a.model), device=dev, dtype=dtype, backend=kind, max_batch_rows=rows or None)
        log(what="direct_init", backend=type(eng.backend).__name__, rows=rows, s=round(time.time() - t, 1),
            max_num_seqs=getattr(eng.backend, "engine_args", {}).get("max_num_seqs",
                                                                    getattr(eng.backend, "max_batch_rows", None)))
        keys = []
        for i, d in enumerate(adapters):
            keys.append(f"direct{i}")
            await eng.ensure_adapter(keys[-1], d)
        rng = random.Random(2)
        b, n = a.concurrency, a.new_tokens
        prompts = [rand_ids(rng, a.prompt_tokens) for _ in range(b)]

        async def rnd(mt: int):
            jobs = [Sample(prompt_tokens=p, base_model=a.model, model_path=keys[i % len(keys)] if keys else None,
                           sampling_params=SamplingParams(max_tokens=mt, temperature=1.0, stop=[]))
                    for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            res = await asyncio.gather(*(eng.sample(j) for j in jobs))
            return time.perf_counter() - t0, sum(len(sq.tokens) for r in res for sq in r.sequences)

        await rnd(8)
        t1 = min([(await rnd(1))[0] for _ in range(2)])
        best = None
        for _ in range(a.reps):
            dt, ntok = await rnd(n)
            best = (dt, ntok) if best is None or dt < best[0] else best
        dt, ntok = best
        log(what="sample_direct", backend=type(eng.backend).__name__, rows=rows, requests=b, snapshots=len(keys),
            prompt_tokens=a.prompt_tokens, new_tokens=n, tokens=ntok, s=round(dt, 3), t1_s=round(t1, 3),
            e2e_tokens_per_s=round(ntok / dt, 1), decode_tokens_per_s=round(b * (n - 1) / max(dt - t1, 1e-6), 1))
        await eng.close()

    asyncio.run(go())


def run_direct(a, ctx: dict) -> None:
    """The direct engine in a subprocess per ``--direct-rows`` entry (0: the engine's default batch width,
    as the stack's sampler builds it; N: ``max_batch_rows=N``, e.g. 64, the width the stack had before)."""
    ads = ctx.get("adapters") or []
    model_dir = a.model or (Path(a.state_dir) / "main" / "models" / "tiny-qwen3")
    for rows in [int(x) for x in str(a.direct_rows).split(",") if x.strip()]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--direct", "--model-dir", str(model_dir),
               "--adapters", ",".join(map(str, ads)), "--out", str(OUT), "--device", a.device,
               "--concurrency", str(a.concurrency), "--new-tokens", str(a.new_tokens),
               "--prompt-tokens", str(a.prompt_tokens), "--reps", str(a.reps), "--direct-rows", str(rows)]
        if a.direct_backend:
            cmd += ["--direct-backend", a.direct_backend]
        lim = left() - 5
        if lim < (30 if a.tiny else 90):
            log(what="skipped", part=f"sample direct rows={rows}", left_s=round(left(), 1))
            return
        t = time.time()
        try:
            env = dict(os.environ)  # vLLM's compile cache of the stack's sampler (a warm start; not timed)
            env.setdefault("VLLM_CACHE_ROOT", str(Path(a.state_dir) / "main" / "cache" / "vllm"))
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True, env=env)
            try:
                _, err = p.communicate(timeout=None if lim == float("inf") else lim)
                rc, tail = p.returncode, (err or "")[-1500:]
            finally:
                try:  # its vLLM engine core too
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        # the child wrote its JSON lines to OUT/stack.jsonl: pick them up for the summary
        for line in (OUT / "stack.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("what") in ("sample_direct", "direct_init") and r not in RECORDS:
                RECORDS.append(r)
        direct = next((r for r in reversed(RECORDS) if r.get("what") == "sample_direct" and r.get("rows") == rows),
                      None)
        st = ctx.get("stack")
        out = dict(what="sample_ratio", rows=rows, rc=rc, s=round(time.time() - t, 1), adapters=len(ads))
        if direct and st and "e2e_tokens_per_s" in direct:
            out.update(stack_over_direct_e2e=round(st["e2e_tokens_per_s"] / direct["e2e_tokens_per_s"], 3),
                       stack_over_direct_decode=round(st["decode_tokens_per_s"] / direct["decode_tokens_per_s"], 3))
        else:
            out["error"] = (direct or {}).get("error") or f"rc={rc}"
            out["stderr_tail"] = tail
        log(**out)


# ------------------------------------------------------------------------------ model


def make_model(out: Path, tok_from: Path | None, tiny: bool = False) -> None:
    """A Qwen3-4B-shaped causal LM with random bf16 weights (as ../shared/vllm-h200/make_model.py,
    without adapters) plus the Qwen tokenizer files of ``tok_from`` (``.gpu/tok`` with an
    ``xz``-packed tokenizer.json, or a built tiny model)."""
    import lzma
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    if tiny:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                          max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          bos_token_id=151643, eos_token_id=151645)
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          bos_token_id=151643, eos_token_id=151645)
    cfg.dtype = "bfloat16"
    cfg.architectures = ["Qwen3ForCausalLM"]  # without it vLLM resolves Qwen3Model (a pooling runner)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    shapes = {"self_attn.q_proj": (nh * hd, H), "self_attn.k_proj": (nkv * hd, H), "self_attn.v_proj": (nkv * hd, H),
              "self_attn.o_proj": (H, nh * hd), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
    shards: list[dict] = [{}]
    size = [0]
    index: dict[str, str] = {}

    def add(name, t):
        shards[-1][name] = t.contiguous()
        size[0] += t.numel() * t.element_size()
        if size[0] >= 2 * 2**30:
            shards.append({})
            size[0] = 0

    add("model.embed_tokens.weight", rnd(V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        for nm, n in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                      ("self_attn.k_norm", hd)):
            add(p + nm + ".weight", torch.ones(n, dtype=torch.bfloat16))
        for m, (o, k) in shapes.items():
            add(p + m + ".weight", rnd(o, k))
    add("model.norm.weight", torch.ones(H, dtype=torch.bfloat16))
    shards = [s for s in shards if s]
    total = 0
    for j, sd in enumerate(shards):
        fn = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(out / fn), metadata={"format": "pt"})
        for k, t in sd.items():
            index[k] = fn
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": index}, indent=1))
    if tok_from is not None:
        for f in Path(tok_from).iterdir():
            if f.name == "tokenizer.json.xz":
                with lzma.open(f) as src, open(out / "tokenizer.json", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            elif f.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                            "vocab.json", "merges.txt", "special_tokens_map.json"):
                shutil.copy2(f, out / f.name)
    print(json.dumps({"what": "make_model", "dir": str(out), "gib": round(total / 2**30, 2), "shards": len(shards),
                      "s": round(time.time() - t0, 1), "tokenizer": (out / "tokenizer.json").exists()}), flush=True)


# ------------------------------------------------------------------------------ summary


def summary() -> str:
    R = RECORDS
    lines = ["# openrl stack benchmark", ""]
    env = next((r for r in R if r.get("what") == "env"), {})
    if env:
        lines.append(f"device: {env.get('gpu') or 'cpu'}; torch {env.get('torch')}; sections {env.get('sections')}; "
                     f"model {env.get('model')}")
        lines.append("")
    sft = [r for r in R if r.get("what") == "sft" and "tokens_per_s" in r]
    if sft:
        lines += ["## SFT through the stack (1 datum x T tokens per run-step; forward_backward + optim_step)", "",
                  "| runs | tokens/s | wall | step (median) | passes | mean runs per pass | busy / step: trainer / sampler |",
                  "|---:|---:|---:|---:|---:|---:|---|"]
        for r in sft:
            p = r.get("packed") or {}
            lines.append(f"| {r['runs']} | {r['tokens_per_s']:,.0f} | {r['wall_s']} s | {r['step_s_median']} s | "
                         f"{p.get('passes')} | {p.get('mean_runs_per_pass')} | {shapes.busy_cell(r)} |")
        lines.append("")
    st = next((r for r in R if r.get("what") == "sample_stack"), None)
    dis = [r for r in R if r.get("what") == "sample_direct" and "e2e_tokens_per_s" in r]
    ras = [r for r in R if r.get("what") == "sample_ratio" and r.get("stack_over_direct_e2e") is not None]
    if st or dis:
        lines += ["## Sampling: concurrent requests over snapshots", "",
                  "| path | requests | new tokens | wall | e2e tokens/s | decode tokens/s |", "|---|---:|---:|---:|---:|---:|"]
        rows = [("stack (SDK -> gateway -> JetStream -> sampler)", st)] + [
            (f"engine called directly ({r.get('backend')}, "
             f"{'default batch width' if not r.get('rows') else 'max_batch_rows ' + str(r['rows'])})", r) for r in dis]
        for name, r in rows:
            if r and "e2e_tokens_per_s" in r:
                lines.append(f"| {name} | {r['requests']} | {r['new_tokens']} | {r['s']} s | {r['e2e_tokens_per_s']:,.0f} | "
                             f"{r['decode_tokens_per_s']:,.0f} |")
        for ra in ras:
            lines.append(f"\nstack / direct (rows={ra.get('rows')}): e2e {ra['stack_over_direct_e2e']}, "
                         f"decode {ra['stack_over_direct_decode']}")
        fs = next((r for r in R if r.get("what") == "first_sample"), None)
        if fs:
            lines.append(f"\nfirst sample: {fs['since_serve_s']} s after `openrl serve` started ({fs['wait_s']} s "
                         f"waited by the request itself; {fs.get('vllm_cache')})")
        bd = next((r for r in R if r.get("what") == "sample_breakdown" and "queued_s" in r), None)
        if bd:
            lines.append(f"\nper request (futures bucket): queued {bd['queued_s']}, handled {bd['handled_s']}")
        lines.append("")
    rl = [r for r in R if r.get("what") == "rl" and "median_s" in r]
    if rl:
        lines += ["## RL steps (save -> sample G x S x n -> importance_sampling forward_backward + optim_step)", "",
                  "| runs | step (median) | save | sample | train | run-steps/s | sampled tokens/s | busy / step: trainer / sampler |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rl:
            m = r["median_s"]
            lines.append(f"| {r['runs']} | {m['step']} s | {m['save']} s | {m['sample']} s | {m['train']} s | "
                         f"{r['steps_per_s']} | {r['sampled_tokens_per_s']:,.0f} | {shapes.busy_cell(r)} |")
        lines.append("")
    cold = [r for r in R if r.get("what") == "cold"]
    if cold:
        lines += ["## Start-up (openrl serve -> ...)", "",
                  "| start | healthz | first run created | first forward_backward | first sample | stop |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in cold:
            if r.get("phase") == "from zero":
                lines.append(f"| from zero (after {r.get('idle_until_zero_s')} s idle) | - | - | "
                             f"{r.get('first_forward_backward_s')} s | {r.get('first_sample_s', '-')} s | - |"
                             + (f" error: {r['error']}" if r.get("error") else ""))
                continue
            lines.append(f"| {r['phase']} | {r.get('healthy_s')} s | {r.get('run_created_s')} s | "
                         f"{r.get('first_forward_backward_s')} s | "
                         f"{str(r['first_sample_s']) + ' s' if 'first_sample_s' in r else '-'} | {r.get('stop_s')} s |"
                         + (f" error: {r['error']}" if r.get("error") else ""))
        for r in cold:
            if "first_routed_sample_s" in r or "first_routed_error" in r:
                lines.append(f"\n{r['phase']}: first routed request (prompt logprobs, lm_head LoRA): "
                             f"{r.get('first_routed_sample_s', '-')} s {r.get('first_routed_error', '')}".rstrip())
        for r in cold:
            if r.get("phases"):
                lines.append(f"\n{r['phase']}: start-up phases (s) {json.dumps(r['phases'])}")
        lines.append("")
    lines += shapes.summary(R)
    skipped = [r for r in R if r.get("what") in ("skipped", "section_error") or
               (r.get("what") in ("sample_direct", "sample_ratio") and r.get("error"))]
    if skipped:
        lines += ["Skipped / failed: " + "; ".join(f"{r.get('part') or r.get('section') or r.get('what')}: "
                                                     f"{r.get('error', 'budget')}" for r in skipped), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main


def main() -> None:
    global OUT, DEADLINE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="sft,sample,rl,sweep,cold")
    ap.add_argument("--shapes", default="fixed,varied",
                    help="sft / rl rows: fixed (the shapes above), varied (bench/stack_shapes.py), or both")
    ap.add_argument("--sweep-experiments", type=int, default=8, help="sweep: experiments (and --parallel of the "
                    "all-at-once run)")
    ap.add_argument("--sweep-steps", type=int, default=None, help="sweep: RL steps per experiment (3; --tiny 2)")
    ap.add_argument("--sweep-args", default="", help="sweep: more examples/autoresearch arguments, e.g. "
                    "'--prompts 8 --max-tokens 64'")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model-dir", dest="model", default=None, help="the base model's directory (default: --tiny's built model)")
    ap.add_argument("--state-dir", default="/tmp/openrl-stack-bench", help="parent of the stacks' state dirs")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (openrl serve --device / OPENRL_DEVICE)")
    ap.add_argument("--tiny", action="store_true", help="small sizes on the built tiny model (a CPU check)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new measurements after this (0: none)")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="SFT tokens per datum (1024)")
    ap.add_argument("--sft-runs", default=None, help="1,2,4,8")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed SFT steps")
    ap.add_argument("--snapshots", type=int, default=None, help="8")
    ap.add_argument("--concurrency", type=int, default=None, help="concurrent sample requests (128)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--rl-runs", default=None, help="1,8")
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("--rl-prompts", type=int, default=None)
    ap.add_argument("--rl-samples", type=int, default=None)
    ap.add_argument("--rl-new-tokens", type=int, default=None)
    ap.add_argument("--no-cold-sample", dest="cold_sample", action="store_false", help="cold: trainer only")
    ap.add_argument("--no-cold-routed", dest="cold_routed", action="store_false",
                    help="cold: skip the first routed request (prompt logprobs of a train_unembed adapter)")
    ap.add_argument("--cold-reuse-main", action="store_true",
                    help="cold: one warm start on the main sections' state dir (after sample/rl)")
    ap.add_argument("--from-zero", type=float, default=0, metavar="IDLE_S",
                    help="cold: start with --idle-timeout IDLE_S and, after the last start, time the first "
                         "forward_backward and sample after the workers scaled to zero (0: off)")
    ap.add_argument("--from-sleep", type=float, default=0, metavar="SLEEP_S",
                    help="cold: start with OPENRL_SLEEP_AFTER=SLEEP_S and, after the last start, time the first "
                         "forward_backward and sample after the workers fell asleep (before --from-zero; 0: off)")
    ap.add_argument("--no-direct", dest="direct_cmp", action="store_false", help="sample: skip the direct engine")
    ap.add_argument("--breakdown", action="store_true", help="sample: per-request times from the futures bucket; "
                    "rl: per operation, queued and handled seconds of the timed steps' requests (ops)")
    ap.add_argument("--profile-sampler", action="store_true",
                    help="cProfile the stack's sampler worker (main thread) -> OUT/sampler_profile.txt")
    ap.add_argument("--stacks", type=float, default=0, metavar="EVERY_S",
                    help="sample the Python stacks of every stack process every EVERY_S seconds for its first "
                         "240 s (bench/profile_site/sitecustomize.py, bench/stack_samples.py) -> OUT/stacks_<start>.md (0: off)")
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--adapters", default="", help=argparse.SUPPRESS)
    ap.add_argument("--direct-rows", default="0",
                    help="sample: direct-engine variants, comma-separated: 0 = the engine's default batch width "
                         "(what the stack's sampler uses), N = max_batch_rows N (64: the stack's width before)")
    ap.add_argument("--direct-backend", default=None, help="hf | vllm | auto (default: what the stack's sampler picks)")
    ap.add_argument("--make-model", default=None, metavar="DIR", help="write a Qwen3-4B-shaped random bf16 model and exit")
    ap.add_argument("--tokenizer-from", default=None, help="--make-model: tokenizer files (.gpu/tok or a built model)")
    a = ap.parse_args()
    if a.make_model:
        tok = a.tokenizer_from or (ROOT / ".gpu" / "tok" if (ROOT / ".gpu" / "tok").is_dir() else None)
        make_model(Path(a.make_model), Path(tok) if tok else None, tiny=a.tiny)
        return
    tiny = a.tiny
    defaults = dict(rank=8 if tiny else 32, tokens=64 if tiny else 1024, sft_runs="1,2" if tiny else "1,2,4,8",
                    warmup=1 if tiny else 2, steps=2 if tiny else 5, snapshots=2 if tiny else 8,
                    concurrency=8 if tiny else 128, prompt_tokens=16 if tiny else 64, new_tokens=16 if tiny else 128,
                    reps=1 if tiny else 2, rl_runs="1,2" if tiny else "1,8", rl_steps=2 if tiny else 3,
                    rl_prompts=2 if tiny else 4, rl_samples=2 if tiny else 4, rl_new_tokens=8 if tiny else 128,
                    sweep_steps=2 if tiny else 3)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.sft_need_s, a.rl_need_s, a.cold_need_s = (20, 20, 30) if tiny else (40, 60, 60)
    a.sweep_need_s = 90 if tiny else 240
    a.shapes = {x for x in a.shapes.split(",") if x}
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    global PROFILE_DIR
    if a.profile_sampler:
        PROFILE_DIR = Path(a.state_dir) / "profile"
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
        for f in PROFILE_DIR.glob("*.prof"):
            f.unlink()
    global STACKS
    if a.stacks > 0:
        STACKS = (Path(a.state_dir) / "stacks" / OUT.name, a.stacks)  # (A/B runs: OUT is default/ or ab/)
        if STACKS[0].exists():
            import shutil

            shutil.rmtree(STACKS[0])
    if a.budget_s:
        DEADLINE = T_START + a.budget_s
    if a.direct:
        try:
            direct_main(a)
        except Exception as e:  # noqa: BLE001
            log(what="sample_direct", rows=int(a.direct_rows or 0), error=f"{type(e).__name__}: {e}",
                tb=traceback.format_exc()[-2000:])
        sys.stdout.flush()
        os._exit(0)  # vLLM's background processes / threads
    signal.signal(signal.SIGTERM, _on_term)
    a.model = Path(a.model).resolve() if a.model else None
    if a.model is None and not tiny:
        ap.error("--model-dir is needed without --tiny")
    sections = [x for x in a.sections.split(",") if x]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        tv = torch.__version__
    except Exception:  # noqa: BLE001
        gpu, tv = None, None
    log(what="env", sections=sections, shapes=sorted(a.shapes), model=str(a.model or "tiny-qwen3 (built)"), device=a.device, gpu=gpu, torch=tv,
        cli_flags=sorted(cli_flags()), tiny=tiny, budget_s=a.budget_s)
    ctx: dict = {}
    try:
        shared = [x for x in sections if x in ("sft", "sample", "rl", "sweep")]
        if shared:
            state = Path(a.state_dir) / "main"
            if state.exists():
                import shutil

                shutil.rmtree(state)
            s = Serve(state, a.model, a.device, "main")
            try:
                ctx["serve_t0"] = time.time()
                log(what="stack_start", healthy_s=round(s.start(), 2), url=s.url, state=str(state))
                svc = service(s)
                for name in shared:
                    t = time.time()
                    try:
                        {"sft": lambda: s_sft(svc, s, a), "sample": lambda: s_sample(svc, s, a, ctx),
                         "rl": lambda: s_rl(svc, s, a, ctx), "sweep": lambda: shapes.s_sweep(H, s, a)}[name]()
                    except Exception as e:  # noqa: BLE001
                        log(what="section_error", section=name, error=f"{type(e).__name__}: {str(e)[:500]}",
                            tb=traceback.format_exc()[-1500:])
                    log(what="section_done", section=name, s=round(time.time() - t, 1))
            finally:
                log(what="stack_stop", s=round(s.stop(), 2))
                if PROFILE_DIR is not None:
                    profile_report(PROFILE_DIR)
            if "sample" in shared and a.direct_cmp and ctx.get("stack"):
                run_direct(a, ctx)
        if "cold" in sections:
            t = time.time()
            try:
                s_cold(a)
            except Exception as e:  # noqa: BLE001
                log(what="section_error", section="cold", error=f"{type(e).__name__}: {str(e)[:500]}")
            log(what="section_done", section="cold", s=round(time.time() - t, 1))
    finally:
        _kill_all()
        if STACKS is not None:
            stacks_report(STACKS[0])
        md = summary()
        (OUT / "stack.md").write_text(md + "\n")
        print(md, flush=True)
        log(what="done", total_s=round(time.time() - T_START, 1))
    sys.stdout.flush()
    os._exit(0)  # the SDK's background threads


def stacks_report(root: Path) -> None:
    """--stacks: bench/stack_samples.py over each start's dumps -> OUT/stacks_<start>.md (the raw dumps stay
    under the state dir, for the call's logs)."""
    for d in sorted(p for p in root.glob("*") if p.is_dir()):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "stack_samples.py"), str(d), "--min-s", "1.0",
                            "--out", str(OUT / f"stacks_{d.name}.md")], capture_output=True, text=True)
        log(what="stacks", start=d.name, rc=r.returncode, out=str(OUT / f"stacks_{d.name}.md"),
            err=r.stderr[-500:] or None)


H = sys.modules[__name__]  # what bench/stack_shapes.py calls back into (log, enough, scrape, ...)

if __name__ == "__main__":
    main()
