"""The HTTP edge of Carpool: the Tinker wire protocol (SDK 0.38) and a plain REST API over a `ControlPlane`.

Modules: `app` (the `create_app` factory), `settings` (`GatewaySettings`), `auth` (the `Authenticator`
Protocol and its database implementation), `deps` (FastAPI dependencies, raw-body parsing and its
OpenAPI), `errors` (JSON errors and the seq_id guard), `middleware` (request id, body limit, per-route
metrics, last-resort 500), `rendering` (wire JSON and future results), and `routes/` (one module per
resource group, plus plain REST).
The gateway authenticates, decodes wire bodies into domain work and calls the control plane; it never
touches the database (except through an `Authenticator`), the queue, storage, torch or workers.
"""
