output "ingress_url" {
  description = "The SDK's base_url: tinker.ServiceClient(base_url=...)."
  value       = "http://gateway.${local.app_namespace}.${local.domain}"
}

output "ingress_ip" {
  description = "Public IP of the Knative ingress (point *.openrl.<domain> here when var.domain is set)."
  value       = google_compute_address.ingress.address
}

output "bucket" {
  description = "GCS bucket: weights under openrl/, base models under models/."
  value       = google_storage_bucket.weights.name
}

output "image_repository" {
  description = "Artifact Registry repository to push the gateway/trainer/sampler images to."
  value       = local.app_tokens["OPENRL_IMAGE_REPO"]
}

output "cluster_name" {
  description = "GKE cluster name."
  value       = google_container_cluster.main.name
}

output "get_credentials" {
  description = "Command that points kubectl at the cluster."
  value       = "gcloud container clusters get-credentials ${google_container_cluster.main.name} --region ${var.region} --project ${var.project_id}"
}

output "runtime_service_account" {
  description = "Google service account the openrl pods act as (Workload Identity)."
  value       = google_service_account.runtime.email
}

output "api_key" {
  description = "The first API key the gateway accepts (export TINKER_API_KEY=...)."
  value       = local.api_keys[0]
  sensitive   = true
}
