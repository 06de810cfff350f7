"""The queue: the Celery app, lanes and routing, submission, the retry policy."""
