"""The packed multi-tenant LoRA engine: multi-LoRA layers, packed passes, losses, per-adapter AdamW."""
