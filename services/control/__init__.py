"""The service core the gateway calls: transport-agnostic training, sampling and checkpoint operations.

`api` is the contract (the `ControlPlane` Protocol and its value types); `plane.ServiceControlPlane`
implements it over the database, the work queue and checkpoint storage. Import what you need from the
submodules: this package deliberately re-exports nothing, so importing the contract stays cheap and free
of import cycles with `services.runtime`.
"""
