"""The checks of POST /v1/jobs beyond the request schema, applied to each line of a batch.

A known pipeline, the pipeline's limits (as live nodes announce them, else the built-in ones) and,
for a line with a webhook, a configured secret and a URL that passes the SSRF rules. Errors come
in FastAPI's shape with `loc` relative to the line, exactly as `api.job_routes` reports them.
"""

from __future__ import annotations

from typing import Any

from kiln.tasks.contract.request_check import (
    PipelineDecl,
    check_request,
    requested_pipeline,
    restated_bounds,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.ssrf import Resolver, UnsafeUrl, UrlPolicy, check_url, system_resolver

Error = dict[str, Any]
# distinct webhook URLs whose SSRF verdict one batch keeps (each check resolves the host)
_URL_CACHE_MAX = 1024


class LineChecks:
    """Pipeline, limit and webhook checks of one batch's lines (URL verdicts cached per batch)."""

    def __init__(
        self,
        submitter: Submitter,
        settings: KilnSettings,
        policy: UrlPolicy,
        resolve: Resolver = system_resolver,
    ) -> None:
        self.submitter = submitter
        self.settings = settings
        self.policy = policy
        self.resolve = resolve
        self._urls: dict[str, str | None] = {}
        self._declared: dict[str, PipelineDecl] = {}

    def errors(self, request: JobRequest) -> list[Error]:
        """Why the request would be refused by POST /v1/jobs; [] when it would be accepted."""
        # the same one pass as POST /v1/jobs (`Submitter.violation`)
        violation = check_request(request, self._declaration(request.pipeline))
        if violation is not None:
            return [_error(violation.loc(), violation.message, violation.kind)]
        if request.webhook is not None:
            problem = self._webhook_problem(request.webhook.url)
            if problem is not None:
                kind, msg = problem
                return [_error(("webhook", "url"), msg, kind)]
        return []

    def restated(self, errors: list[Any], data: dict[str, Any]) -> list[Any]:
        """A line's schema `errors`, a bound its pipeline declares lower named as the pipeline's."""
        if not any(error.get("type") == "less_than_equal" for error in errors):
            return errors  # the common refusals need no read of what the nodes declare
        pipeline = requested_pipeline(data)
        return restated_bounds(errors, pipeline, self._declaration(pipeline))

    def _declaration(self, pipeline: str) -> PipelineDecl:
        """`Submitter.declared`, built once per pipeline while the submitter's read is fresh.

        Every line of a file names one of a few pipelines: building what each declares again for
        every line was a fifth of a line's checks. A declaration is dropped when the submitter's
        read of the heartbeats goes stale, so it is never older than two of its periods.
        """
        if not self.submitter.served_is_fresh():
            self._declared.clear()
        declared = self._declared.get(pipeline)
        if declared is None:
            declared = self._declared[pipeline] = self.submitter.declared(pipeline)
        return declared

    def _webhook_problem(self, url: str) -> tuple[str, str] | None:
        secret = self.settings.webhook_secret
        if secret is None or not secret.get_secret_value():
            return "webhooks_disabled", "webhooks are not configured on this server"
        if url not in self._urls:
            if len(self._urls) >= _URL_CACHE_MAX:
                self._urls.clear()
            try:
                check_url(url, self.policy, self.resolve)
                self._urls[url] = None
            except UnsafeUrl as exc:
                self._urls[url] = f"refused: {exc}"
        refusal = self._urls[url]
        return ("unsafe_url", refusal) if refusal is not None else None


def _error(loc: tuple[str | int | None, ...], msg: str, kind: str) -> Error:
    return {"type": kind, "loc": [part for part in loc if part is not None], "msg": msg}
