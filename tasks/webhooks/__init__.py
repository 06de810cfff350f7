"""Webhooks: which job events become signed callbacks (enqueue), what a message says (message),
one delivery attempt (delivery), and the SSRF guard every attempt passes (ssrf)."""
