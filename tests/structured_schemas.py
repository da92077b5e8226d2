"""Ten bounded JSON schemas (every answer has a longest form: enums, integer ranges, maxLength strings,
maxItems arrays), for the structured-output tests and tools/structured_run.py."""

NAME = {"type": "string", "maxLength": 8}

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "name": NAME}, "required": ["id", "name"],
                 "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1,
                                                        "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    "int_range": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                                   "y": {"type": "integer", "minimum": 100, "maximum": 200}},
                  "required": ["x", "y"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                    {"enum": ["none", "many"]}, {"type": "boolean"}]}},
               "required": ["value"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": NAME, "b": {"type": "integer", "minimum": 0, "maximum": 5},
                                                  "c": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
    "refs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
             "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                                           "maximum": 3}},
        "required": ["k", "v"], "additionalProperties": False}},
    "deep": {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {
        "type": "object", "properties": {"l3": {"type": "array", "maxItems": 2, "items": {"enum": [True, None]}},
                                         "s": {"type": "string", "maxLength": 4}},
        "required": ["l3", "s"], "additionalProperties": False}}, "required": ["l2"], "additionalProperties": False}},
             "required": ["l1"], "additionalProperties": False},
}
