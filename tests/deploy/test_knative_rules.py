"""The Knative controllers' rules (tests/deploy/knative_rules.py, docs/knative-review.md) over
every rendered overlay, offline.

Nothing here talks to a cluster: the overlays are built with kustomize (as in
test_deploy_manifests.py), and what each target cluster enables (Serving feature flags,
config-defaults, config-autoscaler, config-deployment, Eventing features) comes from the
configuration terraform installs on GKE (terraform/manifests/*.tftpl) or, for cpu-dev, from
a stock Knative install plus the flags docs/deploy-gke.md tells the user to enable. Each rule
also gets a manifest that breaks it, so a rule that silently stopped checking would fail here.
"""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/ci-deploy-tools.sh")

import knative_rules as kr  # noqa: E402
from test_deploy_manifests import APP_OVERLAYS, build, ksvcs, objects, triggers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "terraform"


# ----------------------------------------------------------------------------- target clusters


def _render(name: str, **values: str) -> dict:
    text = (TF / "manifests" / name).read_text()
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    assert "${" not in text, f"{name}: unrendered variable"
    return yaml.safe_load(text)


def _flags(d: dict | None) -> set[str]:
    return {k.lower() for k, v in (d or {}).items() if str(v).lower() == "enabled"}


REGION_REGISTRY = "us-central1-docker.pkg.dev"


def target(overlay: str) -> dict:
    """What the cluster an overlay is meant for admits (see the module doc)."""
    if overlay.endswith("gke-gpu"):
        ks = _render("knative-serving.yaml.tftpl", version="1.23", domain="example.com",
                     registry_host=REGION_REGISTRY)["spec"]["config"]
        ke = _render("knative-eventing.yaml.tftpl", version="1.22")["spec"]["config"]
        return {
            "features": kr.SERVING_DEFAULT_FEATURES | _flags(ks.get("features")),
            "allow_zero_initial_scale": ks["autoscaler"].get("allow-zero-initial-scale") == "true",
            "max_timeout_s": int(ks["defaults"]["max-revision-timeout-seconds"]),
            "skip_tag_resolving": set(ks["deployment"]["registries-skipping-tag-resolving"].split(",")),
            "eventing_features": {"delivery-timeout"} | _flags(ke.get("features")),
            "defaults": ks["defaults"],
        }
    # cpu-dev: a stock Knative with the flags the local-cluster section of docs/deploy-gke.md names
    section = (ROOT / "docs" / "deploy-gke.md").read_text().split("## A local cluster (cpu-dev)", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(kubernetes\.[a-z.-]+)`", section))
    assert documented, "docs/deploy-gke.md: the cpu-dev section names no Serving feature"
    return {"features": kr.SERVING_DEFAULT_FEATURES | documented, "allow_zero_initial_scale": False,
            "max_timeout_s": kr.STOCK_MAX_REVISION_TIMEOUT_S, "skip_tag_resolving": kr.DEFAULT_SKIP_TAG_RESOLVING,
            "eventing_features": {"delivery-timeout"}, "defaults": {}}


def gke_images(docs):
    """The gke-gpu build with OPENRL_IMAGE_REPO as terraform/app.tf fills it in."""
    app_tf = (TF / "app.tf").read_text()
    m = re.search(r'"OPENRL_IMAGE_REPO"\s*=\s*"\$\{local\.registry_host\}/([^"]*)"', app_tf)
    assert m, "terraform/app.tf: OPENRL_IMAGE_REPO no longer starts with local.registry_host"
    assert 'registry_host = "${var.region}-docker.pkg.dev"' in (TF / "knative.tf").read_text()
    text = yaml.safe_dump_all(docs).replace("OPENRL_IMAGE_REPO", f"{REGION_REGISTRY}/project/openrl")
    return tuple(d for d in yaml.safe_load_all(text) if d)


def configmaps(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in objects(docs, "ConfigMap")}


# ----------------------------------------------------------------------------- the rules, per overlay


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_every_probe_reaches_its_container_by_a_numeric_port(overlay):
    """The issue-23 rule: no Knative Service of ours declares a probe that, in the pod Knative
    creates, would use port 0 (startup probe without a port: the Deployment is rejected), a
    port name Knative renamed, or a port nothing listens on."""
    services = ksvcs(build(overlay))
    assert services
    for k in services.values():
        assert kr.probe_violations(k) == []
        for c in k["spec"]["template"]["spec"]["containers"]:
            for probe in kr.PROBES:
                if probe in c:
                    assert isinstance(c[probe]["httpGet"]["port"], int), (k["metadata"]["name"], probe)


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_containers_ports_env_and_names_are_what_knative_admits(overlay):
    docs = build(overlay)
    for k in ksvcs(docs).values():
        assert kr.container_violations(k, configmaps(docs)) == []
        assert kr.metadata_violations(k) == []


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_volumes_and_mounts_are_what_knative_admits(overlay):
    for k in ksvcs(build(overlay)).values():
        assert kr.volume_violations(k) == []


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_target_cluster_enables_every_feature_flag_the_services_need(overlay):
    t = target(overlay)
    for k in ksvcs(build(overlay)).values():
        assert kr.feature_violations(k, t["features"]) == []


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_annotations_and_revision_limits_fit_the_target_cluster(overlay):
    t = target(overlay)
    for k in ksvcs(build(overlay)).values():
        assert kr.annotation_violations(k, allow_zero_initial_scale=t["allow_zero_initial_scale"]) == []
        assert kr.revision_limit_violations(k, max_timeout_s=t["max_timeout_s"]) == []


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_no_revision_inherits_a_shorter_response_start_limit(overlay):
    """Issue 34: every revision's response-start (and idle) limit, set or copied from the
    target cluster's config-defaults, is its whole timeoutSeconds, and the cluster's
    config-defaults is one Knative accepts."""
    t = target(overlay)
    assert kr.config_defaults_violations(t["defaults"]) == []
    for k in ksvcs(build(overlay)).values():
        assert kr.response_start_violations(k, defaults=t["defaults"]) == []
        lim = kr.request_limits(k, t["defaults"])
        assert lim["responseStartTimeoutSeconds"] == (lim["timeoutSeconds"][0], "set"), k["metadata"]["name"]


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_images_skip_tag_resolution(overlay):
    docs = build(overlay)
    if overlay.endswith("gke-gpu"):
        docs = gke_images(docs)
    t = target(overlay)
    for k in ksvcs(docs).values():
        assert kr.image_violations(k, t["skip_tag_resolving"]) == []


@pytest.mark.parametrize("overlay", APP_OVERLAYS)
def test_triggers_and_broker_are_what_eventing_admits(overlay):
    docs = build(overlay)
    t = target(overlay)
    cms = configmaps(docs)
    trigs = triggers(docs)
    assert trigs
    for trig in trigs.values():
        assert kr.trigger_filter_violations(trig) == []
        assert kr.delivery_violations(trig, enabled=t["eventing_features"]) == []
        assert kr.destination_violations(trig) == []
        assert kr.dead_letter_sink_violations(trig) == []
    (broker,) = objects(docs, "Broker", "eventing.knative.dev")
    assert kr.broker_violations(broker, cms) == []
    assert kr.delivery_violations(broker, enabled=t["eventing_features"]) == []
    assert kr.destination_violations(broker) == []
    assert kr.dead_letter_sink_violations(broker) == []


# ----------------------------------------------------------------------------- each rule catches its bug


@pytest.fixture(scope="module")
def sampler():
    return ksvcs(build("knative/overlays/gke-gpu"))["sampler"]


def _mutate(obj: dict, fn) -> dict:
    obj = copy.deepcopy(obj)
    fn(obj)
    return obj


def _c(k: dict) -> dict:
    return k["spec"]["template"]["spec"]["containers"][0]


def test_probe_rule_catches_the_port_knative_does_not_fill_in(sampler):
    """The manifests before issue 23: a startup probe with a path and no port (port 0 in the
    Deployment); a startup probe by the port's name (renamed user-port by Knative); a probe
    port that is not the container's; a name the webhook refuses."""
    no_port = _mutate(sampler, lambda k: _c(k)["startupProbe"]["httpGet"].pop("port"))
    assert any("reaches port 0" in v for v in kr.probe_violations(no_port)), kr.probe_violations(no_port)
    named = _mutate(sampler, lambda k: _c(k)["startupProbe"]["httpGet"].__setitem__("port", "http1"))
    assert any("unresolvable name 'http1'" in v for v in kr.probe_violations(named))
    other = _mutate(sampler, lambda k: _c(k)["readinessProbe"]["httpGet"].__setitem__("port", 9000))
    assert any("probes port 9000" in v for v in kr.probe_violations(other))
    bad_name = _mutate(sampler, lambda k: _c(k)["livenessProbe"]["httpGet"].__setitem__("port", "web"))
    assert any("webhook rejects" in v for v in kr.probe_violations(bad_name))
    quoted = _mutate(sampler, lambda k: _c(k)["startupProbe"]["httpGet"].__setitem__("port", "8080"))
    assert any("webhook rejects" in v for v in kr.probe_violations(quoted))  # a name to Kubernetes
    # liveness and readiness without a port are fine: Knative fills in the serving port
    implicit = _mutate(sampler, lambda k: [_c(k)[p]["httpGet"].pop("port") for p in ("livenessProbe", "readinessProbe")])
    assert kr.probe_violations(implicit) == []


def test_container_rules_catch_reserved_ports_env_and_names(sampler):
    cms = {}
    bad = _mutate(sampler, lambda k: (_c(k)["ports"][0].__setitem__("containerPort", 8012),
                                      _c(k)["env"].append({"name": "K_SERVICE", "value": "x"}),
                                      _c(k).__setitem__("name", "queue-proxy")))
    v = " | ".join(kr.container_violations(bad, cms))
    assert "8012" in v and "K_SERVICE" in v and "reserved for Knative's sidecar" in v and "--port 8080" in v
    named = _mutate(sampler, lambda k: _c(k)["ports"][0].__setitem__("name", "http"))
    assert any("port name 'http'" in x for x in kr.container_violations(named, cms))
    via_cm = _mutate(sampler, lambda k: _c(k).__setitem__("envFrom", [{"configMapRef": {"name": "env"}}]))
    assert any("PORT is reserved" in x for x in kr.container_violations(via_cm, {"env": {"data": {"PORT": "1"}}}))


def test_volume_rules_catch_writable_config_and_unmounted_volumes(sampler):
    bad = _mutate(sampler, lambda k: (
        [m.__setitem__("readOnly", False) for m in _c(k)["volumeMounts"] if m["name"] == "models"],
        k["spec"]["template"]["spec"]["volumes"].append({"name": "spare", "emptyDir": {}}),
        _c(k)["volumeMounts"].append({"name": "tmp", "mountPath": "/dev"})))
    v = " | ".join(kr.volume_violations(bad))
    assert "configMap volume must be mounted readOnly" in v and "'spare' is not mounted" in v
    assert "/dev is reserved" in v


def test_feature_rule_names_the_flag_each_field_needs(sampler):
    need = kr.required_features(sampler)
    assert {"kubernetes.podspec-nodeselector", "kubernetes.podspec-tolerations", "kubernetes.podspec-volumes-csi",
            "kubernetes.podspec-volumes-emptydir"} <= set(need)
    stock = kr.feature_violations(sampler, kr.SERVING_DEFAULT_FEATURES)
    assert any("kubernetes.podspec-volumes-csi" in v for v in stock) and len(stock) == 3
    cpu = ksvcs(build("knative/overlays/cpu-dev"))["sampler"]
    assert set(kr.required_features(cpu)) >= {"kubernetes.podspec-persistent-volume-claim",
                                              "kubernetes.podspec-persistent-volume-write"}


def test_annotation_rules_catch_what_the_webhook_refuses(sampler):
    a = lambda k: k["spec"]["template"]["metadata"]["annotations"]  # noqa: E731
    assert any("allow-zero-initial-scale" in v for v in kr.annotation_violations(sampler, allow_zero_initial_scale=False))
    bad = _mutate(sampler, lambda k: (a(k).__setitem__("autoscaling.knative.dev/max-scale", "0"),
                                      a(k).__setitem__("autoscaling.knative.dev/min-scale", "2"),
                                      a(k).__setitem__("autoscaling.knative.dev/scale-to-zero-pod-retention-period", "2h"),
                                      a(k).__setitem__("autoscaling.knative.dev/metric", "memory"),
                                      a(k).__setitem__("serving.knative.dev/progress-deadline", "1.5s"),
                                      k["metadata"].setdefault("annotations", {}).__setitem__(
                                          "autoscaling.knative.dev/min-scale", "1")))
    v = " | ".join(kr.annotation_violations(bad, allow_zero_initial_scale=True))
    for want in ("within 0..1h", "metric 'memory'", "whole seconds", "belongs under spec.template"):
        assert want in v, (want, v)
    assert "max-scale 1 < min-scale" not in v  # max-scale 0 means unlimited
    assert kr.revision_limit_violations(sampler, max_timeout_s=900) == []
    # 900 s is over a stock install's 600 s cap: GKE needs terraform's max-revision-timeout-seconds
    assert any("timeoutSeconds 900 > max-revision-timeout-seconds 600" in v
               for v in kr.revision_limit_violations(sampler, max_timeout_s=600))


def test_response_start_rule_catches_the_inherited_300_s(sampler):
    """What the real Serving 1.23 controller did to the manifests before issue 34: without
    responseStartTimeoutSeconds, terraform's config-defaults (revision-timeout-seconds 300, and
    so a response-start default of 300) gave the gke-gpu sampler 900 / 300 and cpu-dev's
    revisions 600 / 300 (REVISION_TIMEOUT_SECONDS / REVISION_RESPONSE_START_TIMEOUT_SECONDS in
    queue-proxy). The rule names the inherited value; a default that is not below the timeout,
    or 0, is not copied; an explicit shorter or longer value and an idle limit are caught too."""
    gke = target("knative/overlays/gke-gpu")["defaults"]
    pop = lambda k: k["spec"]["template"]["spec"].pop("responseStartTimeoutSeconds")  # noqa: E731
    bare = _mutate(sampler, pop)
    inherited = (300, "config-defaults revision-response-start-timeout-seconds")
    assert kr.request_limits(bare, gke) == {"timeoutSeconds": (900, "set"), "responseStartTimeoutSeconds": inherited,
                                            "idleTimeoutSeconds": (0, "unset")}
    (v,) = kr.response_start_violations(bare, defaults=gke)
    assert "revision-response-start-timeout-seconds 300" in v and "set responseStartTimeoutSeconds: 900" in v
    cpu = _mutate(ksvcs(build("knative/overlays/cpu-dev"))["trainer-shard-0"], pop)
    assert kr.request_limits(cpu, {})["responseStartTimeoutSeconds"][0] == 300  # a stock install: 600 / 300
    assert kr.response_start_violations(cpu, defaults={})
    # a cluster default the revision's timeout does not exceed, or 0 (no limit), is not copied
    assert kr.response_start_violations(bare, defaults={**gke, "revision-timeout-seconds": "900",
                                                        "revision-response-start-timeout-seconds": "900"}) == []
    assert kr.response_start_violations(bare, defaults={**gke, "revision-response-start-timeout-seconds": "0"}) == []
    short = _mutate(sampler, lambda k: k["spec"]["template"]["spec"].__setitem__("responseStartTimeoutSeconds", 60))
    assert any("responseStartTimeoutSeconds 60 < timeoutSeconds 900" in v
               for v in kr.response_start_violations(short, defaults=gke))
    long_ = _mutate(sampler, lambda k: k["spec"]["template"]["spec"].__setitem__("responseStartTimeoutSeconds", 1200))
    assert any("never applies" in v for v in kr.response_start_violations(long_, defaults=gke))
    idle = kr.response_start_violations(sampler, defaults={**gke, "revision-idle-timeout-seconds": "120"})
    assert any("idleTimeoutSeconds unset" in v and "revision-idle-timeout-seconds 120" in v for v in idle)
    # config-defaults Knative refuses
    assert kr.config_defaults_violations({"revision-timeout-seconds": "300",
                                          "revision-response-start-timeout-seconds": "900"}) == [
        "config-defaults: revision-response-start-timeout-seconds 900 > revision-timeout-seconds 300"]
    assert kr.config_defaults_violations({"revision-timeout-seconds": "900"}) == [
        "config-defaults: revision-timeout-seconds 900 > max-revision-timeout-seconds 600"]  # stock max


def test_eventing_rules_catch_bad_filters_deliveries_and_sinks():
    trig = copy.deepcopy(triggers(build("knative/overlays/cpu-dev"))["trainer-shard-0"])
    trig["spec"]["filters"][0] = {"exact": {"trainer_shard": "0"}}
    assert any("trainer_shard" in v for v in kr.trigger_filter_violations(trig))
    trig["spec"]["delivery"].pop("retry")
    trig["spec"]["delivery"]["timeout"] = "30m"
    trig["spec"]["delivery"]["retryAfterMax"] = "PT1M"
    v = " | ".join(kr.delivery_violations(trig))
    assert "delivery.retry unset" in v and "'30m'" in v and "delivery-retryafter" in v
    trig["spec"]["delivery"]["deadLetterSink"] = {"ref": {"apiVersion": "serving.knative.dev/v1", "kind": "Service",
                                                          "name": "gateway"}, "uri": "http://elsewhere/x"}
    assert any("absolute uri" in v for v in kr.destination_violations(trig))
    # issue 34: the sinks before the fix, a ref to the gateway, made the Broker's readiness (and so
    # every Trigger's Subscription) wait for the gateway's first ready revision
    old = {"ref": {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "name": "gateway"},
           "uri": "/events/dead-letter"}
    trig["spec"]["delivery"]["deadLetterSink"] = old
    assert kr.destination_violations(trig) == []  # admitted, and yet:
    assert any("its Subscription waits" in v for v in kr.dead_letter_sink_violations(trig))
    b = {"kind": "Broker", "metadata": {"name": "openrl"}, "spec": {"delivery": {"deadLetterSink": old}}}
    assert any("every Trigger's Subscription waits" in v for v in kr.dead_letter_sink_violations(b))
    broker = {"kind": "Broker", "metadata": {"name": "b"}, "spec": {"config": {"apiVersion": "v1", "kind": "ConfigMap",
                                                                              "name": "missing"}}}
    v = " | ".join(kr.broker_violations(broker, {}))
    assert "broker.class missing" in v and "'missing' is not in the build" in v


# ----------------------------------------------------------------------------- the written review


def test_review_lists_every_rule():
    """docs/knative-review.md names every rule function, and each function says what it checks."""
    review = (ROOT / "docs" / "knative-review.md").read_text()
    rules = [n for n, f in inspect.getmembers(kr, inspect.isfunction) if n.endswith("_violations") and not n.startswith("_")]
    assert len(rules) >= 10
    for name in rules:
        assert f"`{name}`" in review, f"docs/knative-review.md does not mention {name}"
        assert inspect.getdoc(getattr(kr, name)), name
