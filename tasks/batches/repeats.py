"""Lines whose custom_id repeats an earlier line's, removed from a committed batch input.

Repeats are known only once a whole file is read (`unique_ids`). A refused file just reports them;
with skip_invalid the repeated lines were already written to the batch's input as items, so the
committed input is copied once more without them (only a file with repeats pays for this).
"""

from __future__ import annotations

from kiln.storage.object_base import ObjectStore, StoredObject
from kiln.storage.object_streams import iter_lines, open_writer
from kiln.tasks.batches.lines import item_number


def drop_repeats(objects: ObjectStore, stored: StoredObject, lines: set[int]) -> StoredObject:
    """Rewrite the committed input `stored` without the items of `lines`, under the same key."""
    writer = open_writer(objects, stored.key, stored.content_type)
    try:
        for raw in iter_lines(objects, stored.key):
            if raw and item_number(raw) not in lines:
                writer.write(raw + b"\n")
        return writer.commit()
    except BaseException:
        writer.abort()
        raise
