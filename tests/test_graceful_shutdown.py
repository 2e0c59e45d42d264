"""SIGTERM: running requests finish within the grace period, then the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from pathlib import Path

from tests.live_server import live_server_process


def test_sigterm_lets_a_stream_finish_and_exits_zero(model_dir: Path) -> None:
    with live_server_process(model_dir, "--shutdown-grace-seconds", "60") as (url, proc):
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        events: list[str] = []
        started = threading.Event()

        def read() -> None:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode().strip())
                        if len(events) >= 3:
                            started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60), "the stream never started"
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert not reader.is_alive()
        assert proc.wait(timeout=60) == 0
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert len(text) > 400  # all 400 tokens arrived, not a cut stream
