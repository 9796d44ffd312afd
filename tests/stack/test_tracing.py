"""One trace spans gateway and worker: the gateway's ``publish <op>`` span travels in the
CloudEvent's ``traceparent`` over NATS JetStream, the worker's ``handle <op>`` span is its
child, and the worker's JSON logs carry the same trace id and the request's ids.

The test stack's processes append their spans to ``<state>/traces.jsonl``
(``OPENRL_TRACE_FILE``, see tests/conftest.py and openrl/tracing.py)."""

from __future__ import annotations

import io
import json
import logging
import time

import tinker
from tinker import types

from conftest import BASE_MODEL
from external_stack import requires_serve_env


def spans(stack) -> list[dict]:
    f = stack.state_dir / "traces.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def wait_for(pred, what: str, limit_s: float = 30.0):
    """Poll ``pred()`` until it returns something truthy (spans are written when they end)."""
    deadline = time.monotonic() + limit_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.1)


def test_a_trace_spans_gateway_and_worker(stack, api_key):
    requires_serve_env(stack, "OPENRL_TRACE_FILE")  # (conftest's stacks write <state>/traces.jsonl)
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    toks = list(range(400, 410))
    tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                     loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 9})],
                        "cross_entropy").result()
    run_id = tc.model_id
    rid = f"{run_id}:1"  # the future id of seq_id 1 (see functions/gateway/routes_training.py)

    def find():
        by_id = {}
        for s in spans(stack):
            if s["attributes"].get("cloudevents.event_id") == rid:
                by_id.setdefault((s["service"], s["name"]), s)
        return by_id if len(by_id) >= 2 else None

    found = wait_for(find, f"gateway and trainer spans of {rid}")
    pub = found[("openrl-gateway", "publish forward_backward")]
    handle = found[("openrl-trainer", "handle forward_backward")]
    # same trace on both sides of NATS, the worker's span a child of the gateway's
    assert pub["trace_id"] == handle["trace_id"]
    assert handle["parent_span_id"] == pub["span_id"]
    assert pub["kind"] == "PRODUCER" and handle["kind"] == "CONSUMER"
    assert handle["attributes"]["openrl.outcome"] == "ok"
    # ...and back: the result is stored under the worker's span, and the gateway's publish
    # span ends when the result lands (so it covers the worker's work)
    store = wait_for(lambda: [s for s in spans(stack) if s["name"] == "store result"
                              and s["parent_span_id"] == handle["span_id"]], "the store-result span")[0]
    assert store["trace_id"] == pub["trace_id"]
    assert pub["attributes"].get("openrl.outcome") == "ok"
    assert pub["start_ns"] <= handle["start_ns"] <= store["start_ns"] <= pub["end_ns"]
    # the gateway's HTTP span (FastAPI) is an ancestor of the publish span
    trace = {s["span_id"]: s for s in spans(stack) if s["trace_id"] == pub["trace_id"]}
    chain, cur = [], pub
    while cur.get("parent_span_id") in trace:
        cur = trace[cur["parent_span_id"]]
        chain.append(cur)
    assert any(s["kind"] == "SERVER" and "/api/v1/forward_backward" in s["name"] for s in chain), chain

    # the worker's structured log line of that request carries its ids and the trace id
    def log_line():
        for line in (stack.state_dir / "logs" / "trainer.log").read_text().splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("request_id") == rid and rec.get("msg") == "handled":
                    return rec
        return None

    rec = wait_for(log_line, "the trainer's log line")
    assert rec["run_id"] == run_id and rec["seq_id"] == 1 and rec["event_id"] == rid
    assert rec["op"] == "forward_backward" and rec["service"] == "trainer"
    assert rec["trace_id"] == handle["trace_id"]


def test_traceparent_rides_the_cloudevent():
    """In-process: a span's context goes into the request event's extensions and comes back out."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from openrl.contract import events

    from openrl.observe import tracing

    mem = InMemorySpanExporter()
    assert tracing.setup("openrl-test", exporter=mem)
    span = tracing.start_span("publish sample", kind="producer")
    ev = events.request_event("sample", "r-1", "s-1", {"x": 1}, extensions=tracing.carrier(span))
    headers, body = events.to_headers_body(ev)
    assert headers["ce-traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
    back = events.from_headers_body(headers, body)
    with tracing.span("handle sample", kind="consumer", parent=tracing.event_carrier(back)):
        result = events.result_event(back, {"ok": True}, source="/t")
    span.end()
    done = {s.name: s for s in mem.get_finished_spans()}
    assert done["handle sample"].parent.span_id == span.get_span_context().span_id
    assert done["handle sample"].context.trace_id == span.get_span_context().trace_id
    # the result event carries the worker span's context back
    assert result.get_extension("traceparent").split("-")[2] == f"{done['handle sample'].context.span_id:016x}"


def test_json_log_lines_carry_the_context():
    from openrl.observe import logs

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logs.JsonFormatter("trainer"))
    log = logging.getLogger("openrl.test.logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        with logs.context(run_id="s:train:0", request_id="s:train:0:7", seq_id=7, event_id="s:train:0:7"):
            log.info("handled %s", "x", extra={"duration_ms": 1.5})
        log.info("outside")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["msg"] == "handled x" and first["service"] == "trainer" and first["level"] == "info"
    assert (first["run_id"], first["request_id"], first["seq_id"], first["event_id"]) == \
        ("s:train:0", "s:train:0:7", 7, "s:train:0:7")
    assert first["duration_ms"] == 1.5
    assert "run_id" not in second  # the context ends with its block
