# Images of the three functions (docker/*.Dockerfile), pulled by the nodes.
resource "google_artifact_registry_repository" "images" {
  #checkov:skip=CKV_GCP_84:Google-managed encryption: the images hold open-source code and no secrets; a customer-managed key needs a KMS key ring the platform team owns (set kms_key_name where policy requires it).
  repository_id = var.name
  location      = var.region
  format        = "DOCKER"
  description   = "openrl gateway, trainer and sampler images"
  labels        = local.labels

  docker_config {
    immutable_tags = true
  }

  depends_on = [google_project_service.apis]
}
