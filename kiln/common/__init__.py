"""Facts every Kiln package shares: the bottom layer, which imports nothing of Kiln's and no torch.

`kiln.tasks`, `kiln.gpu_worker` and `kiln.storage` may all import it (pyproject.toml's import
contracts say so), so each fact here has one home: the job and batch states (`states`), why a job
stops early (`stops`), the payloads of its state-change events (`job_events`), the
request's ranges, fields and output formats (`request`), the tiny pipelines' limits (`limits`),
content types and upload references (`media`), the distribution's name and extras
(`distribution`), the defaults the CLI, the worker options and the
group's config share (`defaults`), and the log line formats (`logs`). Standard library and
pydantic-free except `logs`, which needs python-json-logger, and `job_events` (pydantic models,
which the contract's event union is made of).
"""
