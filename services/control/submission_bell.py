"""`SubmissionBell`: wakes the batched sampling pollers of a sampling session when one of its samples is queued.

`retrieve_futures` holds a poll while its target has nothing to report, waiting on the notifier for the
completion of the target's unfinished requests (services/control/batch_futures.py). A sample queued after
the poll looked is not among them, so the submission rings the session's bell, and the held poll waits on the
bell's key as well. The bell rings through the notifier (`Notifier.publish` of `key(session)`), so a poll held
by another gateway process of a cluster hears it too, and the notifier's `mark`/`wait_any` tell a ring after
the poll's look from one it has already seen (a ring is rung after the submission is committed, so a sample
the look missed always rings after the poll's mark). The control context makes its bell with its own
notifier; a bell made without one rings nowhere.
"""

from __future__ import annotations

from services.jobqueue.protocol import Notifier
from services.scheduler.requests import RequestId

KEY_PREFIX = "sample-submitted:"
"""The bell's notifier keys: no request id starts with it (ids are `req-…`-like tokens, never with a colon)."""


class SubmissionBell:
    """Rings a sampling session's key on the notifier when a sample of the session is queued here."""

    def __init__(self, notifier: Notifier | None = None) -> None:
        self._notifier = notifier

    def ring(self, sampling_id: str) -> None:
        """Wake every poll of `sampling_id` that looked before now, in any gateway process."""
        if self._notifier is not None:
            self._notifier.publish(RequestId(self.key(sampling_id)))

    @staticmethod
    def key(sampling_id: str) -> str:
        """The notifier key a held poll of `sampling_id` waits on for new submissions."""
        return f"{KEY_PREFIX}{sampling_id}"
