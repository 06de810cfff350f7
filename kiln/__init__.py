"""Kiln: a durable job queue for GPU image and video generation.

The code lives in the top-level folders `tasks/`, `gpu_worker/` and `storage/` (the layout the
project is known by); they install and import as `kiln.tasks`, `kiln.gpu_worker` and
`kiln.storage` through the links in this folder, so Kiln never shadows a user's own `tasks.py`.
"""
