"""The reconciler: budgets, recovery and re-attach, delivery retries, observability."""
