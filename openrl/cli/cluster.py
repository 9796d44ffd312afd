"""``openrl status --cluster``: the Knative deployment seen through the Kubernetes API, plus
the NATS JetStream work still queued, so a platform engineer watches a sweep scale up and
back to zero.

What it reads (``kubernetes`` Python client, ``CustomObjectsApi``; read-only, ``list`` on
these resources in the namespace is all the RBAC it needs):

| resource | fields |
|---|---|
| ``serving.knative.dev/v1`` ``services`` | ``status.latestReadyRevisionName``, ``status.latestCreatedRevisionName``, the ``Ready`` condition, ``status.url``, ``status.traffic`` |
| ``serving.knative.dev/v1`` ``revisions`` | label ``serving.knative.dev/service``, ``status.desiredReplicas``, ``status.actualReplicas``, the ``Ready`` condition |
| ``autoscaling.internal.knative.dev/v1alpha1`` ``podautoscalers`` (optional: skipped when the API answers 403/404) | ``status.desiredScale``, ``status.actualScale``: the autoscaler's numbers, used where the revision's are missing |
| ``v1`` ``events`` of kind Revision (optional, as above) | the newest ``Warning`` of a revision that is not ready: where the controller reports what it could not create (e.g. a Deployment the API server rejected while the revision shows only ``Unknown / Deploying``) |
| ``eventing.knative.dev/v1`` ``brokers``, ``triggers`` (optional, as above) | the ``Ready`` condition and the conditions that say why not: ``DeadLetterSinkResolved``, ``SubscriberResolved``, ``BrokerReady`` |

A read the API refuses (403) or lacks (404) where it is optional is not an error: the view
says so in a line (``--json``: ``notes``), e.g. when events cannot be read, so an empty
"why" is never mistaken for "nothing wrong". (A PodAutoscaler API that is absent is not
mentioned: the revisions' own numbers stand.)

A revision that is not ready shows *why* in the Revisions table: its ``Ready`` condition's
reason and message, else those of the first other condition that is not ``True`` and says
something (``ResourcesAvailable``: unschedulable, ``ContainerHealthy``: exit codes), and the
newest Warning event about it.

A Service's *desired* / *actual* scale is the sum over its revisions (an idle Service at zero
shows 0 / 0; a sweep in flight shows its replicas); it is unknown (``-``, JSON ``null``) when
a revision's is: the PodAutoscaler reports ``desiredScale: -1`` before its first decision, and
the revision then leaves ``desiredReplicas`` out. The Services table shows a Service's Ready
reason *and* message when it is not ready.

Eventing: the Broker and Triggers with their Ready condition, and a line naming the cause when
one is not Ready because something it points at does not resolve. The one that stops
everything: a Broker whose dead-letter sink does not resolve (a ``ref`` to a Knative Service
that has never been ready) is not Ready, and Knative's MT broker then creates no Subscription
for any Trigger, so no function receives an event while the Broker's ingress accepts them.

NATS (``--nats-url``, default ``$OPENRL_NATS_URL``; on a cluster, port-forward the NATS
service first): every JetStream stream except KV buckets (``KV_*``) and object stores
(``OBJ_*``) with each durable consumer's ``queued`` (``num_pending``: not yet delivered) and
``in flight`` (``num_ack_pending``: delivered, not yet acknowledged). These are the
embedded stack's work queues (:data:`openrl.contract.topology.STREAMS`, listed first; marked
``missing`` when absent) and, on a cluster, the Broker's NatsJetStreamChannel stream with one
consumer per Trigger.

Kubernetes credentials: ``--kubeconfig PATH`` (and ``--context NAME``), else the in-cluster
service account when running inside a pod (``$KUBERNETES_SERVICE_HOST``), else
``$KUBECONFIG`` / ``~/.kube/config``. ``--namespace`` defaults to ``openrl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

KNATIVE_GROUP, KNATIVE_VERSION = "serving.knative.dev", "v1"
PA_GROUP, PA_VERSION = "autoscaling.internal.knative.dev", "v1alpha1"
EVENTING_GROUP, EVENTING_VERSION = "eventing.knative.dev", "v1"
SERVICE_LABEL = "serving.knative.dev/service"
DEFAULT_NAMESPACE = "openrl"
NATS_TIMEOUT_S = 5.0


class ClusterError(Exception):
    """The cluster or NATS could not be read (the message is for the user)."""


def add_flags(p: argparse.ArgumentParser) -> None:
    """Add ``--cluster``, ``--kubeconfig``, ``--context``, ``--namespace`` and ``--nats-url`` to
    ``openrl status``'s parser (imports nothing heavy)."""
    g = p.add_argument_group("cluster (--cluster: Knative Services and NATS streams instead of the gateway)")
    g.add_argument("--cluster", action="store_true",
                   help="list the Knative Services (latest ready revision, desired / actual scale, why not ready) "
                        "and the Broker and Triggers through the Kubernetes API, and the NATS streams' pending work")
    g.add_argument("--kubeconfig", default=None, metavar="PATH",
                   help="kubeconfig file (default: in-cluster config inside a pod, else $KUBECONFIG / ~/.kube/config)")
    g.add_argument("--context", default=None, help="kubeconfig context (default: its current-context)")
    g.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"namespace (default {DEFAULT_NAMESPACE})")
    g.add_argument("--nats-url", default=None, metavar="URL",
                   help="NATS server for the streams' pending work (default $OPENRL_NATS_URL; none: no NATS table)")


# -- Kubernetes -------------------------------------------------------------------------------


def api_client(kubeconfig: str | None = None, context: str | None = None):
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` (+ ``context``) when given, else
    the in-cluster service account inside a pod, else the default kubeconfig.

    Raises:
        ClusterError: the ``kubernetes`` package is missing, or no usable configuration.
    """
    try:
        from kubernetes import client, config
    except ImportError:
        raise ClusterError("the kubernetes package is missing: pip install 'openrl[cluster]'") from None
    try:
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return client.ApiClient()
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    except (config.ConfigException, OSError, ValueError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ClusterError(f"--kubeconfig {where}: {exc}") from exc


def _list(api, group: str, version: str, namespace: str, plural: str, *, optional: bool = False,
          refused: list | None = None) -> list[dict]:
    """The items of ``plural``.``group``/``version`` in ``namespace``. ``optional``: a 403 / 404
    answers [] and appends ``(plural.group, status, reason)`` to ``refused``."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        out = api.list_namespaced_custom_object(group, version, namespace, plural, _request_timeout=15)
    except ApiException as exc:
        if optional and exc.status in (403, 404):
            if refused is not None:
                refused.append((f"{plural}.{group}", exc.status, exc.reason))
            return []
        raise ClusterError(f"list {plural}.{group}/{version} in namespace {namespace}: HTTP {exc.status} "
                           f"{exc.reason}: {(exc.body or '')[:200]}") from exc
    except HTTPError as exc:
        host = api.api_client.configuration.host
        raise ClusterError(f"cannot reach the Kubernetes API at {host}: {exc}") from exc
    return list(out.get("items") or [])


def _ready(obj: dict) -> tuple[str, str | None, str | None]:
    """The ``Ready`` condition: (``"True"`` / ``"False"`` / ``"Unknown"``, reason, message).

    When Ready is not True and says nothing (no message), the reason and message come from
    the first other condition that is not True and carries a message (Knative sets
    ``ResourcesAvailable`` / ``ContainerHealthy`` with the pod's cause while Ready stays
    ``Unknown``)."""
    conds = (obj.get("status") or {}).get("conditions") or []
    ready = next((c for c in conds if c.get("type") == "Ready"), None)
    status = str((ready or {}).get("status", "Unknown"))
    reason, message = (ready or {}).get("reason"), (ready or {}).get("message")
    if status != "True" and not message:
        for c in conds:
            if c.get("type") != "Ready" and str(c.get("status")) != "True" and c.get("message"):
                reason, message = c.get("reason") or reason, c["message"]
                break
    return status, reason, message


def why(row: dict) -> str | None:
    """One line for a row that is not ready: ``Reason: message`` plus the newest Warning
    event (``last warning: Reason: message``); None for a ready row."""
    if row.get("ready") == "True":
        return None
    parts = [": ".join(x for x in (row.get("reason"), row.get("message")) if x)]
    ev = row.get("warning")
    if ev:
        parts.append("last warning: " + ": ".join(x for x in (ev.get("reason"), ev.get("message")) if x))
    return "; ".join(p for p in parts if p) or None


def _sum(values) -> int | None:
    """The total, or None when there is nothing to add or any value is unknown (None)."""
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return sum(values)


def _count(v) -> int | None:
    """A replica count, None when unknown: absent, or negative (the PodAutoscaler's ``-1``
    before its first decision)."""
    return None if v is None or int(v) < 0 else int(v)


def _warnings(events: list[dict]) -> dict[str, dict]:
    """The newest ``Warning`` event per involved Revision name: ``{name: {"reason", "message"}}``."""
    out: dict[str, tuple[str, dict]] = {}
    for e in events:
        obj = e.get("involvedObject") or {}
        if e.get("type") != "Warning" or obj.get("kind") != "Revision":
            continue
        when = e.get("lastTimestamp") or e.get("eventTime") or (e.get("metadata") or {}).get("creationTimestamp") or ""
        if obj.get("name") not in out or when >= out[obj["name"]][0]:
            out[obj["name"]] = (when, {"reason": e.get("reason"), "message": e.get("message")})
    return {k: v for k, (_, v) in out.items()}


def summarize(services: list[dict], revisions: list[dict], autoscalers: list[dict],
              events: list[dict] | None = None) -> list[dict]:
    """Join Knative Services, Revisions, PodAutoscalers and the revisions' Events (the raw API
    objects) into one row per Service with its revisions.

    Returns:
        ``[{"name", "ready", "reason", "message", "url", "latest_ready_revision",
        "latest_created_revision", "desired", "actual", "revisions": [{"name", "ready", "reason",
        "message", "warning", "desired", "actual", "traffic_percent"}]}]``, sorted by name;
        ``reason`` / ``message`` are the Ready condition's (see :func:`_ready`), ``warning`` the
        newest Warning event of a revision that is not ready (``{"reason", "message"}`` or None);
        ``desired`` / ``actual`` are replica counts (None where neither the revision nor its
        PodAutoscaler reports one, or the PodAutoscaler's is ``-1``: not decided yet; a
        Service's is None when one of its revisions' is).
    """
    pas = {(p.get("metadata") or {}).get("name"): p.get("status") or {} for p in autoscalers}
    warnings = _warnings(events or [])
    by_service: dict[str, list[dict]] = {}
    for r in revisions:
        meta = r.get("metadata") or {}
        st = r.get("status") or {}
        pa = pas.get(meta.get("name"), {})
        ready, reason, message = _ready(r)
        desired = _count(st.get("desiredReplicas", pa.get("desiredScale")))
        actual = _count(st.get("actualReplicas", pa.get("actualScale")))
        by_service.setdefault((meta.get("labels") or {}).get(SERVICE_LABEL), []).append(
            {"name": meta.get("name"), "ready": ready, "reason": reason, "message": message,
             "warning": warnings.get(meta.get("name")) if ready != "True" else None,
             "desired": desired, "actual": actual, "created": meta.get("creationTimestamp")})
    rows = []
    for s in services:
        name = (s.get("metadata") or {}).get("name")
        st = s.get("status") or {}
        traffic = {}
        for t in st.get("traffic") or []:
            if t.get("revisionName"):
                traffic[t["revisionName"]] = traffic.get(t["revisionName"], 0) + int(t.get("percent") or 0)
        revs = sorted(by_service.get(name, []), key=lambda r: (r["created"] or "", r["name"] or ""))
        for r in revs:
            del r["created"]
            r["traffic_percent"] = traffic.get(r["name"])
        ready, reason, message = _ready(s)
        rows.append({"name": name, "ready": ready, "reason": reason, "message": message, "url": st.get("url"),
                     "latest_ready_revision": st.get("latestReadyRevisionName"),
                     "latest_created_revision": st.get("latestCreatedRevisionName"),
                     "desired": _sum(r["desired"] for r in revs), "actual": _sum(r["actual"] for r in revs),
                     "revisions": revs})
    return sorted(rows, key=lambda r: r["name"] or "")


def knative_status(api_client_, namespace: str, notes: list[str] | None = None) -> list[dict]:
    """List the namespace's Knative Services, Revisions and PodAutoscalers and :func:`summarize` them.

    Args:
        notes: gets one line per optional read the API refused (events, PodAutoscalers: 403).

    Raises:
        ClusterError: the API is unreachable or refuses (the HTTP status and reason are in the message).
    """
    from kubernetes import client

    notes = notes if notes is not None else []
    api = client.CustomObjectsApi(api_client_)
    services = _list(api, KNATIVE_GROUP, KNATIVE_VERSION, namespace, "services")
    revisions = _list(api, KNATIVE_GROUP, KNATIVE_VERSION, namespace, "revisions")
    refused: list = []
    autoscalers = _list(api, PA_GROUP, PA_VERSION, namespace, "podautoscalers", optional=True, refused=refused)
    for what, status, reason in refused:
        if status == 403:  # 404: no such API here; the revisions' own numbers stand
            notes.append(f"{what}: cannot be read (HTTP {status} {reason}): desired / actual come from the "
                         "revisions alone")
    events = []
    if any(_ready(r)[0] != "True" for r in revisions):
        events, refusal = _revision_events(client.CoreV1Api(api_client_), namespace)
        if refusal:
            notes.append(f"events: cannot be read in namespace {namespace} ({refusal}): a revision's Warning "
                         "events (e.g. a Deployment the API server rejected) are not shown")
    return summarize(services, revisions, autoscalers, events)


def _revision_events(core, namespace: str) -> tuple[list[dict], str | None]:
    """The namespace's events about Revisions, and None; or [] and ``"HTTP <status> <reason>"``
    when the API refuses or lacks them (optional)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        out = core.list_namespaced_event(namespace, field_selector="involvedObject.kind=Revision",
                                         _request_timeout=15, _preload_content=False)
        return list(json.loads(out.data).get("items") or []), None
    except ApiException as exc:
        if exc.status in (403, 404):
            return [], f"HTTP {exc.status} {exc.reason}"
        raise ClusterError(f"list events in namespace {namespace}: HTTP {exc.status} {exc.reason}") from exc
    except HTTPError as exc:
        raise ClusterError(f"cannot reach the Kubernetes API at {core.api_client.configuration.host}: {exc}") from exc


def _condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def _false(obj: dict, type_: str) -> dict | None:
    """The condition ``type_`` when its status is False, else None."""
    c = _condition(obj, type_)
    return c if c is not None and str(c.get("status")) == "False" else None


def _detail(c: dict) -> str:
    return ": ".join(str(x) for x in (c.get("reason"), c.get("message")) if x)


def eventing_cause(kind: str, obj: dict) -> str | None:
    """Why a Broker or Trigger that is not Ready stops events, in words, when a condition says
    which of its references does not resolve (Knative Eventing 1.22's condition types); None
    otherwise."""
    if kind == "Broker":
        c = _false(obj, "DeadLetterSinkResolved")
        if c is not None:
            return (f"its dead-letter sink does not resolve ({_detail(c)}). Until it does, the Broker is not Ready "
                    "and Knative's MT broker creates no Subscription for any Trigger: no function receives an "
                    "event while the Broker's ingress still accepts them. A sink that is a ref to a Knative "
                    "Service resolves only once that Service has had a ready revision; give the sink as a plain "
                    "uri (eventing/base/broker.yaml does) or get that Service ready")
        return None
    for type_, what in (("SubscriberResolved", "its subscriber"), ("DeadLetterSinkResolved", "its dead-letter sink")):
        c = _false(obj, type_)
        if c is not None:
            return f"{what} does not resolve ({_detail(c)}): it has no Subscription and its subscriber receives nothing"
    c = _condition(obj, "BrokerReady")
    if c is not None and str(c.get("status")) != "True":
        return "its Broker is not Ready (see the Broker's line): it has no Subscription"
    return None


def summarize_eventing(brokers: list[dict], triggers: list[dict]) -> list[dict]:
    """One row per Broker, then per Trigger (by name): ``{"kind", "name", "ready", "reason",
    "message", "cause"}``; ``cause`` is :func:`eventing_cause` for one that is not Ready."""
    rows = []
    for kind, objs in (("Broker", brokers), ("Trigger", triggers)):
        for o in sorted(objs, key=lambda o: (o.get("metadata") or {}).get("name") or ""):
            ready, reason, message = _ready(o)
            rows.append({"kind": kind, "name": (o.get("metadata") or {}).get("name"), "ready": ready,
                         "reason": reason, "message": message,
                         "cause": eventing_cause(kind, o) if ready != "True" else None})
    return rows


def eventing_status(api_client_, namespace: str, notes: list[str]) -> list[dict] | None:
    """The namespace's Brokers and Triggers (:func:`summarize_eventing`); None, with a line in
    ``notes``, when the API refuses them or has no Knative Eventing."""
    from kubernetes import client

    api = client.CustomObjectsApi(api_client_)
    refused: list = []
    brokers = _list(api, EVENTING_GROUP, EVENTING_VERSION, namespace, "brokers", optional=True, refused=refused)
    triggers = _list(api, EVENTING_GROUP, EVENTING_VERSION, namespace, "triggers", optional=True, refused=refused)
    if refused:
        what = ", ".join(sorted({w for w, _, _ in refused}))
        answers = ", ".join(sorted({f"HTTP {st} {reason}" for _, st, reason in refused}))
        notes.append(f"{what}: cannot be read ({answers})"
                     + ("; is Knative Eventing installed?" if all(st == 404 for _, st, _ in refused) else ""))
        return None
    return summarize_eventing(brokers, triggers)


# -- NATS -------------------------------------------------------------------------------------


async def _quiet(exc: Exception) -> None:
    """nats-py's error callback: the failure is raised to the caller instead of logged."""


async def nats_pending(url: str, timeout_s: float = NATS_TIMEOUT_S) -> list[dict]:
    """The JetStream work streams at ``url`` and their consumers' pending work.

    Returns:
        ``[{"stream", "subjects", "messages", "bytes", "missing", "consumers": [{"name",
        "queued", "in_flight", "redelivered", "waiting"}]}]``: the topology's streams first
        (``missing: True`` when the server has no such stream), then the others by name.

    Raises:
        ClusterError: no NATS server at ``url`` or JetStream is not enabled.
    """
    import nats
    from nats.errors import Error as NatsError

    from openrl.contract.topology import STREAMS

    try:
        # max_reconnect_attempts=0 would retry the first connect for ever (nats-py 2.x): 1 gives up
        # after two attempts
        nc = await asyncio.wait_for(
            nats.connect(url, connect_timeout=timeout_s, allow_reconnect=False, max_reconnect_attempts=1,
                         reconnect_time_wait=0.2, error_cb=_quiet), 3 * timeout_s)
    except (NatsError, OSError, asyncio.TimeoutError) as exc:
        raise ClusterError(f"cannot reach NATS at {url}: {exc!r}") from exc
    try:
        js = nc.jetstream(timeout=timeout_s)
        infos, offset = [], 0
        while True:  # streams_info answers one page at a time
            page = await js.streams_info(offset)
            infos += page
            offset += len(page)
            if not page:
                break
        found = {}
        for si in infos:
            name = si.config.name
            if name.startswith(("KV_", "OBJ_")):
                continue
            consumers = [{"name": ci.name, "queued": ci.num_pending or 0, "in_flight": ci.num_ack_pending or 0,
                          "redelivered": ci.num_redelivered or 0, "waiting": ci.num_waiting or 0}
                         for ci in await js.consumers_info(name)]
            found[name] = {"stream": name, "subjects": list(si.config.subjects or []), "messages": si.state.messages,
                           "bytes": si.state.bytes, "missing": False,
                           "consumers": sorted(consumers, key=lambda c: c["name"])}
    except (NatsError, asyncio.TimeoutError) as exc:
        raise ClusterError(f"NATS at {url}: JetStream stream info failed: {exc!r}") from exc
    finally:
        await nc.close()
    ours = [found.pop(s, None) or {"stream": s, "subjects": subj, "messages": None, "bytes": None, "missing": True,
                                    "consumers": []} for s, subj in STREAMS.items()]
    return ours + [found[k] for k in sorted(found)]


# -- the command ------------------------------------------------------------------------------


def collect(args: argparse.Namespace) -> dict:
    """Everything ``openrl status --cluster`` shows, as one JSON-able dict:
    ``{"namespace", "kubernetes_api", "services": summarize(...), "eventing": summarize_eventing(...)
    or None, "notes": [str], "nats_url", "streams"}`` (``streams`` is None without a NATS URL;
    ``notes``: the optional reads the API refused, see :func:`knative_status`, :func:`eventing_status`).

    Raises:
        ClusterError: see :func:`api_client`, :func:`knative_status`, :func:`nats_pending`.
    """
    api = api_client(args.kubeconfig, args.context)
    notes: list[str] = []
    try:
        services = knative_status(api, args.namespace, notes)
        eventing = eventing_status(api, args.namespace, notes)
        host = api.configuration.host
    finally:
        api.close()
    nats_url = args.nats_url or os.environ.get("OPENRL_NATS_URL")
    streams = asyncio.run(nats_pending(nats_url)) if nats_url else None
    return {"namespace": args.namespace, "kubernetes_api": host, "services": services, "eventing": eventing,
            "notes": notes, "nats_url": nats_url, "streams": streams}


def render(doc: dict, console) -> None:
    """Print :func:`collect`'s dict as rich tables on ``console``."""
    from openrl.cli.tables import table as _table

    services = doc["services"]
    running = sum(s["actual"] or 0 for s in services)
    console.print(f"[bold]openrl[/bold] on {doc['kubernetes_api']}, namespace {doc['namespace']}: "
                  f"{len(services)} Knative Services, {running} replicas running")
    console.print(_table("Knative Services",
                         ["service", "ready", "latest ready revision", "desired", "actual", "url", "why not ready"],
                         [[s["name"], s["ready"], s["latest_ready_revision"], s["desired"], s["actual"], s["url"], why(s)]
                          for s in services], fold=("service",)))
    revs = [(s, r) for s in services for r in s["revisions"]]
    console.print(_table("Revisions", ["revision", "service", "ready", "desired", "actual", "traffic %", "why not ready"],
                         [[r["name"], s["name"], r["ready"], r["desired"], r["actual"], r["traffic_percent"], why(r)]
                          for s, r in revs], fold=("revision",)))
    if doc.get("eventing") is not None:
        ev = doc["eventing"]
        console.print(_table("Knative Eventing", ["object", "ready", "why not ready"],
                             [[f"{e['kind']}/{e['name']}", e["ready"], why(e)] for e in ev], fold=("object",)))
        for e in ev:
            if e.get("cause"):
                console.print(f"{e['kind']}/{e['name']} is not Ready: {e['cause']}", markup=False)
    for note in doc.get("notes") or []:
        console.print(f"Not shown: {note}", markup=False)
    if doc["streams"] is None:
        console.print("NATS: not shown (pass --nats-url or set OPENRL_NATS_URL)")
        return
    rows = []
    for st in doc["streams"]:
        if st["missing"]:
            rows.append([st["stream"], "(no such stream)", None, None, None])
        for c in st["consumers"] or ([] if st["missing"] else [{"name": None}]):
            rows.append([st["stream"], c["name"], c.get("queued", st["messages"]), c.get("in_flight"),
                         c.get("redelivered")])
    console.print(_table(f"NATS streams at {doc['nats_url']} (pending work per consumer)",
                         ["stream", "consumer", "queued", "in flight", "redelivered"], rows))


def cmd_cluster_status(args: argparse.Namespace) -> int:
    """``openrl status --cluster``: Knative Services and NATS pending work (tables, or ``--json``).

    Returns 1 (message on stderr) when the cluster or NATS cannot be read.
    """
    try:
        doc = collect(args)
    except ClusterError as exc:
        print(f"openrl status --cluster: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    from openrl.cli.tables import console

    render(doc, console())
    return 0
