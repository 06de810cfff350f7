"""`kiln worker`'s sleep, compile and warm-up flags: refused by name, layered over the settings."""

from __future__ import annotations

import pytest

from kiln.gpu_worker.sleep import node_asleep, node_warming
from kiln.tasks.node.worker import WorkerOptions, group_settings

TINY = {"tiny": "tiny"}


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"warmup": ("512x512",)}, "--warmup 512x512: warm-up shape"),
        ({"warmup": ("64x64x2", "64x0x2")}, "--warmup 64x0x2: warm-up shape"),
        ({"idle_sleep_s": 0.0}, "--idle-sleep-s 0.0: must be a positive"),
        ({"idle_sleep_s": -5.0}, "--idle-sleep-s -5.0: must be a positive"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(options: dict[str, object], refusal: str) -> None:
    with pytest.raises(ValueError, match="^" + refusal.replace(".", r"\.")):
        WorkerOptions(pipelines=TINY, **options)  # type: ignore[arg-type]


def test_flags_override_the_settings_and_absent_flags_keep_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KILN_SLEEP_MODE", "offload")
    monkeypatch.setenv("KILN_IDLE_SLEEP_S", "300")
    monkeypatch.setenv("KILN_WARMUP", "64x64x2")
    from_env = group_settings(WorkerOptions(pipelines=TINY))
    assert (from_env.sleep_mode, from_env.idle_sleep_s, from_env.compile) == ("offload", 300, False)
    assert from_env.warmup == ["64x64x2"]

    flagged = WorkerOptions(
        pipelines=TINY, idle_sleep_s=5, sleep_mode="drop", compile=True, warmup=("512x512x25",)
    )
    settings = group_settings(flagged)
    assert (settings.sleep_mode, settings.idle_sleep_s, settings.compile) == ("drop", 5, True)
    assert settings.warmup == ["512x512x25"]


def test_a_node_of_replica_groups_is_asleep_only_when_every_group_is() -> None:
    one_awake = {"asleep": False, "groups": [{"asleep": True}, {"asleep": False}]}
    all_asleep = {"asleep": False, "groups": [{"asleep": True}, {"asleep": True}]}
    assert not node_asleep(one_awake)
    assert node_asleep(all_asleep)
    assert node_asleep({"asleep": True})
    assert node_warming({"groups": [{"warming": False}, {"warming": True}]})
    assert not node_warming({"warming": False})
