"""What a pipeline declares it can take: sizes, steps, frame counts and a memory budget.

A pipeline may define `limits() -> DeclaredLimits` (optional in the `Pipeline` protocol; the keys
are `kiln.common.limits`'s, shared with the API that enforces them); rank 0 sends what its
pipelines declare to the group's owner when it is ready, and the node publishes it in its
heartbeat.
"""

from __future__ import annotations

from kiln.common.limits import LIMIT_KEYS, DeclaredLimits


def declared_limits(pipeline: object) -> DeclaredLimits:
    """What `pipeline.limits()` declares (a copy); nothing when the pipeline has no `limits`."""
    limits = getattr(pipeline, "limits", None)
    if limits is None:
        return DeclaredLimits()
    declared: DeclaredLimits = limits()
    unknown = set(declared) - LIMIT_KEYS
    if unknown:  # a typo would otherwise silently announce no limit at all
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; known: {sorted(LIMIT_KEYS)}")
    return DeclaredLimits(**declared)
