"""The child side: agent classes, the run context they get, and the runner that drives them.

The runner (`tether.child.runner.ChildRunner`) is imported from its module, so that code
which only defines agents does not load the NATS machinery.
"""

from tether.child.agent import ChildAgent
from tether.child.context import RunCancelled, RunContext, current_context, report_progress

__all__ = ["ChildAgent", "RunCancelled", "RunContext", "current_context",
           "report_progress"]
