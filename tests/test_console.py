"""What people read: rich bars and tables on a terminal, plain lines in logs, JSON log lines, examples in every
``--help``, and what ``ecrec-server local`` prints once its cluster is ready (pasted, it works)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from ecrec.ops import console, logs
from helpers import born, children as _children, kill_born


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_progress_prints_a_line_when_the_bar_moves():
    out = io.StringIO()
    for step in range(0, 101):
        console.progress("plain", step, 100, stream=out, plain_steps=10)
    console.progress("plain", 100, 100, done=True, stream=out, plain_steps=10)
    lines = out.getvalue().splitlines()
    assert lines[0] == "  plain      [..........] 0/100"
    assert lines[1] == "  plain      [#.........] 10/100"
    assert lines[-1] == "  plain      [##########] 100/100"
    assert len(lines) == 12  # 11 positions of the bar, and the closing line
    with pytest.raises(ValueError, match="must be >= 0"):
        console.progress("bad", -1, 10, stream=out)


def test_rich_progress_on_a_terminal(monkeypatch):
    monkeypatch.delenv("ECREC_PLAIN", raising=False)
    out = FakeTerminal()
    for step in range(5):
        console.progress("rich", step, 4, stream=out)
    console.progress("rich", 4, 4, done=True, stream=out)
    text = out.getvalue()
    assert "rich" in text and "4/4" in text and "[#" not in text  # rich's bar, not the plain one
    assert console._live is None  # every bar done: the live display is closed


def test_tables_plain_and_rich(monkeypatch):
    monkeypatch.delenv("ECREC_PLAIN", raising=False)
    plain = io.StringIO()
    console.print_table(["name", "value"], [["a", 1], ["longer", 22]], stream=plain)
    assert plain.getvalue().splitlines() == ["name    value", "------  -----", "a           1", "longer     22"]
    rich = FakeTerminal()
    console.print_table(["name", "value"], [["a", 1], ["longer", 22]], title="T", stream=rich)
    assert "longer" in rich.getvalue() and "──" in rich.getvalue()  # rich's rule under the header
    monkeypatch.setenv("ECREC_PLAIN", "1")
    forced = FakeTerminal()
    console.print_table(["name", "value"], [["a", 1]], stream=forced)
    assert forced.getvalue().splitlines()[1] == "----  -----"
    with pytest.raises(ValueError, match="a row has 1 cells for 2 columns"):
        console.print_table(["name", "value"], [["a"]], stream=plain)
    with pytest.raises(ValueError, match="align needs one of"):
        console.print_table(["name", "value"], [["a", 1]], align="lx", stream=plain)


def test_json_log_lines():
    record = logging.LogRecord("ecrec.server", logging.WARNING, __file__, 1, "server %s failed", ("x",), None)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    entry = json.loads(logs.JsonFormatter("serve").format(record))
    assert entry["level"] == "WARNING" and entry["logger"] == "ecrec.server" and entry["process"] == "serve"
    assert entry["message"] == "server x failed" and "RuntimeError: boom" in entry["exception"]
    assert entry["time"].endswith("+00:00") and entry["pid"] == os.getpid()
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        logs.configure("INFO", "xml")
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        logs.configure("LOUD", "text")


def test_json_logs_hold_warnings_uncaught_errors_bad_arguments_stacks_and_a_commands_last_word():
    """Under ``--log-format json`` a library's warning, a thread's uncaught exception, a record whose arguments do
    not fit its format and a command's last word (a port in use: exit status 2) were plain text among the JSON
    lines; a record's stack_info was dropped."""
    code = """if 1:
        import logging, sys, threading, warnings
        from ecrec.ops import logs
        logs.configure("INFO", "json", "serve")
        warnings.warn("a library's warning")
        t = threading.Thread(target=lambda: 1 / 0, name="worker"); t.start(); t.join()
        logging.getLogger("x").warning("%d rows", "many")
        logging.getLogger("x").info("here", stack_info=True)
        logs.fatal("ecrec-server serve: it stops")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    entries = [json.loads(line) for line in r.stderr.splitlines()]  # every line an object
    assert "a library's warning" in entries[0]["message"] and entries[0]["logger"] == "py.warnings"
    assert entries[1]["message"] == "uncaught exception in thread worker"
    assert "ZeroDivisionError" in entries[1]["exception"]
    assert "the arguments do not fit" in entries[2]["message"] and "'many'" in entries[2]["message"]
    assert entries[3]["message"] == "here" and "stack" in entries[3]
    assert entries[4] == {**entries[4], "level": "CRITICAL", "message": "ecrec-server serve: it stops"}
    import socket

    with socket.socket() as taken:  # a command's last word, as a user meets it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ecrec.cli", "--log-format", "json", "coordinator", "--port", "0",
                            "--servers", "2", "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    last = [json.loads(line) for line in r.stderr.splitlines()][-1]
    assert last["level"] == "CRITICAL" and f"--metrics-port {port}: cannot serve metrics" in last["message"]


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_command_help_shows_an_example():
    from ecrec import cli
    from ecrec.bench import cli as bench_cli

    for parser in (cli.build_parser(), bench_cli.build_parser()):
        commands = _subparsers(parser)
        assert commands
        assert "example" in parser.format_help()
        for name, sub in commands.items():
            text = sub.format_help()
            assert "example: " in text, f"{parser.prog} {name} --help shows no example"
            assert f"{parser.prog} {name}" in text.split("example: ", 1)[1], f"{name}: the example runs another command"
    assert set(_subparsers(cli.build_parser())) == {"coordinator", "serve", "local", "status"}


def test_help_lists_the_client_commands_and_a_wrong_command_names_them_all(capsys):
    """``snapshot`` and ``restore`` have a parser of their own: ``ecrec-server --help`` listed four commands, and a
    mistyped command was told to choose among those four."""
    from ecrec import cli

    listing = cli.build_parser().format_help().split("options:")[0]
    for name in ("coordinator", "serve", "local", "status", "snapshot", "restore"):
        assert f"\n    {name} " in listing, (name, listing)
    assert cli.main(["snapshots", "/tmp/x"]) == 2
    err = capsys.readouterr().err
    assert "'snapshots' is no command: choose from coordinator, serve, local, status, snapshot, restore" in err


@pytest.mark.cluster
def test_local_prints_a_snippet_that_connects_and_logs_json(tmp_path):
    from helpers import free_port_range

    base = free_port_range(3)
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "--log-level", "INFO", "--log-format", "json",
                                 "local", "--servers", "2", "--metrics-port", str(base)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    children: dict[int, str] = {}
    try:
        lines = [proc.stdout.readline()]
        while not lines[-1].startswith("Prometheus metrics:"):
            lines.append(proc.stdout.readline())
            assert lines[-1], "the local cluster stopped printing before its metrics line"
        children = born(_children(proc.pid))
        address = lines[0].split()[2]
        assert lines[0].startswith("coordinator at 127.0.0.1:")
        snippet = "\n".join(line[4:].rstrip() for line in lines if line.startswith("    "))
        assert f'Cluster.connect("{address}")' in snippet
        assert any(f"ecrec-server status --coordinator {address}" in line for line in lines)
        assert f"coordinator http://127.0.0.1:{base}/metrics" in lines[-1]
        assert f"server 1 http://127.0.0.1:{base + 2}/metrics" in lines[-1]
        namespace: dict = {}
        exec(compile(snippet, "<the printed snippet>", "exec"), namespace)  # pasted as printed, it works
        assert namespace["out"].shape == (2, 16)
        assert namespace["cluster"].table_spec("user").num_rows == 100_000
        namespace["cluster"].close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:  # (by handle, and by start time: a pid reaped already may be another process's by now)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_born(children)
    entries = [json.loads(line) for line in stderr_path.read_text().splitlines() if line.strip()]
    assert entries, "no log line"
    kinds = {e["process"] for e in entries}
    assert {"coordinator", "serve"} <= kinds, kinds
    assert any("registered" in e["message"] for e in entries)
    assert all({"time", "level", "logger", "pid", "message"} <= set(e) for e in entries)


def test_a_client_config_refuses_a_deadline_or_bound_that_is_no_positive_number():
    from ecrec.config import ClientConfig, ServerConfig

    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match=r"rpc_timeout_s \(--rpc-timeout-s\) .*: must be a finite number > 0"):
            ClientConfig(rpc_timeout_s=bad)
    with pytest.raises(ValueError, match=r"idle_poll_s .* must be a finite number >= 0"):
        ClientConfig(idle_poll_s=-0.5)
    assert ClientConfig(idle_poll_s=0).idle_poll_s == 0  # 0: off, as documented
    with pytest.raises(ValueError, match=r"confirm_at_exit_s .* must be a finite number >= 0"):
        ClientConfig(confirm_at_exit_s=float("nan"))
    assert ClientConfig(confirm_at_exit_s=0).confirm_at_exit_s == 0  # 0: no wait at exit
    for bad in ("no", 0, None):  # "no" was taken, and turned the handler on
        with pytest.raises(ValueError, match=r"exit_on_sigterm .*: must be True or False"):
            ClientConfig(exit_on_sigterm=bad)
    with pytest.raises(ValueError, match="max_message_bytes .* 1000: must be at least 65536"):
        ServerConfig(coordinator="127.0.0.1:1", max_message_bytes=1000)
    assert ServerConfig(coordinator="127.0.0.1:1", map_refresh_interval_s=0.0).map_refresh_interval_s == 0.0
