"""Compile cache artifacts through a real object store (moto S3): published once, fetched fresh."""

from __future__ import annotations

from pathlib import Path

from kiln.gpu_worker.settings import ARTIFACTS_FILE, GpuWorkerSettings
from kiln.storage.objects import open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.compile_store import (
    compile_cache_key,
    fetch_compile_cache,
    publish_compile_cache,
)

DEVICES = ["cpu:1"]


def settings_for(folder: Path, compile_on: bool = True) -> GpuWorkerSettings:
    """Compile on, caches in `folder`."""
    return GpuWorkerSettings(compile=compile_on, compile_cache_dir=folder)


def test_a_fresh_volume_gets_the_artifacts_another_node_published(
    s3_settings: StorageSettings, tmp_path: Path
) -> None:
    objects = open_object_store(s3_settings)
    built, fresh = tmp_path / "built", tmp_path / "fresh"
    built.mkdir()
    (built / ARTIFACTS_FILE).write_bytes(b"artifacts v1")

    assert not fetch_compile_cache(objects, settings_for(fresh), DEVICES)  # nothing stored yet
    assert publish_compile_cache(objects, settings_for(built), DEVICES)
    assert not publish_compile_cache(objects, settings_for(built), DEVICES)  # same bytes: kept
    assert fetch_compile_cache(objects, settings_for(fresh), DEVICES)
    assert (fresh / ARTIFACTS_FILE).read_bytes() == b"artifacts v1"
    assert not fetch_compile_cache(objects, settings_for(fresh), DEVICES)  # has its own now

    (built / ARTIFACTS_FILE).write_bytes(b"artifacts v2")  # a later start compiled more
    assert publish_compile_cache(objects, settings_for(built), DEVICES)
    key = compile_cache_key(objects.prefix, DEVICES)
    assert objects.get(key) == b"artifacts v2"
    assert key.startswith(f"{objects.prefix}/compile-cache/torch-")
    assert compile_cache_key(objects.prefix, ["cuda:0"]) != key


def test_nothing_moves_without_compile(s3_settings: StorageSettings, tmp_path: Path) -> None:
    objects = open_object_store(s3_settings)
    (tmp_path / ARTIFACTS_FILE).write_bytes(b"artifacts")
    assert not publish_compile_cache(objects, settings_for(tmp_path, compile_on=False), DEVICES)
    assert objects.head(compile_cache_key(objects.prefix, DEVICES)) is None
