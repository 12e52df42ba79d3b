"""Tether: agents as tools, event-sourced over NATS JetStream with Postgres projections."""

__version__ = "0.1.0"
