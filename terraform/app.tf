# The openrl application: knative/overlays/gke-gpu (Knative Services: gateway, trainer
# shards, sampler; the Broker, its NATS JetStream channel config and the Triggers), with
# its placeholders filled in, plus the gateway's API keys.

data "kubectl_kustomize_documents" "app" {
  target = "${path.module}/../knative/overlays/gke-gpu"
}

locals {
  # Placeholders of knative/overlays/gke-gpu (tests/test_deploy_manifests.py lists them).
  app_tokens = {
    "OPENRL_IMAGE_REPO" = "${local.registry_host}/${var.project_id}/${google_artifact_registry_repository.images.repository_id}"
    "OPENRL_IMAGE_TAG"  = var.image_tag
    "OPENRL_BUCKET"     = google_storage_bucket.weights.name
    "OPENRL_GSA_EMAIL"  = google_service_account.runtime.email
  }

  app_docs = {
    for doc in data.kubectl_kustomize_documents.app.documents :
    "${yamldecode(doc).kind}/${yamldecode(doc).metadata.name}" => doc
  }

  # GPU type per function: the overlay says nvidia-l4; gpu_pools decides.
  app_rendered = {
    for key, doc in local.app_docs : key => replace(
      replace(replace(replace(replace(doc,
        "OPENRL_IMAGE_REPO", local.app_tokens["OPENRL_IMAGE_REPO"]),
        "OPENRL_IMAGE_TAG", local.app_tokens["OPENRL_IMAGE_TAG"]),
        "OPENRL_BUCKET", local.app_tokens["OPENRL_BUCKET"]),
      "OPENRL_GSA_EMAIL", local.app_tokens["OPENRL_GSA_EMAIL"]),
      "cloud.google.com/gke-accelerator: nvidia-l4",
      "cloud.google.com/gke-accelerator: ${var.gpu_pools[strcontains(key, "sampler") ? "sampler" : "trainer"].accelerator_type}",
    )
  }

  app_namespace_doc = { for k, v in local.app_rendered : k => v if startswith(k, "Namespace/") }
  app_other_docs    = { for k, v in local.app_rendered : k => v if !startswith(k, "Namespace/") }
}

resource "kubectl_manifest" "app_namespace" {
  for_each  = var.deploy_app ? local.app_namespace_doc : {}
  yaml_body = each.value
}

resource "random_password" "api_key" {
  length  = 40
  special = false
}

locals {
  api_keys = length(var.api_keys) > 0 ? var.api_keys : ["tml-${random_password.api_key.result}"]
}

# Mounted by the gateway at /etc/openrl/api-keys/keys (OPENRL_API_KEYS_FILE): one key a line.
resource "kubernetes_secret_v1" "api_keys" {
  count = var.deploy_app ? 1 : 0
  metadata {
    name      = "openrl-api-keys"
    namespace = local.app_namespace
  }
  data = {
    keys = join("\n", local.api_keys)
  }
  depends_on = [kubectl_manifest.app_namespace]
}

# The gateway's /events/* sinks (result and dead-letter CloudEvents from the Broker) need
# this token: the gateway reads it from the Secret, the Triggers and the Broker carry it in
# their sink URIs (?token=, knative/overlays/gke-gpu/events-token-patch.yaml).
resource "random_password" "events_token" {
  length  = 40
  special = false
}

resource "kubernetes_secret_v1" "internal_token" {
  count = var.deploy_app ? 1 : 0
  metadata {
    name      = "openrl-internal-token"
    namespace = local.app_namespace
  }
  data = {
    token = random_password.events_token.result
  }
  depends_on = [kubectl_manifest.app_namespace]
}

resource "kubectl_manifest" "app" {
  for_each = var.deploy_app ? local.app_other_docs : {}
  # The token is filled in here, not in local.app_rendered, so for_each stays non-sensitive.
  yaml_body         = replace(each.value, "OPENRL_EVENTS_TOKEN", random_password.events_token.result)
  server_side_apply = true
  depends_on = [
    kubectl_manifest.app_namespace,
    kubernetes_secret_v1.api_keys,
    kubernetes_secret_v1.internal_token,
    kubectl_manifest.knative_serving,
    kubectl_manifest.eventing_natss,
    helm_release.nats,
    google_service_account_iam_member.runtime_workload_identity,
    google_container_node_pool.gpu,
  ]
}
