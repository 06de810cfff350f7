"""What a job's previews may be (the request's `preview` field): the contract's and the ranks'."""

from __future__ import annotations

from typing import Literal, get_args

PreviewFormat = Literal["webp", "png", "jpeg"]
PREVIEW_FORMATS: tuple[str, ...] = get_args(PreviewFormat)
DEFAULT_PREVIEW_FORMAT: PreviewFormat = "webp"
DEFAULT_PREVIEW_SIDE = 256  # pixels of a preview's longer side, at most
MIN_PREVIEW_SIDE = 8
MAX_PREVIEW_SIDE = 1024
# A preview of at most this many encoded bytes rides inside its event (base64); a larger one is
# stored as an object the event names by URL.
PREVIEW_INLINE_MAX = 64 * 1024
# A node marks the input schema it announces for a pipeline with whether rank 0 can decode its
# previews (a decoder the pipeline names, or a VAE): false, and a request for previews is a 422.
PREVIEWS_KEY = "x-kiln-previews"
