"""Progress during a prefill: elapsed time, what the last step's rate predicts (a lower bound), and the hook's calls
so far, scraped from a real HTTP exporter whose counter grows while the request runs."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness.ab.progress import Rate, RequestProgress


class _Counter(BaseHTTPRequestHandler):
    calls = 1000

    def do_GET(self) -> None:
        type(self).calls += 500
        body = (f"# TYPE memtel_hook_calls_total counter\n"
                f'memtel_hook_calls_total{{site="s",rank="0"}} {type(self).calls}\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_progress_shows_elapsed_expected_and_hook_calls():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with RequestProgress(1_000_000, Rate("cold-512k", 20_000.0), {"rank0": url}, interval_s=0.1) as progress:
            deadline = time.monotonic() + 10
            while (progress.hook_calls or 0) < 1000 and time.monotonic() < deadline:
                time.sleep(0.05)
            text = progress.text()
        assert progress.expected_s == 50.0
        assert progress.hook_calls is not None and progress.hook_calls >= 1000 and progress.hook_calls % 500 == 0
        assert text.startswith("request ") and "expected ≥ 50 s at cold-512k's 20,000 tokens/s" in text
        assert "hook calls +" in text and "/s)" in text
    finally:
        server.shutdown()
        server.server_close()


def test_progress_without_a_previous_step_or_ranks_shows_elapsed_only():
    with RequestProgress(32_000, None, {}) as progress:
        text = progress.text()
    assert progress.expected_s is None and progress.hook_calls is None
    assert text.startswith("request ") and "expected" not in text and "hook calls" not in text
