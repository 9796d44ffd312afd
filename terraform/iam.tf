# Two Google service accounts:
#   nodes   - the GKE nodes: logs, metrics, image pulls; nothing else.
#   runtime - the openrl pods, through Workload Identity (KSA openrl/openrl): the bucket.

resource "google_service_account" "nodes" {
  account_id   = "${var.name}-nodes"
  display_name = "openrl GKE nodes"
  depends_on   = [google_project_service.apis]
}

resource "google_project_iam_member" "nodes" {
  for_each = toset([
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/autoscaling.metricsWriter",
  ])
  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_artifact_registry_repository_iam_member" "nodes_pull" {
  repository = google_artifact_registry_repository.images.name
  location   = google_artifact_registry_repository.images.location
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_service_account" "runtime" {
  account_id   = "${var.name}-runtime"
  display_name = "openrl functions (Workload Identity)"
  depends_on   = [google_project_service.apis]
}

# Read and write weights; read base models (GCS FUSE mounts with the pod's identity).
resource "google_storage_bucket_iam_member" "runtime" {
  bucket = google_storage_bucket.weights.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.runtime.email}"
}

# The GCS FUSE sidecar lists the bucket before it mounts it.
resource "google_storage_bucket_iam_member" "runtime_bucket_reader" {
  bucket = google_storage_bucket.weights.name
  role   = "roles/storage.legacyBucketReader"
  member = "serviceAccount:${google_service_account.runtime.email}"
}

# Workload Identity: the Kubernetes service account openrl/openrl may act as runtime.
resource "google_service_account_iam_member" "runtime_workload_identity" {
  service_account_id = google_service_account.runtime.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${local.app_namespace}/${local.app_service_account}]"
  depends_on         = [google_container_cluster.main]
}
