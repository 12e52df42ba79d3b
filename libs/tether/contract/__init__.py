"""The wire contract: subjects and streams, the event codec and the exported JSON Schemas."""
