"""Varied shapes, busy time and the sweep row for ``bench/stack_h200.py`` (issue 25 items 2, 3, 6).

``stack_h200.py`` calls these with itself as ``h`` (its ``log``, ``enough``, ``tmo``, ``train_step``,
``scrape``, ...), so the records land in the same ``stack.jsonl`` / ``stack.md``.

* :func:`busy` - the trainer's and sampler's ``openrl_busy_seconds_total`` (seconds their engine had
  at least one job running, ``openrl/observe/metrics.py: BusyClock``) between two
  :func:`busy_snapshot` s, per step and as a fraction of the wall time.
* :func:`s_sft_varied` (``what="sft_varied"``) - the SFT rows with varied shapes: each run-step is one
  ``forward_backward`` of 1-16 datums, each a prompt of 32-512 tokens (weight 0) + a completion of
  1-256 tokens (weight 1), + ``optim_step``.
* :func:`s_rl_varied` (``what="rl_varied"``) - the RL rows with varied shapes: save -> 1-4 prompts of
  32-512 tokens x 1-16 samples (at most 16 sequences, i.e. datums, a step) with ``max_tokens`` up to
  256 and ``stop`` token ids -> importance_sampling ``forward_backward`` + ``optim_step``.
* :func:`s_sweep` (``what="sweep"``) - ``examples/autoresearch`` (the recipe, unchanged) with 8
  experiments one after another (``--parallel 1``) and all at once (``--parallel 8``) against the
  bench's stack, the same one-point search space as ``bench/autoresearch_sweep.sh``.

Every draw comes from a ``random.Random`` seeded from (section, runs, run index), so the same
arguments give the same shapes. ``--tiny`` scales the lengths down (:data:`TINY`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shapes:
    """Ranges (inclusive, in tokens or counts) the varied rows draw from."""

    prompt: tuple[int, int] = (32, 512)        # prompt tokens
    completion: tuple[int, int] = (1, 256)     # SFT completion tokens; RL: the max_tokens cap is the upper end
    datums: tuple[int, int] = (1, 16)          # datums per forward_backward request
    rl_prompts: tuple[int, int] = (1, 4)       # prompts (sample requests) per RL step
    stop_ids: int = 8                          # RL: stop token ids (besides EOS, which a list of ids implies)


FULL = Shapes()
TINY = Shapes(prompt=(8, 64), completion=(1, 32), datums=(1, 4), rl_prompts=(1, 2), stop_ids=4)


def shapes_of(a) -> Shapes:
    return TINY if a.tiny else FULL


def quantiles(xs: list[float]) -> dict:
    """``{"median", "p90", "max"}`` of ``xs`` (seconds), rounded to ms."""
    xs = sorted(xs)
    if not xs:
        return {}
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return {"median": round(statistics.median(xs), 3), "p90": round(p90, 3), "max": round(xs[-1], 3)}


# ------------------------------------------------------------------------------ busy time


def busy_snapshot(h, s) -> dict:
    """The trainer's and sampler's Prometheus samples now (``{"trainer": {...}, "sampler": {...}}``)."""
    return {name: h.scrape(s.metrics_url(name)) for name in ("trainer", "sampler")}


def _busy_s(m: dict, name: str) -> float | None:
    """Busy seconds in one scrape; 0 when the worker answered but has run no job yet (no clock made),
    None when it did not answer (not started, scaled to zero)."""
    v = m.get(f'openrl_busy_seconds_total{{function="{name}"}}')
    if v is not None:
        return v
    if not any(k.startswith("openrl_busy_seconds_total") for k in m):
        # a stack without BusyClock: the sum of the per-owner engine seconds (overlapping jobs add up)
        vals = [x for k, x in m.items() if k.startswith("openrl_usage_gpu_seconds_total{") and f'function="{name}"' in k]
        if vals:
            return sum(vals)
    return 0.0 if m else None


def busy(before: dict, after: dict, wall_s: float, steps: int) -> dict:
    """Busy seconds of the trainer and the sampler between two :func:`busy_snapshot` s.

    Returns ``{name: {"busy_s", "busy_s_per_step", "busy_fraction"}}`` with ``busy_s`` in seconds
    (``openrl_busy_seconds_total`` increase), per step = busy_s / ``steps`` (timed steps of each run:
    concurrent runs step together), fraction = busy_s / ``wall_s`` (0-1). A worker whose metrics
    were not readable is left out; one that had no job is reported with 0.
    """
    out = {}
    for name in ("trainer", "sampler"):
        b, a = _busy_s(before.get(name, {}), name), _busy_s(after.get(name, {}), name)
        if a is None:
            continue
        d = max(0.0, a - (b or 0.0))
        out[name] = {"busy_s": round(d, 3), "busy_s_per_step": round(d / max(1, steps), 3),
                     "busy_fraction": round(d / wall_s, 3) if wall_s > 0 else None}
        # where the snapshots went (trainer) and what loading them cost (sampler), same interval
        keys = {"trainer": (('openrl_trainer_snapshot_saves_total{path="memory"}', "snapshots_memory"),
                            ('openrl_trainer_snapshot_saves_total{path="storage"}', "snapshots_storage"),
                            ("openrl_trainer_packed_runs_count", "passes"),
                            ("openrl_trainer_packed_runs_sum", "packed_runs")),
                "sampler": (("openrl_sampler_adapter_load_seconds_count", "adapter_loads"),
                            ("openrl_sampler_adapter_load_seconds_sum", "adapter_load_s"),
                            ('openrl_sampler_adapter_load_part_seconds_sum{part="check"}', "adapter_check_s"),
                            ('openrl_sampler_adapter_load_part_seconds_sum{part="preload"}', "adapter_preload_s"),
                            ('openrl_sampler_adapter_load_part_seconds_sum{part="engine"}', "adapter_engine_s"))}
        for key, label in keys[name]:
            bv, av = before.get(name, {}).get(key), after.get(name, {}).get(key)
            if av is not None:
                out[name][label] = round(av - (bv or 0.0), 3)
        if out[name].get("passes"):  # runs per forward(_backward) pass, on average (1 = no packing)
            out[name]["runs_per_pass"] = round(out[name]["packed_runs"] / out[name]["passes"], 2)
    return out


def future_times(s, u_from: float, u_to: float) -> list[tuple[str, float, float, float]]:
    """``(op, t0, ts, t1)`` of every answered request the gateway accepted in ``[u_from, u_to]``
    (unix seconds), from the futures bucket (not the SDK): ``t0`` accepted, ``ts`` taken up by a
    worker (``t0`` when not recorded), ``t1`` answered. Raises what reading the bucket raises."""
    import asyncio

    async def go():
        from openrl.transport.bus import FUTURES_BUCKET, Bus, FutureRecord

        nats = json.loads((Path(s.state) / "ports.json").read_text())["nats"]
        bus = await Bus(nats).connect()
        try:
            rows = []
            for k in await bus.kv_keys(FUTURES_BUCKET):
                e = await bus.futures.get(k)
                rec = FutureRecord.decode(e.value)
                m = rec.meta or {}
                t0, t1 = m.get("t0"), m.get("t1")
                if t0 and t1 and u_from <= t0 <= u_to:
                    rows.append((rec.op or "?", t0, m.get("ts") or t0, t1))
            return rows
        finally:
            await bus.close()

    return asyncio.run(go())


def futures_by_op(s, u_from: float, u_to: float) -> dict:
    """Where the requests accepted in ``[u_from, u_to]`` (unix seconds) spent their time, per
    operation (:func:`future_times`): ``{op: {"n", "queued_s", "handled_s"}}`` with quantiles
    (:func:`quantiles`, seconds) of ``queued_s`` (the gateway accepted it, ``t0`` -> a worker
    took it up, ``ts``) and ``handled_s`` (``ts`` -> the answer landed, ``t1``; for the trainer
    this includes its hold window, the wait for the engine lock and the pass). What the client's
    step time has beyond these is the SDK's own round trips (submit, long-poll). Returns
    ``{"error": ...}`` when the bucket cannot be read."""
    try:
        times = future_times(s, u_from, u_to)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return {"error": f"{type(e).__name__}: {e}"}
    rows: dict[str, list[tuple[float, float]]] = {}
    for op, t0, ts, t1 in times:
        rows.setdefault(op, []).append((ts - t0, t1 - ts))
    return {op: {"n": len(v), "queued_s": quantiles([q for q, _ in v]), "handled_s": quantiles([h for _, h in v])}
            for op, v in sorted(rows.items())}


class Marks:
    """A barrier action: at each release of the two barriers around the timed steps, the time
    (``time.perf_counter()`` seconds) and a :func:`busy_snapshot`: taken before the workers go on,
    so the busy seconds between the two marks belong to the timed steps alone (scrape, then time at
    the start; time, then scrape at the end)."""

    def __init__(self, h, s):
        self.h, self.s, self.at = h, s, []
        self.unix: list[float] = []  # the same marks as unix seconds (the futures bucket's clock)

    def __call__(self) -> None:
        if not self.at:
            snap = busy_snapshot(self.h, self.s)
            self.unix.append(time.time())
            self.at.append((time.perf_counter(), snap))
        else:
            t = time.perf_counter()
            self.unix.append(time.time())
            self.at.append((t, busy_snapshot(self.h, self.s)))

    def ops(self) -> dict:
        """:func:`futures_by_op` over the timed steps (``{}`` if a mark is missing)."""
        if len(self.unix) < 2:
            return {}
        return futures_by_op(self.s, self.unix[0], self.unix[1])

    def busy(self, steps: int) -> dict:
        """:func:`busy` over the timed steps (``{}`` if a mark is missing)."""
        if len(self.at) < 2:
            return {}
        (t0, b0), (t1, b1) = self.at[:2]
        return busy(b0, b1, t1 - t0, steps)

    def snapshots(self) -> tuple[dict, dict]:
        return self.at[0][1], self.at[1][1]


# ------------------------------------------------------------------------------ runs in step


def run_in_step(h, n: int, warmup: int, steps: int, step_fn, action=None):
    """Start ``n`` threads, each ``warmup`` untimed calls ``step_fn(i, -1 - j)`` then ``steps`` timed
    calls ``step_fn(i, k)`` (run i; a call returns a dict of seconds / counts), with a barrier
    before and after the timed calls. Returns (the barrier, whose two waits the caller joins to time
    the timed part, the timed calls' dicts, errors). ``action``: the barrier's action (:class:`Marks`)."""
    bar = threading.Barrier(n + 1, action=action)
    rows: list[dict] = []
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            for k in range(warmup):
                step_fn(i, -1 - k)
            bar.wait(timeout=h.tmo(900, 60))
            for k in range(steps):
                rows.append(step_fn(i, k))
            bar.wait(timeout=h.tmo(900, 60))
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
            bar.abort()

    th = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for x in th:
        x.start()
    return bar, rows, errors


# ------------------------------------------------------------------------------ SFT, varied


def sft_request(h, rng: random.Random, sh: Shapes) -> tuple[list, int]:
    """One varied forward_backward request: (datums, tokens). Each datum = prompt (weights 0) +
    completion (weights 1), next-token targets."""
    from tinker import types

    datums, tokens = [], 0
    for _ in range(rng.randint(*sh.datums)):
        p, c = rng.randint(*sh.prompt), rng.randint(*sh.completion)
        ids = h.rand_ids(rng, p + c + 1)
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                  loss_fn_inputs={"target_tokens": ids[1:],
                                                  "weights": [0.0] * (p - 1) + [1.0] * (c + 1)}))
        tokens += p + c
    return datums, tokens


def s_sft_varied(h, svc, s, a, clients: list) -> None:
    """SFT with varied shapes for each ``--sft-runs`` count; one ``what="sft_varied"`` line each:
    tokens/s (all datum tokens / wall), step median / p90 (s), datums and tokens per request, busy."""
    sh = shapes_of(a)
    for n in [int(x) for x in a.sft_runs.split(",")]:
        if not h.enough(a.sft_need_s * (n / 8 + 1), f"sft_varied runs={n}"):
            break
        tcs = clients[:n]
        # every request drawn up front, per run, from its own seed: the same shapes on every run of the bench
        reqs = []
        for i in range(n):
            rng = random.Random(f"sft_varied-{n}-{i}")
            reqs.append([sft_request(h, rng, sh) for _ in range(a.warmup + a.steps)])

        def step(i: int, k: int) -> dict:
            datums, tokens = reqs[i][k if k >= 0 else a.steps + (-1 - k)]
            t0 = time.perf_counter()
            h.train_step(tcs[i], datums)
            return {"step": time.perf_counter() - t0, "tokens": tokens, "datums": len(datums)}

        marks = Marks(h, s)
        bar, rows, errors = run_in_step(h, n, a.warmup, a.steps, step, action=marks)
        try:
            bar.wait(timeout=h.tmo(900, 60))
            bar.wait(timeout=h.tmo(900, 60))
        except threading.BrokenBarrierError:
            h.log(what="sft_varied", runs=n, error=errors[:3] or "barrier broken (timeout)")
            continue
        wall = marks.at[1][0] - marks.at[0][0]
        tok = sum(r["tokens"] for r in rows)
        h.log(what="sft_varied", runs=n, steps=a.steps, wall_s=round(wall, 3), tokens=tok,
              tokens_per_s=round(tok / wall, 1), step_s=quantiles([r["step"] for r in rows]),
              datums_per_request=quantiles([r["datums"] for r in rows]),
              tokens_per_request=quantiles([r["tokens"] for r in rows]),
              busy=marks.busy(a.steps), packed=h.packed_runs(*(m["trainer"] for m in marks.snapshots())),
              shapes={"prompt": sh.prompt, "completion": sh.completion, "datums": sh.datums})


# ------------------------------------------------------------------------------ RL, varied


def stop_tokens(h, sc, a, sh: Shapes) -> list[int]:
    """Stop token ids for the varied RL rows: the ``sh.stop_ids`` tokens the model samples most often
    (a calibration sample of 8 sequences with ``stop=[]`` from ``sc``, seeded; ties in first-drawn
    order); EOS is implied (a list of ids stops at them or at EOS). A trained model's EOS would end
    most sequences; with random weights next to nothing stops (``stopped_share`` says how many did),
    and the per-request ``max_tokens`` draws (cap/4, cap/2, cap) vary the lengths instead."""
    from collections import Counter

    from tinker import types

    rng = random.Random("rl_varied-stops")
    cap = sh.completion[1]
    r = sc.sample(types.ModelInput.from_ints(h.rand_ids(rng, sh.prompt[0])), 8,
                  types.SamplingParams(max_tokens=cap, temperature=1.0, stop=[], seed=25)).result(timeout=h.tmo(600))
    cnt = Counter(t for sq in r.sequences for t in sq.tokens)
    return [t for t, _ in cnt.most_common(sh.stop_ids)]


def s_rl_varied(h, svc, s, a, clients: list) -> None:
    """RL with varied shapes for each ``--rl-runs`` count; one ``what="rl_varied"`` line each: step
    median / p90 and its parts (save, sample, train; seconds), run-steps/s, sampled tokens/s,
    sequences (= datums) a step, new tokens a sequence, the share of sequences a stop ended, busy."""
    from tinker import types

    sh = shapes_of(a)
    runs_list = [int(x) for x in a.rl_runs.split(",")]
    clients = clients[:max(runs_list)]
    stops = stop_tokens(h, clients[0].save_weights_and_get_sampling_client().result(), a, sh)
    h.log(what="rl_varied_stops", stop_token_ids=stops)
    cap = sh.completion[1]

    def draw(rng: random.Random) -> list[tuple[list[int], int, int]]:
        """One step's sample requests: (prompt, num_samples, max_tokens); at most sh.datums[1] sequences."""
        g = rng.randint(*sh.rl_prompts)
        out = []
        for _ in range(g):
            k = rng.randint(1, max(1, sh.datums[1] // g))
            out.append((h.rand_ids(rng, rng.randint(*sh.prompt)), k, rng.choice((cap // 4 or 1, cap // 2 or 1, cap))))
        return out

    for N in runs_list:
        if not h.enough(a.rl_need_s * 1.5, f"rl_varied runs={N}"):
            break
        tcs = clients[:N]
        plans = [[draw(random.Random(f"rl_varied-{N}-{i}-{k}")) for k in range(a.warmup + a.rl_steps)]
                 for i in range(N)]

        def step(i: int, k: int) -> dict:
            plan = plans[i][k if k >= 0 else a.rl_steps + (-1 - k)]
            rng = random.Random(f"rl_varied-rewards-{N}-{i}-{k}")
            tc = tcs[i]
            t0 = time.perf_counter()
            sc = tc.save_weights_and_get_sampling_client().result()
            t1 = time.perf_counter()
            res, _ = h.wait_all([sc.sample(types.ModelInput.from_ints(p), ns,
                                           types.SamplingParams(max_tokens=mt, temperature=1.0, stop=stops))
                                 for p, ns, mt in plan], timeout=600)
            t2 = time.perf_counter()
            datums, lens, stopped = [], [], 0
            for (p, _, mt), r in zip(plan, res):
                rewards = [rng.random() for _ in r.sequences]
                mu, sd = sum(rewards) / len(rewards), statistics.pstdev(rewards) or 1.0
                for sq, rw in zip(r.sequences, rewards):
                    toks, lps = list(sq.tokens), list(sq.logprobs)
                    lens.append(len(toks))
                    stopped += len(toks) < mt
                    if not toks:
                        continue
                    full = p + toks
                    datums.append(types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (len(p) - 1) + lps,
                                        "advantages": [0.0] * (len(p) - 1) + [(rw - mu) / sd] * len(toks)}))
            h.train_step(tc, datums, "importance_sampling", lr=1e-5)
            t3 = time.perf_counter()
            return {"step": t3 - t0, "save": t1 - t0, "sample": t2 - t1, "train": t3 - t2, "tokens": sum(lens),
                    "sequences": len(lens), "lens": lens, "stopped": stopped,
                    "train_tokens": sum(d.model_input.length for d in datums)}

        marks = Marks(h, s)
        bar, rows, errors = run_in_step(h, N, a.warmup, a.rl_steps, step, action=marks)
        try:
            bar.wait(timeout=h.tmo(900, 60))
            bar.wait(timeout=h.tmo(900, 60))
        except threading.BrokenBarrierError:
            h.log(what="rl_varied", runs=N, error=errors[:3] or "barrier broken (timeout)")
            continue
        wall = marks.at[1][0] - marks.at[0][0]
        lens = [x for r in rows for x in r["lens"]]
        seqs = sum(r["sequences"] for r in rows)
        h.log(what="rl_varied", runs=N, steps=a.rl_steps, wall_s=round(wall, 2),
              step_s=quantiles([r["step"] for r in rows]),
              median_s={k: round(statistics.median(r[k] for r in rows), 3) for k in ("step", "save", "sample", "train")},
              steps_per_s=round(N * a.rl_steps / wall, 3),
              sampled_tokens_per_s=round(sum(r["tokens"] for r in rows) / wall, 1),
              trained_tokens_per_s=round(sum(r["train_tokens"] for r in rows) / wall, 1),
              sequences_per_step=quantiles([r["sequences"] for r in rows]),
              new_tokens_per_sequence=quantiles(lens), stopped_share=round(sum(r["stopped"] for r in rows) / max(1, seqs), 3),
              busy=marks.busy(a.rl_steps), **({"ops": marks.ops()} if getattr(a, "breakdown", False) else {}),
              shapes={"prompt": sh.prompt, "max_tokens": sorted({cap // 4 or 1, cap // 2 or 1, cap}),
                      "sequences_per_step": sh.datums, "prompts_per_step": sh.rl_prompts, "stop_ids": len(stops)})


# ------------------------------------------------------------------------------ the sweep row

#: the one-point search space of bench/autoresearch_sweep.sh: every experiment the same config
SWEEP_SPACE = {"learning_rate": [0.01], "rank": [8], "group_size": [4], "loss": ["importance_sampling"],
               "reward": ["arithmetic/shaped"]}


def s_sweep(h, s, a) -> None:
    """``examples/autoresearch`` against the bench's stack: an untimed 1-experiment sweep, then
    ``--sweep-experiments`` experiments x ``--sweep-steps`` RL steps one after another
    (``--parallel 1``) and all at once (``--parallel N``). One ``what="sweep"`` line: the two wall
    times (seconds, the driver process from start to exit), ``speedup`` = sequential / parallel, and
    the trainer's / sampler's busy seconds and fraction in each."""
    out = Path(a.state_dir) / "sweep"
    out.mkdir(parents=True, exist_ok=True)
    space = out / "space.json"
    space.write_text(json.dumps(SWEEP_SPACE))
    env = {**os.environ, "TINKER_BASE_URL": s.url, "TINKER_API_KEY": s.api_key(), "TINKER_TELEMETRY": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    extra = a.sweep_args.split() if a.sweep_args else []
    n, steps = a.sweep_experiments, a.sweep_steps

    def run(tag: str, experiments: int, parallel: int, k: int) -> tuple[float, dict]:
        d = out / tag
        if d.exists():
            import shutil

            shutil.rmtree(d)
        cmd = [sys.executable, str(ROOT / "examples" / "autoresearch"), "--experiments", str(experiments),
               "--parallel", str(parallel), "--steps", str(k), "--space", str(space), "--model", h.BASE,
               "--out", str(d), *extra]
        m0, t0 = busy_snapshot(h, s), time.perf_counter()
        with open(out / f"{tag}.log", "wb") as f:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=h.tmo(1800, 60))
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            tail = (out / f"{tag}.log").read_text(errors="replace")[-800:]
            raise RuntimeError(f"autoresearch {tag} exited {p.returncode}: {tail}")
        return wall, busy(m0, busy_snapshot(h, s), wall, 1)

    if not h.enough(a.sweep_need_s, "sweep"):
        return
    warm, _ = run("warmup", 1, 1, 1)
    seq, b_seq = run("seq", n, 1, steps)
    if not h.enough(seq * 1.2, "sweep parallel"):
        h.log(what="sweep", experiments=n, steps=steps, warmup_s=round(warm, 2), sequential_s=round(seq, 2),
              error="no time left for the parallel sweep")
        return
    par, b_par = run("par", n, n, steps)
    strip = lambda b: {k: {"busy_s": v["busy_s"], "busy_fraction": v["busy_fraction"]} for k, v in b.items()}  # noqa: E731
    h.log(what="sweep", experiments=n, steps=steps, driver_args=" ".join(extra), warmup_s=round(warm, 2),
          sequential_s=round(seq, 2), parallel_s=round(par, 2), speedup=round(seq / par, 2),
          busy_sequential=strip(b_seq), busy_parallel=strip(b_par))


# ------------------------------------------------------------------------------ summary


def _rng(x) -> str:
    return f"{x[0]}-{x[1]}" if x else "?"


def busy_cell(r: dict) -> str:
    """``trainer s (fraction) / sampler s (fraction)`` per step of a row's ``busy``."""
    b = r.get("busy") or {}
    return " / ".join(f"{b[k]['busy_s_per_step']} s ({b[k]['busy_fraction']:.0%})" if k in b and
                      b[k]["busy_fraction"] is not None else "-" for k in ("trainer", "sampler"))


def summary(R: list[dict]) -> list[str]:
    """Markdown lines of the varied and sweep rows (appended to stack.md)."""
    lines: list[str] = []

    bz = busy_cell
    sft = [r for r in R if r.get("what") == "sft_varied" and "tokens_per_s" in r]
    if sft:
        shp = sft[0].get("shapes", {})
        lines += [f"## SFT, varied shapes ({_rng(shp.get('datums'))} datums x prompt {_rng(shp.get('prompt'))} + "
                  f"completion {_rng(shp.get('completion'))} tokens per request)", "",
                  "| runs | tokens/s | step median | step p90 | tokens / request (median) | busy / step: trainer / sampler |",
                  "|---:|---:|---:|---:|---:|---|"]
        for r in sft:
            lines.append(f"| {r['runs']} | {r['tokens_per_s']:,.0f} | {r['step_s']['median']} s | {r['step_s']['p90']} s | "
                         f"{r['tokens_per_request']['median']:.0f} | {bz(r)} |")
        lines.append("")
    rl = [r for r in R if r.get("what") == "rl_varied" and "median_s" in r]
    if rl:
        shp = rl[0].get("shapes", {})
        lines += [f"## RL steps, varied shapes ({_rng(shp.get('prompts_per_step'))} prompts of {_rng(shp.get('prompt'))} "
                  f"tokens, <= {(shp.get('sequences_per_step') or [0, '?'])[1]} sequences, max_tokens "
                  f"{shp.get('max_tokens')}, {shp.get('stop_ids')} stop ids)", "", "| runs | step median | step p90 | save | sample | train | sampled tokens/s | tokens / sequence "
                  "(median) | stopped | busy / step: trainer / sampler |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rl:
            m = r["median_s"]
            lines.append(f"| {r['runs']} | {r['step_s']['median']} s | {r['step_s']['p90']} s | {m['save']} s | "
                         f"{m['sample']} s | {m['train']} s | {r['sampled_tokens_per_s']:,.0f} | "
                         f"{r['new_tokens_per_sequence'].get('median')} | {r['stopped_share']:.0%} | {bz(r)} |")
        lines.append("")
    sw = [r for r in R if r.get("what") == "sweep" and "parallel_s" in r]
    for r in sw:
        lines += [f"## Autoresearch sweep: {r['experiments']} experiments x {r['steps']} RL steps", "",
                  f"one after another {r['sequential_s']} s, all at once {r['parallel_s']} s: **{r['speedup']}x**", ""]
    return lines
