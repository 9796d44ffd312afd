"""What the Knative controllers do with the fields our objects set, as offline checks.

Each function takes rendered objects (``kustomize build`` output, parsed) and returns the
violations it finds as readable strings (empty: the rule holds). The rules, their source in
Knative's code and what breaks when one is violated are in docs/knative-review.md; the
tests that run them over every overlay are in test_knative_rules.py. Versions: Knative
Serving 1.23 (``knative/serving`` tag ``knative-v1.23.0``), Eventing 1.22 (``knative-v1.22.2``),
eventing-natss 1.22 (``knative-v1.22.0``).

The rules are re-stated here from reading the controllers (``pkg/apis/serving/k8s_validation.go``,
``fieldmask.go``, ``v1/revision_defaults.go``, ``pkg/apis/config/defaults.go``,
``pkg/reconciler/revision/resources/deploy.go``, ``queue.go``, ``pkg/http/handler/timeout.go``
(queue-proxy's and the activator's request limits), ``pkg/apis/autoscaling/annotation_validation.go``, eventing's
``trigger_validation.go`` and ``duck/v1/delivery_types.go``); no Knative code is copied.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

# ----------------------------------------------------------------------------- constants

#: The port Knative assumes when a container declares none (``v1.DefaultUserPort``).
DEFAULT_USER_PORT = 8080
#: Ports queue-proxy and the activator use inside the pod: the webhook rejects them as the
#: user port (``reservedPorts``: 8012, 8013, 8022, 9090, 9091, and 8008 for profiling).
#: 8112 (queue-proxy's HTTPS port) is not in Knative's list, but it is bound in the same pod.
RESERVED_PORTS = {8012, 8013, 8022, 9090, 9091, 8008, 8112}
#: Port names the webhook accepts on the user port (``validPortNames``).
VALID_PORT_NAMES = {"", "http1", "h2c"}
#: Environment variables Knative sets itself (``reservedEnvVars``).
RESERVED_ENV = {"PORT", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"}
#: Container name of Knative's sidecar (``reservedContainerNames``).
RESERVED_CONTAINER_NAMES = {"queue-proxy"}
#: Mount paths the webhook refuses (``reservedPaths``).
RESERVED_MOUNT_PATHS = {"/", "/dev", "/dev/log"}
#: Volume types that may be mounted read-write; Knative's defaulting turns every other mount
#: read-only (``applyDefault``) and its validation requires it (``validateVolumeMounts``), so
#: the manifest says ``readOnly: true`` to be what is deployed.
WRITABLE_VOLUME_TYPES = {"emptyDir", "persistentVolumeClaim", "ephemeral"}
#: Serving feature flags (config-features) that are on in a stock install.
SERVING_DEFAULT_FEATURES = {"multi-container", "kubernetes.podspec-volumes-emptydir"}
#: Registries whose tags Knative does not resolve to digests in a stock install
#: (config-deployment ``registries-skipping-tag-resolving``).
DEFAULT_SKIP_TAG_RESOLVING = {"kind.local", "ko.local", "dev.local"}
#: config-defaults in a stock install (``pkg/apis/config/defaults.go``); a stock
#: ``revision-response-start-timeout-seconds`` is ``revision-timeout-seconds``, a stock
#: ``revision-idle-timeout-seconds`` 0 (no limit).
STOCK_REVISION_TIMEOUT_S = 300
STOCK_MAX_REVISION_TIMEOUT_S = 600
STOCK_CONTAINER_CONCURRENCY_MAX = 1000
#: autoscaling.knative.dev windows are capped at one hour (``WindowMax``).
WINDOW_MAX_S = 3600
#: CloudEvents attribute names a Trigger filter accepts (``validAttributeName``).
ATTRIBUTE_NAME = re.compile(r"^[a-z][a-z0-9]*$")

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
_ISO8601 = re.compile(r"^P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?$")


def go_duration_s(text: str) -> float | None:
    """Seconds of a Go duration (``30m``, ``1h30m``, ``500ms``); None when it does not parse."""
    if not isinstance(text, str) or not _GO_DURATION.match(text):
        return None
    unit = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * unit[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", text))


def _name(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _pod(ksvc: dict) -> dict:
    return ksvc["spec"]["template"]["spec"]


def _containers(ksvc: dict) -> list[dict]:
    return _pod(ksvc).get("containers") or []


def user_port(ksvc: dict) -> int:
    """The port queue-proxy forwards to: the first declared containerPort, else 8080."""
    for c in _containers(ksvc):
        for p in c.get("ports") or []:
            if p.get("containerPort"):
                return int(p["containerPort"])
    return DEFAULT_USER_PORT


# ----------------------------------------------------------------------------- Serving: probes

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
HANDLERS = ("httpGet", "tcpSocket", "grpc", "exec")


def effective_probe_port(kind: str, handler: str, declared, port: int, port_name: str):
    """The port a probe reaches in the pod Knative 1.23 creates (multi-container-probing off).

    * liveness (httpGet / tcpSocket): always rewritten to the user port (``rewriteUserLivenessProbe``);
    * readiness: removed from the container and run by queue-proxy against the declared
      number, or the user port when none (``makeQueueContainer``);
    * startup: copied into the Deployment unchanged. No port is port 0 (the API server rejects
      the Deployment); a port *name* refers to the container's port list, where Knative has
      renamed the user port ``user-port`` (``buildContainerPorts``), so only ``user-port``
      would resolve, and the webhook allows no name other than the declared one.
    """
    if handler == "exec":
        return None
    if kind == "livenessProbe" and handler in ("httpGet", "tcpSocket"):
        return port
    if kind == "readinessProbe":
        return declared if isinstance(declared, int) and declared else port
    if declared is None or declared == 0:
        return 0
    if isinstance(declared, str):
        return "user-port" if declared == "user-port" else f"unresolvable name {declared!r}"
    return declared


def probe_violations(ksvc: dict) -> list[str]:
    """Every probe reaches the serving container by a numeric port equal to its containerPort;
    a port name must equal the declared port's name (webhook); one handler per probe; a
    readiness probe with periodSeconds 0 sets no timeoutSeconds / failureThreshold."""
    out = []
    port = user_port(ksvc)
    for c in _containers(ksvc):
        ports = c.get("ports") or [{}]
        port_name = ports[0].get("name", "")
        for kind in PROBES:
            probe = c.get(kind)
            if probe is None:
                continue
            where = f"{_name(ksvc)} container {c.get('name')} {kind}"
            handlers = [h for h in HANDLERS if h in probe]
            if len(handlers) != 1:
                out.append(f"{where}: exactly one of {HANDLERS} expected, got {handlers}")
                continue
            (handler,) = handlers
            # a quoted number ("8080") is a port *name* to Kubernetes (IntOrString), never a number
            declared = (probe[handler] or {}).get("port")
            if isinstance(declared, str) and declared != port_name:
                out.append(f"{where}: port {declared!r} is neither a number nor the container port's name "
                           f"{port_name!r} (the webhook rejects it)")
            eff = effective_probe_port(kind, handler, declared, port, port_name)
            if eff is None:
                continue
            if not isinstance(eff, int) or eff == 0:
                out.append(f"{where}: reaches port {eff!r} in the pod (declared {declared!r}); give the number "
                           f"{port}: Knative does not fill in a startup probe's port and renames the named port")
            elif eff != port:
                out.append(f"{where}: probes port {eff}, but the container listens on {port}")
            if kind == "readinessProbe":
                period = probe.get("periodSeconds", 0)
                if period == 0 and ("timeoutSeconds" in probe or "failureThreshold" in probe):
                    out.append(f"{where}: periodSeconds 0 (Knative's aggressive probing) allows neither "
                               "timeoutSeconds nor failureThreshold")
    return out


# ----------------------------------------------------------------------------- Serving: containers


def container_violations(ksvc: dict, configmaps: dict[str, dict]) -> list[str]:
    """One serving container, not named queue-proxy; one port, named "", http1 or h2c, TCP,
    not a queue-proxy port; the ``--port`` of its command equals it (the PORT Knative injects);
    no reserved environment variable in env or in an envFrom ConfigMap; no init containers
    (a feature flag that is off)."""
    out = []
    name = _name(ksvc)
    containers = _containers(ksvc)
    if len(containers) != 1:
        out.append(f"{name}: {len(containers)} containers; the functions run as one serving container")
    if _pod(ksvc).get("initContainers"):
        out.append(f"{name}: initContainers need kubernetes.podspec-init-containers")
    for c in containers:
        where = f"{name} container {c.get('name')}"
        if c.get("name") in RESERVED_CONTAINER_NAMES:
            out.append(f"{where}: the name is reserved for Knative's sidecar")
        ports = c.get("ports") or []
        if len(ports) > 1:
            out.append(f"{where}: {len(ports)} ports; Knative allows one")
        for p in ports[:1]:
            if p.get("name", "") not in VALID_PORT_NAMES:
                out.append(f"{where}: port name {p.get('name')!r} not in {sorted(VALID_PORT_NAMES)}")
            if p.get("protocol", "TCP") != "TCP":
                out.append(f"{where}: port protocol {p.get('protocol')!r}; only TCP")
            if p.get("containerPort") in RESERVED_PORTS:
                out.append(f"{where}: containerPort {p['containerPort']} is used by queue-proxy in the same pod")
            for k in ("hostPort", "hostIP"):
                if k in p:
                    out.append(f"{where}: port field {k} is not allowed")
        cmd = list(c.get("command") or []) + list(c.get("args") or [])
        if "--port" in cmd:
            given = cmd[cmd.index("--port") + 1]
            if str(given) != str(user_port(ksvc)):
                out.append(f"{where}: listens on --port {given} but Knative routes to {user_port(ksvc)}")
        env_names = {e.get("name") for e in c.get("env") or []}
        for src in c.get("envFrom") or []:
            ref = (src.get("configMapRef") or {}).get("name")
            if ref in configmaps:
                env_names |= {(src.get("prefix") or "") + k for k in (configmaps[ref].get("data") or {})}
        for bad in sorted(env_names & RESERVED_ENV):
            out.append(f"{where}: environment variable {bad} is reserved (Knative sets it)")
    sa = _pod(ksvc).get("serviceAccountName")
    if sa and not _DNS1123_SUBDOMAIN.match(sa):
        out.append(f"{name}: serviceAccountName {sa!r} is not a DNS-1123 subdomain")
    return out


def volume_type(volume: dict) -> str:
    """The volume's source key (``configMap``, ``emptyDir``, ``csi``, ...)."""
    kinds = [k for k in volume if k != "name"]
    return kinds[0] if len(kinds) == 1 else "+".join(sorted(kinds))


def volume_violations(ksvc: dict) -> list[str]:
    """Volume names are DNS-1123 labels, unique and each mounted; each mount names a volume,
    has an absolute, unique, non-reserved path; mounts of volumes other than emptyDir / PVC /
    ephemeral are readOnly; an emptyDir's medium is "" or Memory; one source per volume."""
    out = []
    name = _name(ksvc)
    vols: dict[str, dict] = {}
    for v in _pod(ksvc).get("volumes") or []:
        vn = v.get("name", "")
        if not _DNS1123_LABEL.match(vn):
            out.append(f"{name}: volume name {vn!r} is not a DNS-1123 label")
        if vn in vols:
            out.append(f"{name}: duplicate volume {vn!r}")
        if len([k for k in v if k != "name"]) != 1:
            out.append(f"{name}: volume {vn!r} needs exactly one source")
        if "emptyDir" in v and (v["emptyDir"] or {}).get("medium", "") not in ("", "Memory"):
            out.append(f"{name}: volume {vn!r} emptyDir medium must be empty or Memory")
        vols[vn] = v
    mounted = set()
    for c in _containers(ksvc):
        paths = set()
        for m in c.get("volumeMounts") or []:
            where = f"{name} container {c.get('name')} mount {m.get('name')!r}"
            mounted.add(m.get("name"))
            v = vols.get(m.get("name"))
            if v is None:
                out.append(f"{where}: no such volume")
                continue
            mp = m.get("mountPath", "")
            clean = str(PurePosixPath(mp)) if mp else ""
            if not mp.startswith("/"):
                out.append(f"{where}: mountPath {mp!r} is not absolute")
            elif clean in RESERVED_MOUNT_PATHS:
                out.append(f"{where}: mountPath {clean} is reserved")
            elif clean in paths:
                out.append(f"{where}: mountPath {clean} mounted twice")
            paths.add(clean)
            vt = volume_type(v)
            if vt not in WRITABLE_VOLUME_TYPES and not m.get("readOnly"):
                out.append(f"{where}: a {vt} volume must be mounted readOnly: true (Knative's defaulting makes it read-only anyway)")
            if vt == "persistentVolumeClaim" and v[vt].get("readOnly") and not m.get("readOnly"):
                out.append(f"{where}: the claim is readOnly but the mount is not")
    for vn in sorted(set(vols) - mounted):
        out.append(f"{name}: volume {vn!r} is not mounted (the webhook rejects it)")
    return out


# ----------------------------------------------------------------------------- Serving: feature flags

#: PodSpec fields the webhook admits only with a config-features flag (``PodSpecMask``).
_POD_FIELD_FEATURES = {
    "affinity": "kubernetes.podspec-affinity",
    "topologySpreadConstraints": "kubernetes.podspec-topologyspreadconstraints",
    "hostAliases": "kubernetes.podspec-hostaliases",
    "nodeSelector": "kubernetes.podspec-nodeselector",
    "runtimeClassName": "kubernetes.podspec-runtimeclassname",
    "tolerations": "kubernetes.podspec-tolerations",
    "securityContext": "kubernetes.podspec-securitycontext",
    "shareProcessNamespace": "kubernetes.podspec-shareprocessnamespace",
    "priorityClassName": "kubernetes.podspec-priorityclassname",
    "schedulerName": "kubernetes.podspec-schedulername",
    "initContainers": "kubernetes.podspec-init-containers",
    "dnsPolicy": "kubernetes.podspec-dnspolicy",
    "dnsConfig": "kubernetes.podspec-dnsconfig",
    "hostIPC": "kubernetes.podspec-hostipc",
    "hostPID": "kubernetes.podspec-hostpid",
    "hostNetwork": "kubernetes.podspec-hostnetwork",
}
#: Volume sources behind a flag (``VolumeSourceMask`` / ``validateVolume``).
_VOLUME_FEATURES = {
    "emptyDir": "kubernetes.podspec-volumes-emptydir",
    "persistentVolumeClaim": "kubernetes.podspec-persistent-volume-claim",
    "hostPath": "kubernetes.podspec-volumes-hostpath",
    "csi": "kubernetes.podspec-volumes-csi",
    "ephemeral": "kubernetes.podspec-volumes-ephemeral",
    "image": "kubernetes.podspec-volumes-image",
}


def required_features(ksvc: dict) -> dict[str, str]:
    """Serving feature flags (config-features) the Service needs: ``{flag: why}``."""
    pod = _pod(ksvc)
    need = {flag: f"spec.template.spec.{f}" for f, flag in _POD_FIELD_FEATURES.items() if pod.get(f)}
    vols = {v.get("name"): v for v in pod.get("volumes") or []}
    for v in vols.values():
        flag = _VOLUME_FEATURES.get(volume_type(v))
        if flag:
            need[flag] = f"volume {v.get('name')} ({volume_type(v)})"
    for c in pod.get("containers") or []:
        for m in c.get("volumeMounts") or []:
            v = vols.get(m.get("name")) or {}
            if "persistentVolumeClaim" in v and not m.get("readOnly") and not v["persistentVolumeClaim"].get("readOnly"):
                need["kubernetes.podspec-persistent-volume-write"] = f"writable mount of claim volume {m.get('name')}"
            if "mountPropagation" in m:
                need["kubernetes.podspec-volumes-mount-propagation"] = f"mount {m.get('name')}"
        for e in c.get("env") or []:
            src = e.get("valueFrom") or {}
            if "fieldRef" in src or "resourceFieldRef" in src:
                need["kubernetes.podspec-fieldref"] = f"env {e.get('name')}"
        if ((c.get("securityContext") or {}).get("capabilities") or {}).get("add"):
            need["kubernetes.containerspec-addcapabilities"] = f"container {c.get('name')} capabilities.add"
    if len(pod.get("containers") or []) > 1:
        need["multi-container"] = "more than one container"
    return need


def feature_violations(ksvc: dict, enabled: set[str]) -> list[str]:
    """Every flag :func:`required_features` names is in ``enabled`` (lower-case flag names)."""
    return [f"{_name(ksvc)}: {why} needs the Serving feature {flag}: enabled (config-features)"
            for flag, why in sorted(required_features(ksvc).items()) if flag not in enabled]


# ----------------------------------------------------------------------------- Serving: annotations

AUTOSCALING = "autoscaling.knative.dev/"


def annotation_violations(ksvc: dict, *, allow_zero_initial_scale: bool, max_scale_limit: int = 0) -> list[str]:
    """The template's autoscaling and serving annotations hold values the webhook admits
    (``autoscaling.ValidateAnnotations``, ``validateProgressDeadlineAnnotation``), and none sits
    on the Service's own metadata (the webhook rejects autoscaling annotations there)."""
    out = []
    name = _name(ksvc)
    for k in (ksvc.get("metadata", {}).get("annotations") or {}):
        if k.startswith(AUTOSCALING):
            out.append(f"{name}: {k} belongs under spec.template.metadata.annotations")
    a = (ksvc["spec"]["template"].get("metadata") or {}).get("annotations") or {}

    def integer(key):
        v = a.get(AUTOSCALING + key)
        if v is None:
            return None
        if not re.fullmatch(r"\d+", str(v)) or int(v) > 2**31 - 1:
            out.append(f"{name}: {AUTOSCALING}{key}={v!r} is not an integer >= 0")
            return None
        return int(v)

    lo, hi = integer("min-scale"), integer("max-scale")
    if lo is not None and hi and hi < lo:
        out.append(f"{name}: max-scale {hi} < min-scale {lo}")
    if max_scale_limit and (hi is None or hi == 0 or hi > max_scale_limit):
        out.append(f"{name}: max-scale must be 1..{max_scale_limit} (config-autoscaler max-scale-limit)")
    init = integer("initial-scale")
    if init == 0 and not allow_zero_initial_scale:
        out.append(f"{name}: initial-scale 0 needs allow-zero-initial-scale: true in config-autoscaler")
    if (m := a.get(AUTOSCALING + "metric")) is not None:
        cls = a.get(AUTOSCALING + "class", "kpa.autoscaling.knative.dev")
        if cls == "kpa.autoscaling.knative.dev" and m not in ("concurrency", "rps"):
            out.append(f"{name}: metric {m!r} is not concurrency or rps (KPA)")
    for key, lo_, hi_ in (("target", 0.01, None), ("target-utilization-percentage", 1, 100)):
        v = a.get(AUTOSCALING + key)
        if v is None:
            continue
        try:
            f = float(v)
        except ValueError:
            out.append(f"{name}: {key}={v!r} is not a number")
            continue
        if f < lo_ or (hi_ is not None and f > hi_):
            out.append(f"{name}: {key}={v} outside [{lo_}, {hi_}]")
    for key in ("scale-to-zero-pod-retention-period", "scale-down-delay", "window"):
        v = a.get(AUTOSCALING + key)
        if v is None:
            continue
        s = go_duration_s(v)
        if s is None or s < 0 or s > WINDOW_MAX_S:
            out.append(f"{name}: {key}={v!r} must be a Go duration within 0..1h")
    pd = a.get("serving.knative.dev/progress-deadline")
    if pd is not None:
        s = go_duration_s(pd)
        if s is None or s <= 0 or s != int(s):
            out.append(f"{name}: progress-deadline={pd!r} must be a positive duration in whole seconds")
    return out


def revision_limit_violations(ksvc: dict, *, max_timeout_s: int,
                              max_concurrency: int = STOCK_CONTAINER_CONCURRENCY_MAX) -> list[str]:
    """``timeoutSeconds`` <= config-defaults ``max-revision-timeout-seconds`` and
    ``containerConcurrency`` within 0..``container-concurrency-max-limit``."""
    spec = _pod(ksvc)
    out = []
    t = spec.get("timeoutSeconds")
    if t is not None and not 0 <= t <= max_timeout_s:
        out.append(f"{_name(ksvc)}: timeoutSeconds {t} > max-revision-timeout-seconds {max_timeout_s}")
    cc = spec.get("containerConcurrency")
    if cc is not None and not 0 <= cc <= max_concurrency:
        out.append(f"{_name(ksvc)}: containerConcurrency {cc} outside 0..{max_concurrency}")
    return out


def config_defaults(data: dict | None = None) -> dict[str, int]:
    """The request limits of config-defaults as Knative parses them (``NewDefaultsConfigFromMap``):
    ``data`` is the ConfigMap's data (terraform's ``spec.config.defaults``; None or {}: a stock
    install). ``revision-response-start-timeout-seconds`` defaults to ``revision-timeout-seconds``."""
    d = data or {}
    timeout = int(d.get("revision-timeout-seconds", STOCK_REVISION_TIMEOUT_S))
    return {"revision-timeout-seconds": timeout,
            "max-revision-timeout-seconds": int(d.get("max-revision-timeout-seconds", STOCK_MAX_REVISION_TIMEOUT_S)),
            "revision-response-start-timeout-seconds": int(d.get("revision-response-start-timeout-seconds", timeout)),
            "revision-idle-timeout-seconds": int(d.get("revision-idle-timeout-seconds", 0))}


def config_defaults_violations(data: dict | None) -> list[str]:
    """What Knative refuses in config-defaults (its ConfigMap webhook rejects the apply):
    ``revision-timeout-seconds`` above ``max-revision-timeout-seconds``, and a non-zero
    ``revision-response-start-timeout-seconds`` or ``revision-idle-timeout-seconds`` above
    ``revision-timeout-seconds``."""
    c = config_defaults(data)
    t = c["revision-timeout-seconds"]
    out = []
    if t > c["max-revision-timeout-seconds"]:
        out.append(f"config-defaults: revision-timeout-seconds {t} > max-revision-timeout-seconds "
                   f"{c['max-revision-timeout-seconds']}")
    for key in ("revision-response-start-timeout-seconds", "revision-idle-timeout-seconds"):
        if 0 < c[key] and c[key] > t:
            out.append(f"config-defaults: {key} {c[key]} > revision-timeout-seconds {t}")
    return out


def request_limits(ksvc: dict, defaults: dict | None = None) -> dict[str, tuple[int, str]]:
    """The limits queue-proxy and the activator apply to the revision's requests, as Knative's
    defaulting (``RevisionSpec.SetDefaults``) fills them in from config-defaults ``defaults``
    (see :func:`config_defaults`): ``{"timeoutSeconds" | "responseStartTimeoutSeconds" |
    "idleTimeoutSeconds": (seconds, where from)}``, 0 meaning no limit. An unset
    response-start (idle) limit takes the config-defaults value only when that is non-zero
    and below the revision's ``timeoutSeconds``; else it stays unset (no limit)."""
    c = config_defaults(defaults)
    spec = _pod(ksvc)
    out = {}
    t = spec.get("timeoutSeconds") or 0
    out["timeoutSeconds"] = (t, "set") if t else (c["revision-timeout-seconds"], "config-defaults revision-timeout-seconds")
    t = out["timeoutSeconds"][0]
    for field, key in (("responseStartTimeoutSeconds", "revision-response-start-timeout-seconds"),
                       ("idleTimeoutSeconds", "revision-idle-timeout-seconds")):
        if spec.get(field) is not None:
            out[field] = (int(spec[field]), "set")
        elif c[key] != 0 and c[key] < t:
            out[field] = (c[key], f"config-defaults {key}")
        else:
            out[field] = (0, "unset")
    return out


def response_start_violations(ksvc: dict, *, defaults: dict | None = None) -> list[str]:
    """The revision's response-start and idle limits, set or inherited from config-defaults
    (:func:`request_limits`), are none or equal to its ``timeoutSeconds``: the functions'
    HTTP binding sends no byte before the handler's result, so a shorter limit answers 504 to
    every longer request, and to a request the activator holds while the revision scales from
    zero (its hold ends at the same limit); a longer one never applies (the request timeout
    ends first)."""
    lim = request_limits(ksvc, defaults)
    t = lim["timeoutSeconds"][0]
    out = []
    for field in ("responseStartTimeoutSeconds", "idleTimeoutSeconds"):
        v, src = lim[field]
        if v == 0 or v == t:
            continue
        if src.startswith("config-defaults"):
            out.append(f"{_name(ksvc)}: {field} unset, so Knative copies {src.split(' ', 1)[1]} {v} into the "
                       f"revision (< timeoutSeconds {t}): queue-proxy and the activator answer 504 to a request "
                       f"with no response byte after {v} s; set {field}: {t}")
        elif v < t:
            out.append(f"{_name(ksvc)}: {field} {v} < timeoutSeconds {t}: the function sends nothing before its "
                       f"result, so a request longer than {v} s (or a scale from zero) gets 504")
        else:
            out.append(f"{_name(ksvc)}: {field} {v} > timeoutSeconds {t} never applies; make it {t}")
    return out


def image_violations(ksvc: dict, skip_tag_resolving: set[str]) -> list[str]:
    """Images whose registry Knative would contact to resolve the tag into a digest: the
    controller has no pull credentials of its own, so each registry must be listed in
    config-deployment ``registries-skipping-tag-resolving`` (or the revision fails with
    ``ContainerMissing``)."""
    out = []
    for c in _containers(ksvc):
        image = c.get("image", "")
        host = image.split("/", 1)[0] if "/" in image else "index.docker.io"
        if "@sha256:" in image:
            continue
        if host not in skip_tag_resolving:
            out.append(f"{_name(ksvc)}: image {image!r}: registry {host} is not in registries-skipping-tag-resolving")
    return out


def metadata_violations(ksvc: dict) -> list[str]:
    """The visibility label holds the one value Knative knows (``cluster-local``); the
    template sets no ``serving.knative.dev/*`` label (Knative owns those on revisions)."""
    out = []
    labels = ksvc.get("metadata", {}).get("labels") or {}
    vis = labels.get("networking.knative.dev/visibility")
    if vis is not None and vis != "cluster-local":
        out.append(f"{_name(ksvc)}: networking.knative.dev/visibility={vis!r}; only cluster-local exists")
    tlabels = (ksvc["spec"]["template"].get("metadata") or {}).get("labels") or {}
    for k in tlabels:
        if k.startswith("serving.knative.dev/"):
            out.append(f"{_name(ksvc)}: template label {k} is set by Knative")
    return out


# ----------------------------------------------------------------------------- Eventing


def _filter_attr_names(expr: dict):
    for dialect, value in expr.items():
        if dialect in ("exact", "prefix", "suffix"):
            yield from (value or {})
        elif dialect in ("all", "any"):
            for sub in value or []:
                yield from _filter_attr_names(sub)
        elif dialect == "not":
            yield from _filter_attr_names(value or {})


def trigger_filter_violations(trigger: dict) -> list[str]:
    """Attribute names in exact / prefix / suffix filters (nested too) match
    ``^[a-z][a-z0-9]*$``, as the webhook requires (a CloudEvents extension such as
    ``trainershard`` may hold no ``_`` or capitals)."""
    spec = trigger.get("spec") or {}
    names = list((spec.get("filter") or {}).get("attributes") or {})
    for f in spec.get("filters") or []:
        names += list(_filter_attr_names(f))
    return [f"{_name(trigger)}: filter attribute {n!r} must match {ATTRIBUTE_NAME.pattern}"
            for n in names if not ATTRIBUTE_NAME.match(n)]


def delivery_violations(obj: dict, *, enabled: set[str] = frozenset({"delivery-timeout"}),
                        require_retry_and_timeout: bool = True) -> list[str]:
    """``spec.delivery``: retry >= 0, backoffPolicy linear/exponential, ISO-8601 backoffDelay,
    a non-zero ISO-8601 timeout (feature delivery-timeout), no retryAfterMax without
    delivery-retryafter; on a Trigger, retry and timeout set (eventing-natss makes them the
    consumer's MaxDeliver = retry + 1 and AckWait = timeout + 0.5 s; without them MaxDeliver is
    unlimited)."""
    out = []
    name = _name(obj)
    d = (obj.get("spec") or {}).get("delivery")
    if d is None:
        return [f"{name}: no spec.delivery"] if require_retry_and_timeout else []
    if require_retry_and_timeout:
        for k in ("retry", "timeout"):
            if k not in d:
                out.append(f"{name}: delivery.{k} unset")
    if "retry" in d and not (isinstance(d["retry"], int) and d["retry"] >= 0):
        out.append(f"{name}: delivery.retry {d['retry']!r} must be an integer >= 0")
    if "backoffPolicy" in d and d["backoffPolicy"] not in ("linear", "exponential"):
        out.append(f"{name}: delivery.backoffPolicy {d['backoffPolicy']!r}")
    if "backoffDelay" in d and not _ISO8601.match(str(d["backoffDelay"])):
        out.append(f"{name}: delivery.backoffDelay {d['backoffDelay']!r} is not ISO 8601")
    if "timeout" in d:
        if "delivery-timeout" not in enabled:
            out.append(f"{name}: delivery.timeout needs the Eventing feature delivery-timeout")
        if not _ISO8601.match(str(d["timeout"])) or not re.search(r"[1-9]", str(d["timeout"])):
            out.append(f"{name}: delivery.timeout {d['timeout']!r} must be a non-zero ISO 8601 duration")
    if "retryAfterMax" in d and "delivery-retryafter" not in enabled:
        out.append(f"{name}: delivery.retryAfterMax needs the Eventing feature delivery-retryafter")
    if d.get("format") not in (None, "binary", "json"):
        out.append(f"{name}: delivery.format {d['format']!r}")
    return out


def _destination_violations(where: str, dest: dict | None, namespace: str | None) -> list[str]:
    if dest is None:
        return []
    ref, uri = dest.get("ref"), dest.get("uri")
    absolute = isinstance(uri, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", uri)
    if ref is None and uri is None:
        return [f"{where}: needs ref or uri"]
    if ref is not None and absolute:
        return [f"{where}: an absolute uri is not allowed next to ref"]
    if ref is None and not absolute:
        return [f"{where}: a relative uri needs a ref"]
    out = []
    if ref is not None:
        for k in ("apiVersion", "kind", "name"):
            if not ref.get(k):
                out.append(f"{where}: ref.{k} missing")
        if ref.get("namespace") not in (None, namespace):
            out.append(f"{where}: ref.namespace {ref['namespace']!r} differs from the object's")
    return out


def destination_violations(obj: dict) -> list[str]:
    """Subscriber and dead-letter sinks: a ref, optionally with a *relative* uri (resolved
    against the ref's address, query kept), in the object's own namespace."""
    spec = obj.get("spec") or {}
    ns = obj.get("metadata", {}).get("namespace")
    out = _destination_violations(f"{_name(obj)} subscriber", spec.get("subscriber"), ns) if obj.get("kind") == "Trigger" else []
    out += _destination_violations(f"{_name(obj)} deadLetterSink", (spec.get("delivery") or {}).get("deadLetterSink"), ns)
    return out


def dead_letter_sink_violations(obj: dict) -> list[str]:
    """A Broker's or Trigger's ``deadLetterSink`` is a plain absolute URI, never a ``ref``: the
    Broker reconciler resolves the ref before anything else and, when that fails, marks
    ``DeadLetterSinkResolved`` False and stops (no address, not Ready), and the MT broker's
    Trigger reconciler creates no Subscription while the Broker is not Ready, nor while its own
    sink ref does not resolve. A Knative Service has no address before its first ready
    revision, so a ref to the gateway makes every function wait on the gateway."""
    d = ((obj.get("spec") or {}).get("delivery") or {}).get("deadLetterSink")
    if d is None or "ref" not in d:
        return []
    ref = d["ref"] or {}
    what = "every Trigger's Subscription" if obj.get("kind") == "Broker" else "its Subscription"
    return [f"{_name(obj)}: deadLetterSink is a ref to {ref.get('kind')}/{ref.get('name')}: {what} waits until "
            f"that has an address (a Knative Service: its first ready revision); give its address as a uri"]


def broker_violations(broker: dict, configmaps: dict[str, dict]) -> list[str]:
    """A Broker names its class (annotation ``eventing.knative.dev/broker.class``; immutable) and
    its ``spec.config`` ConfigMap exists in the same build with a ``channel-template-spec``."""
    out = []
    ann = broker.get("metadata", {}).get("annotations") or {}
    if not ann.get("eventing.knative.dev/broker.class"):
        out.append(f"{_name(broker)}: eventing.knative.dev/broker.class missing")
    cfg = (broker.get("spec") or {}).get("config")
    if cfg is not None:
        if (cfg.get("kind"), cfg.get("apiVersion")) != ("ConfigMap", "v1"):
            out.append(f"{_name(broker)}: spec.config must be a v1 ConfigMap for MTChannelBasedBroker")
        elif cfg.get("name") not in configmaps:
            out.append(f"{_name(broker)}: spec.config ConfigMap {cfg.get('name')!r} is not in the build")
        elif "channel-template-spec" not in (configmaps[cfg["name"]].get("data") or {}):
            out.append(f"{_name(broker)}: ConfigMap {cfg['name']} has no channel-template-spec key")
    return out
