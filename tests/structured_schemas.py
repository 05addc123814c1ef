"""20 JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers.
Strings and arrays are bounded so a small model finishes them within a short max_tokens."""
S = {"type": "string", "maxLength": 8}

SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"const": "user"}, "id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 999}}, "required": ["kind", "id"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["level", "score"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": S, "admin": {"type": "boolean"}},
                                               "required": ["name", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n"]}}},
     "required": ["items"]},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"a": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}},
     "required": ["a"]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}},
     "required": ["when"]},
    {"type": "object", "properties": {"mode": {"enum": ["r", "w"]}, "size": {"type": "integer", "minimum": 1,
                                                                             "maximum": 64}}, "required": ["mode"]},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}}, "required": ["m"]},
    {"type": "object", "properties": {"t": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["t", "unit"]},
    {"type": "object", "properties": {"cfg": {"type": "object", "properties": {"depth": {
        "type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"]}}, "required": ["depth"]}},
     "required": ["cfg"]},
]
assert len(SCHEMAS) == 20
