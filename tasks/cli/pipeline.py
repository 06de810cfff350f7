"""`kiln pipeline check SPEC [--device cpu]`: try a pipeline as a node would, in this process.

The spec is loaded as a rank loads it (a `python:` module from the working directory or
`PYTHONPATH`), run once at its smallest size and once stopped from `on_step_end`
(`tasks.node.pipeline_check`); then its limits and inputs are printed. A spec that cannot load
says why in one line and exits 2; a pipeline that loads but misbehaves, in one line and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kiln.tasks.cli.exits import EXIT_JOB_FAILED, UsageError, print_json

if TYPE_CHECKING:
    from kiln.tasks.node.pipeline_check import PipelineReport


def add_parser(sub: Any) -> None:
    """`kiln pipeline check ...`."""
    pipeline = sub.add_parser("pipeline", help="check a pipeline before serving it")
    actions = pipeline.add_subparsers(dest="pipeline_action", required=True)
    check = actions.add_parser(
        "check",
        help="load SPEC here, run one step at its smallest size and a stop; print its limits",
    )
    check.add_argument(
        "spec", metavar="SPEC", help="tiny, diffusers:<folder>, python:<module>:<factory>, ..."
    )
    check.add_argument("--device", default="cpu", help="the torch device to load it on")
    check.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """Run `kiln pipeline check`."""
    # Deferred: the check loads torch and the pipeline.
    from kiln.tasks.node.pipeline_check import CheckFailed, SpecError, check_pipeline

    try:
        report = check_pipeline(args.spec, args.device)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    except CheckFailed as exc:
        print(f"kiln: pipeline check {args.spec}: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    if args.json:
        print_json(report_data(report))
    else:
        for line in report_lines(report):
            print(line)
    return 0


def report_data(report: PipelineReport) -> dict[str, Any]:
    """A passing check as JSON."""
    return {
        "spec": report.spec,
        "name": report.name,
        "device": report.device,
        "ok": True,
        "supported_fields": sorted(report.fields),
        "request": {
            "width": report.request.width,
            "height": report.request.height,
            "steps": report.request.steps,
            "num_frames": report.request.num_frames,
        },
        "output_shapes": [list(shape) for shape in report.output_shapes],
        "resumes": report.resumes,
        "limits": dict(report.limits),
        "inputs": report.inputs,
    }


def report_lines(report: PipelineReport) -> list[str]:
    """A passing check as text: what ran, then what the pipeline declares."""
    request = report.request
    shapes = ", ".join(str(shape) for shape in report.output_shapes)
    limits = " ".join(f"{k}={v}" for k, v in report.limits.items()) or "none declared"
    inputs = json.dumps(report.inputs, sort_keys=True) if report.inputs else "none declared"
    return [
        f"ok: {report.spec} ({report.name}) on {report.device}, loaded in {report.load_s:.2f} s",
        f"  run:     {request.width}×{request.height}, {request.steps} step, "
        f"{request.num_frames} frame(s) → uint8 {shapes} in {report.run_s:.2f} s; "
        f"on_step_end called {report.steps_reported}×",
        "  stop:    StopDenoising from on_step_end ended run() after step 1",
        "  resume:  "
        + (
            "save_state/restore_state: a run resumed after step 2 of 4 gave the same bytes"
            if report.resumes
            else "no save_state/restore_state: an interrupted job restarts from step 0"
        ),
        f"  fields:  {', '.join(sorted(report.fields))}",
        f"  limits:  {limits}",
        f"  inputs:  {inputs}",
    ]
