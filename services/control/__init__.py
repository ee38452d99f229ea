"""The service core the gateway calls: transport-agnostic training, sampling and checkpoint operations."""
