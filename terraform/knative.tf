# Knative Serving + Eventing (Knative Operator, Helm), eventing-natss (NATS JetStream
# channel), and the public ingress of Knative Serving.

locals {
  registry_host = "${var.region}-docker.pkg.dev"
  # Knative route domain: gateway.openrl.<domain> is the SDK's base_url.
  domain = var.domain != "" ? var.domain : "${google_compute_address.ingress.address}.sslip.io"
}

resource "helm_release" "knative_operator" {
  name             = "knative-operator"
  repository       = "https://knative.github.io/operator"
  chart            = "knative-operator"
  version          = var.knative_operator_chart_version
  namespace        = "knative-operator"
  create_namespace = true
  wait             = true

  depends_on = [google_container_node_pool.cpu]
}

resource "kubernetes_namespace_v1" "knative" {
  for_each = toset(["knative-serving", "knative-eventing"])
  metadata {
    name = each.value
  }
  depends_on = [google_container_node_pool.cpu]
}

resource "kubectl_manifest" "knative_serving" {
  yaml_body = templatefile("${path.module}/manifests/knative-serving.yaml.tftpl", {
    version       = var.knative_serving_version
    domain        = local.domain
    registry_host = local.registry_host
  })
  wait_for {
    condition {
      type   = "Ready"
      status = "True"
    }
  }
  depends_on = [helm_release.knative_operator, kubernetes_namespace_v1.knative]
}

resource "kubectl_manifest" "knative_eventing" {
  yaml_body = templatefile("${path.module}/manifests/knative-eventing.yaml.tftpl", {
    version = var.knative_eventing_version
  })
  wait_for {
    condition {
      type   = "Ready"
      status = "True"
    }
  }
  depends_on = [helm_release.knative_operator, kubernetes_namespace_v1.knative]
}

# eventing-natss: the NatsJetStreamChannel CRD, its controller, dispatcher and webhook.
data "http" "eventing_natss" {
  url = "https://github.com/knative-extensions/eventing-natss/releases/download/knative-v${var.eventing_natss_version}/eventing-jsm.yaml"

  lifecycle {
    postcondition {
      condition     = self.status_code == 200
      error_message = "Could not download eventing-natss ${var.eventing_natss_version} (eventing-jsm.yaml)."
    }
  }
}

data "kubectl_file_documents" "eventing_natss" {
  content = data.http.eventing_natss.response_body
}

# Where eventing-natss finds NATS (the same file serves hand-made clusters).
resource "kubectl_manifest" "config_nats" {
  yaml_body  = file("${path.module}/../eventing/cluster/config-nats.yaml")
  depends_on = [kubectl_manifest.knative_eventing]
}

resource "kubectl_manifest" "eventing_natss" {
  for_each          = data.kubectl_file_documents.eventing_natss.manifests
  yaml_body         = each.value
  server_side_apply = true
  depends_on        = [kubectl_manifest.knative_eventing, kubectl_manifest.config_nats, helm_release.nats]
}

# The public entry: an L4 load balancer on the reserved address in front of Kourier's
# gateway pods (the operator's own kourier Service stays ClusterIP).
resource "kubernetes_service_v1" "ingress" {
  metadata {
    name      = "openrl-ingress"
    namespace = "knative-serving"
    labels    = local.labels
  }
  spec {
    type                        = "LoadBalancer"
    load_balancer_ip            = google_compute_address.ingress.address
    load_balancer_source_ranges = var.ingress_source_ranges
    external_traffic_policy     = "Local"
    selector = {
      app = "3scale-kourier-gateway"
    }
    port {
      name        = "http"
      port        = 80
      target_port = 8080
      protocol    = "TCP"
    }
  }
  depends_on = [kubectl_manifest.knative_serving]
}
