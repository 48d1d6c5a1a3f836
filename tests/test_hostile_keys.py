"""Issue 21 item 7: an API key never reaches the logs, however a client writes it into a URL, and it can
come from a file (--api-key-file) so that it is not in the process table."""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

import httpx

from contract.logs import Redactor
from tests.serving import server_process

KEY = "sk-Ab+c/d=e%f!g"  # characters a URL encodes: base64's + / =, a percent sign, "!"


def url_forms(secret: str) -> list[str]:
    lower_hex = re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quote(secret, safe=""))
    return [secret, quote(secret, safe=""), quote(secret), quote_plus(secret), lower_hex]


def test_the_redactor_catches_every_url_form_of_a_key():
    redact = Redactor([KEY])
    for form in url_forms(KEY):
        assert redact(f'"GET /v1/models?api_key={form} HTTP/1.1" 401') == '"GET /v1/models?api_key=*** HTTP/1.1" 401'
    assert redact("sk-Ab+c/d=e%f") == "sk-Ab+c/d=e%f"  # a prefix of the key is not the key


def test_a_key_from_a_file_is_neither_in_the_process_table_nor_in_the_access_log(checkpoints, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    with server_process(checkpoints["v41"], "tiny", "--max-model-len", "256", "--log-level", "info",
                        "--api-key-file", str(key_file)) as server:
        assert httpx.get(server.base + "/v1/models").status_code == 401
        assert httpx.get(server.base + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        for form in url_forms(KEY):  # a client that puts the key in the query string
            httpx.get(f"{server.base}/v1/models?api_key={form}")
        time.sleep(0.3)
        command_line = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        output = server.output
    assert KEY not in command_line
    assert "GET /v1/models?api_key=***" in output  # the access log is on and shows the request
    for form in url_forms(KEY):
        assert form not in output, form
