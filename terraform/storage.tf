# Weights (openrl/ prefix: adapters, optimizer state, sampler weights, checkpoints) and
# base models (models/ prefix, mounted read-only by GCS FUSE).

locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-${var.name}"
}

resource "google_storage_bucket" "weights" {
  #checkov:skip=CKV_GCP_62:Usage logs need a second bucket and are superseded by Cloud Audit Logs; enable Data Access audit logs for storage.googleapis.com where access must be recorded.
  name                        = local.bucket_name
  location                    = var.region
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = !var.deletion_protection
  labels                      = local.labels

  versioning {
    enabled = true
  }

  # TTL: training state and checkpoints expire object_ttl_days after creation.
  dynamic "lifecycle_rule" {
    for_each = var.object_ttl_days > 0 ? [var.object_ttl_days] : []
    content {
      condition {
        age            = lifecycle_rule.value
        matches_prefix = ["openrl/"]
      }
      action {
        type = "Delete"
      }
    }
  }

  # Versioning keeps overwritten or deleted objects recoverable for a week, no longer.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 7
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  depends_on = [google_project_service.apis]
}
