"""A fixed set of guides for structured output: 24 JSON schemas (nested objects, arrays, enums, numbers with
bounds, optional fields) and regexes, each with a prompt that asks for it. Used by tests/engine/test_guided.py (every
output must validate) and bench/guided_cost.py (throughput and compile time)."""

from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 24}
_I = {"type": "integer"}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person",
     {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a book", {"type": "object", "properties": {"title": _S, "author": _S, "year": {"type": "integer", "minimum": 1450,
                "maximum": 2030}}, "required": ["title", "author", "year"]}),
    ("a color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -90,
                               "maximum": 60}, "city": _S}, "required": ["celsius", "city"]}),
    ("three fruits", {"type": "object", "properties": {"fruits": {"type": "array", "items": _S, "minItems": 3,
                      "maxItems": 3}}, "required": ["fruits"]}),
    ("a point", {"type": "object", "properties": {"x": _I, "y": _I}, "required": ["x", "y"],
                 "additionalProperties": False}),
    ("an address", {"type": "object", "properties": {"street": _S, "city": _S, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("an order", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "items": {"type": "array",
                  "items": {"type": "object", "properties": {"sku": _S, "qty": {"type": "integer", "minimum": 1,
                  "maximum": 9}}, "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3}},
                  "required": ["id", "items"]}),
    ("a user profile", {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": _S,
                        "email": _S}, "required": ["name", "email"]}, "active": {"type": "boolean"}},
                        "required": ["user", "active"]}),
    ("a weekday", {"type": "object", "properties": {"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday",
                   "Friday", "Saturday", "Sunday"]}}, "required": ["day"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                  "comment": _S}, "required": ["stars", "comment"]}),
    ("a list of numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                           "minItems": 2, "maxItems": 5}),
    ("a movie", {"type": "object", "properties": {"title": _S, "genres": {"type": "array", "items": {"enum": [
                 "drama", "comedy", "action", "horror"]}, "minItems": 1, "maxItems": 2}},
                 "required": ["title", "genres"]}),
    ("a server status", {"type": "object", "properties": {"host": _S, "up": {"type": "boolean"}, "load": {
                         "type": "number", "minimum": 0, "maximum": 1}}, "required": ["host", "up", "load"]}),
    ("a recipe", {"type": "object", "properties": {"name": _S, "steps": {"type": "array", "items": _S,
                  "minItems": 1, "maxItems": 3}, "minutes": {"type": "integer", "minimum": 1, "maximum": 300}},
                  "required": ["name", "steps", "minutes"]}),
    ("a country", {"type": "object", "properties": {"name": _S, "capital": _S, "population_millions": {
                   "type": "number", "minimum": 0}}, "required": ["name", "capital", "population_millions"]}),
    ("a matrix", {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "array", "items": _I,
                  "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["rows"]}),
    ("an event", {"type": "object", "properties": {"name": _S, "date": {"type": "string",
                  "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["name", "date"]}),
    ("a tool call", {"type": "object", "properties": {"tool": {"enum": ["search", "calculator"]}, "arguments": {
                     "type": "object", "properties": {"query": _S}, "required": ["query"]}},
                     "required": ["tool", "arguments"]}),
    ("a pet", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "name": _S, "age": {
               "type": "integer", "minimum": 0, "maximum": 30}, "vaccinated": {"type": "boolean"}},
               "required": ["kind", "name", "age", "vaccinated"]}),
    ("a price", {"type": "object", "properties": {"amount": {"type": "number", "exclusiveMinimum": 0,
                 "maximum": 10000}, "currency": {"enum": ["USD", "EUR", "JPY"]}}, "required": ["amount", "currency"]}),
    ("a team", {"type": "object", "properties": {"team": _S, "members": {"type": "array", "items": {
                "type": "object", "properties": {"name": _S, "role": {"enum": ["lead", "dev", "ops"]}},
                "required": ["name", "role"]}, "minItems": 1, "maxItems": 2}}, "required": ["team", "members"]}),
    ("a sensor", {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                  "values": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["id", "values", "unit"]}),
]

REGEXES: list[tuple[str, str]] = [
    ("a US phone number", r"\(\d{3}\) \d{3}-\d{4}"),
    ("an ISO date", r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("an email address", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"),
    ("an IPv4 address", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"),
    ("a hex color", r"#[0-9a-f]{6}"),
    ("a time of day", r"([01]\d|2[0-3]):[0-5]\d"),
]


def schema_prompt(subject: str) -> str:
    return f"Give {subject} as JSON."


def regex_prompt(subject: str) -> str:
    return f"Write {subject}."
