"""The HTTP API: the app, its routes, auth, and the guards in front of it."""
