"""Errors the repositories raise; the gateway maps them to HTTP statuses (404, 409).

Lookups that merely find nothing return None instead: these are for writes whose precondition failed.
"""

from __future__ import annotations


class NotFoundError(LookupError):
    """A referenced row does not exist *for this tenant* (another tenant's row counts as missing)."""


class ConflictError(ValueError):
    """The row would duplicate an existing one (a tenant name, a checkpoint name within a run)."""
