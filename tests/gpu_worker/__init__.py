"""Tests of gpu_worker: worker group, coordinator, failure modes."""
