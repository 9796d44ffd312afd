"""Every CLI error a user can cause is one line naming the cause and what to do, a non-zero exit,
no traceback (issue 23 item 4).

The real ``openrl`` command line runs as a process (``python -m openrl.cli``): a busy port is a
real listening socket, a stack still partly running is a real process recorded in the state
dir's ``pids.json`` (as one left behind by a stack without parent-death signals), bad state
dirs and model dirs are real paths. Nothing is mocked; no stack is started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from openrl.transport import pidfile


def openrl(*argv, home: Path) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "openrl.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OPENRL_HOME": str(home),
                                            "TINKER_BASE_URL": "", "TINKER_API_KEY": ""})
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(rc: int, err: str, *must: str) -> str:
    """The properties of a user error: non-zero exit, exactly one line on stderr, no traceback,
    naming what ``must`` lists."""
    assert rc != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for word in must:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_busy_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = openrl("serve", "--state-dir", tmp_path / "st", "--port", port, "--no-build", home=tmp_path)
    line = one_line_error(rc, err, f"127.0.0.1:{port} is already in use", "--port", "openrl stop")
    assert line.startswith("openrl serve: error:")


def test_a_stack_still_partly_running_is_named_and_can_be_stopped(tmp_path):
    """A new ``openrl serve`` on a state dir whose previous stack still partly runs refuses,
    names what runs and how to stop it; ``openrl stop --state-dir`` stops it (SIGKILL after the
    timeout for a process that ignores SIGTERM); then ``openrl stop`` finds nothing."""
    state = tmp_path / "st"
    state.mkdir()
    left = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                   "print('up', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert left.stdout.readline() == "up\n"
        pidfile.add_child(state, "gateway", left.pid)
        rc, _, err = openrl("serve", "--state-dir", state, "--no-build", "--port", 1, home=tmp_path)
        one_line_error(rc, err, "still partly running", f"gateway (pid {left.pid})",
                       f"openrl stop --state-dir {state}")
        rc, out, err = openrl("stop", "--state-dir", state, "--timeout", 1, home=tmp_path)
        assert rc == 0 and err == "", err
        assert f"stopped gateway (pid {left.pid})" in out
        assert left.wait(timeout=30) == -9
        rc, out, _ = openrl("stop", "--state-dir", state, home=tmp_path)
        assert rc == 0 and "nothing of the stack" in out
        assert not (state / pidfile.FILE).exists()
    finally:
        left.kill()
        left.wait(timeout=30)


def test_unusable_and_missing_state_dirs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, _, err = openrl("serve", "--state-dir", blocker / "state", "--no-build", home=tmp_path)
    one_line_error(rc, err, f"state dir {blocker / 'state'} cannot be used", "--state-dir")
    rc, _, err = openrl("stop", "--state-dir", tmp_path / "never", home=tmp_path)
    one_line_error(rc, err, f"state dir {tmp_path / 'never'} does not exist", "--state-dir")
    rc, _, err = openrl("status", "--state-dir", tmp_path / "never", home=tmp_path)
    one_line_error(rc, err, "cannot reach the gateway", f"state dir {tmp_path / 'never'} does not exist",
                   "openrl serve --state-dir")
    (tmp_path / "never").mkdir()
    rc, _, err = openrl("runs", "list", "--state-dir", tmp_path / "never", home=tmp_path)
    one_line_error(rc, err, "no openrl serve has run with state dir", "--base-url")


@pytest.mark.parametrize("spec,rc_want,must", [
    ("foo", 2, ["--model", "expected NAME=DIR", "--help"]),
    ("foo=", 2, ["--model", "expected NAME=DIR"]),
    ("Qwen/x={missing}", 1, ["{missing}"]),
    ("Qwen/x={empty}", 1, ["--model Qwen/x={empty}", "config.json", "give the directory of a Hugging Face causal LM"]),
])
def test_bad_model(tmp_path, spec, rc_want, must):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    rc, _, err = openrl("serve", "--state-dir", tmp_path / "st", "--model", spec.format(**paths), home=tmp_path)
    assert rc == rc_want, err
    one_line_error(rc, err, *[m.format(**paths) for m in must])


def test_usage_errors_are_one_line(tmp_path):
    rc, _, err = openrl("serve", "--port", 70000, home=tmp_path)
    assert rc == 2
    one_line_error(rc, err, "--port", "1-65535")
    rc, _, err = openrl("no-such-command", home=tmp_path)
    one_line_error(rc, err, "invalid choice", "openrl --help")
    rc, _, err = openrl("run", tmp_path / "nope.py", home=tmp_path)
    one_line_error(rc, err, "no such script", "Python file")
    rc, _, err = openrl("serve", "--idle-timeout", "-1", home=tmp_path)
    one_line_error(rc, err, "--idle-timeout")
