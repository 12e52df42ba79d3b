"""Bad arguments to the `tether` client commands: one line naming the flag or field
(`tether <cmd>: ...`) and exit 2, checked before anything connects (the NATS URL here
points nowhere, so a check left to the command's run would say the server is
unreachable instead). No traceback, ever."""

import argparse

import pytest

from tether.cli import main
from tether.client.cli_commands import client_command

NOWHERE = ["--nats-url", "nats://127.0.0.1:1", "--database-url",
           "postgresql://nobody@127.0.0.1:1/none"]
LONG_TEXT = "y" * 100_001


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch):
    # `main` configures structlog once per process, onto the stderr it finds: here that
    # is pytest's capture of one test, closed after it, and every later test would log
    # into it.
    monkeypatch.setattr("tether.cli.configure_logging", lambda *args: None)


def tether(capsys, *args: str) -> tuple[int, str]:
    code = main([*NOWHERE, *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip()


@pytest.mark.parametrize(("args", "said"), [
    (["send", "A/b", "r1", "hi", "--id", "a.b"], "tether send: --id: invalid message id 'a.b'"),
    (["send", "A/b", "r1", ""], "tether send: the message's text is empty"),
    (["send", "A/b", "r1", LONG_TEXT], "tether send: the message's text is 100,001 characters"),
    (["run", "Researcher", "--parent", "A/b", "--timeout", "nan"],
     "tether run: --timeout must be a positive finite number of seconds, not nan"),
    (["run", "Researcher", "--parent", "A/b", "--timeout", "inf"],
     "tether run: --timeout must be a positive finite number of seconds, not inf"),
    (["runs", "fork", "A/b", "r.1", "--at", "step:1"], "tether runs: invalid run id 'r.1'"),
    (["runs", "fork", "A/b", "r1", "--at", "step:1", "--id", "bad.id"],
     "tether runs: --id: invalid run id 'bad.id'"),
    (["runs", "fork", "A/b", "r1", "--at", "milestone:" + "m" * 300],
     "tether runs: --at: invalid fork request: at: String should have at most 256"),
    (["runs", "rewind", "A/b", "r>1"], "tether runs: invalid run id 'r>1'"),
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_2(capsys, args, said):
    code, err = tether(capsys, *args)
    assert (code, err.splitlines()[0][:len(said)]) == (2, said), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("command", [
    ["run", "Researcher", "--parent", "A/b"], ["cancel", "A/b", "r1"],
    ["send", "A/b", "r1", "hi"], ["clear", "A/b"],
    ["runs", "fork", "A/b", "r1", "--at", "step:1"], ["runs", "rewind", "A/b", "r1"]])
@pytest.mark.parametrize("expires_in", ["nan", "inf", "1e9", "0.0001"])
def test_expires_in_out_of_range_is_refused_naming_the_flag(capsys, command, expires_in):
    code, err = tether(capsys, *command, "--expires-in", expires_in)
    assert code == 2, err
    assert "--expires-in must be more than 0 and at most 604800 seconds (0: no expiry), " \
           f"not {float(expires_in)!r}" in err
    assert err.startswith("tether ")


def test_a_value_error_raised_while_the_command_runs_is_one_line_and_exit_2(capsys):
    async def refused() -> int:
        raise ValueError("invalid run id 'x.y'")

    run = client_command(lambda args, settings: refused())
    code = run(argparse.Namespace(command="send"), None)
    assert (code, capsys.readouterr().err) == (2, "tether send: invalid run id 'x.y'\n")
