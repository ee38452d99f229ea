"""The compat suites use the e2e server fixtures (shared `carpool serve` processes, embedded mode)."""

from tests.e2e.conftest import base_model, e2e_mode, e2e_model_dir, server, smollm2_server  # noqa: F401
