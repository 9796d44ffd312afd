"""``openrl status --cluster`` (openrl/cli/cluster.py) through the real ``kubernetes`` client and a
real nats-server.

No Kubernetes cluster can run here, so the Kubernetes API is a local HTTP server
(``FakeKubeAPI``, threading ``http.server``) that answers the list calls the client makes
(``GET /apis/serving.knative.dev/v1/namespaces/openrl/{services,revisions}``,
``/apis/autoscaling.internal.knative.dev/v1alpha1/namespaces/openrl/podautoscalers``,
``/apis/eventing.knative.dev/v1/namespaces/openrl/{brokers,triggers}``, ``/api/v1/namespaces/openrl/events``)
with objects shaped like Knative's, or with the ``Status`` of a refusal (403) where a test says so.
The Service, Revision, Broker and Trigger objects are checked against the upstream CRDs'
openAPIV3Schema (``tests/data/schemas``, ``../shared/schemas``; strict: unknown fields fail); the
PodAutoscaler has no CRD there, its status fields (``desiredScale``, ``actualScale``) follow
knative/serving's ``pkg/apis/autoscaling/v1alpha1`` PodAutoscalerStatus.
Everything else is real: the kubernetes client reads a kubeconfig written here, the CLI
runs in-process through ``openrl.cli.main``, and the NATS streams are a real nats-server's.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes package is missing: pip install -e '.[test]'")
yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from openrl.cli import main as cli_main  # noqa: E402
from openrl.contract.topology import SAMPLE_STREAM, TRAIN_STREAM, sample_subject, train_subject  # noqa: E402
from openrl.transport.bus import Bus  # noqa: E402
from openrl.transport.local_servers import PortHold, start_nats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIRS = [ROOT / "tests" / "data" / "schemas", ROOT.parent / "shared" / "schemas"]  # vendored first (CI: no ../shared)
NS = "openrl"
SERVING = "/apis/serving.knative.dev/v1/namespaces/openrl"
PA_PATH = "/apis/autoscaling.internal.knative.dev/v1alpha1/namespaces/openrl/podautoscalers"
EVENTING = "/apis/eventing.knative.dev/v1/namespaces/openrl"


# -- Knative objects --------------------------------------------------------------------------


def _cond(ready: bool, reason: str | None = None, message: str | None = None) -> list[dict]:
    c = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-12-01T10:00:00Z"}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return [c]


def service(name: str, revision: str, *, ready: bool = True, reason: str | None = None,
            message: str | None = None) -> dict:
    """A ``serving.knative.dev/v1`` Service as the API returns it (spec abridged, status full)."""
    return {
        "apiVersion": "serving.knative.dev/v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"template": {"spec": {"containers": [{"image": f"openrl/{name}:dev"}], "timeoutSeconds": 900}}},
        "status": {"observedGeneration": 1, "conditions": _cond(ready, reason, message),
                   "latestCreatedRevisionName": revision,
                   "latestReadyRevisionName": revision if ready else None,
                   "url": f"http://{name}.{NS}.svc.cluster.local",
                   "traffic": [{"revisionName": revision, "percent": 100, "latestRevision": True}]},
    }


def revision(name: str, svc: str, desired: int | None, actual: int | None, *, created: str,
             conditions: list[dict] | None = None) -> dict:
    """A ``serving.knative.dev/v1`` Revision; ``desired`` / ``actual`` None leave the fields out;
    ``conditions`` replace the default ``Ready: True``."""
    status = {"observedGeneration": 1, "conditions": conditions or _cond(True)}
    if desired is not None:
        status["desiredReplicas"] = desired
    if actual is not None:
        status["actualReplicas"] = actual
    return {
        "apiVersion": "serving.knative.dev/v1", "kind": "Revision",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": created,
                     "labels": {"serving.knative.dev/service": svc, "serving.knative.dev/configuration": svc}},
        "spec": {"containers": [{"image": f"openrl/{svc}:dev"}], "timeoutSeconds": 900},
        "status": status,
    }


def podautoscaler(name: str, desired: int, actual: int) -> dict:
    """An ``autoscaling.internal.knative.dev/v1alpha1`` PodAutoscaler (no CRD in shared/schemas:
    fields from knative/serving's PodAutoscalerStatus)."""
    return {"apiVersion": "autoscaling.internal.knative.dev/v1alpha1", "kind": "PodAutoscaler",
            "metadata": {"name": name, "namespace": NS},
            "status": {"desiredScale": desired, "actualScale": actual}}


def broker(conditions: list[dict] | None = None) -> dict:
    """The ``eventing.knative.dev/v1`` Broker of eventing/base/broker.yaml as the API returns it
    (spec abridged); ``conditions`` replace the default: every condition of the MT broker True."""
    types = ("Ready", "IngressReady", "TriggerChannelReady", "FilterReady", "Addressable", "DeadLetterSinkResolved",
             "EventPoliciesReady")
    return {"apiVersion": "eventing.knative.dev/v1", "kind": "Broker",
            "metadata": {"name": "openrl", "namespace": NS,
                         "annotations": {"eventing.knative.dev/broker.class": "MTChannelBasedBroker"}},
            "spec": {"delivery": {"deadLetterSink": {"uri": "http://gateway.openrl.svc.cluster.local/events/dead-letter"},
                                  "retry": 3}},
            "status": {"observedGeneration": 1,
                       "conditions": conditions or [_c(t, "True") for t in types]}}


def trigger(name: str, subscriber: str, conditions: list[dict] | None = None) -> dict:
    """An ``eventing.knative.dev/v1`` Trigger (spec abridged); ``conditions`` replace the default:
    every condition of a subscribed Trigger True."""
    types = ("Ready", "BrokerReady", "SubscriptionReady", "DependencyReady", "SubscriberResolved",
             "DeadLetterSinkResolved", "OIDCIdentityCreated")
    return {"apiVersion": "eventing.knative.dev/v1", "kind": "Trigger",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"broker": "openrl",
                     "subscriber": {"ref": {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "name": subscriber}}},
            "status": {"observedGeneration": 1,
                       "conditions": conditions or [_c(t, "True") for t in types]}}


def cluster_state(trainer: tuple[int, int], sampler: tuple[int, int]) -> dict[str, list[dict]]:
    """The three Services of knative/overlays/cpu-dev with the trainer's and the sampler's
    (desired, actual) replicas. The sampler has an old revision (no traffic, at zero) and a
    current one whose status lacks the replica fields, so its numbers come from its
    PodAutoscaler, as with a Knative that does not fill them in."""
    return {
        f"{SERVING}/services": [service("gateway", "gateway-00001"), service("sampler", "sampler-00002"),
                                service("trainer-shard-0", "trainer-shard-0-00001")],
        f"{SERVING}/revisions": [
            revision("gateway-00001", "gateway", 1, 1, created="2026-12-01T09:00:00Z"),
            revision("sampler-00001", "sampler", 0, 0, created="2026-12-01T09:00:00Z"),
            revision("sampler-00002", "sampler", None, None, created="2026-12-01T09:30:00Z"),
            revision("trainer-shard-0-00001", "trainer-shard-0", *trainer, created="2026-12-01T09:00:00Z"),
        ],
        PA_PATH: [podautoscaler("sampler-00002", *sampler)],
        f"{EVENTING}/brokers": [broker()],
        f"{EVENTING}/triggers": [trigger("results", "gateway"), trigger("sampler", "sampler"),
                                 trigger("trainer-shard-0", "trainer-shard-0")],
    }


class FakeKubeAPI:
    """A local HTTP server answering the Kubernetes list calls from ``self.state``
    (path -> items); a path in ``self.refuse`` gets a 403 ``Status`` (RBAC without ``list`` on it)
    and any other path a 404, as the API server sends them. ``paths`` records what the client
    asked for."""

    def __init__(self, state: dict[str, list[dict]]):
        self.state = state
        self.refuse: set[str] = set()
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.split("?")[0]
                fake.paths.append(path)
                if path in fake.refuse:
                    code, body = 403, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "message": f"forbidden: User \"viewer\" cannot list resource at {path}",
                                       "reason": "Forbidden", "code": 403}
                elif path in fake.state:
                    kind = (fake.state[path][0]["kind"] if fake.state[path] else "Object") + "List"
                    code, body = 200, {"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"},
                                       "items": fake.state[path]}
                else:
                    code, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "message": f"the server could not find the requested resource ({path})",
                                       "reason": "NotFound", "code": 404}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig whose current context points at this server (no auth)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}],
        }))
        return path

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """The kubernetes client takes a proxy from the environment; the fake API is local."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def kube(tmp_path):
    fake = FakeKubeAPI(cluster_state(trainer=(0, 0), sampler=(0, 0)))
    yield fake, fake.kubeconfig(tmp_path / "kubeconfig")
    fake.close()


def _status(capsys, *argv) -> dict:
    rc = cli_main(["status", "--cluster", "--json", *map(str, argv)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def _scale(doc: dict) -> dict[str, tuple]:
    return {s["name"]: (s["desired"], s["actual"]) for s in doc["services"]}


# -- CRD shapes -------------------------------------------------------------------------------


def _strict(schema):
    """Unknown fields fail where the CRD does not preserve them (as tests/deploy does)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and not out.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out


def _crd_schema(filename: str, group: str = "knative-serving") -> dict:
    for d in SCHEMA_DIRS:
        f = d / group / filename
        if f.exists():
            crd = yaml.safe_load(f.read_text())
            root = dict(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
            root["properties"] = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                  "metadata": {"type": "object"}, **root.get("properties", {})}
            return _strict(root)
    pytest.skip(f"{group}/{filename} CRD not found in {[str(d) for d in SCHEMA_DIRS]}")


def test_fixture_objects_match_the_knative_crds():
    """The Services and Revisions the fake API serves validate against Knative Serving's CRDs
    (so the listing below reads fields that exist, spelled as upstream spells them); a
    misspelt status field is caught."""
    schemas = {"Service": _crd_schema("service.yaml"), "Revision": _crd_schema("revision.yaml"),
               "Broker": _crd_schema("broker.yaml", "knative-eventing"),
               "Trigger": _crd_schema("trigger.yaml", "knative-eventing")}
    state = not_ready_state()
    objs = state[f"{SERVING}/services"] + state[f"{SERVING}/revisions"]
    objs += unresolved_sink_state()[f"{EVENTING}/brokers"] + unresolved_sink_state()[f"{EVENTING}/triggers"]
    objs += state[f"{EVENTING}/brokers"] + state[f"{EVENTING}/triggers"]
    for obj in objs:
        errors = list(jsonschema.Draft7Validator(schemas[obj["kind"]]).iter_errors(obj))
        assert not errors, (obj["metadata"]["name"], [e.message for e in errors])
    bad = copy.deepcopy(state[f"{SERVING}/revisions"][0])
    bad["status"]["actualReplica"] = bad["status"].pop("actualReplicas")
    assert list(jsonschema.Draft7Validator(schemas["Revision"]).iter_errors(bad))


EVENTS_PATH = "/api/v1/namespaces/openrl/events"
#: What the API server answered Knative 1.23 for our startup probes without a port (issue 23).
PORT_ZERO = ('failed to create deployment "trainer-shard-0-00002-deployment": Deployment.apps '
             '"trainer-shard-0-00002-deployment" is invalid: spec.template.spec.containers[0].startupProbe.httpGet.port: '
             'Invalid value: 0: must be between 1 and 65535, inclusive')


def _c(type_: str, status: str, reason: str | None = None, message: str | None = None) -> dict:
    c = {"type": type_, "status": status, "lastTransitionTime": "2026-12-01T10:00:00Z"}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return c


def not_ready_state() -> dict[str, list[dict]]:
    """Three revisions that are not ready, shaped as Knative 1.23 reports them: the trainer's
    Deployment rejected by the API server (Ready Unknown / Deploying, no message; the cause only
    in the controller's Warning event), the sampler's pod unschedulable (ResourcesAvailable
    False with the scheduler's message), the gateway's container exiting (Ready False)."""
    state = cluster_state(trainer=(0, 0), sampler=(1, 0))
    state[f"{SERVING}/revisions"] += [
        revision("trainer-shard-0-00002", "trainer-shard-0", 0, 0, created="2026-12-01T10:00:00Z", conditions=[
            _c("Ready", "Unknown", "Deploying"), _c("ResourcesAvailable", "Unknown", "Deploying"),
            _c("ContainerHealthy", "Unknown", "Deploying")]),
        revision("sampler-00003", "sampler", 1, 0, created="2026-12-01T10:00:00Z", conditions=[
            _c("Ready", "Unknown", "Deploying"), _c("ContainerHealthy", "Unknown", "Deploying"),
            _c("ResourcesAvailable", "False", "Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")]),
        revision("gateway-00002", "gateway", 1, 0, created="2026-12-01T10:00:00Z", conditions=[
            _c("Ready", "False", "ExitCode1", "Container failed with: KeyError: 'OPENRL_NATS_URL'")]),
    ]
    # core/v1 Events (no CRD: the fields are Kubernetes' Event type); one old and one newer
    # warning about the trainer revision, one Normal event, one about another kind
    def event(name, obj_kind, obj_name, type_, reason, message, when):
        return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": NS},
                "involvedObject": {"kind": obj_kind, "name": obj_name, "namespace": NS,
                                   "apiVersion": "serving.knative.dev/v1"},
                "type": type_, "reason": reason, "message": message, "count": 1,
                "firstTimestamp": when, "lastTimestamp": when}
    state[EVENTS_PATH] = [
        event("e1", "Revision", "trainer-shard-0-00002", "Warning", "InternalError", "old failure", "2026-12-01T10:00:01Z"),
        event("e2", "Revision", "trainer-shard-0-00002", "Warning", "InternalError", PORT_ZERO, "2026-12-01T10:05:00Z"),
        event("e3", "Revision", "trainer-shard-0-00002", "Normal", "Created", "nothing wrong", "2026-12-01T10:06:00Z"),
        event("e4", "Deployment", "sampler-00003-deployment", "Warning", "FailedCreate", "not a revision",
              "2026-12-01T10:06:00Z"),
    ]
    return state


# -- the listing ------------------------------------------------------------------------------


def test_cluster_status_lists_services_and_follows_a_sweep_up_and_back_to_zero(kube, capsys):
    """At zero, then while a sweep runs (trainer 1/1, sampler scaling 3 desired / 1 actual),
    then at zero again: each call's listing follows the objects the API serves."""
    fake, kubeconfig = kube
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    assert doc["namespace"] == NS and doc["kubernetes_api"] == fake.url and doc["streams"] is None
    assert [s["name"] for s in doc["services"]] == ["gateway", "sampler", "trainer-shard-0"]
    by = {s["name"]: s for s in doc["services"]}
    assert by["sampler"]["latest_ready_revision"] == "sampler-00002" and by["sampler"]["ready"] == "True"
    assert [(r["name"], r["traffic_percent"]) for r in by["sampler"]["revisions"]] == [
        ("sampler-00001", None), ("sampler-00002", 100)]
    assert _scale(doc) == {"gateway": (1, 1), "sampler": (0, 0), "trainer-shard-0": (0, 0)}
    assert {f"{SERVING}/services", f"{SERVING}/revisions", PA_PATH} <= set(fake.paths)

    fake.state = cluster_state(trainer=(1, 1), sampler=(3, 1))
    up = _status(capsys, "--kubeconfig", kubeconfig)
    assert _scale(up) == {"gateway": (1, 1), "sampler": (3, 1), "trainer-shard-0": (1, 1)}
    sampler_revs = {r["name"]: (r["desired"], r["actual"]) for r in
                    next(s for s in up["services"] if s["name"] == "sampler")["revisions"]}
    assert sampler_revs == {"sampler-00001": (0, 0), "sampler-00002": (3, 1)}  # the PodAutoscaler's numbers

    fake.state = cluster_state(trainer=(0, 0), sampler=(0, 0))
    assert _scale(_status(capsys, "--kubeconfig", kubeconfig)) == _scale(doc)


def test_cluster_status_table_and_errors(kube, capsys, tmp_path, monkeypatch):
    """Tables: a not-ready Service shows its reason, the PodAutoscalers are optional (404 from
    an API without them is fine); an unreachable API server and a missing kubeconfig are
    errors naming the server / file, exit 1."""
    fake, kubeconfig = kube
    monkeypatch.setenv("COLUMNS", "300")  # rich: no wrapping inside cells
    fake.state[f"{SERVING}/services"][2] = service("trainer-shard-0", "trainer-shard-0-00001", ready=False,
                                                   reason="RevisionMissing", message=REVISION_MISSING)
    del fake.state[PA_PATH]
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "Knative Services" in out and "sampler-00002" in out
    # issue 34: the Service's message, not only its reason, in the Services table
    assert _cells(out, "Knative Services", "trainer-shard-0")[1:2] == ["False"]
    assert f"RevisionMissing: {REVISION_MISSING}" in _cells(out, "Knative Services", "trainer-shard-0")[-1]
    assert "not shown (pass --nats-url" in out and "Not shown:" not in out  # a PodAutoscaler API that is absent: no note

    fake.close()
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 1
    assert f"cannot reach the Kubernetes API at {fake.url}" in capsys.readouterr().err
    assert cli_main(["status", "--cluster", "--kubeconfig", str(tmp_path / "nope")]) == 1
    assert "--kubeconfig" in capsys.readouterr().err


#: Knative Serving's message for a Service whose Configuration has no ready revision.
REVISION_MISSING = 'Configuration "trainer-shard-0" does not have any ready Revision.'


def _cells(out: str, title: str, first: str) -> list[str]:
    """The cells of the row whose first cell is ``first`` in the rich table titled ``title``
    (one line per row: run with a wide ``COLUMNS``)."""
    section = out.split(title, 1)[1]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in {title!r}:\n{section}")


def test_unknown_desired_scale_is_a_dash_not_minus_one(kube, capsys, monkeypatch):
    """A PodAutoscaler that has not decided yet reports ``desiredScale: -1`` (and the revision
    leaves ``desiredReplicas`` out): the revision's and its Service's desired scale are unknown,
    ``null`` in --json and ``-`` in the tables, never ``-1``; the actual scale stays known."""
    fake, kubeconfig = kube
    fake.state = cluster_state(trainer=(0, 0), sampler=(-1, 0))
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    sampler = next(s for s in doc["services"] if s["name"] == "sampler")
    assert (sampler["desired"], sampler["actual"]) == (None, 0)
    assert {r["name"]: r["desired"] for r in sampler["revisions"]} == {"sampler-00001": 0, "sampler-00002": None}
    monkeypatch.setenv("COLUMNS", "250")
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "-1" not in out
    row = _cells(out, "Knative Services", "sampler")
    assert row[3:5] == ["-", "0"], row
    assert _cells(out, "Revisions", "sampler-00002")[3:5] == ["-", "0"]


def test_a_line_says_so_when_events_or_autoscalers_cannot_be_read(kube, capsys, monkeypatch):
    """RBAC that lets the viewer list Knative objects but not events (403): the revisions'
    conditions still show, and a line says that their Warning events could not be read (an
    empty "last warning" must not read as "nothing wrong"); likewise a refused PodAutoscaler
    list. --json carries the same lines in ``notes``."""
    fake, kubeconfig = kube
    fake.state = not_ready_state()
    fake.refuse = {EVENTS_PATH, PA_PATH}
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    revs = {r["name"]: r for s in doc["services"] for r in s["revisions"]}
    assert revs["trainer-shard-0-00002"]["warning"] is None and revs["sampler-00003"]["reason"] == "Unschedulable"
    events_note = [n for n in doc["notes"] if n.startswith("events:")]
    assert len(events_note) == 1 and "HTTP 403 Forbidden" in events_note[0] and "Warning events" in events_note[0]
    assert any(n.startswith("podautoscalers.autoscaling.internal.knative.dev: cannot be read (HTTP 403")
               for n in doc["notes"])
    assert EVENTS_PATH in fake.paths
    monkeypatch.setenv("COLUMNS", "400")
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "Not shown: events: cannot be read in namespace openrl (HTTP 403 Forbidden)" in out
    # all ready: events are not read, so nothing to say about them
    fake.state = cluster_state(trainer=(0, 0), sampler=(0, 0))
    fake.refuse = {EVENTS_PATH}
    assert _status(capsys, "--kubeconfig", kubeconfig)["notes"] == []


#: What Knative Eventing 1.22's Broker reconciler writes when the dead-letter sink is a ref to a
#: Knative Service that has no address yet (knative.dev/pkg resolver: "address not set for ...").
UNRESOLVED = "address not set for &{Service openrl gateway serving.knative.dev/v1 }"
UNRESOLVED_REASON = "Unable to get the dead letter sink's URI"


def unresolved_sink_state() -> dict[str, list[dict]]:
    """The eventing chain before issue 34, while the gateway had never been ready: the Broker's
    dead-letter sink (a ref to the gateway) does not resolve, so the Broker is not Ready, and
    every Trigger shows the Broker's reason on BrokerReady (Knative copies it) and has no
    Subscription."""
    state = cluster_state(trainer=(0, 0), sampler=(0, 0))
    state[f"{SERVING}/services"][0] = service("gateway", "gateway-00001", ready=False, reason="RevisionMissing",
                                              message='Configuration "gateway" does not have any ready Revision.')
    b = broker([_c("Ready", "False", UNRESOLVED_REASON, UNRESOLVED), _c("IngressReady", "True"),
                _c("TriggerChannelReady", "True"), _c("FilterReady", "True"), _c("Addressable", "Unknown"),
                _c("DeadLetterSinkResolved", "False", UNRESOLVED_REASON, UNRESOLVED)])
    b["spec"]["delivery"]["deadLetterSink"] = {"ref": {"apiVersion": "serving.knative.dev/v1", "kind": "Service",
                                                       "name": "gateway"}, "uri": "/events/dead-letter"}

    def waiting(name, subscriber):
        return trigger(name, subscriber, [_c("Ready", "False", UNRESOLVED_REASON, UNRESOLVED),
                                          _c("BrokerReady", "False", UNRESOLVED_REASON, UNRESOLVED),
                                          _c("SubscriptionReady", "Unknown"), _c("SubscriberResolved", "Unknown")])
    state[f"{EVENTING}/brokers"] = [b]
    state[f"{EVENTING}/triggers"] = [waiting("results", "gateway"), waiting("sampler", "sampler"),
                                     waiting("trainer-shard-0", "trainer-shard-0")]
    return state


def test_a_broker_whose_dead_letter_sink_does_not_resolve_is_named_as_the_cause(kube, capsys, monkeypatch):
    """Issue 34, item 2: the Broker is not Ready because its dead-letter sink does not resolve;
    the view says so and what it means (no Subscription for any Trigger: no function receives
    events), and each Trigger points at the Broker rather than at its own sink (Knative copies the
    Broker's reason onto the Trigger's BrokerReady, which reads as if the Trigger's sink failed).
    A Trigger whose own subscriber does not resolve is named too; a ready chain says nothing."""
    fake, kubeconfig = kube
    assert _status(capsys, "--kubeconfig", kubeconfig)["eventing"] == [
        {"kind": k, "name": n, "ready": "True", "reason": None, "message": None, "cause": None}
        for k, n in (("Broker", "openrl"), ("Trigger", "results"), ("Trigger", "sampler"), ("Trigger", "trainer-shard-0"))]

    fake.state = unresolved_sink_state()
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    ev = {(e["kind"], e["name"]): e for e in doc["eventing"]}
    b = ev[("Broker", "openrl")]
    assert (b["ready"], b["reason"], b["message"]) == ("False", UNRESOLVED_REASON, UNRESOLVED)
    assert b["cause"].startswith(f"its dead-letter sink does not resolve ({UNRESOLVED_REASON}: {UNRESOLVED})")
    assert "creates no Subscription for any Trigger" in b["cause"]
    assert ev[("Trigger", "sampler")]["cause"] == "its Broker is not Ready (see the Broker's line): it has no Subscription"
    monkeypatch.setenv("COLUMNS", "400")
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "Knative Eventing" in out
    assert "Broker/openrl is not Ready: its dead-letter sink does not resolve" in out
    assert "no function receives an event" in out and "plain uri" in out
    assert "Trigger/trainer-shard-0 is not Ready: its Broker is not Ready" in out

    fake.state = cluster_state(trainer=(0, 0), sampler=(0, 0))
    gone = ("Unable to get the Subscriber's URI",
            'failed to get object openrl/sampler: services.serving.knative.dev "sampler" not found')
    fake.state[f"{EVENTING}/triggers"][1] = trigger("sampler", "sampler", [
        _c("Ready", "False", *gone), _c("BrokerReady", "True"), _c("SubscriberResolved", "False", *gone)])
    cause = {e["name"]: e["cause"] for e in _status(capsys, "--kubeconfig", kubeconfig)["eventing"]}
    assert cause["sampler"].startswith("its subscriber does not resolve (Unable to get the Subscriber's URI: failed to get")
    assert cause["openrl"] is None and cause["results"] is None


def test_eventing_that_cannot_be_read_is_a_line_not_an_error(kube, capsys):
    """No Knative Eventing on the cluster (404), or RBAC without list on Brokers (403): the
    Serving view still shows, with one line saying why the Eventing one does not."""
    fake, kubeconfig = kube
    del fake.state[f"{EVENTING}/brokers"], fake.state[f"{EVENTING}/triggers"]
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    assert doc["eventing"] is None and [s["name"] for s in doc["services"]] == ["gateway", "sampler", "trainer-shard-0"]
    assert doc["notes"] == ["brokers.eventing.knative.dev, triggers.eventing.knative.dev: cannot be read "
                            "(HTTP 404 Not Found); is Knative Eventing installed?"]
    fake.state = cluster_state(trainer=(0, 0), sampler=(0, 0))
    fake.refuse = {f"{EVENTING}/brokers"}
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    assert doc["eventing"] is None and doc["notes"] == [
        "brokers.eventing.knative.dev: cannot be read (HTTP 403 Forbidden)"]


# -- NATS pending work ------------------------------------------------------------------------


async def _queue_work(url: str) -> None:
    """3 trainer requests and 2 sampler requests queued; the trainer-0 consumer has taken 1
    (unacked: in flight); a third, non-openrl stream with 4 messages and no consumer."""
    bus = await Bus(url).connect()
    try:
        for i in range(3):
            await bus.publish(train_subject(0, "forward_backward"), {}, b"{}", f"t{i}")
        for i in range(2):
            await bus.publish(sample_subject(), {}, b"{}", f"s{i}")
        sub = await bus.work_consumer(TRAIN_STREAM, "trainer-0", "openrl.train.0.>")
        assert len(await sub.fetch(1, timeout=5)) == 1
        await bus.js.add_stream(name="OTHER", subjects=["other.>"])
        for i in range(4):
            await bus.js.publish("other.x", b"x")
    finally:
        await bus.close()


def test_cluster_status_shows_pending_work_of_a_real_nats_server(kube, capsys, tmp_path, monkeypatch):
    """The streams' pending work comes from a real nats-server: per consumer queued (not yet
    delivered) and in flight (delivered, unacked); KV buckets are left out; the openrl streams
    come first; a NATS URL with no server is an error naming it."""
    _, kubeconfig = kube
    monkeypatch.setenv("COLUMNS", "200")
    hold = PortHold()  # held to the end: after the server stops nothing else listens there
    nats = start_nats(tmp_path, hold.port)
    url = f"nats://127.0.0.1:{hold.port}"
    try:
        asyncio.run(_queue_work(url))
        doc = _status(capsys, "--kubeconfig", kubeconfig, "--nats-url", url)
        streams = {s["stream"]: s for s in doc["streams"]}
        assert [s["stream"] for s in doc["streams"]] == [TRAIN_STREAM, SAMPLE_STREAM, "OTHER"]
        assert streams[TRAIN_STREAM]["messages"] == 3
        assert streams[TRAIN_STREAM]["consumers"] == [
            {"name": "trainer-0", "queued": 2, "in_flight": 1, "redelivered": 0, "waiting": 0}]
        assert streams[SAMPLE_STREAM]["messages"] == 2 and streams[SAMPLE_STREAM]["consumers"] == []
        assert streams["OTHER"]["messages"] == 4 and streams["OTHER"]["subjects"] == ["other.>"]
        assert not any(s["missing"] for s in doc["streams"])

        assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig), "--nats-url", url]) == 0
        out = capsys.readouterr().out
        assert "NATS streams at" in out and "trainer-0" in out
    finally:
        nats.terminate()
        nats.wait(timeout=30)
    try:
        assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig), "--nats-url", url]) == 1
        assert f"cannot reach NATS at {url}" in capsys.readouterr().err
    finally:
        hold.close()


def test_not_ready_revisions_show_their_reason_and_message(kube, capsys, monkeypatch):
    """A revision that is not ready shows why in the Revisions table and in --json: the Ready
    condition's reason, else the first other condition that says something (the scheduler's
    message), and the newest Warning event (the API server's rejection of the Deployment,
    which Knative reports only as an event while Ready stays Unknown / Deploying)."""
    fake, kubeconfig = kube
    fake.state = not_ready_state()
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    revs = {r["name"]: r for s in doc["services"] for r in s["revisions"]}
    trainer = revs["trainer-shard-0-00002"]
    assert (trainer["ready"], trainer["reason"], trainer["message"]) == ("Unknown", "Deploying", None)
    assert trainer["warning"] == {"reason": "InternalError", "message": PORT_ZERO}
    sampler = revs["sampler-00003"]
    assert (sampler["reason"], sampler["message"]) == ("Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert sampler["warning"] is None and revs["sampler-00002"]["warning"] is None
    assert revs["gateway-00002"]["message"] == "Container failed with: KeyError: 'OPENRL_NATS_URL'"
    assert EVENTS_PATH in fake.paths

    monkeypatch.setenv("COLUMNS", "400")
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "why not ready" in out
    assert f"Deploying; last warning: InternalError: {PORT_ZERO}" in out
    assert "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in out
    assert "ExitCode1: Container failed with: KeyError: 'OPENRL_NATS_URL'" in out
    assert "old failure" not in out and "not a revision" not in out

    # an API that does not let us list events: the conditions still show, no error
    del fake.state[EVENTS_PATH]
    doc = _status(capsys, "--kubeconfig", kubeconfig)
    revs = {r["name"]: r for s in doc["services"] for r in s["revisions"]}
    assert revs["trainer-shard-0-00002"]["warning"] is None and revs["sampler-00003"]["reason"] == "Unschedulable"
