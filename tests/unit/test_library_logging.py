"""The library's log lines inside an application: never on stdout, and under the
application's own `logging` settings unless it asks for the services' rendering."""

import subprocess
import sys

RECORDS = ("from tether.log import get_logger\n"
           "get_logger(component='hooks').info('hooks.serving', methods=['on_done'])\n"
           "get_logger(component='hooks').warning('hook.failed', run_id='r1')\n")


def run(code: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=30)
    return done.stdout, done.stderr


def test_with_no_logging_configured_warnings_reach_stderr_and_nothing_stdout() -> None:
    out, err = run(RECORDS)
    assert out == ""
    assert err == "event='hook.failed' component='hooks' run_id='r1'\n"


def test_the_applications_logging_configuration_decides() -> None:
    out, err = run("import logging, sys\n"
                   "logging.basicConfig(stream=sys.stdout, level=logging.INFO,"
                   " format='app %(name)s %(levelname)s %(message)s')\n" + RECORDS)
    assert out == ("app tether INFO event='hooks.serving' component='hooks' methods=['on_done']\n"
                   "app tether WARNING event='hook.failed' component='hooks' run_id='r1'\n")
    assert err == ""
    out, _ = run("import logging, sys\n"
                 "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
                 "logging.getLogger('tether').setLevel(logging.ERROR)\n" + RECORDS)
    assert out == ""


def test_configure_logging_asks_for_the_services_json_lines_on_stderr() -> None:
    out, err = run("from tether.log import configure_logging\n"
                   "configure_logging('info', 'json')\n" + RECORDS)
    assert out == ""
    lines = err.splitlines()
    assert [line.split('"event": ')[1].split('"')[1] for line in lines] == \
        ["hooks.serving", "hook.failed"]
