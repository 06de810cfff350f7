"""The job spec: what a job record and a batch item line store, and what a node decodes.

A `JobSpec` is the effective request of one job: the request as the intake accepted it, the
contract's defaults filled in and its seed drawn, under a `version`. Storage keeps it as opaque
JSON (`JobRecord.request`, `NewJob.request`, the `r` of a batch item line); everything in
`kiln.tasks` that reads it goes through `JobSpec.decode`, once, and reads typed fields after.

The version rule (docs/contract.md §1.1): a release that adds, removes or changes the meaning
of a stored field raises `JOB_SPEC_VERSION` and still decodes every older version. A spec
without a `version` is version 1 (what releases before the field wrote). A spec is written at the
lowest version that holds what it uses (`lowest_version`): a job that asks for nothing a newer
version added stays readable by the older nodes of a rolling upgrade. A version above this
release's is refused with `JobSpecRefused`, never guessed at: a node fails such a job for good
under `JOB_SPEC_ERROR`, naming the version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import Field, ValidationError, model_validator

from kiln.common.request import SEED_MAX, OutputFormat
from kiln.tasks.contract.schemas import JobRequest

JOB_SPEC_VERSION: Final = 2
# the fields each version added, and the first version that has them
ADDED_IN: Final[dict[str, int]] = {"checkpoint": 2}
# the error `type` of a job whose stored spec this release cannot decode
JOB_SPEC_ERROR = "job_spec_unreadable"


class JobSpecRefused(ValueError):
    """A stored spec this release cannot decode: a future version, or not a spec at all."""

    def __init__(self, message: str, version: object = None) -> None:
        super().__init__(message)
        self.version = version

    def error(self) -> dict[str, Any]:
        """The job's error when a node refuses it for this (never retried: it cannot change)."""
        error: dict[str, Any] = {"type": JOB_SPEC_ERROR, "message": str(self), "retryable": False}
        if self.version is not None:
            error["version"] = self.version
        return error


class JobSpec(JobRequest):
    """The effective request of one stored job: every field as the job runs it."""

    version: Literal[1, 2] = Field(
        default=1, description="The spec's version (absent in old records: 1)."
    )
    seed: int = Field(strict=True, ge=0, le=SEED_MAX, description="As given, or drawn at submit.")
    # filled in from num_frames by the schema when the request has none
    output_format: OutputFormat = Field(description="As given, or its kind's default.")

    @classmethod
    def of(cls, request: JobRequest) -> JobSpec:
        """The spec of an accepted request (its seed given or drawn); no second validation."""
        if request.seed is None:
            raise ValueError("a job spec needs the request's seed: draw it first")
        if isinstance(request, JobSpec):
            return request
        fields = {name: getattr(request, name) for name in JobRequest.model_fields}
        fields["version"] = lowest_version(request)
        return cls.model_construct(request.model_fields_set | {"version"}, **fields)

    @model_validator(mode="after")
    def _fields_of_its_version(self) -> JobSpec:
        newer = [
            name for name, since in ADDED_IN.items() if self._uses(name) and since > self.version
        ]
        if newer:
            raise ValueError(f"version {self.version} has no field {', '.join(newer)}")
        return self

    def _uses(self, name: str) -> bool:
        """Whether the spec sets `name` (a field ADDED_IN names: None is unset)."""
        return getattr(self, name) is not None

    @classmethod
    def decode(cls, stored: Mapping[str, Any]) -> JobSpec:
        """The spec of a stored request; JobSpecRefused when this release cannot read it."""
        version = stored.get("version", 1)  # the one read of the raw dict: its version
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise JobSpecRefused(f"the job spec's version {version!r} is not a version", version)
        if version > JOB_SPEC_VERSION:
            raise JobSpecRefused(
                f"the job spec is version {version}, newer than this release reads "
                f"(up to {JOB_SPEC_VERSION}): a newer Kiln wrote it",
                version,
            )
        try:
            return cls.model_validate(stored)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors()
            )
            raise JobSpecRefused(f"the stored job spec is invalid: {problems}", version) from None

    def encode(self) -> dict[str, Any]:
        """The JSON-safe dict a record stores (`NewJob.request`), its version included."""
        return self.model_dump(mode="json", exclude=self._unused())

    def encode_json(self) -> bytes:
        """`encode()` as JSON bytes, written by pydantic (a batch item line's `r`)."""
        return self.__pydantic_serializer__.to_json(self, exclude=self._unused())

    def _unused(self) -> set[str] | None:
        """Fields a newer version added that this spec leaves unset: never written.

        So a spec of an older version reads as that version's release wrote it.
        """
        unused = {name for name in ADDED_IN if not self._uses(name)}
        return unused or None


def lowest_version(request: JobRequest) -> Literal[1, 2]:
    """The lowest spec version that holds every field `request` uses."""
    used = [since for name, since in ADDED_IN.items() if getattr(request, name) is not None]
    return 2 if max(used, default=1) == 2 else 1
