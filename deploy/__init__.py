"""Carpool composition root: the `carpool` CLI, the only place that sees both gateway and worker."""
