r"""A cheap proof, from a batch line's bytes alone, that the API's strict-JSON check would pass it.

`api.json_guard.body_errors` parses with a hook on every number and then walks the whole value:
the costliest step of accepting a batch. Almost every line of a real file is plain, and for a
plain line the walk cannot find anything, for reasons that show in its bytes. One reason per
refusal of `body_errors`:

- not UTF-8: the screen decodes the line itself;
- a lone UTF-16 surrogate or a NUL: JSON text can carry them only as escapes, `\uD800` to
  `\uDFFF` and `\u0000` (strict UTF-8 refuses encoded surrogates, and `json` raw control
  characters), so without those escapes, neither (other escapes, `\u00e9` say, are fine);
- `NaN`, `Infinity`, `-Infinity`: their names;
- an integer above 2**64-1 needs 20 digits in a row; a float that overflows to infinity (above
  1.8e308) needs an exponent of three digits or more, or an integer part of over 200 digits
  (fraction digits add no magnitude, and JSON allows no leading zeros);
- nesting deeper than `max_depth` needs more opening brackets than that.

A line the screen is unsure of (a prompt that says "NaN", say) simply goes through `body_errors`;
the screen only ever skips work, it never decides a refusal.
"""

from __future__ import annotations

import re

_SUSPECT = re.compile(
    rb"\\u(?:0000|[dD][89a-fA-F])"  # an escaped NUL or surrogate
    rb"|NaN|Infinity"
    rb"|[0-9](?:[eE][-+]?[0-9]{3}|[0-9]{19})"  # a big exponent, 20 digits in a row
)


def plain_text(raw: bytes, max_depth: int) -> str | None:
    """The line as text if it plainly holds nothing `body_errors` refuses, else None."""
    if raw.count(b"{") + raw.count(b"[") > max_depth or _SUSPECT.search(raw):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
