"""A GPU node: the Celery worker, the node and its loops, run_job, progress and uploads."""
