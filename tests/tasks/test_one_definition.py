"""Each fact of the contract is stated once.

Where a second copy must exist (gpu_worker and storage cannot import tasks), a test here keeps
the two equal, so they cannot drift apart unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from kiln.storage.records import NewJob
from kiln.storage.states import TRANSITIONS
from kiln.storage.status import JobStore
from kiln.tasks.cli.main import build_parser
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.schemas import (
    DRAWN_SEED_LIMIT,
    IMAGE_FORMATS,
    MAX_FRAMES,
    MAX_SIDE,
    MAX_STEPS,
    SEED_MAX,
    SIZE_MULTIPLE,
    VIDEO_FORMATS,
    JobRequest,
    Lane,
    OutputFormat,
)
from kiln.tasks.contract.states import TERMINAL_STATES, JobState, is_terminal
from kiln.tasks.contract.views import JobView
from kiln.tasks.queue.lanes import LANES
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import api_settings

# --- job states: storage/states.py ----------------------------------------------------------


def test_the_view_status_is_the_state_machines_enum() -> None:
    assert JobView.model_fields["status"].annotation is JobState
    schema = JobView.model_json_schema()
    assert schema["$defs"]["JobState"]["enum"] == [str(state) for state in JobState]
    view = JobView.model_validate(job_body("expired"))
    assert view.status is JobState.EXPIRED
    assert json.loads(view.model_dump_json())["status"] == "expired"  # the JSON is plain strings


def test_terminal_states_are_those_the_table_lets_nothing_leave() -> None:
    assert {state for state, nxt in TRANSITIONS.items() if not nxt} == TERMINAL_STATES
    for state in JobState:
        assert is_terminal(state) == is_terminal(str(state)) == (not TRANSITIONS[state])
    assert not is_terminal("progress")  # an event type that is no state


def test_the_client_and_the_states_load_no_redis_celery_or_boto3() -> None:
    probe = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import kiln.storage.states\n"
        "states = sorted(set(sys.modules) - before)\n"
        "import kiln.tasks.client\n"
        "print(json.dumps([states, sorted(sys.modules)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    states, loaded = json.loads(result.stdout)
    # storage/states.py, and storage/__init__.py on the way, need only the standard library
    foreign = [m for m in states if m.split(".")[0] not in {"kiln", *sys.stdlib_module_names}]
    assert foreign == []
    heavy = {"redis", "celery", "kombu", "boto3", "botocore", "torch"}
    assert [m for m in loaded if m.split(".")[0] in heavy] == []


# --- lanes: contract.schemas.Lane --------------------------------------------------------------


def test_lanes_are_the_contracts_enum_everywhere() -> None:
    assert LANES == tuple(Lane) == ("interactive", "bulk")
    # storage keeps a plain default (it cannot import tasks): it must be the first lane
    default_lane = next(f for f in dataclasses.fields(NewJob) if f.name == "lane").default
    assert default_lane == LANES[0] == JobRequest(prompt="p").priority
    parser = build_parser()
    assert parser.parse_args(["worker"]).queues == ",".join(LANES)
    assert parser.parse_args(["submit", "p", "--priority", "bulk"]).priority == Lane.bulk
    with pytest.raises(SystemExit):
        parser.parse_args(["submit", "p", "--priority", "urgent"])


def test_the_cli_leaves_request_defaults_to_the_contract() -> None:
    args = build_parser().parse_args(["submit", "p"])
    for name in ("pipeline", "width", "height", "num_frames", "steps", "num_outputs", "priority"):
        assert getattr(args, name) is None, name


# --- output formats: contract.schemas ------------------------------------------------------------


def test_gpu_worker_encodes_exactly_the_contracts_formats() -> None:
    from kiln.gpu_worker import outputs

    assert set(outputs.IMAGE_FORMATS) == set(IMAGE_FORMATS)
    assert set(outputs.VIDEO_FORMATS) == set(VIDEO_FORMATS)
    assert JobRequest.model_json_schema()["properties"]["output_format"]["anyOf"][0]["enum"] == [
        *IMAGE_FORMATS,
        *VIDEO_FORMATS,
    ]
    assert OutputFormat.__args__ == (*IMAGE_FORMATS, *VIDEO_FORMATS)  # type: ignore[attr-defined]


# --- ranges: the schema, the limits' defaults, the generators -------------------------------------


def test_undeclared_limits_are_the_schemas_own_ranges() -> None:
    limits = PipelineLimits()
    assert (limits.max_width, limits.max_height, limits.size_multiple) == (
        MAX_SIDE,
        MAX_SIDE,
        SIZE_MULTIPLE,
    )
    assert (limits.max_steps, limits.max_frames) == (MAX_STEPS, MAX_FRAMES)
    properties = JobRequest.model_json_schema()["properties"]
    assert properties["width"]["maximum"] == properties["height"]["maximum"] == MAX_SIDE
    assert properties["steps"]["maximum"] == MAX_STEPS
    assert properties["num_frames"]["maximum"] == MAX_FRAMES
    from kiln.gpu_worker.pipelines import diffusers_limits

    assert diffusers_limits.MAX_SIDE == MAX_SIDE


def test_any_accepted_seed_is_one_the_generators_take() -> None:
    from kiln.gpu_worker.pipelines.diffusers_pipeline import SEED_MASK

    assert SEED_MAX == SEED_MASK
    assert JobRequest(prompt="p", seed=SEED_MAX).seed == SEED_MAX
    assert 0 < DRAWN_SEED_LIMIT <= SEED_MAX


def test_a_drawn_seed_stays_below_the_drawn_limit(job_store: JobStore) -> None:
    submitter = Submitter(job_store, api_settings(), lambda *_args, **_kw: None)
    for _ in range(20):
        record, _ = submitter.submit(JobRequest(prompt="p", width=64, height=64))
        assert 0 <= record.request["seed"] < DRAWN_SEED_LIMIT


# --- the idempotency fingerprint: storage.status.request_fingerprint -----------------------------


def test_idempotency_binds_the_request_as_sent_not_the_drawn_seed(job_store: JobStore) -> None:
    submitter = Submitter(job_store, api_settings(), lambda *_args, **_kw: None)
    first, created = submitter.submit(JobRequest(prompt="p"), idempotency_key="k")
    spelled_out = JobRequest.model_validate({"prompt": "p", "width": 512, "steps": 25})
    again, created_again = submitter.submit(spelled_out, idempotency_key="k")
    assert created
    assert not created_again
    assert again.id == first.id


def job_body(status: str) -> dict[str, object]:
    """A minimal job view body."""
    parameters = JobRequest(prompt="p").to_record()
    return {
        "id": "j1",
        "status": status,
        "lane": "interactive",
        "created_at": 1.0,
        "attempts": 0,
        "parameters": parameters,
    }
