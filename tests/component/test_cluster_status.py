"""``openrl status --cluster`` (openrl/cli/cluster.py) through the real ``kubernetes`` client and a
real nats-server.

No Kubernetes cluster can run here, so the Kubernetes API is a local HTTP server
(``FakeKubeAPI``, threading ``http.server``) that answers the list calls the client makes
(``GET /apis/serving.knative.dev/v1/namespaces/openrl/{services,revisions}`` and
``/apis/autoscaling.internal.knative.dev/v1alpha1/namespaces/openrl/podautoscalers``) with
objects shaped like Knative Serving's. The Service and Revision objects are checked against
the upstream CRDs' openAPIV3Schema (``../shared/schemas/knative-serving/``, strict: unknown
fields fail); the PodAutoscaler has no CRD there, its status fields (``desiredScale``,
``actualScale``) follow knative/serving's ``pkg/apis/autoscaling/v1alpha1`` PodAutoscalerStatus.
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
from openrl.transport.embedded import PortHold, start_nats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIRS = [ROOT / "tests" / "data" / "schemas", ROOT.parent / "shared" / "schemas"]  # vendored first (CI: no ../shared)
NS = "openrl"
SERVING = "/apis/serving.knative.dev/v1/namespaces/openrl"
PA_PATH = "/apis/autoscaling.internal.knative.dev/v1alpha1/namespaces/openrl/podautoscalers"


# -- Knative objects --------------------------------------------------------------------------


def _cond(ready: bool, reason: str | None = None) -> list[dict]:
    c = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-12-01T10:00:00Z"}
    if reason:
        c["reason"] = reason
    return [c]


def service(name: str, revision: str, *, ready: bool = True, reason: str | None = None) -> dict:
    """A ``serving.knative.dev/v1`` Service as the API returns it (spec abridged, status full)."""
    return {
        "apiVersion": "serving.knative.dev/v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"template": {"spec": {"containers": [{"image": f"openrl/{name}:dev"}], "timeoutSeconds": 900}}},
        "status": {"observedGeneration": 1, "conditions": _cond(ready, reason),
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
    }


class FakeKubeAPI:
    """A local HTTP server answering the Kubernetes list calls from ``self.state``
    (path -> items); any other path is a 404 ``Status`` as the API server sends. ``paths``
    records what the client asked for."""

    def __init__(self, state: dict[str, list[dict]]):
        self.state = state
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.split("?")[0]
                fake.paths.append(path)
                if path in fake.state:
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


def _crd_schema(filename: str) -> dict:
    for d in SCHEMA_DIRS:
        f = d / "knative-serving" / filename
        if f.exists():
            crd = yaml.safe_load(f.read_text())
            root = dict(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
            root["properties"] = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                  "metadata": {"type": "object"}, **root.get("properties", {})}
            return _strict(root)
    pytest.skip(f"knative-serving/{filename} CRD not found in {[str(d) for d in SCHEMA_DIRS]}")


def test_fixture_objects_match_the_knative_crds():
    """The Services and Revisions the fake API serves validate against Knative Serving's CRDs
    (so the listing below reads fields that exist, spelled as upstream spells them); a
    misspelt status field is caught."""
    schemas = {"Service": _crd_schema("service.yaml"), "Revision": _crd_schema("revision.yaml")}
    state = not_ready_state()
    objs = state[f"{SERVING}/services"] + state[f"{SERVING}/revisions"]
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
    monkeypatch.setenv("COLUMNS", "200")  # rich: no wrapping inside cells
    fake.state[f"{SERVING}/services"][2] = service("trainer-shard-0", "trainer-shard-0-00001", ready=False,
                                                   reason="RevisionMissing")
    del fake.state[PA_PATH]
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "Knative Services" in out and "False (RevisionMissing)" in out and "sampler-00002" in out
    assert "not shown (pass --nats-url" in out

    fake.close()
    assert cli_main(["status", "--cluster", "--kubeconfig", str(kubeconfig)]) == 1
    assert f"cannot reach the Kubernetes API at {fake.url}" in capsys.readouterr().err
    assert cli_main(["status", "--cluster", "--kubeconfig", str(tmp_path / "nope")]) == 1
    assert "--kubeconfig" in capsys.readouterr().err


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
