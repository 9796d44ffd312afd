"""Offline checks of the Kubernetes deployment: knative/, eventing/ and docker/.

What runs here (no cluster, no network):

* ``kustomize build`` (or ``kubectl kustomize``) of every overlay;
* every Knative Serving / Eventing object of the output against the upstream CRD's
  openAPIV3Schema (vendored in tests/data/schemas/), in a strict mode that also rejects
  unknown fields (the API server would silently prune a misspelt field);
* the NatsJetStreamChannel the Broker will create (its ``channel-template-spec``)
  against the eventing-natss CRD;
* the routing contract: a small evaluator of the Triggers' Subscriptions-API filters
  sends every openrl CloudEvent type through the Triggers and checks that each one
  reaches exactly the function it belongs to (a training run's events: one shard);
* the scaling, GPU, delivery-budget, security and environment contracts the functions
  rely on;
* the Dockerfiles: hadolint, plus the facts the manifests depend on (non-root user,
  pinned bases, entry points).

Tools come from PATH or from the directory ``scripts/ci-deploy-tools.sh`` fills
(``$OPENRL_DEPLOY_TOOLS``, default ``~/.cache/openrl-deploy-tools``). A test that
needs a tool that is missing is skipped with the reason; CI runs the script first.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/ci-deploy-tools.sh")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema missing: run scripts/ci-deploy-tools.sh")

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "schemas"
TOOLS_DIR = Path(os.environ.get("OPENRL_DEPLOY_TOOLS", Path.home() / ".cache" / "openrl-deploy-tools"))
INSTALL_HINT = "run scripts/ci-deploy-tools.sh to install it"

APP_OVERLAYS = ["knative/overlays/cpu-dev", "knative/overlays/gke-gpu"]
EVENTING_OVERLAYS = ["eventing/overlays/cpu-dev", "eventing/overlays/gke-gpu"]
ALL_OVERLAYS = APP_OVERLAYS + EVENTING_OVERLAYS + ["knative/shards/shard-0", "knative/shards/shard-1"]

NAMESPACE = "openrl"
BROKER = "openrl"
# The event types the gateway publishes and which function consumes each (the contract's
# topology is the source of truth, so a new op without a Trigger fails
# test_every_event_type_reaches_exactly_its_function).
from openrl.contract.events import RESULT_TYPE  # noqa: E402
from openrl.contract.topology import FUNCTION_OPS, SAMPLER, SOURCE_GATEWAY, TRAINER  # noqa: E402

TRAIN_OPS, SAMPLE_OPS = FUNCTION_OPS[TRAINER], FUNCTION_OPS[SAMPLER]
# How each function starts; the same command is the image's CMD (docker/*.Dockerfile).
ENTRYPOINTS = {
    "gateway": ["python", "-m", "functions.gateway", "--host", "0.0.0.0", "--port", "8080"],
    "trainer": ["python", "-m", "openrl.transport.bindings.http", "functions.trainer", "--host", "0.0.0.0", "--port", "8080"],
    "sampler": ["python", "-m", "openrl.transport.bindings.http", "functions.sampler", "--host", "0.0.0.0", "--port", "8080"],
}
KNATIVE_GROUPS = ("serving.knative.dev", "eventing.knative.dev", "messaging.knative.dev", "sources.knative.dev")


# --------------------------------------------------------------------------- tools


def find_tool(name: str) -> str | None:
    """A tool on PATH, else in the directory scripts/ci-deploy-tools.sh fills."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (TOOLS_DIR / "bin" / name, TOOLS_DIR / "venv" / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@functools.lru_cache(maxsize=None)
def kustomize_cmd() -> tuple[str, ...] | None:
    kustomize = find_tool("kustomize")
    if kustomize:
        return (kustomize, "build")
    kubectl = find_tool("kubectl")
    if kubectl:
        return (kubectl, "kustomize")
    return None


@functools.lru_cache(maxsize=None)
def build(path: str) -> tuple[dict, ...]:
    cmd = kustomize_cmd()
    if cmd is None:
        pytest.skip(f"neither kustomize nor kubectl found: {INSTALL_HINT}")
    proc = subprocess.run([*cmd, str(ROOT / path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} {path} failed:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{path} built to nothing"
    return docs


def objects(docs, kind: str, group: str | None = None) -> list[dict]:
    out = []
    for d in docs:
        if d["kind"] != kind:
            continue
        g = d["apiVersion"].split("/")[0] if "/" in d["apiVersion"] else ""
        if group is None or g == group:
            out.append(d)
    return out


def ksvcs(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in objects(docs, "Service", "serving.knative.dev")}


def triggers(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in objects(docs, "Trigger", "eventing.knative.dev")}


def function_of(ksvc: dict) -> str:
    return ksvc["metadata"]["labels"]["openrl.dev/function"]


def annotations(ksvc: dict) -> dict:
    return ksvc["spec"]["template"]["metadata"].get("annotations", {})


def container(ksvc: dict) -> dict:
    containers = ksvc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, ksvc["metadata"]["name"]
    return containers[0]


def env_of(docs, ksvc: dict) -> dict[str, str]:
    """The container's environment: envFrom ConfigMaps first, then env (which wins)."""
    env: dict[str, str] = {}
    cms = {d["metadata"]["name"]: d for d in objects(docs, "ConfigMap")}
    c = container(ksvc)
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in cms, f"{ksvc['metadata']['name']}: envFrom ConfigMap {ref} not in the build"
        env.update(cms[ref].get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    return env


def sink_query(overlay: str) -> str:
    """The query of the gateway's /events/* sink URIs: gke-gpu carries the internal token."""
    return "?token=OPENRL_EVENTS_TOKEN" if overlay.endswith("gke-gpu") else ""


# ------------------------------------------------------------------- durations


def iso8601_seconds(text: str) -> float:
    """Knative delivery durations: ISO 8601 (PT30M, PT0.5S, P1DT2H)."""
    m = re.fullmatch(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?", text)
    assert m and text not in ("P", "PT"), f"not an ISO 8601 duration: {text!r}"
    d, h, mi, s = m.groups()
    return int(d or 0) * 86400 + int(h or 0) * 3600 + int(mi or 0) * 60 + float(s or 0)


def go_seconds(text: str) -> float:
    """NATS / metav1.Duration durations: Go syntax (31m, 24h, 1h30m, 500ms)."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"not a Go duration: {text!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(a) * unit[b] for a, b in parts)


def test_duration_parsers():
    assert iso8601_seconds("PT30M") == 1800
    assert iso8601_seconds("PT0.5S") == 0.5
    assert iso8601_seconds("P1DT1H") == 90000
    assert go_seconds("31m") == 1860
    assert go_seconds("1h30m") == 5400
    with pytest.raises(AssertionError):
        iso8601_seconds("30m")


# --------------------------------------------------------------------- schemas


def _strict(schema):
    """Reject unknown fields where the CRD does not preserve them (the API server
    would prune them silently, so a typo would simply not take effect)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and isinstance(out.get("properties"), dict)
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict openAPIV3Schema, from every vendored CRD."""
    out = {}
    for path in sorted(SCHEMAS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group = doc["spec"]["group"]
            kind = doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if version.get("served", True):
                    root = dict(version["schema"]["openAPIV3Schema"])
                    # The API server accepts these on every object, listed or not.
                    root["properties"] = {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        **root.get("properties", {}),
                    }
                    out[(f"{group}/{version['name']}", kind)] = _strict(root)
    return out


def schema_errors(obj: dict, schema: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]


def test_vendored_schemas_present():
    schemas = crd_schemas()
    for key in [
        ("serving.knative.dev/v1", "Service"),
        ("eventing.knative.dev/v1", "Broker"),
        ("eventing.knative.dev/v1", "Trigger"),
        ("messaging.knative.dev/v1alpha1", "NatsJetStreamChannel"),
    ]:
        assert key in schemas, key


def test_strict_schema_catches_typos():
    """The strict mode is what makes a misspelt field fail (plain CRD schemas accept it)."""
    schema = crd_schemas()[("serving.knative.dev/v1", "Service")]
    good = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"template": {"spec": {"containers": [{"image": "x"}], "timeoutSeconds": 5}}},
    }
    assert schema_errors(good, schema) == []
    bad = yaml.safe_load(yaml.safe_dump(good))
    bad["spec"]["template"]["spec"]["timeoutSecs"] = 5
    assert any("timeoutSecs" in e for e in schema_errors(bad, schema))
    bad = yaml.safe_load(yaml.safe_dump(good))
    bad["spec"]["template"]["spec"]["containerConcurrency"] = "many"
    assert schema_errors(bad, schema)


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_overlay_builds(overlay):
    docs = build(overlay)
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), d
    if overlay in APP_OVERLAYS:
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace") == NAMESPACE, (d["kind"], d["metadata"]["name"])
        assert [d["metadata"]["name"] for d in objects(docs, "Namespace")] == [NAMESPACE]


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_knative_objects_match_crd_schemas(overlay):
    docs = build(overlay)
    schemas = crd_schemas()
    checked = 0
    for d in docs:
        group = d["apiVersion"].split("/")[0]
        if group not in KNATIVE_GROUPS and not group.endswith(".knative.dev"):
            continue
        key = (d["apiVersion"], d["kind"])
        assert key in schemas, f"no vendored CRD schema for {key}: add it to tests/data/schemas/"
        errors = schema_errors(d, schemas[key])
        assert not errors, f"{d['kind']}/{d['metadata']['name']}:\n" + "\n".join(errors)
        checked += 1
    assert checked, f"{overlay}: no Knative object checked"


def channel_template(docs) -> dict:
    cms = [d for d in objects(docs, "ConfigMap") if "channel-template-spec" in d.get("data", {})]
    assert len(cms) == 1, "exactly one Broker channel ConfigMap expected"
    return yaml.safe_load(cms[0]["data"]["channel-template-spec"])


@pytest.mark.parametrize("overlay", APP_OVERLAYS + EVENTING_OVERLAYS)
def test_broker_channel_is_nats_jetstream(overlay):
    docs = build(overlay)
    (broker,) = objects(docs, "Broker", "eventing.knative.dev")
    assert broker["metadata"]["name"] == BROKER
    assert broker["metadata"]["annotations"]["eventing.knative.dev/broker.class"] == "MTChannelBasedBroker"
    cm_name = broker["spec"]["config"]["name"]
    assert broker["spec"]["config"]["kind"] == "ConfigMap"
    assert cm_name in {d["metadata"]["name"] for d in objects(docs, "ConfigMap")}
    template = channel_template(docs)
    assert (template["apiVersion"], template["kind"]) == ("messaging.knative.dev/v1alpha1", "NatsJetStreamChannel")
    channel = {**template, "metadata": {"name": f"{BROKER}-kne-trigger"}}
    errors = schema_errors(channel, crd_schemas()[(template["apiVersion"], template["kind"])])
    assert not errors, "channel-template-spec:\n" + "\n".join(errors)
    stream = template["spec"]["stream"]["config"]
    assert stream["storage"] == "File"
    assert stream["retention"] in ("Limits", "Interest")
    assert stream["discard"] == "New", "a full stream must refuse new events, not drop accepted ones"
    consumer = template["spec"]["consumerConfigTemplate"]
    assert consumer["deliverPolicy"] == "New", "a new Trigger must not replay the stream's history"


# ------------------------------------------------------------------- routing


def _filter_items_schema() -> dict:
    trig = crd_schemas()[("eventing.knative.dev/v1", "Trigger")]
    return trig["properties"]["spec"]["properties"]["filters"]["items"]


def check_filter_expr(expr, where: str):
    """Nested expressions are typed as free objects in the CRD: check them with the
    same item schema, and one dialect per expression (as the webhook requires)."""
    errors = schema_errors(expr, _filter_items_schema())
    assert not errors, f"{where}: " + "; ".join(errors)
    assert len(expr) == 1, f"{where}: one dialect per filter expression, got {sorted(expr)}"
    (dialect, value), = expr.items()
    if dialect in ("all", "any"):
        assert value, f"{where}: empty {dialect}"
        for i, sub in enumerate(value):
            check_filter_expr(sub, f"{where}.{dialect}[{i}]")
    elif dialect == "not":
        check_filter_expr(value, f"{where}.not")
    elif dialect in ("exact", "prefix", "suffix"):
        assert value and all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()), where
    elif dialect == "cesql":
        pytest.fail(f"{where}: CESQL filters are not evaluated by this test; use exact/prefix/any/all/not")


def eval_filter(expr: dict, event: dict) -> bool:
    (dialect, value), = expr.items()
    if dialect == "exact":
        return all(event.get(k) == v for k, v in value.items())
    if dialect == "prefix":
        return all(k in event and event[k].startswith(v) for k, v in value.items())
    if dialect == "suffix":
        return all(k in event and event[k].endswith(v) for k, v in value.items())
    if dialect == "all":
        return all(eval_filter(e, event) for e in value)
    if dialect == "any":
        return any(eval_filter(e, event) for e in value)
    if dialect == "not":
        return not eval_filter(value, event)
    raise AssertionError(f"unsupported dialect {dialect}")


def trigger_accepts(trigger: dict, event: dict) -> bool:
    spec = trigger["spec"]
    if spec.get("filters"):
        return all(eval_filter(f, event) for f in spec["filters"])
    attrs = (spec.get("filter") or {}).get("attributes") or {}
    return all(event.get(k) == v for k, v in attrs.items())


def shard_count(docs) -> int:
    (gateway,) = [k for k in ksvcs(docs).values() if function_of(k) == "gateway"]
    return int(env_of(docs, gateway)["OPENRL_TRAINER_SHARDS"])


def route(docs, event: dict) -> list[str]:
    return sorted(name for name, t in triggers(docs).items() if trigger_accepts(t, event))


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_trigger_filters_are_well_formed(overlay):
    for name, t in triggers(build(overlay)).items():
        assert t["spec"]["broker"] == BROKER, name
        assert t["spec"].get("filters"), f"{name}: use the Subscriptions API filters"
        for i, expr in enumerate(t["spec"]["filters"]):
            check_filter_expr(expr, f"Trigger/{name}.filters[{i}]")


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_every_event_type_reaches_exactly_its_function(overlay):
    docs = build(overlay)
    services = ksvcs(docs)
    trigs = triggers(docs)
    n = shard_count(docs)
    base = {"specversion": "1.0", "source": SOURCE_GATEWAY, "id": "req-1", "subject": "run-1"}

    def target(trigger_name):
        ref = trigs[trigger_name]["spec"]["subscriber"]
        return ref["ref"]["name"], ref.get("uri", "")

    for op in TRAIN_OPS:
        for shard in range(n):
            ev = {**base, "type": f"dev.openrl.{op}.v1", "trainershard": str(shard)}
            hits = route(docs, ev)
            assert hits == [f"trainer-shard-{shard}"], (op, shard, hits)
            ksvc_name, _ = target(hits[0])
            assert ksvc_name == f"trainer-shard-{shard}"
            assert env_of(docs, services[ksvc_name])["OPENRL_TRAINER_SHARD"] == str(shard)
        # A training event without a shard (a gateway bug) must not be spread around.
        assert route(docs, {**base, "type": f"dev.openrl.{op}.v1"}) == [], op
    for op in SAMPLE_OPS:
        for extra in ({}, {"trainershard": "0"}):
            hits = route(docs, {**base, "type": f"dev.openrl.{op}.v1", **extra})
            assert hits == ["sampler"], (op, hits)
            assert function_of(services[target("sampler")[0]]) == "sampler"
    # Results go to the gateway, even when they carry the request's extensions.
    for extra in ({}, {"trainershard": "0"}):
        hits = route(docs, {**base, "type": RESULT_TYPE, **extra})
        assert hits == ["results"], hits
        assert target("results") == ("gateway", "/events/result" + sink_query(overlay))
    assert route(docs, {**base, "type": "dev.openrl.unknown.v1", "trainershard": "0"}) == []
    # Every subscriber is a Knative Service of this build.
    for name in trigs:
        assert target(name)[0] in services, name


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_trainer_shards_are_consistent(overlay):
    docs = build(overlay)
    n = shard_count(docs)
    assert n >= 1
    trainers = {name: k for name, k in ksvcs(docs).items() if function_of(k) == "trainer"}
    assert sorted(trainers) == sorted(f"trainer-shard-{i}" for i in range(n)), (
        "OPENRL_TRAINER_SHARDS must equal the number of trainer-shard-N services"
    )
    trainer_triggers = [t for t in triggers(docs).values() if t["metadata"]["labels"]["openrl.dev/function"] == "trainer"]
    assert sorted(t["metadata"]["name"] for t in trainer_triggers) == sorted(trainers)

    def comparable(ksvc):
        k = yaml.safe_load(yaml.safe_dump(ksvc))
        k["metadata"]["name"] = "X"
        for e in k["spec"]["template"]["spec"]["containers"][0]["env"]:
            if e["name"] == "OPENRL_TRAINER_SHARD":
                e["value"] = "X"
        return k

    first = comparable(trainers["trainer-shard-0"])
    for name, k in trainers.items():
        assert comparable(k) == first, f"{name} differs from trainer-shard-0 in more than its shard id"


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_dead_letters_go_to_the_gateway(overlay):
    """Every dead-letter sink is the gateway Service's cluster-local address in the build's
    namespace, given as a plain URI (a ref would make the Broker wait for the gateway's first
    ready revision: docs/knative-review.md, "Knative Eventing")."""
    docs = build(overlay)
    (gateway,) = [k for k in ksvcs(docs).values() if function_of(k) == "gateway"]
    host = f"{gateway['metadata']['name']}.{gateway['metadata']['namespace']}.svc.cluster.local"
    holders = list(triggers(docs).values()) + objects(docs, "Broker", "eventing.knative.dev")
    for obj in holders:
        delivery = obj["spec"]["delivery"]
        dls = delivery["deadLetterSink"]
        assert "ref" not in dls, obj["metadata"]["name"]
        assert dls["uri"] == f"http://{host}/events/dead-letter" + sink_query(overlay), obj["metadata"]["name"]
        assert delivery["retry"] >= 1
        assert delivery["backoffPolicy"] in ("linear", "exponential")
        iso8601_seconds(delivery["backoffDelay"])


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_delivery_budget_covers_the_longest_step(overlay):
    """Trigger timeout >= the subscriber's timeoutSeconds (a step is never cut short by
    the Broker); the JetStream AckWait >= every Trigger timeout (no redelivery while an
    attempt runs); MaxDeliver fallback = retry + 1 of the Broker default."""
    docs = build(overlay)
    services = ksvcs(docs)
    timeouts = []
    for name, t in triggers(docs).items():
        ksvc = services[t["spec"]["subscriber"]["ref"]["name"]]
        step = ksvc["spec"]["template"]["spec"]["timeoutSeconds"]
        timeout = iso8601_seconds(t["spec"]["delivery"]["timeout"])
        timeouts.append(timeout)
        if function_of(ksvc) != "gateway":
            assert timeout >= step, f"{name}: delivery timeout {timeout}s < {ksvc['metadata']['name']} timeoutSeconds {step}"
    longest_step = max(k["spec"]["template"]["spec"]["timeoutSeconds"] for k in services.values() if function_of(k) == "trainer")
    assert longest_step >= 600, "a training step plus a GPU cold start needs at least 10 minutes"
    consumer = channel_template(docs)["spec"]["consumerConfigTemplate"]
    assert go_seconds(consumer["ackWait"]) >= max(timeouts) >= longest_step
    (broker,) = objects(docs, "Broker", "eventing.knative.dev")
    assert consumer["maxDeliver"] == broker["spec"]["delivery"]["retry"] + 1
    assert consumer["maxAckPending"] >= 256


# ------------------------------------------------------------------- scaling


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_scale_bounds(overlay):
    for name, k in ksvcs(build(overlay)).items():
        a = annotations(k)
        spec = k["spec"]["template"]["spec"]
        fn = function_of(k)
        assert "containerConcurrency" in spec and spec["timeoutSeconds"] > 0, name
        if "cpu-dev" in overlay:
            # A stock Knative install rejects timeouts above 600 s (max-revision-timeout-seconds);
            # GKE raises the cap (terraform/manifests/knative-serving.yaml.tftpl).
            assert spec["timeoutSeconds"] <= 600, name
        if fn == "gateway":
            assert int(a["autoscaling.knative.dev/min-scale"]) >= 1, "the gateway is always on"
            assert k["metadata"].get("labels", {}).get("networking.knative.dev/visibility") != "cluster-local"
            continue
        assert a["autoscaling.knative.dev/min-scale"] == "0", f"{name} must scale to zero"
        assert int(a["autoscaling.knative.dev/max-scale"]) >= 1
        assert "autoscaling.knative.dev/scale-to-zero-pod-retention-period" in a, name
        go_seconds(a["autoscaling.knative.dev/scale-to-zero-pod-retention-period"])
        assert k["metadata"]["labels"]["networking.knative.dev/visibility"] == "cluster-local", name
        if fn == "trainer":
            assert a["autoscaling.knative.dev/max-scale"] == "1", "a trainer shard never has two replicas"
            assert spec["containerConcurrency"] >= 32, "the trainer packs concurrent requests"
        probe = container(k)["startupProbe"]
        assert probe["httpGet"]["path"] == "/healthz/ready"
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget >= 600, f"{name}: startup probe allows only {budget}s for the model load"


def test_gpu_overlay_puts_functions_on_gpus():
    docs = build("knative/overlays/gke-gpu")
    for name, k in ksvcs(docs).items():
        spec = k["spec"]["template"]["spec"]
        a = annotations(k)
        limits = container(k)["resources"]["limits"]
        if function_of(k) == "gateway":
            assert "nvidia.com/gpu" not in limits
            assert "cloud.google.com/gke-accelerator" not in spec.get("nodeSelector", {})
            continue
        assert limits["nvidia.com/gpu"] == "1", name
        assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"].startswith("nvidia-"), name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], name
        assert a["autoscaling.knative.dev/initial-scale"] == "0", f"{name}: a deploy must not wake a GPU"
        assert go_seconds(a["serving.knative.dev/progress-deadline"]) >= 1200, name
        mounts = {m["mountPath"]: m for m in container(k)["volumeMounts"]}
        assert "/dev/shm" in mounts and mounts["/models"]["readOnly"] is True
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols[mounts["/models"]["name"]]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
        assert a["gke-gcsfuse/volumes"] == "true"


def test_cpu_dev_has_no_gpu():
    for name, k in ksvcs(build("knative/overlays/cpu-dev")).items():
        assert "nvidia.com/gpu" not in container(k)["resources"].get("limits", {}), name
        assert "nodeSelector" not in k["spec"]["template"]["spec"], name


def test_gpu_overlay_runs_functions_on_cuda():
    """On GKE every trainer shard and the sampler say OPENRL_DEVICE=cuda (openrl/device.py
    then refuses to start without a GPU instead of silently using the CPU) next to their
    nvidia.com/gpu limit, and the sampler samples with vLLM."""
    docs = build("knative/overlays/gke-gpu")
    by_fn: dict[str, list[str]] = {}
    for name, k in ksvcs(docs).items():
        fn = function_of(k)
        by_fn.setdefault(fn, []).append(name)
        env = env_of(docs, k)
        if fn == "gateway":
            assert env.get("OPENRL_DEVICE") in (None, "cpu"), name
            continue
        assert env.get("OPENRL_DEVICE") == "cuda", name
        assert container(k)["resources"]["limits"].get("nvidia.com/gpu") == "1", name
        if fn == "sampler":
            assert env.get("OPENRL_SAMPLER_BACKEND") == "vllm", name
            assert float(env.get("OPENRL_SAMPLER_GPU_MEMORY")) >= 0.8, name  # a GPU of its own
        else:
            assert env.get("OPENRL_SAMPLER_BACKEND") is None, name
    shards = int(next(d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].startswith("openrl-env"))
                 ["data"]["OPENRL_TRAINER_SHARDS"])
    assert sorted(by_fn["trainer"]) == [f"trainer-shard-{i}" for i in range(shards)], by_fn
    assert by_fn["sampler"] == ["sampler"], by_fn


def test_cpu_dev_runs_functions_on_cpu():
    docs = build("knative/overlays/cpu-dev")
    for name, k in ksvcs(docs).items():
        env = env_of(docs, k)
        assert env.get("OPENRL_DEVICE") == "cpu", name
        assert env.get("OPENRL_SAMPLER_BACKEND") in (None, "auto", "hf"), name
        assert "nvidia.com/gpu" not in container(k)["resources"].get("limits", {}), name


# ------------------------------------------------------------- containers, env


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_containers_are_hardened_and_probed(overlay):
    for name, k in ksvcs(build(overlay)).items():
        c = container(k)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert c["ports"] == [{"name": "http1", "containerPort": 8080}], name
        if function_of(k) == "gateway":
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["path"] == "/api/v1/healthz", name
        else:
            assert c["readinessProbe"]["httpGet"]["path"] == "/healthz/ready", name
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz/live", name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # by number: Knative fills in no startup probe port (test_knative_rules.py)
            assert c[probe]["httpGet"]["port"] == 8080, f"{name}: {probe} must name port 8080"
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, f"{name}: read-only root needs a writable /tmp"
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], name
        assert k["spec"]["template"]["spec"]["serviceAccountName"] == "openrl"
        assert c["command"] == ENTRYPOINTS[function_of(k)], name


def mounted_file(docs, ksvc: dict, path: str) -> dict:
    """The volume (by its source) that provides ``path`` inside ``ksvc``'s container."""
    vols = {v["name"]: v for v in ksvc["spec"]["template"]["spec"]["volumes"]}
    for m in container(ksvc)["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return vols[m["name"]]
    raise AssertionError(f"{ksvc['metadata']['name']}: nothing mounted at {path}")


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_environment_contract(overlay):
    docs = build(overlay)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name, k in ksvcs(docs).items():
        env = env_of(docs, k)
        fn = function_of(k)
        for var in ("OPENRL_STORAGE", "OPENRL_NATS_URL", "OPENRL_MODEL_REGISTRY"):
            assert env.get(var), f"{name}: {var} missing"
        assert env["OPENRL_NATS_URL"] == "nats://nats.nats-io.svc.cluster.local:4222"
        vol = mounted_file(docs, k, env["OPENRL_MODEL_REGISTRY"])
        assert ("ConfigMap", vol["configMap"]["name"]) in names, name
        cm = next(d for d in objects(docs, "ConfigMap") if d["metadata"]["name"] == vol["configMap"]["name"])
        registry_key = Path(env["OPENRL_MODEL_REGISTRY"]).name
        assert registry_key in cm["data"] and "[models." in cm["data"][registry_key]
        storage = env["OPENRL_STORAGE"]
        if "gke" in overlay:
            assert storage.startswith("gs://"), name
        else:
            assert storage.startswith("file:///"), name
            mounted_file(docs, k, storage[len("file://"):] + "/x")
        if fn == "gateway":
            assert env["K_SINK"] == f"http://broker-ingress.knative-eventing.svc.cluster.local/{NAMESPACE}/{BROKER}"
            vol = mounted_file(docs, k, env["OPENRL_API_KEYS_FILE"])
            assert vol["secret"]["secretName"] == "openrl-api-keys"
        else:
            assert "OPENRL_API_KEYS_FILE" not in env, f"{name} needs no API keys"
        if fn == "trainer":
            assert re.fullmatch(r"\d+", env["OPENRL_TRAINER_SHARD"]), name
    if "cpu-dev" in overlay:
        assert ("Secret", "openrl-api-keys") in names
        assert ("PersistentVolumeClaim", "openrl-storage") in names


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_model_registry_loads(overlay, tmp_path):
    """The mounted models.toml parses with the real registry code (openrl/model/registry.py)."""
    registry = pytest.importorskip("openrl.model.registry", reason="openrl not importable")
    docs = build(overlay)
    (gateway,) = [k for k in ksvcs(docs).values() if function_of(k) == "gateway"]
    path = env_of(docs, gateway)["OPENRL_MODEL_REGISTRY"]
    cm_name = mounted_file(docs, gateway, path)["configMap"]["name"]
    cm = next(d for d in objects(docs, "ConfigMap") if d["metadata"]["name"] == cm_name)
    (tmp_path / "models.toml").write_text(cm["data"][Path(path).name])
    reg = registry.ModelRegistry.load(tmp_path / "models.toml", models_dir=tmp_path)
    assert "Qwen/Qwen3-4B-Instruct-2507" in reg
    for entry in reg.entries():
        assert str(entry.path).startswith(("/opt/openrl/models/", "/models/")), entry


def test_gke_overlay_placeholders_and_identity():
    docs = build("knative/overlays/gke-gpu")
    (sa,) = objects(docs, "ServiceAccount")
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == "OPENRL_GSA_EMAIL"
    for name, k in ksvcs(docs).items():
        image = container(k)["image"]
        assert image == f"OPENRL_IMAGE_REPO/{function_of(k)}:OPENRL_IMAGE_TAG", (name, image)
    text = yaml.safe_dump_all(docs)
    assert "gs://OPENRL_BUCKET/openrl" in text and "bucketName: OPENRL_BUCKET" in text
    # terraform/app.tf replaces exactly these tokens; nothing else may look like one.
    tokens = set(re.findall(r"\bOPENRL_[A-Z_]+\b", text)) - {
        "OPENRL_STORAGE", "OPENRL_NATS_URL", "OPENRL_MODEL_REGISTRY", "OPENRL_API_KEYS_FILE",
        "OPENRL_TRAINER_SHARDS", "OPENRL_TRAINER_SHARD", "OPENRL_ROLE", "OPENRL_INTERNAL_TOKEN",
        "OPENRL_DEVICE", "OPENRL_SAMPLER_BACKEND", "OPENRL_SAMPLER_GPU_MEMORY",
    }
    assert tokens == {"OPENRL_IMAGE_REPO", "OPENRL_IMAGE_TAG", "OPENRL_BUCKET", "OPENRL_GSA_EMAIL",
                      "OPENRL_EVENTS_TOKEN"}, tokens
    app_tf = (ROOT / "terraform" / "app.tf").read_text()
    for token in tokens:
        assert f'"{token}"' in app_tf, f"terraform/app.tf does not replace {token}"


def test_gke_event_sinks_need_the_internal_token():
    """On GKE the gateway's Service is public, so its /events/* sinks must check the
    internal token: the gateway reads OPENRL_INTERNAL_TOKEN from the Secret terraform
    creates, and every Trigger and Broker URI that points at a sink carries the same value
    (terraform fills in OPENRL_EVENTS_TOKEN from the one random_password)."""
    docs = build("knative/overlays/gke-gpu")
    (gateway,) = [k for k in ksvcs(docs).values() if function_of(k) == "gateway"]
    (env,) = [e for e in container(gateway)["env"] if e["name"] == "OPENRL_INTERNAL_TOKEN"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("openrl-internal-token", "token") and not ref.get("optional")
    sinks = re.findall(r"uri: ((?:http://[^/\s]+)?/events/[^\s]*)", yaml.safe_dump_all(docs))
    assert len(sinks) == len(triggers(docs)) + 2, sinks  # every dead-letter sink, the Broker's, the results
    assert all(u.endswith("?token=OPENRL_EVENTS_TOKEN") for u in sinks), sinks
    app_tf = (ROOT / "terraform" / "app.tf").read_text()
    secret = app_tf.split('resource "kubernetes_secret_v1" "internal_token"', 1)[1].split("\n}\n", 1)[0]
    assert 'name      = "openrl-internal-token"' in secret and "token = random_password.events_token.result" in secret
    assert 'replace(each.value, "OPENRL_EVENTS_TOKEN", random_password.events_token.result)' in app_tf
    # the gateway accepts the token from the query (openrl/auth.py, functions/gateway/app.py)
    assert "?token=" in (ROOT / "openrl" / "edge" / "auth.py").read_text()


def test_cpu_dev_images_are_local():
    for name, k in ksvcs(build("knative/overlays/cpu-dev")).items():
        assert container(k)["image"] == "dev.local/openrl/cpu:dev", name


# ------------------------------------------------------------------- NATS values


@pytest.mark.parametrize(
    "values_file,overlay",
    [("eventing/nats/values.yaml", "eventing/overlays/gke-gpu"), ("eventing/nats/values-cpu-dev.yaml", "eventing/overlays/cpu-dev")],
)
def test_nats_values_fit_the_channel(values_file, overlay):
    values = yaml.safe_load((ROOT / values_file).read_text())
    js = values["config"]["jetstream"]
    assert js["enabled"] and js["fileStore"]["enabled"] and js["fileStore"]["pvc"]["enabled"], "JetStream on disk"
    assert not js.get("memoryStore", {}).get("enabled", False)
    servers = values["config"]["cluster"]["replicas"] if values["config"]["cluster"]["enabled"] else 1
    stream = channel_template(build(overlay))["spec"]["stream"]["config"]
    assert stream["replicas"] <= servers, "a stream cannot have more replicas than NATS servers"
    if "gke" in overlay:
        assert servers >= 3 and stream["replicas"] >= 3, "on GKE every event survives the loss of one server"
    assert values["config"]["merge"]["max_payload"] >= stream["maxMsgSize"]


# ------------------------------------------------------------------ Dockerfiles

DOCKERFILES = {
    "gateway": ROOT / "docker" / "gateway.Dockerfile",
    "trainer": ROOT / "docker" / "trainer.Dockerfile",
    "sampler": ROOT / "docker" / "sampler.Dockerfile",
}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("function", sorted(DOCKERFILES))
def test_dockerfile_facts(function):
    path = DOCKERFILES[function]
    ins = dockerfile_instructions(path)
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v.strip('"')
    froms = [rest.split()[0] for word, rest in ins if word == "FROM"]
    assert froms
    for ref in froms:
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), ref)
        if ref in {rest.split()[-1] for w, rest in ins if w == "FROM" and " AS " in rest.upper()}:
            continue  # a previous stage
        assert ":" in ref and not ref.endswith(":latest"), f"{path.name}: base image not pinned: {ref}"
        assert re.search(r":\d+(\.\d+)+", ref), f"{path.name}: pin a full version: {ref}"
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] == "10001", f"{path.name}: must run as uid 10001 (runAsUser)"
    assert ("EXPOSE", "8080") in ins
    cmd = [rest for word, rest in ins if word == "CMD"][-1]
    assert json.loads(cmd) == ENTRYPOINTS[function], f"{path.name}: CMD differs from the Knative Service's command"
    assert (path.parent / f"{path.name}.dockerignore").is_file(), "each Dockerfile carries its own .dockerignore"
    with_value = {"-c", "--constraint", "-r", "--requirement", "--index-url", "--extra-index-url", "-i"}
    for run in (rest for word, rest in ins if word == "RUN"):
        for command in re.split(r"&&|;|\|", run):
            words = command.split()
            if words[:2] != ["pip", "install"]:
                continue
            skip = False
            for token in words[2:]:
                if skip or token.startswith("-") or token.startswith(("/", "$", ".")):
                    skip = token in with_value
                    continue
                assert re.fullmatch(r"[\w.\-\[\]]+==[\w.+]+", token), f"{path.name}: unpinned pip package {token!r}"


GPU_DOCKERFILES = ("trainer", "sampler")
CPU_TORCH = re.compile(r"download\.pytorch\.org/whl/cpu|torch==[\w.]+\+cpu")


@pytest.mark.parametrize("function", GPU_DOCKERFILES)
def test_gpu_images_install_cuda_torch(function):
    """The trainer and sampler images are CUDA images: a CUDA base in every stage, torch
    (vLLM's for the sampler) from a CUDA wheel source, never the CPU wheel index the gateway
    image uses; the build checks ``torch.version.cuda``; and they run with OPENRL_DEVICE=auto
    (cuda where torch sees a GPU, openrl/device.py)."""
    path = DOCKERFILES[function]
    ins = dockerfile_instructions(path)
    code = " ".join(f"{word} {rest}" for word, rest in ins)  # comments left out
    assert not CPU_TORCH.search(code), f"{path.name} installs the CPU torch build"
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v.strip('"')
    assert not CPU_TORCH.search(" ".join(args.values())), args
    froms = [rest.split()[0] for word, rest in ins if word == "FROM"]
    assert froms and all(ref.startswith("nvidia/cuda:") for ref in froms), froms
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    wanted = "vllm==" if function == "sampler" else "torch=="
    assert re.search(r"pip install [^&;|]*" + re.escape(wanted), runs), f"{path.name}: no {wanted} install"
    assert "torch.version.cuda" in runs, f"{path.name}: the build must check that torch is a CUDA build"
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert re.search(r"(^|\s)OPENRL_DEVICE=auto(\s|$)", env), f"{path.name}: ENV OPENRL_DEVICE=auto missing"
    # the CPU image still takes the CPU wheel (a multi-GB CUDA torch the gateway never uses)
    assert CPU_TORCH.search(" ".join(rest for _, rest in dockerfile_instructions(DOCKERFILES["gateway"])))


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("constraints", ["constraints.txt", "constraints-sampler.txt"])
def test_constraints_pin_every_dependency(constraints):
    """The images pin exactly openrl's direct dependencies, within pyproject's ranges."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for line in (ROOT / "docker" / constraints).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{constraints}: {line!r} is not an exact pin"
            pins[_requirement_name(name)] = version
    expected = {_requirement_name(d) for d in deps}
    if constraints == "constraints-sampler.txt":
        expected |= {"vllm"}
    assert set(pins) == expected, f"{constraints} vs pyproject.toml: {sorted(set(pins) ^ expected)}"
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return
    for dep in deps:
        req = Requirement(dep)
        if constraints == "constraints-sampler.txt" and req.name == "torch":
            continue  # vLLM brings its own torch (docker/sampler.Dockerfile)
        assert req.specifier.contains(pins[_requirement_name(dep)], prereleases=True), (constraints, dep)


def test_hadolint():
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip(f"hadolint not found: {INSTALL_HINT}")
    config = ROOT / "docker" / "hadolint.yaml"
    proc = subprocess.run(
        [hadolint, "--config", str(config), *map(str, DOCKERFILES.values())],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
