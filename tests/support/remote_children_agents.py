"""A remote A2A agent as a child, for services a test starts as processes (PYTHONPATH):
its URL and token from the environment the test gives them."""

import os

from tether.remote.a2a_agent import a2a_agent

Echo = a2a_agent("Echo", os.environ.get("REMOTE_A2A_URL", "http://127.0.0.1:1"),
                 token_variable="ECHO_TOKEN", unreachable_for_s=30)
