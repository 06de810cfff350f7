"""A module-level Celery app built from the environment, for Celery's own command line.

`celery -A kiln.tasks.queue.celery_app flower` (or `inspect`, `events`, `purge`...) finds `app`
here; it has Kiln's broker, key prefix and serializers (tasks/queue/app.py) but no tasks: Kiln's
own processes take their app from `this_process()` (tasks/queue/process.py), never import this
module.
"""

from __future__ import annotations

from kiln.tasks.queue.process import this_process

app = this_process().celery_app
