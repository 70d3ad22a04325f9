"""How a chat request uses its tools, for both edges: one check of tools, tool_choice and
parallel_tool_calls (400 naming the field), and the grammar that forces a call.

tool_choice "auto" (OpenAI's default when tools are given) needs a parser that finds calls in
free text, in the model's own format (the version's `tool_call_parser`, flow/tool_parser.py):
without one it is refused rather than answered as if the tools were not there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster.errors import InvalidRequestError
from router.ingress.flow.tool_parser import HermesToolParser, parser_for
from router.ingress.request import ToolsSpec


@dataclass(frozen=True)
class ToolUse:
    """`forced`: the output is a tool call, enforced by a grammar (tool_choice "required": a JSON
    array of {name, parameters}; a named function: its arguments object). `parser`: tool_choice
    "auto", calls found in the free text by the model's parser. Neither: tools play no part (none
    given, or "none")."""

    forced: Literal["required", "named"] | None = None
    name: str | None = None  # the named function
    parser: HermesToolParser | None = None
    names: frozenset[str] = frozenset()  # the functions an "auto" call may name
    parallel: bool = True  # parallel_tool_calls: more than one call in one reply

    @property
    def active(self) -> bool:
        return self.forced is not None or self.parser is not None


def tool_use(spec: ToolsSpec | None, response_format: str | None, parser: str = "none") -> ToolUse:
    """`response_format`: the request's response_format type (a forced call cannot have one)."""
    if spec is None:
        return ToolUse()
    tools, choice = spec.functions, spec.choice
    if choice is not None and not tools and choice != "none":
        raise InvalidRequestError("tool_choice", "needs tools")
    if spec.parallel is not None and not tools:
        raise InvalidRequestError("parallel_tool_calls", "needs tools")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "two tools have the same function name")
    if not tools or choice == "none":
        return ToolUse()
    if choice is None or choice == "auto":
        if parser == "none":
            raise InvalidRequestError("tool_choice", "'auto' (the default with tools) needs a tool-call parser for "
                                                     "this model, and none is configured (tool_call_parser): give "
                                                     "'required', 'none' or "
                                                     '{"type": "function", "function": {"name": ...}}')
        return ToolUse(parser=parser_for(parser), names=frozenset(names), parallel=spec.parallel is not False)
    if response_format not in (None, "text"):
        raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with response_format")
    if choice == "required":
        return ToolUse("required")
    if spec.function not in names:
        raise InvalidRequestError("tool_choice", f"names function {spec.function!r}, which is not in tools")
    return ToolUse("named", spec.function)


def tool_schema(spec: ToolsSpec, use: ToolUse) -> tuple[dict, bool]:
    """The JSON schema a forced tool call's output must match, and whether it is strict."""
    by_name = {t.name: t for t in spec.functions}
    if use.forced == "named":
        f = by_name[use.name]
        return (f.parameters if f.parameters is not None else {"type": "object"}), bool(f.strict)
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [name]},
                             "parameters": f.parameters if f.parameters is not None else {"type": "object"}}}
             for name, f in by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if spec.parallel is False:
        schema["maxItems"] = 1
    return schema, any(bool(f.strict) for f in by_name.values())
