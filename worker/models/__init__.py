"""Base models for the worker: offline dev models and resolution of model sources to local directories."""
