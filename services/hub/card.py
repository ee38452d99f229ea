"""What a hub push uploads: the PEFT adapter files of a checkpoint plus a model card (`README.md`).

Only `adapter_config.json` and `adapter_model.safetensors` leave the server (they load with
`PeftModel.from_pretrained`); Carpool's optimizer state stays behind. The card's front matter is what the
Hub indexes (`base_model`, `library_name: peft`, tags); its body names the base model, LoRA rank, training
run and optimizer steps.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
STATE_META = "carpool_state.json"


class CardError(ValueError):
    """A checkpoint that holds no PEFT adapter to push."""


@dataclass(frozen=True)
class CardFacts:
    base_model: str
    rank: int
    training_run_id: str
    tinker_path: str
    steps: int | None
    """Optimizer steps the adapter had taken (None for weights-only checkpoints that do not record it)."""


def read_steps(checkpoint_dir: Path) -> int | None:
    try:
        meta = json.loads((checkpoint_dir / STATE_META).read_text())
    except (OSError, ValueError):
        return None
    steps = meta.get("optimizer_step") if isinstance(meta, dict) else None
    return steps if isinstance(steps, int) else None


def model_card(facts: CardFacts) -> str:
    steps = "unknown" if facts.steps is None else str(facts.steps)
    front = "\n".join([
        "---",
        f"base_model: {json.dumps(facts.base_model)}",
        "library_name: peft",
        "tags:",
        "- lora",
        "- peft",
        "- carpool",
        f"- base_model:adapter:{facts.base_model}",
        "---",
    ])
    body = f"""
# LoRA adapter for {facts.base_model}

A LoRA adapter trained with [Carpool](https://github.com/carpool-ai/carpool) (multi-tenant LoRA training).

| | |
|---|---|
| Base model | `{facts.base_model}` |
| LoRA rank | {facts.rank} |
| Training run | `{facts.training_run_id}` |
| Optimizer steps | {steps} |
| Checkpoint | `{facts.tinker_path}` |

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("{facts.base_model}")
model = PeftModel.from_pretrained(base, "<this repo>")
```
"""
    return front + "\n" + body


def build_upload_folder(checkpoint_dir: Path, dest: Path, facts: CardFacts) -> dict[str, str]:
    """Copy the adapter files and write the card into `dest`; return relative path → sha256."""
    missing = [name for name in ADAPTER_FILES if not (checkpoint_dir / name).is_file()]
    if missing:
        raise CardError(f"checkpoint {facts.tinker_path} holds no PEFT adapter (missing {', '.join(missing)}); "
                        "encrypted exports cannot be pushed")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(checkpoint_dir / name, dest / name)
    (dest / "README.md").write_text(model_card(facts))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dest.iterdir())}
