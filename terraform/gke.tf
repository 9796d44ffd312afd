# The GKE cluster: a regional control plane, an always-on CPU pool, and one GPU pool per
# GPU function (trainer, sampler) that autoscales from 0 nodes. A GPU node exists only
# while a trainer shard or sampler pod is scheduled on it: Knative scales idle functions
# to zero pods, then the cluster autoscaler removes the empty GPU nodes.

resource "google_container_cluster" "main" {
  #checkov:skip=CKV_GCP_12:NetworkPolicy is enforced by Dataplane V2 (datapath_provider = ADVANCED_DATAPATH), which replaces the Calico network_policy add-on checkov looks for.
  #checkov:skip=CKV_GCP_65:Google Groups for RBAC needs a Google Workspace domain group (gke-security-groups@<domain>) that differs per organization; add authenticator_groups_config where one exists.
  #checkov:skip=CKV_GCP_69:The default node pool is removed at creation; every node pool below sets workload_metadata_config GKE_METADATA (asserted by tests/test_terraform.py).
  name                = var.name
  location            = var.region
  node_locations      = var.zones
  deletion_protection = var.deletion_protection
  resource_labels     = local.labels

  network    = google_compute_network.main.id
  subnetwork = google_compute_subnetwork.main.id

  # Node pools are managed below; the default pool is removed right away.
  remove_default_node_pool = true
  initial_node_count       = 1

  # Knative Serving 1.23 needs Kubernetes >= 1.34: pin the control plane's lowest version (the
  # channel may upgrade it, never below) and check what GKE gave after the apply.
  min_master_version = var.kubernetes_version
  release_channel {
    channel = var.release_channel
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  # Workload Identity: pods act as Google service accounts, no key files.
  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
    master_ipv4_cidr_block  = "172.16.0.0/28"
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.master_authorized_cidrs
      content {
        cidr_block   = cidr_blocks.value
        display_name = "authorized-${cidr_blocks.key}"
      }
    }
  }

  # Dataplane V2 (Cilium): enforces NetworkPolicy without the Calico add-on.
  datapath_provider           = "ADVANCED_DATAPATH"
  enable_intranode_visibility = true
  enable_shielded_nodes       = true

  binary_authorization {
    evaluation_mode = "PROJECT_SINGLETON_POLICY_ENFORCE"
  }

  addons_config {
    # Base models are read from the bucket through GCS FUSE (knative/overlays/gke-gpu).
    gcs_fuse_csi_driver_config {
      enabled = true
    }
    gce_persistent_disk_csi_driver_config {
      enabled = true
    }
    http_load_balancing {
      disabled = false
    }
  }

  # Node auto-provisioning stays off (the pools below are explicit); the profile makes
  # the autoscaler remove idle nodes - idle GPU nodes above all - sooner.
  cluster_autoscaling {
    enabled             = false
    autoscaling_profile = "OPTIMIZE_UTILIZATION"
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
  }

  depends_on = [google_project_service.apis]

  lifecycle {
    postcondition {
      condition     = try(tonumber(regex("^1\\.([0-9]+)\\.", self.master_version)[0]) >= 34, false)
      error_message = "GKE runs Kubernetes ${self.master_version}; Knative Serving 1.23 needs >= 1.34: raise kubernetes_version or pick a release_channel that offers it."
    }
  }
}

locals {
  node_oauth_scopes = ["https://www.googleapis.com/auth/cloud-platform"]
}

resource "google_container_node_pool" "cpu" {
  name           = "cpu"
  cluster        = google_container_cluster.main.id
  node_locations = var.zones

  autoscaling {
    total_min_node_count = var.cpu_pool.min_nodes
    total_max_node_count = var.cpu_pool.max_nodes
    location_policy      = "BALANCED"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.cpu_pool.machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 100
    service_account = google_service_account.nodes.email
    oauth_scopes    = local.node_oauth_scopes
    labels          = merge(local.labels, { "openrl.dev/pool" = "cpu" })

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}

resource "google_container_node_pool" "gpu" {
  for_each = var.gpu_pools

  name           = "${each.key}-gpu"
  cluster        = google_container_cluster.main.id
  node_locations = var.zones

  # Scale from zero: no GPU node runs while no GPU pod wants one.
  initial_node_count = 0
  autoscaling {
    total_min_node_count = 0
    total_max_node_count = each.value.max_nodes
    # Take a GPU wherever a zone has one free.
    location_policy = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = each.value.machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-ssd"
    disk_size_gb    = each.value.disk_size_gb
    spot            = each.value.spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = local.node_oauth_scopes
    # GKE itself labels the nodes cloud.google.com/gke-accelerator=<type> and taints
    # them nvidia.com/gpu=present:NoSchedule; the Knative Services select and tolerate that.
    labels = merge(local.labels, { "openrl.dev/pool" = each.key })

    guest_accelerator {
      type  = each.value.accelerator_type
      count = each.value.accelerator_count
      gpu_driver_installation_config {
        gpu_driver_version = var.gpu_driver_version
      }
    }

    # Image streaming: a multi-GB CUDA image starts before it is fully pulled.
    gcfs_config {
      enabled = true
    }

    gvnic {
      enabled = true
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  lifecycle {
    # The autoscaler owns the node count.
    ignore_changes = [initial_node_count]
  }
}
