"""Webhooks: job events as signed callbacks.

Which job events become callbacks (enqueue), what a message says (message), one delivery attempt
(delivery), and the SSRF guard every attempt passes (ssrf).
"""
