"""The HTTP front end alone: the real app (routes, middleware, metrics, detokenization, SSE) over a
scripted engine that costs next to nothing, so `bench.http --scripted-step-ms MS` measures what the
front end spends per token at concurrencies the tiny model on the CPU cannot reach.

    python -m bench.scripted_engine [--model DIR] [--port 8012] [--step-ms 10] [--max-num-seqs 256]
                                    [--tokens-per-step 1]

Every `--step-ms` the engine thread makes one step: `--tokens-per-step` tokens (more than one: as a
speculative step would) for each running request (the request's own slice of an encoded multilingual
text, so byte-level tokens split characters as real text does), its outputs in one StepOutputs frame
that goes through the wire codec and is handed to the front end as the engine process's receiver
thread hands it (`EngineClient.on_outputs`). A request ends at its
max_tokens with "length". The engine thread runs in the front end's process: its share of the CPU time
(building and coding a frame, ~1 us a token) is counted with the front end's.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from contract import NewRequest, RequestOutput, StepOutputs, StructuredOutput
from contract.codec import decode, encode
from server.app import ServedModel, create_app
from server.chat import ChatFormat
from server.engine_client import EngineClient
from server.metrics import MetricsSetup, install_metrics
from server.tokenizer import TextTokenizer

REPO = Path(__file__).resolve().parent.parent
TEXT = ("The quick brown fox jumps over the lazy dog; naïve café — 東京 😀, données, データ, Ünïcödé ☃ ✓. "
        "def main():\n    print('hello world')\n    return 0\n") * 4


class ScriptedEngine:
    """An EngineHandle whose steps are scripted: `per_step` tokens per running request every `step_s`."""

    def __init__(self, client: EngineClient, tokens: list[int], step_s: float, per_step: int = 1) -> None:
        self._client, self._tokens, self._step_s, self._per_step = client, tokens, step_s, per_step
        self._running: dict[str, list[int]] = {}  # request id -> [tokens made, max_tokens, offset]
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="scripted-engine", daemon=True).start()

    def validate(self, request: NewRequest) -> None: ...

    def submit(self, request: NewRequest) -> None:
        with self._lock:
            self._running[request.request_id] = [0, request.params.max_tokens, len(self._running) * 7]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._running.pop(request_id, None)

    def check_grammar(self, check_id: str, structured: StructuredOutput) -> None:
        self._client.on_grammar_checked(check_id, None)

    def _loop(self) -> None:
        while True:
            began = time.perf_counter()
            outputs = self._step()
            if outputs:
                self._client.on_outputs(decode(encode(StepOutputs(outputs))).outputs)
            time.sleep(max(0.0, self._step_s - (time.perf_counter() - began)))

    def _step(self) -> tuple[RequestOutput, ...]:
        outputs = []
        with self._lock:
            for request_id, state in list(self._running.items()):
                made, limit, offset = state
                new = range(made, min(made + self._per_step, limit))
                state[0] = made = made + len(new)
                tokens = tuple(self._tokens[(offset + i + 1) % len(self._tokens)] for i in new)
                done = made >= limit
                outputs.append(RequestOutput(request_id, tokens, finished=done, num_prompt_tokens=1, inference_time_s=0.0,
                                             finish_reason="length" if done else None))
                if done:
                    del self._running[request_id]
        return tuple(outputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "checkpoints" / "tiny", help="a checkpoint's tokenizer")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tokens-per-step", type=int, default=1, help="tokens a step gives each request")
    parser.add_argument("--served-model-name", default="scripted")
    args = parser.parse_args(argv)
    import uvicorn

    from server.http_edge import OpenAIErrorH11Protocol

    tokenizer = TextTokenizer(args.model, bos_token_id=0, max_tokens=1 << 20)
    client = EngineClient()
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    client.connect(ScriptedEngine(client, tokens, args.step_ms / 1000, args.tokens_per_step))
    served = ServedModel(args.served_model_name, str(args.model), 1 << 20, args.max_num_seqs)
    model_type = json.loads((args.model / "config.json").read_text())["model_type"]
    app = create_app(client, tokenizer, served, chat=ChatFormat.for_checkpoint(args.model, model_type))
    install_metrics(app, client, MetricsSetup(served.name, served.max_model_len, 128))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", http=OpenAIErrorH11Protocol)


if __name__ == "__main__":
    main()
