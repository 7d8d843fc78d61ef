"""JSON Schema validation with each schema checked once per process: `jsonschema.validate` checks the schema
itself against its metaschema on every call (about 20 ms here), and the harness validates many instances against
a few schemas (every known-failures entry, every output of a `json_schema` case)."""

import json

import jsonschema

_VALIDATORS: dict[str, jsonschema.protocols.Validator] = {}
"""A schema's JSON text (keys in its own order: an error message prints the schema as given) → its validator."""


def validate(instance, schema: dict) -> None:
    """`jsonschema.validate(instance, schema)`: raises the best-matching `jsonschema.ValidationError` (and
    `jsonschema.SchemaError` for a schema that is not one), with the same message."""
    key = json.dumps(schema, default=repr)
    validator = _VALIDATORS.get(key)
    if validator is None:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = _VALIDATORS[key] = cls(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is not None:
        raise error
