"""`wideserve bench serve` pointed at no server says so in one line naming what to do (a new
user's first mistake: benchmarking before `wideserve serve` is up)."""
from __future__ import annotations

import socket

from wideserve.entrypoints.cli import main as cli_main


def test_no_server_at_the_base_url_is_one_line_naming_the_fix(capsys) -> None:
    with socket.socket() as s:                 # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc = cli_main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[0].startswith(f"wideserve bench serve: error: cannot reach --base-url {url} (")
    assert err[0].endswith("start the server first (`wideserve serve`) or fix the URL")
