"""Chaos in cluster mode: six tenants train through the SDK while every part of the cluster fails at random.

Each round (seeded; the plan is printed, and `CHAOS_SEED=N` reruns round N) builds a cluster of processes
(`tests.integration.chaos_support.ChaosCluster`): three worker replicas, two `carpool scheduler` processes
(active + standby), a `carpool serve --mode cluster` gateway, and a private Redis (AOF, fsync always) and
PostgreSQL of the round's own. `TENANTS` SDK tenants train `STEPS` steps each (forward_backward +
optim_step, a `save_state` every `SAVE_EVERY` steps and after the last). At points drawn from the seed
(counted in acknowledged optim steps of all tenants), a driver thread fires each fault of
`chaos_support.FAULTS` once (`CHAOS_REPEATS` times in `make chaos`), in a seeded order:

- SIGKILL a worker replica holding adapters (a replacement starts, as Ray Serve would start one);
- SIGKILL the active scheduler (a new standby starts);
- SIGKILL the active scheduler **and** the busiest replica in the same instant, inside one snapshot
  interval (the double failure the journal's `applied` closes);
- SIGKILL the gateway and start it again on its port;
- SIGKILL Redis and restart it; stop PostgreSQL in immediate mode and restart it.

One tenant (seeded) also sends one bad request of its own (a token outside the vocabulary).

After each round:
- every future resolved within `FUTURE_BOUND_S` (else the round fails naming the tenant and the call), and
  no call failed but the bad tenant's one request, refused with a 400 naming the vocabulary: the SDK's own
  retries are all any tenant needed to ride out the faults;
- every save of every tenant equals that tenant's weights after the same number of steps trained alone
  on an in-process engine (≤ 1e-5): each acknowledged optim_step applied exactly once, by every tenant;
- each tenant's first save loads (weights and optimizer) into a new training client whose next step
  equals the reference's;
- every process the driver killed died of SIGKILL, and a live scheduler holds the lease.

Size: `CHAOS_ROUNDS` rounds (1 in `make test`), `CHAOS_TENANTS` tenants (6), `CHAOS_STEPS` steps (4),
`CHAOS_REPEATS` (1); `make chaos` runs more rounds of more steps with every fault twice.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deploy.settings import ClusterSettings
from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, LoraSpec
from tests.integration import chaos_processes
from tests.integration.chaos_support import ChaosCluster, FaultDriver, FaultPlan, private_servers
from tests.integration.cluster_support import (
    BASE,
    LEARNING_RATE,
    RANK,
    assert_equal_to_reference,
    cluster_settings,
    create_tenant_keys,
    domain_datum,
    prepared_database,
    seed_of,
    tenant_batches,
)
from tests.sdk_janitor import close_all

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
TENANTS = int(os.environ.get("CHAOS_TENANTS", "6"))
STEPS = int(os.environ.get("CHAOS_STEPS", "4"))
REPEATS = int(os.environ.get("CHAOS_REPEATS", "1"))
SEEDS = [int(os.environ["CHAOS_SEED"])] if "CHAOS_SEED" in os.environ else list(range(1, ROUNDS + 1))
REPLICAS = 3
SAVE_EVERY = 2
FUTURE_BOUND_S = 300.0
"""The most any future may stay pending: far above what a fault costs (seconds), so only a hang reaches it."""


@pytest.fixture(scope="module", autouse=True)
def fork_server() -> Iterator[None]:
    yield
    chaos_processes.stop_fork_server()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_acknowledged_step_survives_random_faults(seed: int, tmp_path: Path, tiny_model_dir: Path) -> None:
    plan = FaultPlan.draw(seed, TENANTS, STEPS, REPEATS)
    print(plan)
    with private_servers(tmp_path) as (redis_server, postgres):
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(postgres.url),
                                    redis_server.url, "carpool")
        cluster = ChaosCluster(settings, redis_server, postgres, tmp_path / "logs")
        try:
            runs, resumed = _round(cluster, plan)
        except BaseException:
            print(cluster.log_tails())
            raise
        finally:
            cluster.close()
        _check(runs, resumed, plan, settings, tiny_model_dir)


def _round(cluster: ChaosCluster, plan: FaultPlan) -> tuple[list[TenantRun], list[str]]:
    """Start the cluster, train every tenant through the plan's faults, resume each from its first save."""
    started = time.monotonic()
    cluster.start(REPLICAS)
    print(f"  cluster up in {time.monotonic() - started:.0f} s")
    keys = create_tenant_keys(cluster.settings.resolved_database_url(), TENANTS, prefix=f"chaos{plan.seed}")
    driver = FaultDriver(plan, cluster.actions(random.Random(f"victims-{plan.seed}")), 2 * FUTURE_BOUND_S)
    runs = [TenantRun(tenant, FUTURE_BOUND_S) for tenant in range(TENANTS)]
    started = time.monotonic()
    driver.start()
    with ThreadPoolExecutor(max_workers=TENANTS) as pool:
        futures = [pool.submit(train_tenant, cluster.url, key, run, STEPS, driver,
                               plan.refused[1] if run.tenant == plan.refused[0] else None)
                   for run, key in zip(runs, keys, strict=True)]
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            driver.abandon()  # nobody waits for steps that will not come
        for future in futures:
            future.result()
        fired = driver.join()
        print(f"  {TENANTS} tenants trained through {len(fired)} faults in {time.monotonic() - started:.0f} s")
        resumed = list(pool.map(lambda run, key: resume_one_step(cluster.url, key, run), runs, keys))
    assert len(fired) == len(plan.points), fired
    for process in cluster.killed:
        process.join(30)
    assert [process.exitcode for process in cluster.killed] == [-signal.SIGKILL] * len(cluster.killed)
    assert cluster.lease_holder_alive(), "no live scheduler holds the lease after the round"
    return runs, resumed


def _check(runs: list[TenantRun], resumed: list[str], plan: FaultPlan, settings: ClusterSettings,
           model_dir: Path) -> None:
    saves = sorted(runs[0].saves)
    assert all(sorted(run.saves) == saves for run in runs), [sorted(run.saves) for run in runs]
    expected = reference_at(model_dir, TENANTS, STEPS, {*saves, SAVE_EVERY + 1})
    database_url, data_dir = settings.resolved_database_url(), settings.data_dir
    for step in saves:
        assert_equal_to_reference(database_url, data_dir, [run.saves[step] for run in runs],
                                  [reference[step] for reference in expected], f"seed {plan.seed} step {step} ")
    assert_equal_to_reference(database_url, data_dir, resumed, [reference[SAVE_EVERY + 1] for reference in expected],
                              f"seed {plan.seed} resumed from step {SAVE_EVERY} ")
    for run in runs:
        if run.tenant == plan.refused[0]:
            assert run.refused is not None and "vocabulary" in run.refused, run.refused
        else:
            assert run.refused is None
    print(f"seed {plan.seed}: slowest future {max(run.slowest_s for run in runs):.1f} s "
          f"(bound {FUTURE_BOUND_S:.0f} s)")


# -- tenants ------------------------------------------------------------------------------------------------
@dataclass
class TenantRun:
    """What one tenant saw: its saves by the number of optim steps before them, and how long it waited."""

    tenant: int
    bound_s: float
    saves: dict[int, str] = field(default_factory=dict)
    refused: str | None = None
    slowest_s: float = 0.0

    def resolve(self, future: Any, what: str, since: float) -> Any:
        """`future`'s value, or a clear failure once it has been pending for the bound."""
        try:
            value = future.result(timeout=self.bound_s)
        except TimeoutError as error:
            raise AssertionError(f"tenant {self.tenant}: {what} unresolved after {self.bound_s:.0f} s") from error
        self.slowest_s = max(self.slowest_s, time.monotonic() - since)
        return value


def sdk_data(batch: list[Any]) -> list[Any]:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": t[1:].tolist(), "weights": [1.0] * (len(t) - 1)})
            for t in batch]


def train_tenant(url: str, key: str, run: TenantRun, steps: int, driver: FaultDriver,
                 refuse_at: int | None) -> TenantRun:
    """One tenant's run through the SDK: forward_backward + optim_step per step, `save_state` every
    `SAVE_EVERY` steps and after the last; at step `refuse_at` first one request with a token outside any
    vocabulary (the tenant's own fault: a clear 400, after which it trains on)."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        started = time.monotonic()
        training = run.resolve(service.create_lora_training_client(base_model=BASE, rank=RANK,
                                                                   seed=seed_of(run.tenant)), "create", started)
        for step, batch in enumerate(tenant_batches(run.tenant, steps)):
            if step == steps - 1:
                driver.hold()
            if step == refuse_at:
                run.refused = _refused(training, run)
            started = time.monotonic()
            fb = training.forward_backward(sdk_data(batch), "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
            assert run.resolve(fb, f"forward_backward {step}", started).metrics["loss:sum"] > 0
            run.resolve(optim, f"optim_step {step}", started)
            driver.step_done()
            if (step + 1) % SAVE_EVERY == 0 or step + 1 == steps:
                started = time.monotonic()
                save = training.save_state(f"step-{step + 1}")
                run.saves[step + 1] = run.resolve(save, f"save after step {step + 1}", started).path
        return run
    finally:
        close_all([service])  # finishes the session: its heartbeat stops


def _refused(training: Any, run: TenantRun) -> str:
    import tinker
    from tinker import types

    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**6]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    started = time.monotonic()
    try:
        run.resolve(training.forward_backward([bad], "cross_entropy"), "the refused request", started)
    except tinker.BadRequestError as error:
        return str(error)
    raise AssertionError(f"tenant {run.tenant}: a token outside the vocabulary was accepted")


def resume_one_step(url: str, key: str, run: TenantRun) -> str:
    """Load the tenant's first save (weights and optimizer) into a new training client, run the next step
    there and save it: a save is only as good as what loading it gives back."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        step, started = SAVE_EVERY, time.monotonic()
        load = service.create_training_client_from_state_with_optimizer(run.saves[step])
        training = run.resolve(load, "load", started)
        fb = training.forward_backward(sdk_data(tenant_batches(run.tenant, step + 1)[step]), "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        run.resolve(fb, "resumed forward_backward", started)
        run.resolve(optim, "resumed optim_step", started)
        return str(run.resolve(training.save_state("resumed"), "resumed save", started).path)
    finally:
        close_all([service])  # finishes the session: its heartbeat stops


def reference_at(model_dir: Path, tenants: int, steps: int, at: set[int]) -> list[dict[int, dict[str, Any]]]:
    """Each tenant trained alone on an in-process engine, its weights after each step count in `at`."""
    from worker.engine.engine import Engine, EngineConfig

    engine = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    references: list[dict[int, dict[str, Any]]] = []
    for tenant in range(tenants):
        adapter = AdapterId(f"reference-{tenant}")
        engine.create_adapter(adapter, LoraSpec(rank=RANK, seed=seed_of(tenant)))
        weights = {}
        for step, batch in enumerate(tenant_batches(tenant, steps)):
            engine.forward_backward([ForwardBackwardWork(adapter, [domain_datum(t) for t in batch])])
            engine.optim_step(adapter, AdamParams(learning_rate=LEARNING_RATE))
            if step + 1 in at:
                weights[step + 1] = {n: p.detach().clone() for n, p in engine.adapter(adapter).params.items()}
        references.append(weights)
    return references


