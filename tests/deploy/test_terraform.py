"""Offline checks of terraform/ (no providers, no cloud: no `terraform init`).

* ``terraform fmt -check -recursive``;
* every .tf file parses (python-hcl2), and the key facts hold: GPU node pools autoscale
  from 0 with the accelerator type and count taken from variables, the bucket has uniform
  access and a TTL lifecycle rule, Workload Identity ties the Kubernetes service account
  the manifests use to the Google service account that owns the bucket;
* the Knative configuration terraform installs admits what knative/ deploys (timeouts,
  zero initial scale, node selectors and tolerations, CSI volumes);
* every variable is documented in terraform/README.md;
* checkov over terraform/ and docker/, every skip carrying its reason inline.

Tools come from PATH or from the directory ``scripts/ci-deploy-tools.sh`` fills
(``$OPENRL_DEPLOY_TOOLS``, default ``~/.cache/openrl-deploy-tools``).
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

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 missing: run scripts/ci-deploy-tools.sh")
yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/ci-deploy-tools.sh")

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "terraform"
TOOLS_DIR = Path(os.environ.get("OPENRL_DEPLOY_TOOLS", Path.home() / ".cache" / "openrl-deploy-tools"))
INSTALL_HINT = "run scripts/ci-deploy-tools.sh to install it"


def find_tool(name: str) -> str | None:
    """A tool on PATH, else in the directory scripts/ci-deploy-tools.sh fills."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (TOOLS_DIR / "bin" / name, TOOLS_DIR / "venv" / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


# ------------------------------------------------------------------ HCL model


def _normalize(value):
    """python-hcl2 output, made version-independent: no quote marks around strings and
    keys, no __is_block__ / __comments__ markers."""
    if isinstance(value, dict):
        return {_unquote(k): _normalize(v) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return _unquote(value)
    return value


def _unquote(s):
    if isinstance(s, str) and len(s) >= 2 and s[0] == s[-1] == '"':
        return s[1:-1]
    return s


def _load(path: Path) -> dict:
    with path.open() as f:
        try:
            opts = hcl2.SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
            return _normalize(hcl2.load(f, serialization_options=opts))
        except (AttributeError, TypeError):  # python-hcl2 < 8
            f.seek(0)
            return _normalize(hcl2.load(f))


@functools.lru_cache(maxsize=None)
def config() -> dict:
    """All .tf files merged: {"resource": {type: {name: body}}, "variable": {...}, ...}."""
    files = sorted(TF.glob("*.tf"))
    assert files, "no terraform files"
    merged: dict = {"resource": {}, "data": {}, "variable": {}, "output": {}, "locals": {}, "provider": {}}
    for path in files:
        doc = _load(path)
        for block in doc.get("resource", []):
            for rtype, named in block.items():
                for name, body in named.items():
                    merged["resource"].setdefault(rtype, {})[name] = body
        for block in doc.get("data", []):
            for dtype, named in block.items():
                for name, body in named.items():
                    merged["data"].setdefault(dtype, {})[name] = body
        for kind in ("variable", "output"):
            for block in doc.get(kind, []):
                merged[kind].update(block)
        for block in doc.get("locals", []):
            merged["locals"].update(block)
        for block in doc.get("provider", []):
            merged["provider"].update(block)
    return merged


def res(rtype: str, name: str) -> dict:
    r = config()["resource"].get(rtype, {}).get(name)
    assert r is not None, f"resource {rtype}.{name} missing"
    return r


def one(block):
    """A nested block as parsed: a list of one dict (or a dict)."""
    if isinstance(block, list):
        assert len(block) == 1, block
        return block[0]
    return block


def test_every_tf_file_parses():
    for path in sorted(TF.rglob("*.tf")):
        assert isinstance(_load(path), dict), path


def test_terraform_fmt():
    terraform = find_tool("terraform")
    if terraform is None:
        pytest.skip(f"terraform not found: {INSTALL_HINT}")
    env = {**os.environ, "CHECKPOINT_DISABLE": "1"}
    proc = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(TF)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, f"terraform fmt would change files:\n{proc.stdout}{proc.stderr}"


# --------------------------------------------------------------------- cluster


def test_gpu_pools_scale_from_zero():
    pool = res("google_container_node_pool", "gpu")
    assert pool["for_each"] == "${var.gpu_pools}"
    autoscaling = one(pool["autoscaling"])
    assert autoscaling["total_min_node_count"] == 0, "GPU pools must autoscale down to 0 nodes"
    assert autoscaling["total_max_node_count"] == "${each.value.max_nodes}"
    assert pool["initial_node_count"] == 0
    node = one(pool["node_config"])
    acc = one(node["guest_accelerator"])
    assert acc["type"] == "${each.value.accelerator_type}", "accelerator type comes from a variable"
    assert acc["count"] == "${each.value.accelerator_count}", "accelerator count comes from a variable"
    assert one(acc["gpu_driver_installation_config"])["gpu_driver_version"] == "${var.gpu_driver_version}"
    assert one(node["gcfs_config"])["enabled"] is True, "image streaming shortens the GPU cold start"

    var = config()["variable"]["gpu_pools"]
    assert set(var["default"]) == {"trainer", "sampler"}
    for pool_default in var["default"].values():
        assert pool_default["accelerator_type"].startswith("nvidia-")
        assert pool_default["accelerator_count"] >= 1


def test_cpu_pool_is_always_on_and_fits_nats():
    pool = res("google_container_node_pool", "cpu")
    autoscaling = one(pool["autoscaling"])
    assert autoscaling["total_min_node_count"] == "${var.cpu_pool.min_nodes}"
    assert config()["variable"]["cpu_pool"]["default"]["min_nodes"] >= 3
    labels = one(pool["node_config"])["labels"]
    assert "cpu" in str(labels) and "openrl.dev/pool" in str(labels)
    nats = yaml.safe_load((ROOT / "eventing" / "nats" / "values.yaml").read_text())
    assert nats["podTemplate"]["merge"]["spec"]["nodeSelector"] == {"openrl.dev/pool": "cpu"}


def test_node_pools_use_workload_identity_metadata():
    pools = config()["resource"]["google_container_node_pool"]
    assert set(pools) == {"cpu", "gpu"}
    for name, pool in pools.items():
        node = one(pool["node_config"])
        assert one(node["workload_metadata_config"])["mode"] == "GKE_METADATA", name
        assert node["service_account"] == "${google_service_account.nodes.email}", name
        assert one(node["shielded_instance_config"])["enable_secure_boot"] is True, name


def test_cluster_has_workload_identity_and_gcs_fuse():
    cluster = res("google_container_cluster", "main")
    assert one(cluster["workload_identity_config"])["workload_pool"] == "${var.project_id}.svc.id.goog"
    assert cluster["remove_default_node_pool"] is True
    addons = one(cluster["addons_config"])
    assert one(addons["gcs_fuse_csi_driver_config"])["enabled"] is True
    assert one(cluster["private_cluster_config"])["enable_private_nodes"] is True


def test_workload_identity_binds_the_manifests_service_account():
    binding = res("google_service_account_iam_member", "runtime_workload_identity")
    assert binding["role"] == "roles/iam.workloadIdentityUser"
    assert binding["service_account_id"] == "${google_service_account.runtime.name}"
    member = binding["member"]
    assert member == "serviceAccount:${var.project_id}.svc.id.goog[${local.app_namespace}/${local.app_service_account}]"
    loc = config()["locals"]
    sa = yaml.safe_load((ROOT / "knative" / "base" / "serviceaccount.yaml").read_text())
    overlay = yaml.safe_load((ROOT / "knative" / "overlays" / "gke-gpu" / "kustomization.yaml").read_text())
    assert loc["app_namespace"] == overlay["namespace"] == "openrl"
    assert loc["app_service_account"] == sa["metadata"]["name"]
    patch = yaml.safe_load((ROOT / "knative" / "overlays" / "gke-gpu" / "serviceaccount-patch.yaml").read_text())
    assert patch["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == "OPENRL_GSA_EMAIL"
    assert "${google_service_account.runtime.email}" in str(loc["app_tokens"]["OPENRL_GSA_EMAIL"])
    # The runtime identity (not the nodes) owns the bucket.
    grant = res("google_storage_bucket_iam_member", "runtime")
    assert grant["member"] == "serviceAccount:${google_service_account.runtime.email}"
    assert grant["role"] in ("roles/storage.objectUser", "roles/storage.objectAdmin")


# ---------------------------------------------------------------------- bucket


def test_bucket_uniform_access_and_ttl():
    bucket = res("google_storage_bucket", "weights")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    dynamic = one(bucket["dynamic"])
    ttl = one(dynamic["lifecycle_rule"])
    assert "var.object_ttl_days" in ttl["for_each"]
    content = one(ttl["content"])
    cond = one(content["condition"])
    assert cond["age"] == "${lifecycle_rule.value}"
    assert cond["matches_prefix"] == ["openrl/"], "base models (models/) must never expire"
    assert one(content["action"])["type"] == "Delete"
    assert config()["variable"]["object_ttl_days"]["default"] > 0


# ------------------------------------------------------------ platform installs


def test_helm_installs_knative_operator_and_nats():
    helm = config()["resource"]["helm_release"]
    assert helm["knative_operator"]["chart"] == "knative-operator"
    assert helm["knative_operator"]["version"] == "${var.knative_operator_chart_version}"
    nats = helm["nats"]
    assert nats["chart"] == "nats" and nats["namespace"] == "nats-io" and nats["name"] == "nats"
    assert "../eventing/nats/values.yaml" in str(nats["values"])
    assert (ROOT / "eventing" / "nats" / "values.yaml").is_file()


def _rendered_template(name: str, **values) -> dict:
    text = (TF / "manifests" / name).read_text()
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    assert "${" not in text, f"{name}: unrendered variable"
    return yaml.safe_load(text)


def _ksvc_files():
    for path in [ROOT / "knative" / "base" / "gateway.yaml", ROOT / "knative" / "base" / "sampler.yaml",
                 ROOT / "knative" / "trainer-shard" / "trainer.yaml"]:
        yield yaml.safe_load(path.read_text())


def test_knative_serving_config_admits_the_services():
    ks = _rendered_template("knative-serving.yaml.tftpl", version="1.23", domain="203.0.113.7.sslip.io",
                            registry_host="us-central1-docker.pkg.dev")
    assert ks["kind"] == "KnativeServing" and ks["spec"]["ingress"]["kourier"]["enabled"] is True
    cfg = ks["spec"]["config"]
    longest = max(k["spec"]["template"]["spec"]["timeoutSeconds"] for k in _ksvc_files())
    assert int(cfg["defaults"]["max-revision-timeout-seconds"]) >= longest
    assert cfg["autoscaler"]["allow-zero-initial-scale"] == "true"
    assert cfg["autoscaler"]["enable-scale-to-zero"] == "true"
    for feature in ("kubernetes.podspec-nodeselector", "kubernetes.podspec-tolerations", "kubernetes.podspec-volumes-csi"):
        assert cfg["features"][feature] == "enabled", feature
    assert "us-central1-docker.pkg.dev" in cfg["deployment"]["registries-skipping-tag-resolving"]
    assert cfg["domain"] == {"203.0.113.7.sslip.io": ""}
    ke = _rendered_template("knative-eventing.yaml.tftpl", version="1.22")
    assert ke["spec"]["config"]["features"]["delivery-timeout"] == "enabled"
    assert ke["spec"]["config"]["features"]["new-trigger-filters"] == "enabled"


#: The lowest Kubernetes each Knative Serving release starts on (knative.dev/pkg version.go
#: DefaultKubernetesMinVersion at the commit the release's go.mod pins; serving 1.23: v1.34.0).
#: A new knative_serving_version needs its entry here.
KNATIVE_MIN_KUBERNETES = {"1.23": (1, 34)}


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", version)
    assert m, version
    return int(m.group(1)), int(m.group(2))


def _terraform_eval(tmp_path: Path, variables: str, outputs: dict[str, str], tfvars: dict[str, str]):
    """``terraform plan`` of a provider-less module made of ``variables`` (HCL text) and one
    output per ``outputs`` entry: (return code, output text). No provider, no network."""
    terraform = find_tool("terraform")
    if terraform is None:
        pytest.skip(f"terraform not found: {INSTALL_HINT}")
    body = variables + "".join(f'\noutput "{k}" {{\n  value = {v}\n}}\n' for k, v in outputs.items())
    (tmp_path / "main.tf").write_text(body)
    env = {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1", "NO_COLOR": "1"}
    init = subprocess.run([terraform, "init", "-input=false", "-no-color"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert init.returncode == 0, init.stdout + init.stderr
    args = [a for k, v in tfvars.items() for a in ("-var", f"{k}={v}")]
    proc = subprocess.run([terraform, "plan", "-input=false", "-no-color", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_gke_version_satisfies_knative_minimum(tmp_path):
    """Knative Serving refuses to start on a Kubernetes older than its minimum (1.34 for 1.23),
    and a release channel alone does not say which version GKE picks: the cluster pins
    ``min_master_version = var.kubernetes_version``, whose default and validation keep it at the
    minimum or above, and a postcondition fails the apply if GKE's ``master_version`` is older.
    The validation and the postcondition's expression are evaluated by the real terraform
    binary in a provider-less module (no cloud)."""
    var = config()["variable"]
    low = KNATIVE_MIN_KUBERNETES.get(var["knative_serving_version"]["default"])
    assert low, f"KNATIVE_MIN_KUBERNETES has no entry for Knative Serving {var['knative_serving_version']['default']}"
    assert _minor(var["kubernetes_version"]["default"]) >= low
    cluster = res("google_container_cluster", "main")
    assert cluster["min_master_version"] == "${var.kubernetes_version}"
    assert one(cluster["release_channel"])["channel"] == "${var.release_channel}"
    gke = (TF / "gke.tf").read_text()
    post = re.search(r"postcondition \{\s*condition\s*=\s*(.+)\n", gke)
    assert post and "self.master_version" in post.group(1), "google_container_cluster.main: no master_version postcondition"
    assert f">= {low[1]}" in post.group(1)
    text = (TF / "variables.tf").read_text()
    block = re.search(r'variable "kubernetes_version" \{.*?\n\}\n', text, re.S).group(0)
    for version, ok in (("1.34", True), ("1.35.2-gke.1100", True), ("1.33", False), ("1.9", False), ("latest", False)):
        rc, out = _terraform_eval(tmp_path, block, {}, {"kubernetes_version": version})
        assert (rc == 0) is ok, (version, out[-1500:])
        if not ok:
            assert "needs Kubernetes >= 1.34" in out, out[-1500:]
    cond = post.group(1).strip()
    outs = {f"v{i}": cond.replace("self.master_version", f'"{v}"') for i, v in
            enumerate(["1.34.1-gke.1200", "1.36.0-gke.5", "1.33.9-gke.1", "1.4.0"])}
    rc, out = _terraform_eval(tmp_path, "", outs, {})
    assert rc == 0, out[-1500:]
    got = dict(re.findall(r"\+ (v\d) += (true|false)", out))
    assert got == {"v0": "true", "v1": "true", "v2": "false", "v3": "false"}, out[-1500:]


def test_versions_match_the_vendored_schemas():
    """The CRD schemas the manifests are validated against are those terraform installs."""
    readme = (ROOT / "tests" / "data" / "schemas" / "README.md").read_text()
    var = config()["variable"]
    assert f"knative/serving `knative-v{var['knative_serving_version']['default']}." in readme
    assert f"knative/eventing `knative-v{var['knative_eventing_version']['default']}." in readme
    assert f"eventing-natss `knative-v{var['eventing_natss_version']['default']}`" in readme
    assert var["knative_operator_chart_version"]["default"].lstrip("v").startswith(var["knative_serving_version"]["default"])


def test_app_overlay_and_files_exist():
    data = config()["data"]["kubectl_kustomize_documents"]["app"]
    target = data["target"].replace("${path.module}", str(TF))
    assert (Path(target) / "kustomization.yaml").is_file(), target
    text = "\n".join(p.read_text() for p in TF.glob("*.tf"))
    for ref in re.findall(r'(?:file|templatefile)\("\$\{path\.module\}/([^"]+)"', text):
        assert (TF / ref).is_file(), ref


def test_outputs():
    outputs = config()["output"]
    for name in ("ingress_url", "bucket", "image_repository", "get_credentials", "api_key"):
        assert name in outputs and outputs[name].get("description"), name
    assert "gateway.${local.app_namespace}.${local.domain}" in outputs["ingress_url"]["value"]
    assert outputs["api_key"]["sensitive"] is True


def test_variables_are_documented():
    readme = (TF / "README.md").read_text()
    for name, var in config()["variable"].items():
        assert var.get("description"), f"variable {name} has no description"
        assert f"`{name}`" in readme, f"variable {name} is not documented in terraform/README.md"


# ---------------------------------------------------------------------- checkov

SKIP = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?")


def test_checkov_skips_are_justified():
    for path in [*TF.rglob("*.tf"), *(ROOT / "docker").glob("*Dockerfile")]:
        for line in path.read_text().splitlines():
            m = SKIP.search(line)
            if m:
                reason = (m.group(2) or "").strip()
                assert len(reason) >= 30, f"{path.name}: skip of {m.group(1)} needs a reason: {line.strip()}"


def test_checkov():
    checkov = find_tool("checkov")
    if checkov is None:
        pytest.skip(f"checkov not found: {INSTALL_HINT}")
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false", "LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [checkov, "-d", str(TF), "-d", str(ROOT / "docker"), "--framework", "terraform", "dockerfile",
         "--quiet", "--compact", "-o", "json", "--skip-download"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.stdout.strip(), f"checkov printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    # One JSON document, or several in a row (one per framework, then a combined list).
    reports, text, decoder = [], proc.stdout.strip(), json.JSONDecoder()
    while text:
        value, end = decoder.raw_decode(text)
        reports.extend(value if isinstance(value, list) else [value])
        text = text[end:].lstrip()
    reports = list({r.get("check_type"): r for r in reports if isinstance(r, dict)}.values())
    failed, passed = [], 0
    for r in reports:
        if "summary" not in r:
            continue
        passed += r["summary"]["passed"]
        for check in r.get("results", {}).get("failed_checks", []):
            failed.append(f"{check['check_id']} {check['resource']} ({check['file_path']})")
    assert passed > 0, "checkov checked nothing"
    assert not failed, "checkov failed (fix it, or skip inline with #checkov:skip=ID:reason):\n" + "\n".join(failed)
