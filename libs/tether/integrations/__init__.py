"""Agents written with a framework as durable Tether children, and Tether children as tools
of such agents: `tether.integrations.pydantic_ai` (docs/integrations.md). Each needs its
extra (`pip install 'tether[pydantic-ai]'`)."""
