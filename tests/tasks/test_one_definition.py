"""The shared facts (kiln.common) as the contract shows them, and what depends on them.

Each fact has one home, `kiln.common`, which tasks, gpu_worker and storage all import: no copy
needs a test to keep it equal. What stays here is behaviour: the job view's states, the CLI's
lanes, the seeds a submit draws and accepts, and that the shared facts load nothing heavy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.common.request import DRAWN_SEED_LIMIT, SEED_MAX, Lane
from kiln.common.states import TERMINAL_STATES, TRANSITIONS, JobState, is_terminal
from kiln.storage.job_store import JobStore
from kiln.storage.records import NewJob
from kiln.tasks.cli.main import build_parser
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.lanes import LANES
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import api_settings

# --- job states: kiln/common/states.py ----------------------------------------------------


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


def test_the_shared_facts_and_the_client_load_no_redis_celery_boto3_or_torch() -> None:
    probe = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import kiln.common.states, kiln.common.request, kiln.common.limits\n"
        "import kiln.common.media, kiln.common.defaults\n"
        "plain = sorted(set(sys.modules) - before)\n"
        "import kiln.common.logs\n"
        "logs = sorted(set(sys.modules) - before)\n"
        "import kiln.tasks.client\n"
        "print(json.dumps([plain, logs, sorted(sys.modules)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    plain, logs, loaded = json.loads(result.stdout)
    # the bottom layer needs the standard library only; its log formats python-json-logger
    stdlib = {"kiln", *sys.stdlib_module_names}
    assert [m for m in plain if m.split(".")[0] not in stdlib] == []
    assert {m.split(".")[0] for m in logs} - stdlib <= {"pythonjsonlogger", "typing_extensions"}
    assert [m for m in loaded if m.startswith("kiln.storage")] == []  # the client needs no store
    heavy = {"redis", "celery", "kombu", "boto3", "botocore", "torch"}
    assert [m for m in loaded if m.split(".")[0] in heavy] == []


# --- lanes: kiln/common/request.py Lane -------------------------------------------------------


def test_lanes_are_the_contracts_enum_everywhere() -> None:
    assert LANES == tuple(Lane) == ("interactive", "bulk")
    assert NewJob(id="j", request={}).lane == LANES[0] == JobRequest(prompt="p").priority
    parser = build_parser()
    assert parser.parse_args(["worker"]).queues == ",".join(LANES)
    assert parser.parse_args(["submit", "p", "--priority", "bulk"]).priority == Lane.bulk
    with pytest.raises(SystemExit):
        parser.parse_args(["submit", "p", "--priority", "urgent"])


def test_the_cli_leaves_request_defaults_to_the_contract() -> None:
    args = build_parser().parse_args(["submit", "p"])
    for name in ("pipeline", "width", "height", "num_frames", "steps", "num_outputs", "priority"):
        assert getattr(args, name) is None, name


# --- seeds ----------------------------------------------------------------------------------------


def test_any_seed_up_to_the_generators_largest_is_accepted() -> None:
    assert JobRequest(prompt="p", seed=SEED_MAX).seed == SEED_MAX
    assert 0 < DRAWN_SEED_LIMIT <= SEED_MAX


def test_a_drawn_seed_stays_below_the_drawn_limit(job_store: JobStore) -> None:
    submitter = Submitter(job_store, api_settings(), lambda *_args, **_kw: None)
    for _ in range(20):
        record, _ = Intake(submitter, None).submit(JobRequest(prompt="p", width=64, height=64))
        assert 0 <= record.request["seed"] < DRAWN_SEED_LIMIT


# --- the idempotency fingerprint: storage.job_store.request_fingerprint -------------------------


def test_idempotency_binds_the_request_as_sent_not_the_drawn_seed(job_store: JobStore) -> None:
    submitter = Submitter(job_store, api_settings(), lambda *_args, **_kw: None)
    first, created = Intake(submitter, None).submit(JobRequest(prompt="p"), idempotency_key="k")
    spelled_out = JobRequest.model_validate({"prompt": "p", "width": 512, "steps": 25})
    again, created_again = Intake(submitter, None).submit(spelled_out, idempotency_key="k")
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
