"""`memtel ledger` and `memtel top` read every endpoint as hostile (issue 27): any local user can listen on an
unused default hook port. Real servers on loopback (raw sockets, one thread per connection) answer with what a
hostile or broken endpoint sends; the commands run in-process. Found by the review: control characters reached
the terminal, a bad status line was a traceback, a truncated body was accepted as whole, a 1 byte/s endpoint
held `--timeout 2` for over 60 s."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from telemetry.cli import main
from telemetry.ledger.scrape import take_report

Handler = Callable[[socket.socket], None]


class RawServer:
    """A loopback TCP server: every connection has its request head read, then `handler` writes what it likes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metrics"
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(4096)
                    if not data:
                        return
                    head += data
                self.handler(conn)
            except OSError:   # the client gave up (its deadline): nothing to answer
                pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], str]]:
    servers: list[RawServer] = []

    def start(handler: Handler) -> str:
        servers.append(RawServer(handler))
        return servers[-1].url

    yield start
    for server in servers:
        server.close()


def send(data: bytes) -> Handler:
    return lambda conn: conn.sendall(data)


def answer(body: bytes, *, headers: bytes = b"Content-Type: text/plain; version=0.0.4\r\n") -> Handler:
    return send(b"HTTP/1.1 200 OK\r\n" + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def refused_url() -> str:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def terminal_controls(text: str) -> list[str]:
    """Characters a terminal acts on (C0 but the newline, DEL, C1)."""
    return [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F]


HOSTILE_LABELS = ('memtel_engine_weights_bytes{rank="0\x1b]0;owned\x07",node="\x1b[2J\x1b[H",pid="7\x9b31m\x7f"} 1e9\n'
                  'memtel_hook_calls_total{rank="0\x1b]0;owned\x07",node="\x1b[2J\x1b[H",site="s\rX"} 3\n')


def test_control_characters_in_labels_never_reach_the_terminal(serve, capsys):
    hook = serve(answer(HOSTILE_LABELS.encode()))
    daemon = serve(send(b"\x1b]0;title\x07HTTP/1.1 200 OK\r\n\r\n"))   # a status line with a title escape
    for command in (("ledger", "--timeout", "2"), ("top", "--once")):   # top reads within min(1 s, --interval)
        code, out, err = run(capsys, *command, "--daemon", daemon, "--hooks", hook)
        assert code == 1 and "Traceback" not in err
        assert terminal_controls(out + err) == [], repr(out)
        assert "0\\x1b]0;own" in out and "\\x1b[2J" in out   # escaped (and cut to its column), still readable


@pytest.mark.parametrize("response, reason", [
    (b"HELLO THERE\r\n\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", "malformed HTTP answer"),
    (b"HTTP/1.1 200 OK\r\nX-Long: " + b"y" * 70_000 + b"\r\n\r\n", "malformed HTTP answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n<html>hi</html>\n", "not the metrics text format"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n\xff\xfe\n\n", "not UTF-8"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", "badly framed"),
    (b"", "closed the connection without an answer"),
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", "HTTP 503"),
], ids=["garbage-status", "bad-code", "200-headers", "long-header", "html", "not-utf8", "bad-chunk", "empty",
        "503"])
def test_a_malformed_answer_is_one_line_not_a_traceback(serve, capsys, response, reason):
    hook = serve(send(response))
    code, out, err = run(capsys, "ledger", "--daemon", refused_url(), "--hooks", hook, "--timeout", "2")
    assert code == 1 and "Traceback" not in err and err == ""
    (line,) = [line for line in out.splitlines() if line.startswith(f"  hook {hook}: unreachable")]
    assert reason in line and len(line) < 300, line


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\nmemtel_hook_calls_total{rank=\"0\"} 3\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n24\r\nmemtel_hook_calls_total{rank=\"0\"} 3\n\r\n",
    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nmemtel_hook_calls_total{rank=\"0\"} 3\nmemtel_hook_gro",
], ids=["content-length", "chunked", "until-close"])
def test_a_truncated_body_is_reported_not_taken_as_whole(serve, response):
    hook = serve(send(response))
    report = take_report([refused_url()], [hook], timeout_s=2)
    (view,) = [h for n in report.nodes for h in n.hooks]
    assert view.error is not None and "cut short" in view.error and view.calls is None, view


def test_a_whole_answer_is_read(serve):
    """The counterpart of the truncation tests: the same framings, whole, are read."""
    body = b"memtel_hook_calls_total{rank=\"0\",node=\"n\"} 3\n"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    hooks = [serve(answer(body)), serve(send(chunked)), serve(send(b"HTTP/1.0 200 OK\r\n\r\n" + body))]
    report = take_report([refused_url()], hooks, timeout_s=2)
    assert [h.calls for n in report.nodes for h in n.hooks] == [3, 3, 3]


def drip(data: bytes, every_s: float) -> Handler:
    def handler(conn: socket.socket) -> None:
        for byte in data:
            conn.sendall(bytes([byte]))
            time.sleep(every_s)
    return handler


def test_one_deadline_for_the_whole_request_not_per_read(serve, capsys):
    # a byte every 50 ms: each read is quick, the answer takes 10 s; --timeout 0.5 holds for 0.5 s
    slow = serve(drip(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"#" * 99 + b"\n", 0.05))
    start = time.monotonic()
    code, out, _ = run(capsys, "ledger", "--daemon", slow, "--hooks", slow, "--timeout", "0.5")
    elapsed = time.monotonic() - start
    assert code == 1 and elapsed < 0.5 + 1.0, elapsed   # the slack: a loaded 2-CPU machine; the drip takes 10 s
    assert "daemon unreachable: no whole answer before the deadline" in out


def test_top_interval_0_says_what_is_wrong_with_the_interval(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["top", "--interval", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--interval" in err and "> 0" in err and "timeout" not in err


@pytest.mark.parametrize("command", [("ledger",), ("top", "--once")])
def test_an_unreachable_daemon_exits_1_in_ledger_and_top(capsys, command):
    code, out, _ = run(capsys, *command, "--daemon", refused_url(), "--hooks", refused_url())
    assert code == 1 and "daemon unreachable: Connection refused" in out


@pytest.mark.parametrize("command", [("ledger",), ("top", "--once")])
@pytest.mark.parametrize("body", [b"# another exporter\nnode_memory_MemTotal_bytes 1e9\n", b"",
                                  b'memtel_hook_calls_total{rank="0",site="s"} 3\n'], ids=["exporter", "empty", "hook"])
def test_a_port_that_is_not_a_memtel_daemon_exits_1_with_one_line_saying_so(serve, capsys, command, body):
    """Issue 40: pointed at another exporter (or a hook), both printed a node of `?` and exited 0."""
    other = serve(answer(body))
    hook = serve(answer(b'memtel_hook_calls_total{rank="0",site="s"} 3\n'))  # a hook that answers: exit 0 by itself
    code, out, _ = run(capsys, *command, "--daemon", other, "--hooks", hook)
    assert code == 1
    assert out.count("  not a memtel daemon (none of its node series; the daemon's port is 9101)\n") == 1, out


def test_json_gives_rank_and_pid_as_numbers_and_null_for_a_label_that_is_none(serve, capsys):
    daemon = serve(answer(b"memtel_node_mem_total_bytes 1e9\n"))
    hooks = [serve(answer(b'memtel_engine_weights_bytes{rank="%s",node="n",pid="%s"} 5\n' % pair))
             for pair in ((b"1", b"4242"), (b"x\x1b", b"-3"))]
    code, out, _ = run(capsys, "ledger", "--daemon", daemon, "--hooks", ",".join(hooks), "--json")
    processes = json.loads(out)["nodes"][0]["processes"]
    assert code == 0 and [(p["rank"], p["pid"]) for p in processes] == [(1, 4242), (None, None)]


def test_the_node_is_named_as_its_hooks_name_it(serve):
    hook = serve(answer(b'memtel_hook_calls_total{rank="0",node="spark-a",site="s"} 3\n'))
    daemon = serve(answer(b"memtel_node_mem_total_bytes 1e9\n"))
    (node,) = take_report([daemon], [hook], timeout_s=2).nodes
    assert node.name == "spark-a" and node.daemon_url == daemon and len(node.hooks) == 1
    # a loopback daemon without hooks is this host: the name a hook here exports (the host name)
    (alone,) = take_report([daemon], [], timeout_s=2).nodes
    assert alone.name == socket.gethostname()
