"""Carpool worker: one base model, many resident LoRA adapters, packed passes."""
