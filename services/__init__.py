"""Carpool's pure domain core: wire schema, domain types, db, queue protocol, scheduler policy, auth, storage.

Nothing here imports a web framework, Ray or a tensor library; the gateway and the worker build on it.
"""
