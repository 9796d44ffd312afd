"""Transport: the NATS bus, the worker bindings (JetStream pull, HTTP push), the embedded stack."""
