"""A request's tools and tool_choice, checked, and what they ask of the engine (vLLM's rules).

"none": no call is made (the tools still reach the template); "auto": the model decides and the server's
--tool-call-parser finds calls in its output; "required" and a named function: the output is constrained
by a JSON schema built from the functions' parameter schemas (an array of {"name", "parameters"} objects
for "required", the named function's arguments themselves for a named one), so every call parses and
validates whatever the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from stepahead.entrypoints.openai.errors import APIError
from stepahead.validation import shorten

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function name (vLLM also allows dots)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    functions: tuple[Function, ...]
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # several calls may be made (parallel_tool_calls)

    @property
    def constrained(self) -> bool:
        """The output is a grammar-constrained call (required or named)."""
        return self.mode in ("required", "named")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match, for the constrained modes."""
        if self.mode == "named":
            return next(f.parameters for f in self.functions if f.name == self.named)
        if self.mode != "required":
            return None
        parameters, defs = _hoisted_defs(self.functions)
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": params},
                  "required": ["name", "parameters"]} for f, params in zip(self.functions, parameters, strict=True)]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return array


def _hoisted_defs(functions) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each function's parameters without their $defs, and those $defs together: nested under the calls'
    array, a "#/$defs/..." reference must still find its definition at the root."""
    defs: dict[str, Any] = {}
    parameters = []
    for f in functions:
        params = dict(f.parameters)
        for name, definition in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise APIError(f"tools: two functions define $defs {shorten(repr(name))} differently", 400, "tools")
        parameters.append(params)
    return parameters, defs


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, auto_enabled: bool) -> ToolPlan | None:
    """The plan for a request's tools; None without tools. Every bad definition is a 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
        return None
    functions = tuple(_function(index, tool) for index, tool in enumerate(tools))
    names = [f.name for f in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(f"tools: function names must be unique, got {shorten(repr(duplicates))} more than once",
                       400, "tools")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if isinstance(tool_choice, dict):
        name = _named_choice(tool_choice)
        if name not in names:
            raise APIError(f"tool_choice names the function {shorten(repr(name))}, which is not in tools "
                           f"({shorten(repr(names))})", 400, "tool_choice")
        return ToolPlan("named", functions, named=name, parallel=parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                       f"{shorten(repr(tool_choice))}", 400, "tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       400, "tool_choice")
    return ToolPlan(cast(Mode, tool_choice), functions, parallel=parallel)  # one of the modes, checked above


def _function(index: int, tool: dict[str, Any]) -> Function:
    where = f"tools[{index}]"
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(f"{where}: only tools of type 'function' with a 'function' object are supported", 400, "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got "
                       f"{shorten(repr(name))}", 400, "tools")
    parameters = function.get("parameters")
    if parameters is None:
        return Function(name, _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise APIError(f"{where}.function.parameters must be a JSON schema object, got {shorten(repr(parameters))}",
                       400, "tools")
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        raise APIError(f"{where}.function.parameters is not a valid JSON schema: {shorten(e.message)}", 400,
                       "tools") from None
    except RecursionError:
        raise APIError(f"{where}.function.parameters is nested too deeply", 400, "tools") from None
    if parameters.get("type", "object") != "object":
        raise APIError(f"{where}.function.parameters must describe an object, got type "
                       f"{shorten(json.dumps(parameters.get('type')))}", 400, "tools")
    return Function(name, parameters)


def _named_choice(tool_choice: dict[str, Any]) -> str:
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict) or \
            not isinstance(function.get("name"), str):
        raise APIError('tool_choice must be {"type": "function", "function": {"name": ...}}, got '
                       f"{shorten(json.dumps(tool_choice))}", 400, "tool_choice")
    return function["name"]
