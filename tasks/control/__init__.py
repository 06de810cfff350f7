"""The cluster's loops (reaper, sweeper, audits, pruner, batch feeder) as declared components."""
