"""A `/v1/chat/completions` (or gRPC chat) request -> prompt ids + the parsers of its output.

Validates, each failure an APIError (400) naming the field: `messages` (roles; assistant
`tool_calls`, `reasoning_content`; `tool` messages need `tool_call_id`), `tools` (functions whose
`parameters` must be a JSON schema), `tool_choice` (`auto`, `none`, `required`, or a named
function among `tools`), `parallel_tool_calls`, `chat_template_kwargs` (template variables, e.g.
`{"thinking": true}`); the legacy `functions` / `function_call` are refused with the new names;
`store` / `metadata` / `verbosity` as gpu_service.api.openai_params.chat_options says.

`reasoning_effort` onto the format's thinking control (`reasoning_kwargs`):
- a format with `reasoning_efforts` (a tuple of its levels): passed on as the template variable
  `reasoning_effort`; a value outside the tuple is a 400 listing it; when the format also has a
  `thinking` switch (DeepSeek-V4: levels "high", "max"), "none" turns thinking off and a level
  turns it on (the other OpenAI values are a 400 listing "none" and the levels);
- a thinking on/off switch (the `thinking` variable: V3.2's built-in format, a Jinja template that
  reads `thinking` such as V3.1's): "none" / "minimal" -> thinking off, "low" / "medium" / "high" /
  "xhigh" / "max" -> on (one level of reasoning: the levels above "minimal" all mean "think");
- a template that always reasons (writes `<think>` without a switch: Kimi-K2-Thinking, R1):
  "low" .. "max" accepted (it reasons anyway), "none" / "minimal" a 400 (it cannot stop);
- no reasoning at all (Kimi-K2, V3): any value is a 400.
A `reasoning_effort` contradicting `chat_template_kwargs.thinking` is a 400.

`tool_choice`:
- `auto`: tools rendered in the prompt, the model's calls parsed;
- `none`: tools left out of the prompt, nothing parsed as a call;
- `required` / named: the prompt is extended with the opening of a call in the model's native
  syntax (of the named function, or up to the name for `required`), and the plan carries a
  grammar (gpu_service.api.tool_grammar) for the rest: a listed name, arguments valid for its
  schema, the closing markers. The text goes through the same tool-call parser. Without a grammar
  engine for the vocabulary the prefix alone still forces the call and its name, not the
  arguments' shape.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

from gpu_service.api.chat_formats.common import THINK_END, THINK_START
from gpu_service.api.errors import APIError, check_prompt_chars
from gpu_service.api.openai_params import chat_options
from gpu_service.api.parsers import OutputParser, reasoning_parser_for, tool_parser_for
from gpu_service.api.parsers.stream import ChatStream, IncrementalStream, open_stream
from gpu_service.api.tool_grammar import tool_call_grammar

MAX_TOOLS = 128  # functions one request may list (each is rendered into the prompt and may be compiled)
ROLES = ("system", "user", "assistant", "developer", "tool")
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")
DEVELOPER_FAMILIES = ("deepseek_v32", "deepseek_v4")  # formats with a developer role of their own
THINKING_OFF = ("none", "minimal")  # reasoning_effort values that turn an on/off switch off
log = logging.getLogger("moesplit.chat")


@dataclass
class ChatSettings:
    """Server-wide choices (`--tool-call-parser`, `--reasoning-parser`); "auto" picks by model."""

    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    refused: str | None = None  # why this model takes no chat requests (e.g. no encoder for its format)


@dataclass
class ChatPlan:
    ids: list[int]
    prompt: str
    parser: OutputParser
    tool_choice: str | dict
    grammar: object = None  # GrammarSpec forcing the call (tool_choice required / named), else None
    metadata: dict | None = None  # the request's `metadata`, returned on the chat.completion object
    images: list | None = None  # the ImageInputs of the prompt's image placeholder runs, in order

    def stream(self) -> ChatStream | IncrementalStream:
        return open_stream(self.parser)


MEDIA_PARTS = ("image_url", "image", "input_image", "video_url", "video", "input_audio")


def _media_part_error(p: dict, where: str, vision: str | None, images_on: bool = False) -> APIError:
    """The 400 for a media content part this path does not take (`images_on`: image_url parts are
    served here, so the part is a video / audio / other-shaped image part)."""
    kind = p.get("type")
    if kind in ("video_url", "video"):
        why = ("moesplit serves images only, not Kimi-K2.5's video input; send frames as image_url parts"
               if vision else "this model takes text only")
    elif kind == "input_audio":
        why = "no served model takes audio"
    elif images_on:
        why = "images are sent as {\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/...;base64,...\"}}"
    elif vision:
        why = (f"this model ({vision}) has a vision tower, but this server does not serve it (its checkpoint "
               "has no vision_tower.* tensors, or gRPC Generate, which takes text only)")
    else:
        why = "this model takes text only"
    return APIError(400, f"{where}: {kind!r} content parts are not served: {why}", param=where)


def _text(content, where: str, allow_none: bool = False, vision: str | None = None, image_fn=None) -> str:
    """A message's content as text: a string, or an array of text parts (media parts are a 400
    naming the part; `vision`: the model's multimodal architecture, when it has one; `image_fn(part,
    where) -> text`: takes an image_url part, returning the text standing for it)."""
    if content is None:
        if allow_none:
            return ""
        raise APIError(400, f"{where} is required", param=where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url" and image_fn is not None:
                parts.append(image_fn(p, f"{where}[{j}]"))
                continue
            if isinstance(p, dict) and p.get("type") in MEDIA_PARTS:
                raise _media_part_error(p, f"{where}[{j}]", vision, image_fn is not None)
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise APIError(400, f"{where}: only text parts are supported", param=where)
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or an array of text parts", param=where)


def _tool_calls(calls, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be an array", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}[{j}].function.name is required", param=f"{where}[{j}].function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise APIError(400, f"{where}[{j}].function.arguments must be a JSON string",
                           param=f"{where}[{j}].function.arguments")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if c.get("id") is not None:
            call["id"] = str(c["id"])
        out.append(call)
    return out


def normalize_messages(messages, keep_developer: bool = False, vision: str | None = None, image_fn=None) -> list[dict]:
    """OpenAI messages -> the plain dicts templates read (content as text, tool fields kept).
    `vision`: the model's multimodal architecture (its image parts are refused naming it unless
    `image_fn` takes them: see _text)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role' and 'content'", param="messages")
        role = m["role"]
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}", param="messages")
        msg: dict = {"role": "system" if role == "developer" and not keep_developer else role}
        msg["content"] = _text(m.get("content"), f"messages[{i}].content",
                               allow_none=role == "assistant" or role == "system", vision=vision,
                               image_fn=image_fn)
        if isinstance(m.get("name"), str) and m["name"]:
            msg["name"] = m["name"]
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            for k in ("reasoning_content", "reasoning"):
                if m.get(k) is not None:
                    msg["reasoning_content"] = _text(m[k], f"messages[{i}].{k}")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:
                raise APIError(400, f"messages[{i}]: a 'tool' message needs 'tool_call_id', the id of the call "
                                    "it answers", param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = tcid
        out.append(msg)
    return out


def _check_schema(schema, where: str) -> None:
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON schema object", param=where)
    from gpu_service.runtime.grammar import check_schema_depth, InvalidSchema

    try:
        check_schema_depth(schema, where)
    except InvalidSchema as e:
        raise APIError(400, str(e), param=where) from None
    try:
        import jsonschema
    except ImportError:  # the shape check above is all we can do
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"{where} is not a valid JSON schema: {e.message}", param=where) from None


def validate_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be an array of {type: 'function', function: {...}}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' lists {len(tools)} functions; at most {MAX_TOOLS} are accepted", param="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(400, f"{where} must be {{type: 'function', function: {{name, parameters}}}}", param=where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                           param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}.function.name {name!r} is given twice", param=f"{where}.function.name")
        names.add(name)
        if "parameters" in fn and fn["parameters"] is not None:
            _check_schema(fn["parameters"], f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def validate_tool_choice(choice, tools: list[dict]) -> str | dict:
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs 'tools'", param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in 'tools' "
                                f"({', '.join(names) or 'none given'})", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                        "{type: 'function', function: {name}}", param="tool_choice")


def thinking_control(fmt) -> str | None:
    """How a chat format controls reasoning: "efforts" (a `reasoning_efforts` tuple), "switch" (the
    `thinking` template variable), "always" (it reasons, no switch), or None (no reasoning)."""
    if isinstance(getattr(fmt, "reasoning_efforts", None), tuple):
        return "efforts"
    if "thinking" in (getattr(fmt, "template_kwargs", None) or ()):
        return "switch"
    text = getattr(fmt, "template_text", None)
    if text is None:
        return None
    if "thinking" in _template_variables(text):
        return "switch"
    return "always" if THINK_START in text or THINK_END in text else None


@functools.lru_cache(maxsize=8)
def _template_variables(text: str) -> frozenset:
    """The variables a Jinja template reads from its caller."""
    import jinja2.meta

    from gpu_service.api.chat_formats.jinja_format import make_environment

    return frozenset(jinja2.meta.find_undeclared_variables(make_environment().parse(text)))


def _effort_kwargs(effort: str, fmt, kwargs: dict) -> dict:
    """`reasoning_effort` on a format that names its levels; with a `thinking` switch too
    (DeepSeek-V4), "none" turns thinking off and a level turns it on."""
    switch = "thinking" in (getattr(fmt, "template_kwargs", None) or ())
    allowed = (("none",) if switch else ()) + tuple(fmt.reasoning_efforts)
    if effort not in allowed:
        raise APIError(400, f"'reasoning_effort' {effort!r} is not one this model takes: use one of "
                            f"{', '.join(allowed)}", param="reasoning_effort")
    if not switch:
        return {**kwargs, "reasoning_effort": effort}
    on = effort != "none"
    given = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if given is not None and bool(given) != on:
        raise APIError(400, f"'reasoning_effort' {effort!r} turns thinking {'on' if on else 'off'} but "
                            f"chat_template_kwargs sets thinking {given!r}: drop one", param="reasoning_effort")
    if kwargs.get("reasoning_effort") not in (None, effort if on else None):
        raise APIError(400, f"'reasoning_effort' {effort!r} and chat_template_kwargs.reasoning_effort "
                            f"{kwargs['reasoning_effort']!r} disagree: drop one", param="reasoning_effort")
    out = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    return {**out, "thinking": True, "reasoning_effort": effort} if on else {**out, "thinking": False}


def reasoning_kwargs(effort: str | None, fmt, kwargs: dict) -> dict:
    """`chat_template_kwargs` with `reasoning_effort` applied (see the module docstring)."""
    if effort is None:
        return kwargs
    control = thinking_control(fmt)
    if control == "efforts":
        return _effort_kwargs(effort, fmt, kwargs)
    if control == "switch":
        on = effort not in THINKING_OFF
        if "thinking" in kwargs and bool(kwargs["thinking"]) != on:
            raise APIError(400, f"'reasoning_effort' {effort!r} turns thinking {'on' if on else 'off'} but "
                                f"chat_template_kwargs.thinking is {kwargs['thinking']!r}: drop one",
                           param="reasoning_effort")
        return {**kwargs, "thinking": on}
    if control == "always":
        if effort in THINKING_OFF:
            raise APIError(400, f"'reasoning_effort' {effort!r}: this model always reasons and cannot turn it "
                                "off; use low, medium, high, xhigh or max (all the same here), or leave it out",
                           param="reasoning_effort")
        return kwargs
    raise APIError(400, f"'reasoning_effort' {effort!r}: this model has no reasoning control; leave it out "
                        "(allowed: null)", param="reasoning_effort")


def chat_plan(body: dict, tokenizer, settings: ChatSettings, max_chars: int | None = None,
              images=None) -> ChatPlan:
    """Validate the chat fields of `body`, render the prompt and set up its output parsers; a
    conversation over `max_chars` characters is refused before the template runs. `images`: the
    server's ImagePolicy when it serves image_url parts (gpu_service.api.image_parts), else None."""
    if settings.refused:
        raise APIError(400, settings.refused, param="messages")
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer (tokenizer.json or tiktoken.model); use /v1/completions "
                            "with token ids", param="messages")
    for legacy, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(legacy) is not None:
            raise APIError(400, f"'{legacy}' is the deprecated form: send '{new}' instead", param=legacy)
    try:
        metadata, effort = chat_options(body)
    except ValueError as e:  # RequestError
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    if metadata is not None:
        log.info("chat request metadata %s", json.dumps(metadata, ensure_ascii=False))
    fmt = tokenizer.chat_format
    family = getattr(fmt, "family", None)
    taken: list = []  # ImageInputs, in prompt order
    messages = normalize_messages(body.get("messages"), keep_developer=family in DEVELOPER_FAMILIES,
                                  vision=getattr(tokenizer, "vision_wrapper", None),
                                  image_fn=_image_taker(images, taken) if images is not None else None)
    check_prompt_chars(sum(len(m.get("content") or "") for m in messages), max_chars, "messages")
    tools = validate_tools(body["tools"]) if body.get("tools") is not None else []
    choice = validate_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object of template variables",
                       param="chat_template_kwargs")
    bad = [k for k in kwargs if k in RESERVED_KWARGS]
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {bad}: use the request's own fields",
                       param="chat_template_kwargs")
    kwargs = reasoning_kwargs(effort, fmt, kwargs)
    rendered_tools = tools if choice != "none" else None
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=rendered_tools, **kwargs)
    except ValueError as e:  # TokenizerError: no template, or the template refused the conversation
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise APIError(400, f"chat template: {e}", param=param) from None
    tparser = tool_parser_for(settings.tool_parser, family) if choice != "none" else None
    rparser = reasoning_parser_for(settings.reasoning_parser, family, prompt)
    prefix, grammar = "", None
    if choice == "required" or isinstance(choice, dict):
        if tparser is None:
            raise APIError(400, f"tool_choice {choice!r} needs a tool-call parser for this model; start the server "
                                "with --tool-call-parser NAME", param="tool_choice")
        tparser.call_index = sum(len(m.get("tool_calls") or []) for m in messages)
        prefix = ("</think>" if rparser is not None and rparser.start_in else "") + \
            tparser.forced_prefix(choice["function"]["name"] if isinstance(choice, dict) else None)
        prompt += prefix
        grammar = tool_call_grammar(tparser.name, tools, choice, tokenizer, tparser.call_index)
    ids = tokenizer.encode(prompt, add_bos=False)
    if taken:
        from gpu_service.api.image_parts import expand_placeholders

        ids = expand_placeholders(ids, tokenizer.encode("<|media_pad|>", add_bos=False)[0], taken)
    max_calls = 1 if (not parallel or isinstance(choice, dict)) else None
    return ChatPlan(ids, prompt, OutputParser(rparser, tparser, prefix, max_calls), choice, grammar, metadata,
                    images=taken or None)


def _image_taker(policy, taken: list):
    """image_fn for normalize_messages: each image_url part decoded into `taken` (at most
    policy.limits.max_images: a 400 naming --max-images), standing in the text as K2.5's marker."""
    from gpu_service.api.image_parts import IMAGE_MARKER, image_of_part

    def take(part: dict, where: str) -> str:
        if len(taken) >= policy.limits.max_images:
            raise APIError(400, f"{where}: more than {policy.limits.max_images} images in one request "
                                "(--max-images)", param=where, code="too_many_images")
        taken.append(image_of_part(part, where, policy))
        return IMAGE_MARKER
    return take
