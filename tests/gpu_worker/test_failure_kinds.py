"""What a rank's failure is taken for (`classify_failure`): the group's fault or the pipeline's.

A peer rank that dies under a collective surfaces on the survivors as gloo's or NCCL's transport
error, which torch raises as a plain RuntimeError: it must read as a broken group (the request is
retried on a rebuilt group), not as the pipeline's failure (the job would fail for good).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.gpu_worker.protocol import FailureKind
from kiln.gpu_worker.ranks.forward import classify_failure

# what a surviving gloo rank raised in a broadcast when its peer exited (torch 2.13, CPU)
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:33496: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)


def test_a_peer_gone_under_a_collective_is_the_groups_fault() -> None:
    assert classify_failure(RuntimeError(GLOO_PEER_GONE)) is FailureKind.COLLECTIVE
    assert classify_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp")) is (
        FailureKind.COLLECTIVE
    )
    assert classify_failure(dist.DistNetworkError("timed out")) is FailureKind.COLLECTIVE


def test_the_pipelines_own_errors_stay_its_own() -> None:
    assert classify_failure(RuntimeError("shape mismatch")) is FailureKind.ERROR
    assert classify_failure(ValueError("bad prompt")) is FailureKind.ERROR
    assert classify_failure(torch.OutOfMemoryError("CUDA out of memory")) is FailureKind.OOM
