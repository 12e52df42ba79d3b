"""Model clients: scripted (tests, demos) and OpenAI-compatible chat completions (HTTP).

The HTTP client is imported from its module, so code that only plays scripts does not
need an HTTP library.
"""

from tether.agents.clients.scripted import Fail, Reply, ScriptedModelClient, read_calls

__all__ = ["Fail", "Reply", "ScriptedModelClient", "read_calls"]
