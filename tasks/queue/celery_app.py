"""A module-level Celery app built from the environment, for Celery's own command line.

`celery -A kiln.tasks.queue.celery_app flower` (or `inspect`, `events`, `purge`...) finds `app`
here; it has Kiln's broker, key prefix and serializers (tasks/queue/app.py) but no tasks: Kiln's
own processes build their app with `make_celery_app`, never import this module.
"""

from __future__ import annotations

from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import make_celery_app

app = make_celery_app(KilnSettings(), StorageSettings())
