# NATS with JetStream: the Broker's channel stream and openrl's KV buckets (futures,
# run metadata). Values in eventing/nats/values.yaml: 3 servers, file storage on PDs.
resource "helm_release" "nats" {
  name             = "nats"
  repository       = "https://nats-io.github.io/k8s/helm/charts/"
  chart            = "nats"
  version          = var.nats_chart_version
  namespace        = "nats-io"
  create_namespace = true
  wait             = true
  timeout          = 900

  values = [file("${path.module}/../eventing/nats/values.yaml")]

  depends_on = [google_container_node_pool.cpu]
}
