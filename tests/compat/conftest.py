"""The compat suites use the e2e server fixtures (one `carpool serve` per module, embedded mode)."""

from tests.e2e.conftest import base_model, e2e_mode, e2e_model_dir, server  # noqa: F401
