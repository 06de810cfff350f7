"""README's configuration tables list every setting, with its default, as the classes define it."""

from __future__ import annotations

from tests.docs.settings_tables import README, readme_tables, render_tables


def test_readme_lists_every_setting_as_the_classes_define_it() -> None:
    # A setting added, renamed or re-defaulted in code without README following fails here;
    # `python -m tests.docs.settings_tables` rewrites the tables.
    assert readme_tables(README.read_text()) == render_tables()
