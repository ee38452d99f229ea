"""The operators' side of Carpool: audited admin actions and the cross-tenant read models of the dashboard.

`actions` changes tenants, keys and quotas and records each change in the audit log in the same
transaction; the `carpool` CLI and the admin dashboard both go through it. Nothing here imports a web
framework: the gateway renders, this package decides and reads.
"""
