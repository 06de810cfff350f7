"""The job contract; the bottom room: every other room, the client included, may import it.

Settings, the request (schemas) and what comes back (views, responses), pipeline limits, retry
delays. The facts it shares with gpu_worker and storage (job states, ranges, formats, lanes,
request fields, content types) live below every package, in `kiln.common`.
"""
