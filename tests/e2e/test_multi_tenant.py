"""Three tenants train at once on one `carpool serve`, each with its own key and `ServiceClient` (issue item 2).

Each tenant runs in its own thread; a barrier lines the threads up before every step, and each submits
its `forward_backward` and `optim_step` futures before waiting on either, so the three tenants' requests
sit in the scheduler's queue together and share packed passes. The tenants differ in LoRA rank, learning
rate, data lengths and losses. Afterwards each tenant trains a fresh model (same LoRA seed, data and
learning rate) alone, and its per-step losses and final logprobs must equal the concurrent run's to 1e-5.
`GET /metrics` must show passes that held more than one tenant during the concurrent run, and none while
the tenants trained alone; the server log must show passes with all three.

In cluster mode the scheduler runs as a child process of `cluster up` (`CARPOOL_SCHEDULER_PROCESSES`, the
production layout: its own process beside the gateway's); the module checks that child exists, that its
own /metrics port measured the requests' queue waits, and that it is gone once the cluster stopped.

This module's server uses a 100 ms batch window (`CARPOOL_BATCH_WINDOW_MS`) instead of 5 ms, so that
requests submitted together on two busy shared cores reliably land in the same pass.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.server import Server, free_port, start_server

STEPS = 5
PROBE = [[9, 81, 7, 300, 44, 12, 5], [250, 3, 3, 61, 199]]


@dataclass
class TenantPlan:
    name: str
    rank: int
    seed: int
    lr: float
    lengths: tuple[int, ...]
    losses: tuple[str, ...]
    """Loss per step (cycled)."""


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    probe: list[np.ndarray] = field(default_factory=list)
    model_id: str = ""


PLANS = [
    TenantPlan("alpha", rank=4, seed=31, lr=5e-3, lengths=(9, 7, 12), losses=("cross_entropy",)),
    TenantPlan("beta", rank=8, seed=32, lr=1e-2, lengths=(6, 10), losses=("cross_entropy", "importance_sampling")),
    TenantPlan("gamma", rank=2, seed=33, lr=2e-3, lengths=(14,), losses=("ppo", "cross_entropy")),
]


@pytest.fixture(scope="module")
def scheduler_metrics_port(e2e_mode: str) -> int | None:
    """In cluster mode the scheduler runs as `cluster up`'s child process, as production runs it
    (`CARPOOL_SCHEDULER_PROCESSES`; the other cluster-mode modules keep `cluster up`'s default, a thread),
    and serves its pass counters on a port of its own."""
    return free_port() if e2e_mode == "cluster" else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, e2e_mode: str,
           scheduler_metrics_port: int | None) -> Iterator[Server]:
    env = {"CARPOOL_BATCH_WINDOW_MS": "100"}
    if scheduler_metrics_port is not None:
        env |= {"CARPOOL_SCHEDULER_PROCESSES": "true", "CARPOOL_SCHEDULER_METRICS_PORT": str(scheduler_metrics_port)}
    srv = start_server(tmp_path_factory.mktemp(f"carpool-mt-{e2e_mode}"), e2e_model_dir, mode=e2e_mode,
                       extra_env=env)
    children = _scheduler_children(srv.process.pid)
    try:
        yield srv
    finally:
        srv.stop()
    for pid in children:  # stopped with the cluster: gone, not orphaned
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _scheduler_children(pid: int) -> list[int]:
    """`carpool scheduler` processes among the direct children of `pid`."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [c for c in children if b"scheduler\0--base-model" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _batch(plan: TenantPlan, step: int) -> tuple[list[types.Datum], str]:
    loss_fn = plan.losses[step % len(plan.losses)]
    rng = np.random.default_rng([plan.seed, step])
    data = []
    for length in plan.lengths:
        seq = rng.integers(1, 512, length)
        n = length - 1
        inputs: dict[str, object] = {"target_tokens": seq[1:].tolist()}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0.5, 1.0, n).astype(np.float32).tolist()
        else:
            inputs["logprobs"] = types.TensorData.from_numpy((-6.2 + rng.normal(0, 0.1, n)).astype(np.float32))
            inputs["advantages"] = types.TensorData.from_numpy(rng.normal(0.0, 1.0, n).astype(np.float32))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                loss_fn_inputs=inputs))  # type: ignore[arg-type]
    return data, loss_fn


def _probe(client: tinker.TrainingClient) -> list[np.ndarray]:
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in PROBE]
    return [o["logprobs"].to_numpy() for o in client.forward(data, "cross_entropy").result().loss_fn_outputs]


def _train(client: tinker.TrainingClient, plan: TenantPlan, run: Run, barrier: threading.Barrier | None) -> None:
    run.model_id = client.model_id
    for step in range(STEPS):
        data, loss_fn = _batch(plan, step)
        if barrier is not None:
            barrier.wait(timeout=120)
        # Both futures are submitted before either is awaited.
        fb = client.forward_backward(data, loss_fn)
        opt = client.optim_step(types.AdamParams(learning_rate=plan.lr))
        run.losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    run.probe = _probe(client)


def _multi_tenant_passes(server: Server) -> float:
    """From the gateway's /metrics: the scheduler's counters as it publishes them (its own process's, or in
    cluster mode through Redis)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(r"^carpool_runtime_multi_tenant_passes_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, text[:2000]
    return float(match.group(1))


def _waits_measured(port: int) -> float:
    """Requests whose queue wait the scheduler child measured, from its own /metrics (which it serves once
    it has started: the gateway is healthy as soon as the workers are, the child may still be importing)."""
    for _ in range(600):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            break
        except httpx.ConnectError:
            time.sleep(0.1)
    else:
        raise AssertionError(f"the scheduler child serves no /metrics on port {port} after 60 s")
    return sum(float(v) for v in re.findall(r"^carpool_queue_wait_seconds_count\{[^}]*\} ([0-9.e+]+)$", text,
                                            re.MULTILINE))


def test_three_tenants_concurrently_equal_each_alone(server: Server, base_model: str,
                                                     scheduler_metrics_port: int | None) -> None:
    if scheduler_metrics_port is not None:  # the passes below run in the scheduler's own process
        assert len(_scheduler_children(server.process.pid)) == 1, "no `carpool scheduler` child process"
        waits_before = _waits_measured(scheduler_metrics_port)
    keys = {plan.name: server.create_tenant(plan.name) for plan in PLANS}
    clients = {name: tinker.ServiceClient(base_url=server.url, api_key=key) for name, key in keys.items()}
    models = {plan.name: clients[plan.name].create_lora_training_client(
        base_model=base_model, rank=plan.rank, seed=plan.seed).result() for plan in PLANS}

    # -- together ------------------------------------------------------------------------------------
    before = _multi_tenant_passes(server)
    together = {plan.name: Run() for plan in PLANS}
    barrier = threading.Barrier(len(PLANS))
    errors: list[BaseException] = []

    def worker(plan: TenantPlan) -> None:
        try:
            _train(models[plan.name], plan, together[plan.name], barrier)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(plan,), name=f"tenant-{plan.name}") for plan in PLANS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    shared = _multi_tenant_passes(server) - before
    assert shared >= 1, "no pass held more than one tenant's requests"
    if scheduler_metrics_port is not None:  # the child ran them: fb + optim_step of every tenant's steps
        assert _waits_measured(scheduler_metrics_port) - waits_before >= 2 * STEPS * len(PLANS)
    three_tenant_passes = re.findall(r"pass \S+: \d+ requests, \d+ tokens, 3 tenants", server.log())
    assert three_tenant_passes, server.log()[-3000:]

    # -- each alone, on fresh models with the same seeds ------------------------------------------------
    alone = {}
    for plan in PLANS:
        fresh = clients[plan.name].create_lora_training_client(base_model=base_model, rank=plan.rank,
                                                               seed=plan.seed).result()
        alone[plan.name] = Run()
        _train(fresh, plan, alone[plan.name], barrier=None)
    assert _multi_tenant_passes(server) - before == shared  # alone really was alone

    for plan in PLANS:
        got, want = together[plan.name], alone[plan.name]
        assert len(got.losses) == STEPS
        np.testing.assert_allclose(got.losses, want.losses, rtol=0, atol=1e-5, err_msg=plan.name)
        for a, b in zip(got.probe, want.probe, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=plan.name)
        assert got.losses[-1] != pytest.approx(got.losses[0], abs=1e-3)  # the tenant really trained
    # The tenants trained different things: no tenant's adapter is another's.
    assert np.abs(together["alpha"].probe[0] - together["beta"].probe[0]).max() > 1e-3

    # Isolation: a tenant sees only its own runs.
    for plan in PLANS:
        rest = tinker.RestClient(base_url=server.url, api_key=keys[plan.name])
        runs = {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
        assert together[plan.name].model_id in runs
        assert not runs & {together[p.name].model_id for p in PLANS if p.name != plan.name}
    for client in clients.values():
        client.close("success").result()
