"""The job contract: settings, the request (schemas) and what comes back (views, responses), job
states, pipeline limits, retry delays. The bottom room: every other room, the client included,
may import it."""
