"""`Notifier.changed_since` where a notifier can no longer vouch for a mark: publishes it forgot (in process)
and publishes it may have missed (Redis: a subscription never established, lost, or re-established).

An ack poll answered from memory trusts a False answer instead of looking at the database, so every case in
which publishes may have gone unseen must answer True."""

from __future__ import annotations

import socket
import threading
import uuid

import redis

from services.jobqueue import InMemoryNotifier
from services.jobqueue.redis_results import RedisNotifier
from services.scheduler import RequestId
from tests.integration.test_jobqueue_redis import REDIS_URL, kill_connections, wait_until
from tests.required import require_redis

WATCHED = [RequestId("watched")]


def test_a_publish_the_in_process_notifier_no_longer_remembers_counts_as_a_change() -> None:
    notifier = InMemoryNotifier(max_retained=1)
    mark = notifier.mark()
    notifier.publish(RequestId("other-1"))
    assert not notifier.changed_since(WATCHED, mark)
    notifier.publish(RequestId("other-2"))  # forgets other-1: it might have been any id, "watched" included
    assert notifier.changed_since(WATCHED, mark)
    assert not notifier.changed_since(WATCHED, notifier.mark())


def test_a_redis_notifier_that_never_subscribed_vouches_for_nothing() -> None:
    """Also: `close()` ends the listener even though it never got through. The client is made from a URL, as
    the services make theirs (`services.runtime.redis_replicas.connect`): such connections try once, and the
    listener's own loop backs off and notices `close()`. (A client built with `redis.Redis(host=...)` retries
    each connect ten times with redis-py's backoff, so its listener outlived the test by seconds, drawing
    from the process-wide `random` while later tests ran.)"""
    with socket.socket() as probe:  # a port nothing listens on: the subscription can never be established
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.2)
    threads_before = set(threading.enumerate())
    notifier = RedisNotifier(dead, prefix="carpool-test-never-subscribed")
    try:
        assert notifier.changed_since(WATCHED, notifier.mark())  # not listening yet
        assert not notifier.start(timeout_s=0.3)
        assert notifier.changed_since(WATCHED, notifier.mark())  # listening, but never subscribed
    finally:
        notifier.close()
        dead.close()
    assert [t.name for t in set(threading.enumerate()) - threads_before if t.name == "carpool-notifier"] == []


def test_a_mark_taken_before_a_lost_subscription_counts_as_changed() -> None:
    """Publishes made while the subscription was down are lost to this process: a mark from before the
    resubscription cannot be vouched for, a fresh one can (no grace period is set here)."""
    require_redis(REDIS_URL)
    prefix = f"carpool-test-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(REDIS_URL)
    admin = redis.Redis.from_url(REDIS_URL)
    subscriber = redis.Redis.from_url(REDIS_URL, client_name=f"{prefix}-sub")
    notifier = RedisNotifier(client, prefix=prefix, subscriber=subscriber, resubscribe_grace_s=0.0)
    try:
        assert notifier.start()
        mark = notifier.mark()
        assert not notifier.changed_since(WATCHED, mark)
        assert kill_connections(admin, f"{prefix}-sub", "pubsub") == 1
        assert wait_until(lambda: notifier.is_subscribed and notifier.subscriptions == 2)
        assert notifier.changed_since(WATCHED, mark)
        assert not notifier.changed_since(WATCHED, notifier.mark())
    finally:
        notifier.close()
        for connection in (subscriber, admin, client):
            connection.close()
