"""The job contract; the bottom room: every other room, the client included, may import it.

Settings, the request (schemas) and what comes back (views, responses), job states, pipeline
limits, retry delays.
"""
