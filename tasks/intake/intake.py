"""The intake: (request, caller, entrance) → a typed refusal, or an accepted job to write.

Every entrance calls it: POST /v1/jobs (`api.job_routes`), Python callers and `kiln submit` on
Redis (`submit`), a batch line at upload (`lines`, a per-file `LineIntake`) and at feeding
(`line_job`: the job of a line accepted at upload, as the feeder and a batch's retry make it).
The checks run in one order for all of them:

1. the schema (`JobRequest`: FastAPI's parse, a line's `request_of`, or the Python caller's);
2. the pipeline's declaration and limits, its inputs, LoRAs, speed and previews
   (`contract.request_check.check_request`, one pass, no I/O);
3. image inputs: an upload is the caller's own and within the limits, a URL passes the input
   allow-list (`KILN_INPUT_ALLOW_*`, SSRF rules);
4. the webhook rule: a secret is configured and the URL passes the webhook allow-list;
5. admission: an interactive job with a deadline the backlog cannot meet is refused (429);
6. quotas: the key's queued cap and the queue depth, checked in the step that writes the job.

A batch line passes 1-4 at upload; 5-6 do not refuse a line (bulk is never refused for latency,
and the feeder waits for room under the owner's cap instead). The seed is drawn once, by
`accept`, and the `NewJob` is built once, by `spec_job` from the job's versioned spec
(contract/job_spec.py: what the record stores), whatever the door.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from anyio import to_thread

from kiln.common.request import DRAWN_SEED_LIMIT
from kiln.common.tracing import (
    ADMISSION_SPAN,
    BATCH_ID_ATTRIBUTE,
    JOB_ID_ATTRIBUTE,
    QUEUE_ATTRIBUTE,
    ROOT,
    Carrier,
    SpanKind,
    current_carrier,
    job_carrier,
    set_span_attributes,
    span,
)
from kiln.storage.creation import QueueFull, request_fingerprint
from kiln.storage.errors import ObjectStoreError, QuotaExceeded
from kiln.storage.job_store import JobRecord, NewJob
from kiln.storage.object_base import ObjectStore
from kiln.storage.uploaded_inputs import UploadRefused, checked_upload, resolve_upload
from kiln.tasks.contract.image_refs import ImageRef
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.request_check import (
    PipelineDecl,
    Violation,
    check_request,
    image_refs,
    requested_pipeline,
    restated_bounds,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.upload_slots import CONTENT_TYPES
from kiln.tasks.intake.refusal import Accepted, Caller, Loc, Refusal, Refused
from kiln.tasks.queue.backlog import BacklogCache, late_start, needs_admission
from kiln.tasks.queue.lanes import queue_name
from kiln.tasks.queue.quotas import effective_cap
from kiln.tasks.queue.submit import Submitter, new_job_id
from kiln.tasks.webhooks.ssrf import (
    Resolver,
    UnsafeUrl,
    UrlPolicy,
    check_url,
    policy_from,
    system_resolver,
)

ANONYMOUS = Caller()


@dataclasses.dataclass(frozen=True)
class _Read:
    """A read one of the intake's steps needs: `call(*args)` may block, unless it is `cached`."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    cached: bool  # answered from memory: an event loop makes it in place

    def __call__(self) -> Any:
        return self.call(*self.args)


# the intake's checks as a generator: it yields its reads, is sent their answers, returns a refusal
_Checks = Generator[_Read, Any, "Refusal | None"]
WEBHOOK_LOC: Loc = ("webhook", "url")
# distinct image inputs and webhook URLs whose verdict one batch file keeps (each costs a HEAD or
# a DNS lookup; the lines of a file mostly repeat a few)
_VERDICTS_MAX = 1024
# lookups of one chunk of a batch file made at once (a HEAD or a DNS lookup each)
_LOOKUP_THREADS = 8


def spec_job(
    spec: JobSpec,
    *,
    job_id: str,
    owner: str | None,
    batch_id: str | None = None,
    idempotency_key: str | None = None,
    fingerprint: str | None = None,
    lane: str | None = None,
    trace: Carrier | None = None,
) -> NewJob:
    """The job of an accepted request's spec: the one place a `NewJob` is built.

    `lane`: for a spec stored without its own priority (the spec's default applies otherwise).
    `trace`: the job's W3C trace context (kiln/common/tracing.py), stored on its record.
    """
    own = "priority" in spec.model_fields_set or lane is None
    chosen = str(spec.priority if own else lane)
    return NewJob(
        id=job_id,
        request=spec.encode(),
        batch_id=batch_id,
        metadata=dict(spec.metadata),
        owner=owner,
        idempotency_key=idempotency_key,
        fingerprint=fingerprint,
        lane=chosen,
        queue=queue_name(chosen, spec.pipeline),
        trace=dict(trace or {}),
    )


def line_job(
    spec: JobSpec,
    job_id: str,
    batch_id: str,
    owner: str | None,
    lane: str,
    trace: Carrier | None = None,
) -> NewJob:
    """The job of a batch line accepted at upload (its stored spec: seed drawn then).

    `lane`: the batch's, for a line stored without its own priority. `trace`: the job's W3C
    trace context (`line_trace`).
    """
    return spec_job(spec, job_id=job_id, owner=owner, batch_id=batch_id, lane=lane, trace=trace)


def line_trace(
    job_id: str, batch_id: str, line: Mapping[str, str], batch: Mapping[str, str]
) -> Carrier:
    """The trace context of a batch line's job, made as the feeder writes it.

    Its admission span is a child of the line's own `traceparent` (else the root of a trace of
    its own) and links to the batch's span; tracing off, the line's context as it came.
    """
    facts = {JOB_ID_ATTRIBUTE: job_id, BATCH_ID_ATTRIBUTE: batch_id}
    with span(ADMISSION_SPAN, line or ROOT, links=[batch], attributes=facts) as admission:
        return job_carrier(admission, line)


def effective_request(request: JobRequest) -> JobRequest:
    """The request as its job runs it: its own seed, else one drawn now (the only draw)."""
    if request.seed is not None:
        return request
    return request.model_copy(update={"seed": random.randrange(DRAWN_SEED_LIMIT)})


def violation_refusal(violation: Violation) -> Refusal:
    """`check_request`'s finding as a refusal (422 naming the field)."""
    return Refusal(
        422,
        violation.kind,
        violation.loc(),
        violation.message,
        violation.value,
        violation.context(),
    )


class Intake:
    """The checks and the job of every entrance, over one submitter (what nodes serve, writes)."""

    def __init__(
        self,
        submitter: Submitter,
        objects: ObjectStore | None,
        *,
        resolve: Resolver = system_resolver,
        webhook_policy: UrlPolicy | None = None,
        backlogs: BacklogCache | None = None,
    ) -> None:
        self.submitter = submitter
        self.settings = settings = submitter.settings
        self.store = submitter.store
        self.objects = objects
        self.resolve = resolve
        allow = (settings.webhook_allow_http, settings.webhook_allow_hosts)
        self.webhook_policy = webhook_policy or policy_from(*allow)
        self.input_policy = policy_from(settings.input_allow_http, settings.input_allow_hosts)
        self.backlogs = backlogs or BacklogCache(submitter.store, settings)

    # --- 2. the one pass over what the pipeline declares -------------------------------------
    def declared(self, pipeline: str) -> PipelineDecl:
        """What the served pipelines declare about `pipeline` (the submitter's cached read)."""
        return self.submitter.declared(pipeline)

    def static_refusal(self, request: JobRequest, declared: PipelineDecl) -> Refusal | None:
        """Step 2: the pipeline, its limits, inputs, LoRAs, speed, previews; no I/O."""
        violation = check_request(request, declared)
        return None if violation is None else violation_refusal(violation)

    # --- 3-4. the checks that need I/O ------------------------------------------------------
    def needs_lookups(self, request: JobRequest, declared: PipelineDecl) -> bool:
        """Whether steps 3-4 have anything to look up (an image input or a webhook)."""
        if request.webhook is not None:
            return True
        return bool(request.inputs) and bool(image_refs(request, declared))

    def lookup_refusal(
        self,
        request: JobRequest,
        caller: Caller,
        declared: PipelineDecl,
        verdicts: dict[tuple[str | None, str], Refusal | None] | None = None,
    ) -> Refusal | None:
        """Steps 3-4: each image input (sorted by name), then the webhook's URL. Blocks (I/O).

        `verdicts` keeps what was looked up across the lines of one file (keyed by caller and
        reference); None looks everything up afresh.
        """
        for name, ref in image_refs(request, declared).items():
            refusal = self._remembered(
                verdicts, (caller.key_id, ref.text), self.image_refusal, caller, ref
            )
            if refusal is not None:
                named = f"{name}: {refusal.message}" if refusal.code == "image_input" else None
                return dataclasses.replace(
                    refusal, loc=("inputs", name), message=named or refusal.message
                )
        if request.webhook is not None:
            url = request.webhook.url
            return self._remembered(verdicts, (None, url), self.webhook_refusal, url)
        return None

    def _remembered(
        self,
        verdicts: dict[tuple[str | None, str], Refusal | None] | None,
        key: tuple[str | None, str],
        look: Any,
        *args: Any,
    ) -> Refusal | None:
        if verdicts is None:
            return look(*args)  # type: ignore[no-any-return]
        if key not in verdicts:
            if len(verdicts) >= _VERDICTS_MAX:
                verdicts.clear()
            verdicts[key] = look(*args)
        return verdicts[key]

    def image_refusal(self, caller: Caller, ref: ImageRef) -> Refusal | None:
        """One image input: an upload the caller's own and within limits, or an allowed URL."""
        loc: Loc = ("inputs",)
        try:
            if ref.kind == "upload":
                if self.objects is None:
                    msg = "no object store is configured; uploads are unavailable"
                    return Refusal(503, "object_store_unavailable", loc, msg, ref.text)
                key = resolve_upload(self.objects, caller.key_id, ref.target)
                limit = self.settings.upload_max_bytes
                checked_upload(self.objects, key, limit, CONTENT_TYPES["image"])
            else:
                check_url(ref.target, self.input_policy, self.resolve)
        except UnsafeUrl as exc:
            return Refusal(422, "unsafe_url", loc, f"refused: {exc}", ref.text)
        except (UploadRefused, ValueError) as exc:
            return Refusal(422, "image_input", loc, str(exc), ref.text)
        except ObjectStoreError:
            msg = "object store unavailable; retry later"
            return Refusal(503, "object_store_unavailable", loc, msg, ref.text)
        return None

    def webhook_refusal(self, url: str, loc: Loc = WEBHOOK_LOC) -> Refusal | None:
        """Step 4, the webhook rule (a job's, a line's or a batch's): a secret, a safe URL."""
        secret = self.settings.webhook_secret
        if secret is None or not secret.get_secret_value():
            msg = "webhooks are not configured on this server (no KILN_WEBHOOK_SECRET)"
            return Refusal(422, "webhooks_disabled", loc, msg, url)
        try:
            check_url(url, self.webhook_policy, self.resolve)
        except UnsafeUrl as exc:
            return Refusal(422, "unsafe_url", loc, f"refused: {exc}", url)
        return None

    # --- 5-6. admission and quotas -----------------------------------------------------------
    def needs_admission(self, request: JobRequest) -> bool:
        """Whether step 5 applies: an interactive job with a deadline (or admit-by-target)."""
        return needs_admission(request.priority, request.start_by, self.settings)

    def admission_refusal(self, request: JobRequest, scoped_key: str | None) -> Refusal | None:
        """Step 5: 429 when the backlog cannot start the job in time; may read Redis.

        A replay of an idempotency key that already names a job is let through to get that job.
        """
        if not self.needs_admission(request):
            return None
        if scoped_key is not None and self.store.idempotency_bound(scoped_key):
            return None
        backlog, now = self.backlogs.now(request.pipeline)
        late = late_start(backlog, request.priority, request.start_by, self.settings, now)
        if late is None:
            return None
        loc: Loc = ("start_by",) if request.start_by is not None else ()
        return Refusal(
            429, "late_start", loc, late.message(), request.start_by, {}, late.retry_after_s
        )

    def queued_cap(self, caller: Caller) -> int | None:
        """Step 6's cap on the caller's queued jobs (its own, else the server's default)."""
        return effective_cap(caller.max_queued, self.settings.max_queued_per_key)

    def write_refusal(self, exc: QueueFull | QuotaExceeded, caller: Caller) -> Refusal:
        """Step 6's refusal, from what the write itself found (nothing was written)."""
        retry_after = self.settings.queue_full_retry_after_s
        if isinstance(exc, QueueFull):
            return Refusal(
                429, "queue_full", (), "queue is full; retry later", None, {}, retry_after
            )
        cap = self.queued_cap(caller)
        msg = f"this API key has {cap} queued jobs, its maximum; retry later"
        return Refusal(429, "quota_exceeded", (), msg, None, {}, retry_after)

    # --- the accepted job --------------------------------------------------------------------
    def accept(
        self,
        request: JobRequest,
        caller: Caller,
        *,
        idempotency_key: str | None = None,
        trace: Carrier | None = None,
    ) -> Accepted:
        """The effective request (the seed drawn here, once) and its job, checks passed."""
        effective = effective_request(request)
        new = spec_job(
            JobSpec.of(effective),
            job_id=new_job_id(),
            owner=caller.key_id,
            idempotency_key=idempotency_key,
            # of the request as sent (defaults filled, no drawn seed): a replay must match it
            fingerprint=request_fingerprint(request.to_record()) if idempotency_key else None,
            trace=trace,
        )
        return Accepted(effective, new)

    def _checks(self, request: JobRequest, caller: Caller, scoped_key: str | None) -> _Checks:
        """Steps 2-5 in their one order; each read they need is yielded to the entrance's driver.

        (`refusal` makes every read in place; `admit`, on an event loop, hands the ones that may
        block to a worker thread.) Returns the first refusal, or None.
        """
        served = self.submitter
        declared = yield _Read(self.declared, (request.pipeline,), served.served_is_fresh())
        refusal = self.static_refusal(request, declared)  # no I/O
        if refusal is None and self.needs_lookups(request, declared):
            refusal = yield _Read(self.lookup_refusal, (request, caller, declared), False)
        if refusal is None and self.needs_admission(request):
            cached = scoped_key is None and self.backlogs.is_fresh(request.pipeline)
            refusal = yield _Read(self.admission_refusal, (request, scoped_key), cached)
        return refusal

    def refusal(
        self, request: JobRequest, caller: Caller, scoped_key: str | None
    ) -> Refusal | None:
        """Steps 2-5, each read made on the calling thread (the direct entrance)."""
        checks = self._checks(request, caller, scoped_key)
        try:
            read = next(checks)
            while True:
                read = checks.send(read())
        except StopIteration as done:
            return cast(Refusal | None, done.value)

    async def admit(
        self, request: JobRequest, caller: Caller, *, scoped_key: str | None, trace: Carrier
    ) -> Accepted:
        """Steps 2-5 on an event loop (POST /v1/jobs), then the accepted job; Refused if not.

        A read answered from memory runs in place: a thread hop costs a plain submission more
        CPU than its own work. One that may block goes to a worker thread: the nodes'
        heartbeats (read every few seconds), an image input's HEAD or a URL's DNS, a backlog or
        an idempotency key's read.
        """
        checks = self._checks(request, caller, scoped_key)
        try:
            read = next(checks)
            while True:
                answer = read() if read.cached else await to_thread.run_sync(read)
                read = checks.send(answer)
        except StopIteration as done:
            refusal = cast(Refusal | None, done.value)
        if refusal is not None:
            raise Refused(refusal)
        return self.accept(request, caller, idempotency_key=scoped_key, trace=trace)

    def submit(
        self,
        request: JobRequest,
        caller: Caller = ANONYMOUS,
        *,
        idempotency_key: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> tuple[JobRecord, bool]:
        """The direct entrance: check, write and publish one job; Refused names what is wrong.

        Returns the record and whether it was created (vs an idempotent replay). `trace`: the
        caller's W3C carrier (else the caller's current span's); the admission span is its child.
        """
        given = trace if trace else current_carrier()
        with span(ADMISSION_SPAN, given, kind=SpanKind.SERVER) as admission:
            return self._submit(request, caller, idempotency_key, job_carrier(admission, given))

    def _submit(
        self,
        request: JobRequest,
        caller: Caller,
        idempotency_key: str | None,
        trace: Carrier,
    ) -> tuple[JobRecord, bool]:
        refusal = self.refusal(request, caller, idempotency_key)
        if refusal is not None:
            raise Refused(refusal)
        new = self.accept(request, caller, idempotency_key=idempotency_key, trace=trace).new
        set_span_attributes({JOB_ID_ATTRIBUTE: new.id, QUEUE_ATTRIBUTE: new.queue or ""})
        submitter = self.submitter
        try:
            record, created = self.store.create_job(
                new,
                max_queued=self.queued_cap(caller),
                max_depth=self.settings.max_queue_depth,
                message=submitter.message_for(new),
            )
        except (QueueFull, QuotaExceeded) as exc:
            raise Refused(self.write_refusal(exc, caller)) from exc
        submitter.accepted(record, created)
        return record, created

    def lines(self, caller: Caller) -> LineIntake:
        """The intake of one batch file's lines (what it looks up is kept for the file)."""
        return LineIntake(self, caller)


class LineIntake:
    """Steps 1-4 for the lines of one batch file, then each valid line's accepted request.

    What nodes declare is built once per pipeline while the submitter's read of the heartbeats
    is fresh, and each distinct image input and webhook URL is looked up once per file: building
    the declaration again for every line was a fifth of a line's checks.
    """

    def __init__(self, intake: Intake, caller: Caller) -> None:
        self.intake = intake
        self.caller = caller
        self._declared: dict[str, PipelineDecl] = {}
        self._verdicts: dict[tuple[str | None, str], Refusal | None] = {}

    def declared(self, pipeline: str) -> PipelineDecl:
        """`Intake.declared`, kept per pipeline while the submitter's read stays fresh."""
        if not self.intake.submitter.served_is_fresh():
            self._declared.clear()
        declared = self._declared.get(pipeline)
        if declared is None:
            declared = self._declared[pipeline] = self.intake.declared(pipeline)
        return declared

    def prefetch(self, requests: Sequence[JobRequest | object]) -> None:
        """Look up at once (threads) the distinct image inputs and webhook URLs of a chunk's lines.

        Only lines that pass step 2 are looked at; `check` then finds each verdict kept. A chunk
        of lines naming their own uploads costs one round trip's wait, not one per line.
        """
        intake, caller = self.intake, self.caller
        todo: dict[tuple[str | None, str], Callable[[], Refusal | None]] = {}
        for request in requests:
            if not isinstance(request, JobRequest) or (not request.inputs and not request.webhook):
                continue
            declared = self.declared(request.pipeline)
            if intake.static_refusal(request, declared) is not None:
                continue
            for ref in image_refs(request, declared).values():
                key = (caller.key_id, ref.text)
                if key not in self._verdicts:
                    todo[key] = functools.partial(intake.image_refusal, caller, ref)
            if request.webhook is not None and (None, request.webhook.url) not in self._verdicts:
                todo[(None, request.webhook.url)] = functools.partial(
                    intake.webhook_refusal, request.webhook.url
                )
        if len(todo) < 2:
            return  # one lookup is as quick where `check` makes it
        if len(self._verdicts) + len(todo) > _VERDICTS_MAX:
            self._verdicts.clear()
        with ThreadPoolExecutor(min(_LOOKUP_THREADS, len(todo))) as pool:
            found = list(pool.map(lambda look: look(), todo.values()))
        self._verdicts.update(zip(todo, found, strict=True))

    def restated(self, errors: list[Any], data: dict[str, Any]) -> list[Any]:
        """Step 1's `errors` of a line, a bound its pipeline declares lower named as its own."""
        if not any(error.get("type") == "less_than_equal" for error in errors):
            return errors  # the common refusals need no read of what the nodes declare
        pipeline = requested_pipeline(data)
        return restated_bounds(errors, pipeline, self.declared(pipeline))

    def check(self, request: JobRequest) -> JobRequest | Refusal:
        """Steps 2-4 for a line that passed the schema: its effective request (seed drawn)."""
        # Intake.static_refusal and needs_lookups inlined: this runs once per line of a file
        declared = self.declared(request.pipeline)
        violation = check_request(request, declared)
        if violation is not None:
            return violation_refusal(violation)
        if request.webhook is not None or request.inputs:
            refusal = self.intake.lookup_refusal(request, self.caller, declared, self._verdicts)
            if refusal is not None:
                return refusal
        # drawn once, stored with the line: a line fed again (or retried) makes the same job
        return request if request.seed is not None else effective_request(request)
