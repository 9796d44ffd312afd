"""The event contract: CloudEvent types, payloads, records and topology."""
