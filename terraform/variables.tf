# Every variable is documented in README.md (tests/test_terraform.py checks it).

variable "project_id" {
  description = "GCP project to deploy into (must exist, with billing enabled)."
  type        = string
}

variable "region" {
  description = "GCP region of the cluster, the bucket, the image registry and the ingress IP."
  type        = string
  default     = "us-central1"
}

variable "name" {
  description = "Prefix of every resource name (cluster, bucket, service accounts, network)."
  type        = string
  default     = "openrl"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.name))
    error_message = "name: 3-20 characters, lower-case letters, digits and dashes, starting with a letter."
  }
}

variable "zones" {
  description = "Zones of the node pools. Pick zones that offer the GPU types of gpu_pools (gcloud compute accelerator-types list)."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-b", "us-central1-c"]
}

variable "cpu_pool" {
  description = "The always-on CPU node pool (gateway, Knative, NATS). min_nodes >= 3: one NATS server per node."
  type = object({
    machine_type = string
    min_nodes    = number
    max_nodes    = number
  })
  default = {
    machine_type = "e2-standard-4"
    min_nodes    = 3
    max_nodes    = 6
  }

  validation {
    condition     = var.cpu_pool.min_nodes >= 3 && var.cpu_pool.max_nodes >= var.cpu_pool.min_nodes
    error_message = "cpu_pool: min_nodes >= 3 (the 3 NATS servers spread over nodes) and max_nodes >= min_nodes."
  }
}

variable "gpu_pools" {
  description = "GPU node pools, keyed by the function they serve (exactly \"trainer\" and \"sampler\"). Each autoscales from 0 nodes to max_nodes; accelerator_type is a GKE accelerator name (nvidia-l4, nvidia-h100-80gb, ...), accelerator_count the GPUs per node."
  type = map(object({
    machine_type      = string
    accelerator_type  = string
    accelerator_count = number
    max_nodes         = number
    spot              = optional(bool, false)
    disk_size_gb      = optional(number, 200)
  }))
  default = {
    trainer = {
      machine_type      = "g2-standard-8"
      accelerator_type  = "nvidia-l4"
      accelerator_count = 1
      max_nodes         = 2
    }
    sampler = {
      machine_type      = "g2-standard-8"
      accelerator_type  = "nvidia-l4"
      accelerator_count = 1
      max_nodes         = 4
    }
  }

  validation {
    condition     = toset(keys(var.gpu_pools)) == toset(["trainer", "sampler"])
    error_message = "gpu_pools: exactly the keys \"trainer\" and \"sampler\"."
  }

  validation {
    condition     = alltrue([for p in values(var.gpu_pools) : p.accelerator_count >= 1 && p.max_nodes >= 1])
    error_message = "gpu_pools: accelerator_count and max_nodes must be >= 1."
  }
}

variable "gpu_driver_version" {
  description = "NVIDIA driver GKE installs on GPU nodes: LATEST or DEFAULT. The images use CUDA 13, which needs driver >= 580 (LATEST on current GKE versions)."
  type        = string
  default     = "LATEST"
}

variable "release_channel" {
  description = "GKE release channel (RAPID, REGULAR, STABLE, EXTENDED). The channel must offer kubernetes_version."
  type        = string
  default     = "REGULAR"

  validation {
    condition     = contains(["RAPID", "REGULAR", "STABLE", "EXTENDED"], var.release_channel)
    error_message = "release_channel: one of RAPID, REGULAR, STABLE, EXTENDED."
  }
}

variable "kubernetes_version" {
  description = "Lowest Kubernetes version of the control plane (GKE min_master_version: 1.X for the newest 1.X patch, or 1.X.Y-gke.N). Knative Serving 1.23 needs >= 1.34 (knative.dev/pkg DefaultKubernetesMinVersion v1.34.0) and refuses to start on older clusters."
  type        = string
  default     = "1.34"

  validation {
    condition     = can(regex("^1\\.[0-9]+(\\.[0-9]+(-gke\\.[0-9]+)?)?$", var.kubernetes_version)) && try(tonumber(split(".", var.kubernetes_version)[1]) >= 34, false)
    error_message = "kubernetes_version: Knative Serving 1.23 needs Kubernetes >= 1.34 (e.g. \"1.34\" or \"1.35.1-gke.1000\")."
  }
}

variable "master_authorized_cidrs" {
  description = "CIDR blocks allowed to reach the cluster's API server (where you run terraform and kubectl). Narrow it to your own range."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "ingress_source_ranges" {
  description = "CIDR blocks allowed to reach the Knative ingress (the SDK's base_url)."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "domain" {
  description = "DNS domain of the Knative ingress. Empty: <ingress-ip>.sslip.io (works without any DNS setup). Otherwise point a wildcard A record *.openrl.<domain> at the ingress_ip output."
  type        = string
  default     = ""
}

variable "bucket_name" {
  description = "GCS bucket for weights (prefix openrl/) and base models (prefix models/). Empty: <project_id>-<name>."
  type        = string
  default     = ""
}

variable "object_ttl_days" {
  description = "Lifecycle TTL: objects under the openrl/ prefix (checkpoints, sampler weights, run state) are deleted this many days after creation. 0 disables it. Base models (models/) are never expired."
  type        = number
  default     = 30
}

variable "image_tag" {
  description = "Tag of the gateway/trainer/sampler images pushed to the Artifact Registry repository (see docs/deploy-gke.md)."
  type        = string
  default     = "0.1.0"
}

variable "deploy_app" {
  description = "Apply the openrl Knative Services, Broker and Triggers (knative/overlays/gke-gpu). false: only the platform (cluster, bucket, Knative, NATS); apply the overlay yourself."
  type        = bool
  default     = true
}

variable "api_keys" {
  description = "API keys the gateway accepts (the SDK's TINKER_API_KEY). Empty: one random key is generated (output api_key)."
  type        = list(string)
  default     = []
  sensitive   = true
}

variable "knative_operator_chart_version" {
  description = "Version of the Knative Operator Helm chart (https://knative.github.io/operator)."
  type        = string
  default     = "v1.23.0"
}

variable "knative_serving_version" {
  description = "Knative Serving version the operator installs (tests/data/schemas holds its Service CRD)."
  type        = string
  default     = "1.23"
}

variable "knative_eventing_version" {
  description = "Knative Eventing version the operator installs (tests/data/schemas holds its Broker/Trigger CRDs)."
  type        = string
  default     = "1.22"
}

variable "eventing_natss_version" {
  description = "Release of knative-extensions/eventing-natss (NatsJetStreamChannel) to install."
  type        = string
  default     = "1.22.0"
}

variable "nats_chart_version" {
  description = "Version of the NATS Helm chart (https://nats-io.github.io/k8s/helm/charts/); values in eventing/nats/values.yaml."
  type        = string
  default     = "1.3.7"
}

variable "deletion_protection" {
  description = "Protect the cluster and the bucket against terraform destroy (set false to tear a test deployment down)."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Labels added to the cluster, node pools and bucket."
  type        = map(string)
  default     = {}
}
