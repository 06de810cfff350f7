"""Batches: a JSONL file of job requests accepted at once, fed to the queue as capacity frees up.

`intake` validates a file line by line while it streams to the object store, and stores its valid
lines in their stored form (item lines, read back by `parse_item`; job ids by `batch_job_id`);
`feeder` (run by every node's maintenance loops, one feeder per batch at a time under a lease)
creates and publishes the jobs of each batch within its share of the window (`fairness`), writes
their results in parts (`reporting`), winds a stopped batch down and ends it, and sends batch
webhooks (`notify`); `retry` makes a batch of another's failed or expired lines; `service` is what
the API and the CLI call. Above `webhooks` and `queue`, below `api`, `node` and `cli`.
"""
