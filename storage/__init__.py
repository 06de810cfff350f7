"""Kiln's storage layer: job state in Redis (storage.job_store) and outputs (storage.objects)."""
