"""Support for the chaos rounds (tests/integration/test_chaos.py): a cluster made of killable processes,
the seeded fault plan, the driver that fires it while tenants train, and the tenants' SDK loop.

`ChaosCluster` runs every part the way production does, each in a process of its own or a private server:
worker replicas (the `ReplicaHost` Ray Serve would host), scheduler processes (`carpool scheduler`'s body;
one active, standbys) and the gateway (`carpool serve --mode cluster`'s body), all forked by
`tests.integration.chaos_processes`, plus a private Redis (AOF, fsync always, as docs/cluster.md requires)
and a private PostgreSQL. Faults are real: SIGKILL for
processes, SIGKILL + restart for Redis, an immediate-mode stop + start for PostgreSQL. The machine's shared
servers are never touched. Whatever is killed is replaced as an orchestrator would (a new replica, a new
standby scheduler, the gateway again on its port), so every round keeps the same shape.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import httpx
import redis

from deploy.settings import ClusterSettings
from services.runtime.journal import RedisPlacement
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink, connect
from tests.e2e.server import free_port, is_carpool_health
from tests.integration import chaos_processes
from tests.integration.cluster_support import (
    BASE,
    PrivatePostgres,
    PrivateRedis,
    postgres_bin_dir,
    settings_env,
    wait_until,
)
from tests.required import missing, require_binary

FAULTS = ("replica", "scheduler", "scheduler+replica", "gateway", "redis", "postgres")
START_BOUND_S = 240.0
"""How long a process may take to start on a busy shared box before the round fails (not a measurement)."""


@contextlib.contextmanager
def private_servers(workdir: Path) -> Iterator[tuple[PrivateRedis, PrivatePostgres]]:
    """A Redis and a PostgreSQL of the round's own, which its faults may kill; removed afterwards."""
    require_binary("redis-server", "redis-server")
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        missing("PostgreSQL's initdb and pg_ctl", "neither `pg_config --bindir` nor /usr/lib/postgresql/*/bin "
                "has them", "install the PostgreSQL server package (apt-get install postgresql)")
    redis_server, postgres = PrivateRedis(workdir / "redis"), PrivatePostgres(bin_dir)
    try:
        redis_server.start()
        postgres.init()
        yield redis_server, postgres
    finally:
        redis_server.kill()
        postgres.remove()


@dataclass(frozen=True)
class FaultPlan:
    """A round's faults: each fires once `point` optim steps (of all tenants together) are acknowledged."""

    seed: int
    points: tuple[tuple[int, str], ...]
    refused: tuple[int, int]
    """(tenant, step): that tenant sends one request the gateway must refuse (its own fault, nobody else's)."""

    @classmethod
    def draw(cls, seed: int, tenants: int, steps: int, repeats: int = 1) -> FaultPlan:
        rng = random.Random(seed)
        kinds = list(FAULTS) * repeats
        rng.shuffle(kinds)
        # Tenants wait before their last step until every fault fired, so each point must be reachable
        # without anyone's last step.
        reachable = tenants * (steps - 1)
        assert reachable >= len(kinds), f"{tenants} tenants x {steps} steps leave no room for {len(kinds)} faults"
        points = sorted(rng.sample(range(1, reachable + 1), len(kinds)))
        return cls(seed, tuple(zip(points, kinds, strict=True)), (rng.randrange(tenants), rng.randrange(steps)))

    def __str__(self) -> str:
        faults = ", ".join(f"{kind} after step {point}" for point, kind in self.points)
        tenant, step = self.refused
        return f"chaos seed {self.seed}: {faults}; tenant {tenant} sends a bad request at step {step}"


class FaultDriver:
    """Fires a plan's faults in order on a thread of its own while the tenants train.

    Tenants report each acknowledged optim step (`step_done`) and wait before their last step (`hold`) until
    every fault has fired, so a fast round cannot finish before its faults."""

    def __init__(self, plan: FaultPlan, actions: Mapping[str, Callable[[], str]], bound_s: float) -> None:
        self.plan = plan
        self.fired: list[str] = []
        self.error: BaseException | None = None
        self._actions = actions
        self._bound_s = bound_s
        self._steps = 0
        self._abandoned = False
        self._changed = threading.Condition()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_done(self) -> None:
        with self._changed:
            self._steps += 1
            self._changed.notify_all()

    def hold(self) -> None:
        if not self._finished.wait(self._bound_s):
            raise AssertionError(f"the faults had not all fired after {self._bound_s:.0f} s: {self.fired}")

    def abandon(self) -> None:
        """Training failed: stop waiting for steps that will not come."""
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()

    def join(self) -> list[str]:
        """The faults fired, in order; re-raises the driver's failure."""
        self._thread.join(self._bound_s)
        if self.error is not None:
            raise self.error
        return self.fired

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for point, kind in self.plan.points:
                with self._changed:
                    if not self._changed.wait_for(lambda p=point: self._steps >= p or self._abandoned,
                                                  self._bound_s) or self._abandoned:
                        return
                    at = self._steps
                fired_at = time.monotonic()
                detail = self._actions[kind]()
                self.fired.append(f"{kind} after step {at} (t={fired_at - started:.0f} s, "
                                  f"{time.monotonic() - fired_at:.0f} s): {detail}")
                print(f"  fault: {self.fired[-1]}", flush=True)
        except BaseException as error:  # reported by join(), in the test's thread
            self.error = error
        finally:
            self._finished.set()


class Gateway:
    """The cluster gateway as a forked process on a fixed port: killable like a crash, restartable."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.env = {**env, "CARPOOL_PORT": str(self.port)}
        self.log_path = log_path
        self.process: BaseProcess | None = None

    def start(self, timeout_s: float) -> None:
        self.process = chaos_processes.start("gateway", self.env, self.log_path)
        wait_until(self._healthy, timeout_s, "the cluster gateway did not become healthy")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(10)
            self.process = None

    def _healthy(self) -> bool:
        assert self.process is not None
        if not self.process.is_alive():
            raise AssertionError(f"gateway exited:\n{self.log_path.read_text()}")
        try:
            return is_carpool_health(httpx.get(f"http://127.0.0.1:{self.port}/api/v1/healthz", timeout=2))
        except httpx.HTTPError:
            return False


@dataclass
class ChaosCluster:
    """Every part of a cluster as something the test can kill; see the module docstring."""

    settings: ClusterSettings
    redis_server: PrivateRedis
    postgres: PrivatePostgres
    logs: Path
    replicas: list[BaseProcess] = field(default_factory=list)
    schedulers: list[BaseProcess] = field(default_factory=list)
    killed: list[BaseProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **settings_env(self.settings)}
        self.keys = ClusterKeys(BASE, self.settings.redis_prefix)
        self.client = connect(self.settings.redis_url)
        self.link = RedisReplicaLink(self.client, self.keys, heartbeat_ttl_s=self.settings.heartbeat_ttl_seconds)
        self.gateway = Gateway(self.env, self.logs / "gateway.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def start(self, replicas: int) -> None:
        """Start everything at once and wait until it serves."""
        for _ in range(replicas):
            self._spawn("replica", self.replicas)
        self._spawn("scheduler", self.schedulers)
        self._spawn("scheduler", self.schedulers)
        self.gateway.start(START_BOUND_S)  # healthy once the replicas published the model
        wait_until(lambda: len(self._replica_load()) == replicas, START_BOUND_S, "replicas did not register")
        self._active_scheduler()

    def actions(self, rng: random.Random) -> dict[str, Callable[[], str]]:
        """What each fault of `FAULTS` does; each returns a line for the round's log."""
        return {"replica": lambda: self._kill_replica(rng), "scheduler": self._kill_scheduler,
                "scheduler+replica": self._kill_scheduler_and_replica, "gateway": self._kill_gateway,
                "redis": self._restart_redis, "postgres": self._restart_postgres}

    def lease_holder_alive(self) -> bool:
        return self._holder() is not None

    def close(self) -> None:
        self.gateway.kill()
        running = [p for p in self.schedulers + self.replicas if p.is_alive()]
        for process in running:
            process.terminate()
        for process in running:
            process.join(20)
            if process.is_alive():
                process.kill()
                process.join(10)
        self.client.close()

    def log_tails(self, lines: int = 15) -> str:
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- faults ---------------------------------------------------------------------------------------------
    def _kill_replica(self, rng: random.Random) -> str:
        load = self._loaded_replicas()
        victim = rng.choice(sorted(load, key=_pid))
        self._kill(victim)
        self._spawn("replica", self.replicas)  # as Ray Serve starts a replacement
        return f"replica pid {victim.pid} ({load[victim]} adapters) SIGKILLed"

    def _kill_scheduler(self) -> str:
        active = self._active_scheduler()
        self._kill(active)
        self._spawn("scheduler", self.schedulers)  # the next standby
        return f"active scheduler pid {active.pid} SIGKILLed"

    def _kill_scheduler_and_replica(self) -> str:
        active = self._active_scheduler()
        load = self._loaded_replicas()
        victim = max(sorted(load, key=_pid), key=lambda p: load[p])
        self._kill(active)  # the same instant: inside one snapshot interval
        self._kill(victim)
        self._spawn("scheduler", self.schedulers)
        self._spawn("replica", self.replicas)
        return f"active scheduler pid {active.pid} and replica pid {victim.pid} ({load[victim]} adapters) SIGKILLed"

    def _kill_gateway(self) -> str:
        pid = self.gateway.process.pid if self.gateway.process is not None else None
        self.gateway.kill()  # SIGKILL; the SDK retries connection errors against its successor on the port
        self.gateway.start(START_BOUND_S)
        return f"gateway pid {pid} SIGKILLed and restarted"

    def _restart_redis(self) -> str:
        self.redis_server.kill()  # SIGKILL: with fsync always, every acknowledged write is on disk
        time.sleep(1.0)  # down for a moment, as a crashed server restarted by its supervisor is
        self.redis_server.start()
        return "Redis SIGKILLed and restarted"

    def _restart_postgres(self) -> str:
        self.postgres.stop("immediate")  # a crash as far as clients can tell; WAL recovery on start
        time.sleep(1.5)
        self.postgres.start()
        return "PostgreSQL stopped (immediate) and restarted"

    # -- processes ------------------------------------------------------------------------------------------
    def _spawn(self, role: str, into: list[BaseProcess]) -> None:
        into.append(chaos_processes.start(role, self.env, self.logs / f"{role}-{len(into)}.log"))

    def _kill(self, process: BaseProcess) -> None:
        process.kill()  # SIGKILL
        self.killed.append(process)

    def _holder(self) -> BaseProcess | None:
        """Our live scheduler process that holds the lease, if any (the holder's name carries its pid)."""
        holder = _quietly(lambda: self.client.get(self.keys.lease))
        if not holder:
            return None
        pid = int(holder.decode().rsplit(":", 2)[1])
        return next((p for p in self.schedulers if p.pid == pid and p.is_alive()), None)

    def _active_scheduler(self) -> BaseProcess:
        wait_until(lambda: self._holder() is not None, START_BOUND_S, "no live scheduler holds the lease")
        holder = self._holder()
        assert holder is not None
        return holder

    def _replica_load(self) -> dict[BaseProcess, int]:
        """Our running replica processes that are registered, with the number of adapters each holds."""
        infos = _quietly(self.link.replica_infos) or []
        placement = _quietly(RedisPlacement(self.client, self.keys).load) or {}
        running = {p.pid: p for p in self.replicas if p.is_alive()}
        return {running[i.pid]: sum(1 for r in placement.values() if r == i.replica_id)
                for i in infos if i.pid in running}

    def _loaded_replicas(self) -> dict[BaseProcess, int]:
        """Like `_replica_load`, only those holding adapters (waits for one: a kill must cost a restore)."""
        loaded: dict[BaseProcess, int] = {}

        def some() -> bool:
            loaded.clear()
            loaded.update({p: n for p, n in self._replica_load().items() if n > 0})
            return bool(loaded)

        wait_until(some, START_BOUND_S, "no replica holds an adapter")
        return dict(loaded)


def _pid(process: BaseProcess) -> int:
    return process.pid or 0


def _quietly(read: Callable[[], Any]) -> Any:
    """A read of the cluster's Redis that may meet the moment it restarts (None then: the caller polls)."""
    try:
        return read()
    except redis.RedisError:
        return None
