"""Postgres projections of the event log: migrations, the projector, rebuild and verify."""
