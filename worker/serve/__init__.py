"""Cluster-mode workers: replicas hosting an `Engine` each, pulling their calls from Redis, on Ray Serve."""
