"""The runnable example in docs/runtime.md runs: it serves, is listed, answers, and drains."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import openai

from shoal.discovery import Discovery
from shoal.store import Store

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


async def test_the_documented_echo_worker_serves_is_listed_and_exits_0_on_sigterm(
    tmp_path: Path, store_url: str, store: Store
) -> None:
    example = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert example is not None
    script = tmp_path / "echo_worker.py"
    script.write_text(example.group(1))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "SHOAL_STORE": store_url},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        match = re.match(r"serving (\S+) instance=([0-9a-f]+)", line)
        assert match, line
        models = await Discovery(store).list()
        assert [(m.card.display_name, m.instance_id) for m in models] == [
            ("echo", int(match[2], 16))
        ]
        client = openai.AsyncOpenAI(base_url=match[1] + "/v1", api_key="unused")
        answer = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "ping"}]
        )
        await client.close()
        assert answer.choices[0].message.content == "ping"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert await Discovery(store).list() == []
