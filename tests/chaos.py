"""Chaos soak (issue 17 item 2): concurrent SDK training runs while processes of a supervised
embedded stack are killed at random moments. Shared by ``tests/stack/test_chaos_soak.py`` (a
short CI version) and ``bench/chaos_soak.py`` (``--duration`` / ``--seed``).

What runs:

- ``runs`` training runs, each on its own thread with its own ``tinker.ServiceClient`` (the
  unmodified SDK): deterministic data per run (:func:`datum`), forward_backward +
  optim_step per step, and every ``save_every`` steps a ``save_state`` (the run's recovery
  point), a ``save_weights_for_sampler`` and a ``sample`` on those weights.
- a fault loop (:class:`Injector`, seeded ``random.Random``) that, at random moments, sends
  SIGKILL or SIGTERM to the trainer, SIGKILL to the sampler, the gateway and nats-server
  (in the push binding the trainer and sampler are the HTTP receivers the dispatcher posts
  to). The stack's :class:`~openrl.transport.supervisor.Supervisor` restarts them; the SDK
  retries. nats-server and the gateway are killed at most twice per 60 s (a third death in
  the supervisor's crash window is fatal by design).

How a run treats a failed future (the documented client policy, docs/errors.md "Faults"):
a trainer SIGKILLed after it answered work it had not flushed yet restores the run at its
last flush, so the run's next requests fail with category ``"server"`` (a request dead-
lettered after ``max_deliver`` deliveries fails the same way). Such a run is never continued
on the server's word: the client takes its last ``save_state`` checkpoint
(``create_training_client_from_state_with_optimizer``; before the first one, a new run with
the same seed; that create / load is retried 5 s apart while it fails with "server") and replays
the steps after it. So "no step lost or applied twice" is checked
as: each run's final adapter equals a fault-free twin that ran the same steps once, within
1e-6 (a lost step or a step applied twice moves the weights far more than that). Any other
failure category, or an exception that is not a failed future, counts as a defect.

Counts (:class:`Counts`): faults injected by kind, client requests, SDK retries (the SDK's
own "Retrying request" / "Retrying in" log records of its HTTP and retry-handler layers;
the futures poller's reconnects are not logged by the SDK and not counted), gateway HTTP
requests (its ``openrl_gateway_requests_total``, summed over the gateway's lives), failed
futures by category, recoveries, checkpoints verified.
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
#: Adam with eps 1e-3: a weight whose gradient is ~0 (a LoRA A matrix while B is still ~0) moves by
#: lr * g / eps instead of Adam's +-lr sign step, so the float noise of a different packing of
#: the runs into one pass (a different batched matmul) stays far below the 1e-6 tolerance; with
#: the default eps (1e-8) two such weights flipped sign and differed by 1.5e-4 in a fault-free
#: pass. A lost or repeated step still moves every weight with a real gradient by ~LR (1e-3).
RANK, LR, EPS = 4, 1e-3, 1e-3
LOST_S = 300.0  # a future not answered after this long is lost (a hang guard, not a speed check)

#: Fault kinds: (process name in the supervisor, signal).
FAULTS = {"trainer:SIGKILL": ("trainer", signal.SIGKILL), "trainer:SIGTERM": ("trainer", signal.SIGTERM),
          "sampler:SIGKILL": ("sampler", signal.SIGKILL), "gateway:SIGKILL": ("gateway", signal.SIGKILL),
          "nats:SIGKILL": ("nats", signal.SIGKILL)}
CRITICAL = ("gateway", "nats")

#: The stack's settings for a soak: quick redelivery (3 s ack wait), 1 s periodic flushes, a short
#: restore wait and a short seq_id gap timeout (a run whose trainer lost unflushed work fails fast).
SOAK_ENV = {"OPENRL_ACK_WAIT_S": "3", "OPENRL_FLUSH_INTERVAL_S": "1", "OPENRL_RESTORE_WAIT_S": "1",
            "OPENRL_SEQ_GAP_TIMEOUT_S": "6"}


@dataclass
class Counts:
    """What a soak did; :meth:`as_dict` is what the script prints and the test reads."""

    faults: Counter = field(default_factory=Counter)
    requests: int = 0
    sdk_retries: int = 0
    gateway_requests: float = 0.0
    failed: Counter = field(default_factory=Counter)  # failed futures by category
    unanswered: list = field(default_factory=list)  # anything that was not a result or a failed future
    recoveries: int = 0
    checkpoints_verified: int = 0
    steps: dict = field(default_factory=dict)  # run index -> steps in its final weights
    max_abs_diff: dict = field(default_factory=dict)  # run index -> max |weights - twin's weights|

    def as_dict(self) -> dict:
        return {"faults": dict(self.faults), "faults_total": sum(self.faults.values()), "requests": self.requests,
                "sdk_retries": self.sdk_retries, "gateway_http_requests": int(self.gateway_requests),
                "failed_futures": dict(self.failed), "unanswered": list(self.unanswered),
                "recoveries": self.recoveries, "checkpoints_verified": self.checkpoints_verified,
                "steps": dict(self.steps), "max_abs_diff_vs_twin": dict(self.max_abs_diff)}


class _RetryCounter(logging.Handler):
    """Counts the SDK's retry log records (DEBUG records of ``tinker._base_client`` and
    ``tinker.lib.retry_handler``) while installed."""

    NAMES = ("tinker._base_client", "tinker.lib.retry_handler")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.n = 0
        self._saved = {}

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(("Retrying request to", "Retrying in")):
            self.n += 1

    def __enter__(self):
        for name in self.NAMES:
            lg = logging.getLogger(name)
            self._saved[name] = (lg.level, lg.propagate)
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
            lg.addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            lg = logging.getLogger(name)
            lg.removeHandler(self)
            lg.setLevel(self._saved[name][0])
            lg.propagate = self._saved[name][1]


def datum(run: int, i: int):
    """Step ``i`` of run ``run``: one 24-token cross-entropy datum (deterministic)."""
    from tinker import types

    toks = [(37 * i + 11 * k + 101 * run) % 5000 + 100 for k in range(24)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})


def seed_of(run: int) -> int:
    return 1000 + run


class Driver(threading.Thread):
    """One training run of the soak (see the module doc). After :meth:`join`: ``weights`` (the
    final adapter tensors), ``steps`` (steps in them), ``saved`` (every tinker:// path saved),
    ``error`` (an exception that ended the thread)."""

    def __init__(self, stack, idx: int, counts: Counts, lock: threading.Lock, *, min_steps: int, save_every: int,
                 keep_going: threading.Event):
        super().__init__(name=f"chaos-run-{idx}", daemon=True)
        self.stack, self.idx, self.counts, self.lock = stack, idx, counts, lock
        self.min_steps, self.save_every, self.keep_going = min_steps, save_every, keep_going
        self.weights: dict | None = None
        self.steps = 0
        self.saved: list[str] = []
        self.error: BaseException | None = None

    def _answer(self, fut, what: str):
        """The future's result, or the failed future's exception (category counted); anything
        else is recorded as unanswered and raised."""
        import tinker

        with self.lock:
            self.counts.requests += 1
        try:
            return fut.result(timeout=LOST_S)
        except tinker.RequestFailedError as e:
            cat = getattr(e.category, "value", str(e.category))
            with self.lock:
                self.counts.failed[str(cat)] += 1
            if str(cat) != "server":
                raise
            return e
        except BaseException as e:
            with self.lock:
                self.counts.unanswered.append(f"run {self.idx} {what}: {type(e).__name__}: {e}")
            raise

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the soak
            self.error = e

    def _run(self) -> None:
        import tinker
        from tinker import types

        svc = tinker.ServiceClient(base_url=self.stack.base_url, api_key=self.stack.api_key)

        def retried(make, what: str):
            """A client-making call, retried (5 s apart, 6 tries) while it fails with category
            "server" (the failure says "retry it": e.g. dead-lettered while the trainer restarts)."""
            for attempt in range(6):
                got = self._answer(make(), what)
                if not isinstance(got, Exception):
                    return got
                time.sleep(5.0)
            raise RuntimeError(f"run {self.idx}: {what} failed 6 times: {got}")

        def fresh():
            return retried(lambda: svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK,
                                                                   seed=seed_of(self.idx)), "create")

        tc = fresh()
        ckpt: tuple[int, str] | None = None
        i = 0
        while i < self.min_steps or self.keep_going.is_set():
            fb = tc.forward_backward([datum(self.idx, i)], "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=LR, eps=EPS))
            outs = [self._answer(fb, f"forward_backward {i}"), self._answer(opt, f"optim_step {i}")]
            ok = not any(isinstance(o, Exception) for o in outs)
            if ok:
                i += 1
                if i % self.save_every == 0:
                    st = self._answer(tc.save_state(f"s{i}"), f"save_state {i}")
                    sw = self._answer(tc.save_weights_for_sampler(f"w{i}"), f"save_weights_for_sampler {i}")
                    ok = not isinstance(st, Exception) and not isinstance(sw, Exception)
                    if ok:
                        ckpt = (i, st.path)
                        self.saved += [st.path, sw.path]
                        sc = self._answer(svc.create_sampling_client(model_path=sw.path), "sampling client")
                        if not isinstance(sc, Exception):
                            got = self._answer(sc.sample(types.ModelInput.from_ints([5, 6, 7]), 1,
                                                         types.SamplingParams(max_tokens=4, seed=i)), "sample")
                            if not isinstance(got, Exception):
                                assert 1 <= len(got.sequences[0].tokens) <= 4
            if not ok:  # the server lost this run's recent work: resume from the last checkpoint
                with self.lock:
                    self.counts.recoveries += 1
                if ckpt is None:
                    tc, i = fresh(), 0
                else:
                    tc = retried(lambda: svc.create_training_client_from_state_with_optimizer(ckpt[1]), "load")
                    i = ckpt[0]
        self.steps = i
        self.weights = final_weights(self.stack, tc, f"final-{self.idx}", self._answer)


def final_weights(stack, tc, name: str, answer=None) -> dict:
    """The run's adapter tensors, read from the storage behind ``save_weights_for_sampler(name)``."""
    from safetensors.numpy import load_file

    from openrl.storage import TinkerPath

    fut = tc.save_weights_for_sampler(name)
    res = answer(fut, "final save") if answer else fut.result(timeout=LOST_S)
    if isinstance(res, Exception):
        raise RuntimeError(f"final save failed: {res}")
    path = TinkerPath.parse(res.path)
    return load_file(str(stack.state_dir / "storage" / path.key / "adapter_model.safetensors"))


def twin_weights(stack, idx: int, steps: int) -> dict:
    """A fault-free run with the same seed and data, ``steps`` steps."""
    import tinker
    from tinker import types

    svc = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed_of(idx)).result(timeout=LOST_S)
    for i in range(steps):
        fb = tc.forward_backward([datum(idx, i)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR, eps=EPS)).result(timeout=LOST_S)
        fb.result(timeout=LOST_S)
    return final_weights(stack, tc, f"twin-{idx}")


def verify_checkpoint(stack, path: str) -> None:
    """Every file of the checkpoint matches its manifest (size and sha256).

    Raises:
        openrl.storage.ChecksumMismatch: a file differs or is missing.
    """
    from openrl.storage import TinkerPath
    from openrl.storage.layout import verify_files

    d = stack.state_dir / "storage" / TinkerPath.parse(path).key
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["files"], path
    verify_files(d, manifest["files"], path)


def gateway_requests(stack) -> float:
    """Sum of the gateway's ``openrl_gateway_requests_total`` (0 when it does not answer)."""
    try:
        text = httpx.get(stack.base_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^openrl_gateway_requests_total\{[^}]*\} (\S+)$", text, re.M))


class Injector:
    """The fault loop: ``plan`` (fault kinds, in order) or, with ``plan=None``, seeded random
    kinds until ``stop`` is set; ``gap_s`` (lo, hi): the random wait before each fault, after
    the previous victim was restarted and the gateway answers again."""

    def __init__(self, stack, counts: Counts, lock: threading.Lock, rng: random.Random, *,
                 plan: list[str] | None, gap_s: tuple[float, float], stop: threading.Event):
        self.stack, self.counts, self.lock, self.rng = stack, counts, lock, rng
        self.plan, self.gap_s, self.stop = plan, gap_s, stop
        self._deaths: dict[str, list[float]] = {n: [] for n in CRITICAL}
        self._gw_base = 0.0

    def _wait(self, cond, what: str, timeout_s: float = 180.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.stack.fatal:
                raise RuntimeError(f"the stack gave up while waiting for {what}: {self.stack.fatal}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.stack.base_url + "/api/v1/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _pick(self) -> str:
        now = time.monotonic()
        kinds = [k for k in FAULTS if FAULTS[k][0] not in CRITICAL
                 or len([t for t in self._deaths[FAULTS[k][0]] if now - t < 65]) < 2]
        return self.rng.choice(kinds)

    def inject(self, kind: str) -> None:
        """Send the fault's signal to the live process, wait for its exit and its restart."""
        name, sig = FAULTS[kind]
        sup = self.stack.supervisor
        self._wait(lambda: (p := sup.proc(name)) is not None and p.poll() is None, f"a live {name}")
        if name in CRITICAL:
            now = time.monotonic()
            recent = [t for t in self._deaths[name] if now - t < 65]
            if len(recent) >= 2:  # the supervisor's crash window (3 in 60 s) would stop the stack
                time.sleep(65 - (now - recent[0]))
            self._deaths[name].append(time.monotonic())
        if name == "gateway":
            self.counts.gateway_requests += gateway_requests(self.stack)
        old = sup.proc(name)
        old.send_signal(sig)
        old.wait(timeout=120)
        with self.lock:
            self.counts.faults[kind] += 1
        self._wait(lambda: (p := sup.proc(name)) is not old and p is not None and p.poll() is None,
                   f"the restart of {name}")
        self._wait(self._healthy, "the gateway's health")

    def run(self) -> None:
        """Inject until the plan is done or ``stop`` is set."""
        todo = list(self.plan) if self.plan is not None else None
        while not self.stop.is_set() and (todo is None or todo):
            self.stop.wait(self.rng.uniform(*self.gap_s))
            if self.stop.is_set():
                break
            self.inject(todo.pop(0) if todo is not None else self._pick())


def soak(stack, *, seed: int, runs: int = 4, min_steps: int = 3, save_every: int = 2,
         plan: list[str] | None = None, duration_s: float | None = None,
         gap_s: tuple[float, float] = (1.0, 4.0), check: bool = True) -> Counts:
    """Run the soak on a started, supervised ``stack`` (see the module doc).

    With ``plan`` the runs keep stepping until every planned fault was injected (and at
    least ``min_steps`` steps); with ``duration_s`` the fault loop picks random kinds for that
    many seconds. Then the runs finish, their fault-free twins run, and with ``check`` the
    invariants are asserted (AssertionError naming the broken one). Returns the counts.
    """
    counts, lock = Counts(), threading.Lock()
    rng = random.Random(seed)
    keep_going, stop = threading.Event(), threading.Event()
    keep_going.set()
    with _RetryCounter() as retries:
        drivers = [Driver(stack, i, counts, lock, min_steps=min_steps, save_every=save_every, keep_going=keep_going)
                   for i in range(runs)]
        for d in drivers:
            d.start()
        inj = Injector(stack, counts, lock, rng, plan=plan, gap_s=gap_s, stop=stop)
        timer = threading.Timer(duration_s, stop.set) if duration_s else None
        if timer:
            timer.start()
        try:
            inj.run()
        finally:
            stop.set()
            keep_going.clear()
            if timer:
                timer.cancel()
            for d in drivers:
                d.join(timeout=LOST_S * 3)
        counts.sdk_retries = retries.n
    counts.gateway_requests += gateway_requests(stack)
    hung = [d.name for d in drivers if d.is_alive()]
    errors = {d.name: f"{type(d.error).__name__}: {d.error}" for d in drivers if d.error is not None}
    for d in drivers:
        counts.steps[d.idx] = d.steps
    if check:
        assert not hung, f"runs that never finished: {hung}"
        assert not errors and not counts.unanswered, (errors, counts.unanswered)
        assert set(counts.failed) <= {"server"}, counts.failed
    for d in drivers:
        for p in d.saved:
            verify_checkpoint(stack, p)
            counts.checkpoints_verified += 1
    if check:
        twins = []
        threads = [threading.Thread(target=lambda d=d: twins.append((d, twin_weights(stack, d.idx, d.steps))))
                   for d in drivers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=LOST_S * 3)
        assert len(twins) == len(drivers), "a twin run did not finish"
        for d, ref in sorted(twins, key=lambda t: t[0].idx):
            assert d.weights.keys() == ref.keys()
            diff = max(float(np.abs(d.weights[k] - ref[k]).max()) for k in ref)
            counts.max_abs_diff[d.idx] = diff
            assert any(np.abs(v).max() > 0 for k, v in ref.items() if "lora_B" in k)  # it did train
        bad = {i: v for i, v in counts.max_abs_diff.items() if v > 1e-6}
        assert not bad, f"runs whose adapter differs from their fault-free twin's by more than 1e-6: {bad}"
    assert not stack.fatal, stack.fatal
    return counts


def summary(counts: Counts, binding: str) -> str:
    return f"chaos soak [{binding}]: " + json.dumps(counts.as_dict(), sort_keys=True)

