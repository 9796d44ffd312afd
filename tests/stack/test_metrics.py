"""Prometheus metrics move when work is done: scrape every process of the real embedded
stack (gateway /metrics, the JetStream workers' metrics ports from <state>/ports.json),
run SDK calls, scrape again and compare."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from conftest import BASE_MODEL

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "openrl.json"


def scrape(url: str) -> tuple[dict, str]:
    """({(sample name, sorted label items): value}, raw text) of one /metrics endpoint."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, (url, r.status_code)
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, r.text


def value(samples: dict, name: str, **labels) -> float:
    """The sample ``name`` with exactly ``labels`` (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_all(stack) -> dict[str, tuple[dict, str]]:
    ports = json.loads((stack.state_dir / "ports.json").read_text())
    supervised = {"supervisor"} if getattr(stack, "external", False) else set()  # openrl serve supervises
    assert set(ports["metrics"]) == {"gateway", "trainer", "sampler"} | supervised
    return {name: scrape(url) for name, url in ports["metrics"].items()}


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_metrics_move_when_work_is_done(stack, api_key):
    from openrl.edge.auth import owner_of

    owner = owner_of(api_key)
    before = scrape_all(stack)

    service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    data = [datum(list(range(200, 213))), datum(list(range(300, 308)))]
    trained_tokens = sum(d.model_input.length for d in data)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    first = sampler.sample(types.ModelInput.from_ints([200, 201, 202]), num_samples=2, sampling_params=params).result()
    second = sampler.sample(types.ModelInput.from_ints([300, 301]), num_samples=1, sampling_params=params).result()
    sampled_tokens = sum(len(s.tokens) for s in first.sequences + second.sequences)
    assert sampled_tokens > 0

    after = scrape_all(stack)
    (g0, _), (g1, gtext) = before["gateway"], after["gateway"]
    (t0, _), (t1, ttext) = before["trainer"], after["trainer"]
    (s0, _), (s1, stext) = before["sampler"], after["sampler"]

    def delta(a, b, name, **labels):
        return value(b, name, **labels) - value(a, name, **labels)

    # gateway: requests by route and status, future latency per op
    for route in ("/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/asample"):
        assert delta(g0, g1, "openrl_gateway_requests_total", route=route, method="POST", status="200") >= 1, route
    assert delta(g0, g1, "openrl_gateway_requests_total", route="/api/v1/asample", method="POST", status="200") >= 2
    for op in ("create_model", "forward_backward", "optim_step", "save_weights_for_sampler", "sample"):
        assert delta(g0, g1, "openrl_future_latency_seconds_count", op=op, outcome="ok") >= 1, op
        assert delta(g0, g1, "openrl_future_latency_seconds_sum", op=op, outcome="ok") > 0, op
    # queue depth per stream, read from JetStream at scrape time
    for stream, consumer in (("OPENRL_TRAIN", "trainer-0"), ("OPENRL_SAMPLE", "sampler")):
        assert ("openrl_queue_pending_messages", (("consumer", consumer), ("stream", stream))) in g1
        assert ("openrl_stream_messages", (("stream", stream),)) in g1

    # trainer: tokens, packed runs, per-key usage, handled requests
    assert delta(t0, t1, "openrl_tokens_trained_total", op="forward_backward") >= trained_tokens
    assert delta(t0, t1, "openrl_trainer_packed_runs_count") >= 1
    assert delta(t0, t1, "openrl_usage_tokens_trained_total", owner=owner) >= trained_tokens
    assert delta(t0, t1, "openrl_usage_gpu_seconds_total", owner=owner, function="trainer") > 0
    assert delta(t0, t1, "openrl_worker_requests_total", function="trainer", op="forward_backward", outcome="ok") >= 1

    # sampler: tokens, adapter cache (a miss loading the snapshot, then a hit), per-key usage
    assert delta(s0, s1, "openrl_tokens_sampled_total") >= sampled_tokens
    assert delta(s0, s1, "openrl_usage_tokens_sampled_total", owner=owner) >= sampled_tokens
    assert delta(s0, s1, "openrl_usage_gpu_seconds_total", owner=owner, function="sampler") > 0
    assert delta(s0, s1, "openrl_sampler_adapter_cache_total", result="miss") >= 1
    assert delta(s0, s1, "openrl_sampler_adapter_cache_total", result="hit") >= 1
    assert delta(s0, s1, "openrl_worker_requests_total", function="sampler", op="sample", outcome="ok") >= 2

    # start-up phases (openrl.observe.startup): where a cold start went, per worker process
    for samples, phases in ((t1, ("process_to_serve", "function_start", "ready", "trainer_model_load",
                                  "trainer_to_device", "trainer_first_pass")),
                            (s1, ("process_to_serve", "function_start", "ready", "sampler_engine_start"))):
        got = {ph: value(samples, "openrl_startup_seconds", phase=ph) for ph in phases}
        assert all(v > 0 for v in got.values()), got
        assert got["ready"] >= got["process_to_serve"] + got["function_start"] - 0.5, got

    # per-key series carry the owner id, never the key
    for text in (gtext, ttext, stext):
        assert api_key not in text


def test_status_route_needs_a_key_and_metrics_do_not(stack, api_key):
    assert httpx.get(f"{stack.base_url}/api/v1/status", timeout=10).status_code == 401
    assert httpx.get(f"{stack.base_url}/metrics", timeout=10).status_code == 200
    st = httpx.get(f"{stack.base_url}/api/v1/status", headers={"X-API-Key": api_key}, timeout=10).json()
    assert {q["stream"] for q in st["queues"]} == {"OPENRL_TRAIN", "OPENRL_SAMPLE"}
    assert {(w["function"], w["shard"]) for w in st["workers"]} >= {("trainer", 0), ("sampler", None)}


def test_dashboard_queries_only_metrics_that_exist():
    """Every openrl_* series the Grafana dashboard queries is defined in openrl/metrics.py."""
    from prometheus_client import REGISTRY

    import openrl.observe.metrics  # noqa: F401  (registers the metrics)

    known = set()
    for collector_names in REGISTRY._names_to_collectors:  # sample names (incl. _total, _bucket, ...)
        known.add(collector_names)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bopenrl_[a-z0-9_]+", e)}
    assert len(used) >= 15
    missing = sorted(m for m in used if m not in known)
    assert not missing, missing
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"] if "datasource" in p)


@pytest.mark.parametrize("bad", ["", "tml-not-a-key"])
def test_metrics_count_rejected_requests(stack, bad):
    """A 401 is counted too (route "unmatched": the edge rejects it before routing)."""
    g0, _ = scrape(f"{stack.base_url}/metrics")
    r = httpx.post(f"{stack.base_url}/api/v1/create_session", headers={"X-API-Key": bad} if bad else {}, json={})
    assert r.status_code == 401
    g1, _ = scrape(f"{stack.base_url}/metrics")
    key = ("openrl_gateway_requests_total", (("method", "POST"), ("route", "unmatched"), ("status", "401")))
    assert g1.get(key, 0) - g0.get(key, 0) >= 1
