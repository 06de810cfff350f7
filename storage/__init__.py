"""Kiln's storage layer: job state in Redis (storage.status) and outputs (storage.objects)."""
