"""The encoding options come from the job record: the contract's defaults, never the node's own."""

from __future__ import annotations

from kiln.gpu_worker.outputs import OutputSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.uploads import output_spec


def test_a_video_is_encoded_at_the_recorded_fps_and_format() -> None:
    record = JobRequest(prompt="waves", num_frames=5, fps=12, output_format="gif").to_record()
    assert output_spec(record) == OutputSpec(format="gif", fps=12)


def test_a_request_without_fps_or_format_gets_the_contracts_defaults() -> None:
    video = JobRequest(prompt="waves", num_frames=5).to_record()
    image = JobRequest(prompt="a fox").to_record()
    defaults = JobRequest.model_fields["fps"].default
    assert output_spec(video) == OutputSpec(format="mp4", fps=defaults)
    assert output_spec(image).format == "png"
    assert output_spec(video).quality is None  # the contract has no quality: each codec's own
