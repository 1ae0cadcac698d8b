"""JSON Schemas for the structured-output tests, natively, through the API and in the browser:
nested objects, arrays with bounds, enums, numbers with ranges, required and optional fields,
anyOf, string patterns and formats. Strings and arrays are mostly bounded, as a schema for a
small model should be: a random tiny model left free inside a string may not close it."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "color_enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "const_version": {
        "type": "object",
        "properties": {"version": {"const": 2}, "name": NAME},
        "required": ["version", "name"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
        },
        "required": ["ratio", "count", "score"],
    },
    "tags_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
    },
    "fixed_tuple": {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
        "items": False,
    },
    "matrix": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 2,
        "maxItems": 2,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "nickname": NAME,
            "admin": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "any_of_scalar": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"type": "null"}]
            }
        },
        "required": ["value"],
    },
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "radius"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "side"],
            },
        ]
    },
    "pattern_code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "date_format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "enum_array": {"type": "array", "items": {"enum": ["low", "mid", "high"]}, "minItems": 1, "maxItems": 4},
    "null_or_name": {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["middle"],
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["items", "paid"],
    },
    "top_level_integer": {"type": "integer", "minimum": 10, "maximum": 20},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "bounded_text": {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 24}},
        "required": ["summary"],
    },
    "all_types": {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 5},
            "i": {"type": "integer", "minimum": 0, "maximum": 3},
            "n": {"type": "number", "minimum": -1, "maximum": 1},
            "b": {"type": "boolean"},
            "z": {"type": "null"},
            "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "maxItems": 2},
        },
        "required": ["s", "i", "n", "b", "z", "a"],
    },
}
