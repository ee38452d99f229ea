"""Domain types shared by the gateway, the scheduler and the worker (no wire types, no tensors)."""
