"""Observability: Prometheus metrics, OpenTelemetry tracing, JSON logs."""
