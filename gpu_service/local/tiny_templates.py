"""Jinja chat templates of the tiny checkpoints, written from `../shared/formats.md` (not copies).

- `KIMI_K2` / `KIMI_K2_THINKING`: no newlines between messages, every message ends `<|im_end|>`;
  tools first as `<|im_system|>tool_declare<|im_middle|>{JSON}<|im_end|>`; the role header is the
  message's `name` when given (tool results always `tool`); system and tool messages use
  `<|im_system|>`; tool results `## Return of {tool_call_id}\\n{content}`; tool calls in Kimi's
  section syntax, a call without an id numbered `functions.{name}:{counter}`. Thinking adds the
  default system prompt when there is none, and `<think>` blocks: empty for assistant messages up
  to the last one without tool calls, `<think>{reasoning_content}</think>` after it.
- `KIMI_K25` / `KIMI_K26` (formats-v4.md, Kimi section): K2-Thinking's layout; `tool_declare`
  holds `tools_ts_str` (TypeScript, gpu_service.api.chat_formats.tools_ts) or the JSON; content
  may be parts (text; `image` / `image_url` as `<|media_begin|>image<|media_content|><|media_pad|>
  <|media_end|>`); the generation prompt ends `<think>` (`thinking` false: `<think></think>`); K2.6's
  `preserve_thinking` keeps the reasoning of every assistant turn.
- `DEEPSEEK_V3` / `DEEPSEEK_R1`: BOS, system text (with a `## Tools` part listing the schemas),
  `<｜User｜>`, `<｜Assistant｜>` ... `<｜end▁of▁sentence｜>`, V3 tool calls and tool outputs; R1
  opens `<think>\\n` in the generation prompt and drops the reasoning of earlier answers.
"""
from __future__ import annotations

KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

_KIMI_HEAD = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
)
_KIMI_CALLS = (
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}"
    "{%- set args = call.function.arguments -%}"
    "<|tool_call_begin|>{{ call.id if call.id else 'functions.' ~ call.function.name ~ ':' ~ ns.calls }}"
    "<|tool_call_argument_begin|>{{ args if args is string else args | tojson }}<|tool_call_end|>"
    "{%- set ns.calls = ns.calls + 1 -%}"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
)


def _kimi(thinking: bool) -> str:
    parts = [_KIMI_HEAD, "{%- set ns = namespace(calls=0, split=-1) -%}"]
    if thinking:
        parts.append(
            "{%- for message in messages -%}"
            "{%- if message.role == 'assistant' and not message.tool_calls -%}{%- set ns.split = loop.index0 -%}"
            "{%- endif -%}{%- endfor -%}"
            "{%- if not messages or messages[0].role != 'system' -%}"
            "<|im_system|>system<|im_middle|>" + KIMI_DEFAULT_SYSTEM + "<|im_end|>{%- endif -%}")
    think = ("{%- if loop.index0 <= ns.split -%}<think></think>"
             "{%- else -%}<think>{{ message.reasoning_content or '' }}</think>{%- endif -%}") if thinking else ""
    parts.append(
        "{%- for message in messages -%}"
        "{%- set header = 'tool' if message.role == 'tool' else (message.name or message.role) -%}"
        "{%- if message.role == 'user' -%}<|im_user|>"
        "{%- elif message.role == 'assistant' -%}<|im_assistant|>"
        "{%- else -%}<|im_system|>{%- endif -%}"
        "{{ header }}<|im_middle|>"
        "{%- if message.role == 'assistant' -%}" + think + "{{ message.content or '' }}" + _KIMI_CALLS +
        "{%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}{{ '\\n' }}{{ message.content }}"
        "{%- else -%}{{ message.content }}{%- endif -%}"
        "<|im_end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
    return "".join(parts)


KIMI_K2 = _kimi(False)
KIMI_K2_THINKING = _kimi(True)

_KIMI25_CONTENT = (  # a string, or parts: text as is, an image as K2.5's media marker
    "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}{%- for part in c -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- elif part.type in ('image', 'image_url') -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)


def _kimi25(k26: bool) -> str:
    """K2.5 (k26: K2.6): K2-Thinking's layout with TypeScript tool declarations (`tools_ts_str`,
    the JSON without it), content parts (images as media markers), `thinking` (default on: the
    generation prompt opens `<think>`, off: `<think></think>`) and, K2.6, `preserve_thinking`."""
    keep = "(preserve_thinking is defined and preserve_thinking) or " if k26 else ""
    return "".join([
        _KIMI25_CONTENT,
        "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
        "{%- if tools_ts_str is defined and tools_ts_str -%}{{ tools_ts_str }}"
        "{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}<|im_end|>{%- endif -%}",
        "{%- set ns = namespace(calls=0, split=-1) -%}",
        "{%- for message in messages -%}"
        "{%- if message.role == 'assistant' and not message.tool_calls -%}{%- set ns.split = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if not messages or messages[0].role != 'system' -%}"
        "<|im_system|>system<|im_middle|>" + KIMI_DEFAULT_SYSTEM + "<|im_end|>{%- endif -%}",
        "{%- for message in messages -%}"
        "{%- set header = 'tool' if message.role == 'tool' else (message.name or message.role) -%}"
        "{%- if message.role == 'user' -%}<|im_user|>"
        "{%- elif message.role == 'assistant' -%}<|im_assistant|>"
        "{%- else -%}<|im_system|>{%- endif -%}"
        "{{ header }}<|im_middle|>"
        "{%- if message.role == 'assistant' -%}"
        "{%- if " + keep + "loop.index0 > ns.split -%}<think>{{ message.reasoning_content or '' }}</think>"
        "{%- else -%}<think></think>{%- endif -%}"
        "{{ content(message.content) }}" + _KIMI_CALLS +
        "{%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}{{ '\\n' }}"
        "{{ content(message.content) }}"
        "{%- else -%}{{ content(message.content) }}{%- endif -%}"
        "<|im_end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
        "{%- endif -%}"])


KIMI_K25 = _kimi25(False)
KIMI_K26 = _kimi25(True)


def _deepseek(r1: bool) -> str:
    content = ("{%- set content = message.content or '' -%}"
               "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
               if r1 else "{%- set content = message.content or '' -%}")
    return (
        "{{ bos_token }}"
        "{%- set ns = namespace(system='', outputs=false) -%}"
        "{%- for message in messages if message.role == 'system' -%}"
        "{%- set ns.system = ns.system ~ ('\\n\\n' if ns.system else '') ~ message.content -%}"
        "{%- endfor -%}"
        "{%- if tools -%}"
        "{%- set ns.system = ns.system ~ ('\\n\\n' if ns.system else '') ~ '## Tools\\nYou can call these functions:' -%}"
        "{%- for tool in tools -%}{%- set ns.system = ns.system ~ '\\n' ~ (tool.function | tojson) -%}{%- endfor -%}"
        "{%- set ns.system = ns.system ~ '\\nTo call one, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        "<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' -%}"
        "{%- endif -%}"
        "{{ ns.system }}"
        "{%- for message in messages -%}"
        "{%- if message.role != 'tool' and ns.outputs -%}<｜tool▁outputs▁end｜>{%- set ns.outputs = false -%}"
        "{%- endif -%}"
        "{%- if message.role == 'user' -%}<｜User｜>{{ message.content }}"
        "{%- elif message.role == 'assistant' -%}" + content + "<｜Assistant｜>{{ content }}"
        "{%- if message.tool_calls -%}<｜tool▁calls▁begin｜>"
        "{%- for call in message.tool_calls -%}{%- set args = call.function.arguments -%}"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ call.function.name }}{{ '\\n```json\\n' }}"
        "{{ args if args is string else args | tojson }}{{ '\\n```' }}<｜tool▁call▁end｜>"
        "{%- endfor -%}<｜tool▁calls▁end｜>{%- endif -%}<｜end▁of▁sentence｜>"
        "{%- elif message.role == 'tool' -%}"
        "{%- if not ns.outputs -%}<｜tool▁outputs▁begin｜>{%- set ns.outputs = true -%}{%- endif -%}"
        "<｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜>"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if ns.outputs -%}<｜tool▁outputs▁end｜>{%- endif -%}"
        "{%- if add_generation_prompt -%}<｜Assistant｜>" + ("<think>{{ '\\n' }}" if r1 else "") + "{%- endif -%}"
    )


DEEPSEEK_V3 = _deepseek(False)
DEEPSEEK_R1 = _deepseek(True)
