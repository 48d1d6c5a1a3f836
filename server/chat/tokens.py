"""Special-token spellings and fixed prompt texts of the DeepSeek-V4 chat format (V4 and V4.1)."""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

# Quick-instruction tasks: an internal classification turn closes with its own token.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOL_RESULT_TEMPLATE = "<tool_result>{content}</tool_result>"

# One template serves both versions; only the DSML tag names ({calls}, {invoke}, ...) differ.
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}{calls}>" block like the following:

<{dsml}{calls}>
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
</{dsml}{calls}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
