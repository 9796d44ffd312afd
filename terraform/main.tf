locals {
  labels = merge({ app = "openrl", managed-by = "terraform" }, var.labels)

  # Where the openrl functions run (knative/base/serviceaccount.yaml, namespace openrl).
  app_namespace       = "openrl"
  app_service_account = "openrl"
}

resource "google_project_service" "apis" {
  for_each = toset([
    "artifactregistry.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",
    "storage.googleapis.com",
  ])
  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}
