"""The pure core: identifiers, commands, events and the run state machine.

Nothing in this package imports asyncio, nats, faststream or asyncpg; time and ids come in
on the command or event.
"""
