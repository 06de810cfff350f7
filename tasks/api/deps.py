"""What the API routes share: a router, the caller, the context, visibility, errors and docs.

The dependencies here are `async`: FastAPI runs a plain `def` dependency in a worker thread,
and three thread hops per request cost more than the work they do (none blocks but a key's
first read, which still goes to a thread).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kiln.storage.errors import JobNotFound
from kiln.storage.job_store import JobRecord
from kiln.storage.keys import valid_id
from kiln.tasks.api.auth import AuthError, Principal
from kiln.tasks.api.context import ApiContext
from kiln.tasks.api.json_guard import StrictJsonRoute
from kiln.tasks.contract.responses import ErrorBody

bearer = HTTPBearer(auto_error=False, description="An API key from `kiln keys create`.")


def _query_names(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def no_unknown_query(request: Request) -> None:
    """422 for query parameters the route does not declare (a typo must not pass silently)."""
    if not request.scope.get("query_string"):
        return  # nothing to check (most requests): spares walking the route's dependencies
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known = _query_names(dependant)
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        raise RequestValidationError(
            [
                {
                    "loc": ("query", name),
                    "msg": "unknown query parameter",
                    "type": "extra_forbidden",
                    "input": request.query_params[name],
                }
                for name in unknown
            ]
        )


def api_router() -> APIRouter:
    """A router for API routes: strict JSON bodies, unknown query parameters refused."""
    return APIRouter(dependencies=[Depends(no_unknown_query)], route_class=StrictJsonRoute)


RETRY_AFTER_DOC = {
    "Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}
}


def error_docs(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses with an `ErrorBody`."""
    docs: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in codes}
    if 429 in docs:
        docs[429]["headers"] = RETRY_AFTER_DOC
    return docs


def json_error_docs(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Like `error_docs`, for routes whose success is not JSON (their errors still are)."""
    schema = {"$ref": "#/components/schemas/ErrorBody"}
    docs: dict[int | str, dict[str, Any]] = {
        code: {"description": "Error", "content": {"application/json": {"schema": schema}}}
        for code in codes
    }
    if 429 in docs:
        docs[429]["headers"] = RETRY_AFTER_DOC
    return docs


async def context(request: Request) -> ApiContext:
    """The app's shared parts."""
    ctx: ApiContext = request.app.state.kiln
    return ctx


Ctx = Annotated[ApiContext, Depends(context)]


async def authorization(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str | None:
    """The request's `Authorization` header as the authenticator (and its cache) knows it."""
    return f"Bearer {credentials.credentials}" if credentials else None


Authorization = Annotated[str | None, Depends(authorization)]


async def principal(ctx: Ctx, header: Authorization) -> Principal:
    """The caller; 401 without a valid key (unless auth is switched off)."""
    try:
        # a cached key is known at once; only a Redis read goes to a worker thread
        caller = ctx.auth.cached_principal(header)
        if caller is None:
            caller = await run_in_threadpool(ctx.auth.principal, header)
        return caller
    except AuthError as exc:
        raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from exc


Caller = Annotated[Principal, Depends(principal)]


async def admin(caller: Caller) -> Principal:
    """The caller, if it holds an admin key; 403 otherwise."""
    if not caller.admin:
        raise HTTPException(403, "only admin API keys may do this")
    return caller


Admin = Annotated[Principal, Depends(admin)]
JobId = Annotated[str, Path(max_length=128, description="A job id.")]
AUTH_ERRORS = error_docs(401)
JOB_ERRORS = error_docs(401, 403, 404)


def visible_job(ctx: ApiContext, caller: Principal, job_id: str) -> JobRecord:
    """The job's record; 404 when unknown, 403 when it belongs to another key."""
    try:
        if not valid_id(job_id):
            raise JobNotFound(job_id)
        record = ctx.store.get(job_id)
    except JobNotFound as exc:
        raise HTTPException(404, f"no job {job_id!r}") from exc
    if not caller.may_see(record.owner):
        raise HTTPException(403, "this job belongs to another API key")
    return record


def field_error(
    loc: tuple[str | int, ...], msg: str, kind: str, value: Any, **ctx: Any
) -> Exception:
    """A 422 in FastAPI's own error shape, naming the field."""
    error: dict[str, Any] = {"loc": loc, "msg": msg, "type": kind, "input": value}
    if ctx:
        error["ctx"] = ctx
    return RequestValidationError([error])


def refuse_over_page_limit(ctx: ApiContext, limit: int) -> None:
    """422 naming `limit` and the maximum when a list page asks for more than it."""
    maximum = ctx.settings.list_limit_max  # KILN_LIST_LIMIT_MAX
    if limit > maximum:
        msg = f"limit is at most {maximum}"
        raise field_error(("query", "limit"), msg, "less_than_equal", limit, le=maximum)
