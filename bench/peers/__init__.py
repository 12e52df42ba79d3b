"""The same W1 workload on other durable-execution systems, for a side-by-side ratio."""
