"""executor_svc."""
