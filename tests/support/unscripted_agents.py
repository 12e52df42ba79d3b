"""A model agent with no script and no client of its own: it needs TETHER_MODEL_CLIENT.
Loaded by the services a test starts (PYTHONPATH)."""

from tether.agents import AgentDefinition, ModelAgent


class Unscripted(ModelAgent):
    definition = AgentDefinition(id="unscripted", model="any-model",
                                 description="Answers with whatever model it is given")
