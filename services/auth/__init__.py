"""Authentication: API key generation and hashing, tenant lookup by key, and key redaction for logs.

Keys are random `tml-…` strings shown to the tenant once; only their hash and a short display prefix are
stored.
"""
