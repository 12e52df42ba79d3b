"""A parent that thinks: a model delegates to child agents as tools, and reacts to them.

The Planner is a model parent (`tether.agents.ModelParent`): its tools are two child
agents of examples/agents.py, the Researcher (awaited; two calls in one model turn fan
out at once) and the Importer (detached, with `notify`: its outcome comes back into the
conversation as a message, and the model answers it in its next turn).

    tether services child-runner --agents examples.agents:Researcher,examples.agents:Importer,examples.model_parent:Planner
    python examples/model_parent.py            # needs the parent and child-runner services

With no model configured, the Planner plays a scripted model that decides from the
conversation as a real one would. With TETHER_MODEL_BASE_URL set (an OpenAI-compatible
server; TETHER_MODEL_API_KEY if it needs one, TETHER_MODEL_NAME for the model), the
child-runner asks that server instead.
"""

import asyncio
import os
import sys
import uuid

from tether import agent_tool, connect
from tether.agents import AgentDefinition, ModelParent, Reply
from tether.agents.clients.openai_compatible import OpenAICompatibleClient
from tether.agents.model_messages import ModelRequest

try:  # a module of the child-runner's agents, or this script run from examples/
    from examples.agents import ImportInput, ResearchInput
except ImportError:
    from agents import ImportInput, ResearchInput  # type: ignore[no-redef]

QUESTION = "Compare HTTP/3 and gRPC for our API, and import the customer list meanwhile."
IMPORT = {"source": "s3://demo/customers.csv", "rows": 20_000, "batch": 2_000, "pace_s": 0.1}
DONE_WITHIN_S = 60


def scripted_turn(request: ModelRequest) -> Reply:
    """The scripted model: fan out and start the import, then summarise, then answer the
    importer's completion message."""
    last = request.messages[-1]
    if last.role == "tool":
        found = [m.content for m in request.messages if m.role == "tool"]
        return Reply("Research done: " + " | ".join(text.rstrip(".") for text in found[:2])
                     + ". The import runs in the background; I will tell you when it is done.")
    if last.role == "user" and "Importer" in last.content:
        return Reply(f"The customer import is done ({last.content.split(': ', 1)[-1]}). "
                     "HTTP/3 suits the public API; gRPC suits service-to-service calls.",
                     chunk_delay_ms=20)  # streamed as a model writes
    return Reply("Researching both and starting the import.", [
        ("Researcher", {"query": "HTTP/3 for public APIs"}),
        ("Researcher", {"query": "gRPC for internal services"}),
        ("Importer", IMPORT)])


class Planner(ModelParent):
    definition = AgentDefinition(
        id="planner", model=os.environ.get("TETHER_MODEL_NAME", "demo-small"), max_steps=4,
        instructions="You plan technical work. Delegate research to the Researcher tool "
                     "(one call per topic, in parallel) and imports to the Importer tool, "
                     "which runs in the background and reports back when it is done.",
        tools=(agent_tool("Researcher", description="Research one topic in depth.",
                          display_name="Researcher", input_model=ResearchInput),
               agent_tool("Importer", description="Import rows from a source, in the "
                                                  "background; you are told when it ends.",
                          input_model=ImportInput,
                          detached={"notify": True, "on_milestones": ["half-imported"]})))
    script = (scripted_turn,) * 12

    if os.environ.get("TETHER_MODEL_BASE_URL"):
        model_client = OpenAICompatibleClient.from_env()


def line(message) -> str:
    kind = message.metadata.get("kind", "")
    who = {"message": "🧑 user", "reply": "🤖 planner", "milestone": "📣 status",
           "finish": "📬 notify"}.get(kind, message.role)
    return f"  {who}: {message.content}"


async def main() -> int:
    name = f"demo-{uuid.uuid4().hex[:6]}"
    async with connect(name="tether-model-parent") as tether:
        conversation = tether.conversation("Planner", name, owner=("User", "u1"))
        print(f"Conversation Planner/{name}: a model parent with two Researchers and an "
              "Importer as tools.")
        await conversation.start()
        await conversation.send(QUESTION)
        try:
            async with asyncio.timeout(DONE_WITHIN_S):
                notified = None
                async for message in conversation.messages():
                    print(line(message), flush=True)
                    if message.metadata.get("kind") == "finish":
                        notified = message.id
                    elif notified and notified in message.metadata.get("in_reply_to", ()):
                        break
            print("Runs the model started (timeline Planner/" + name + "):")
            view = None
            async for view in conversation.parent.timeline(live=False):  # noqa: B007 - the last
                pass
            for run in sorted(view.runs.values(), key=lambda r: r.requested_at):
                print(f"  {run.run_id} {run.agent_type} {run.status}"
                      f"{' (detached)' if run.detached else ''}: {run.summary or ''}")
        finally:
            await conversation.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
