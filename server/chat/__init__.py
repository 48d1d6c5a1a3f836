"""Chat rendering and output parsing for DeepSeek-V4 and DeepSeek-V4.1 (OpenAI chat completions).

Public API::

    fmt = ChatFormat.for_checkpoint(model_dir, model_type)   # config.json model_type
    # (optionally a template replacing the checkpoint's, and default chat_template_kwargs)
    prompt = fmt.render(body)             # str with BOS: tokenize it without adding another
    parser = fmt.parser(body, prompt)     # one per request; the prompt tells if <think> is open
    deltas = parser.feed(text_delta)      # list[Delta]; Delta.to_openai() is a chunk's "delta"
    deltas += parser.finish()             # once the generation ended
    message = parser.message()            # ParsedMessage: reasoning_content, content, tool_calls
    message.finish_reason("stop")         # "tool_calls" when calls are returned
    fmt.parse(body, prompt, text)         # whole-text shortcut for non-streaming responses

Any client mistake raises `ChatRequestError(message, param)`, a ValueError: answer 400.

Families: model_type deepseek_v4 -> V4; deepseek_v41 / deepseek_v41_text -> V4.1. Prompts and
parses are vLLM 0.33.0's, byte for byte. A checkpoint's own Jinja template
(chat_template.jinja, or tokenizer_config.json "chat_template") takes precedence for
rendering (a template handed to for_checkpoint, the server's chat.template, over both); output
is still parsed with the family's dialect. Another family without a
template cannot serve chat (ChatRequestError at render).

Request fields consumed: messages (string or list-of-text-part content; reasoning /
reasoning_content, tool_calls, tool_call_id, task), tools, tool_choice ("auto" / "none";
"required" and named functions raise ChatRequestError: constrained decoding is not supported
yet), reasoning_effort, chat_template_kwargs (thinking, enable_thinking, reasoning_effort,
drop_thinking), include_reasoning, parallel_tool_calls. add_generation_prompt and
continue_final_message are validated but, as in vLLM 0.33.0, do not change a built-in prompt.

The text fed to the parser must keep special tokens (<think>, </think>, ｜DSML｜ markup): they
are the structure being parsed. BOS/EOS spellings in it are dropped.

Below the request layer, `encode_messages(messages, dialect, ...)` renders encoder-format
messages (server/chat/encoding.py); `dialect_for(model_type)` gives the dialect.
"""

from server.chat.chat_format import ChatFormat
from server.chat.dialects import Dialect, dialect_for
from server.chat.encoding import encode_messages
from server.chat.errors import ChatRequestError
from server.chat.output import Delta, ParsedMessage, ToolCall, ToolCallDelta
from server.chat.parse import OutputParser

__all__ = [
    "ChatFormat",
    "ChatRequestError",
    "Delta",
    "Dialect",
    "OutputParser",
    "ParsedMessage",
    "ToolCall",
    "ToolCallDelta",
    "dialect_for",
    "encode_messages",
]
