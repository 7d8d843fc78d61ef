"""harness.suites.jsonschemas.validate is `jsonschema.validate` with each schema checked once: the same errors."""

import jsonschema
import pytest

from harness.suites import jsonschemas

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("instance", [{"name": "x"}, {"name": 1, "age": 1}, {"name": "x", "age": -1, "extra": 1}])
def test_an_invalid_instance_fails_with_jsonschema_s_own_error(instance):
    with pytest.raises(jsonschema.ValidationError) as expected:
        jsonschema.validate(instance, SCHEMA)
    for _ in range(2):  # the second time from the cached validator
        with pytest.raises(jsonschema.ValidationError) as ours:
            jsonschemas.validate(instance, SCHEMA)
        assert str(ours.value) == str(expected.value)


def test_a_valid_instance_passes_and_a_schema_that_is_none_is_refused():
    jsonschemas.validate({"name": "x", "age": 3}, SCHEMA)
    with pytest.raises(jsonschema.SchemaError):
        jsonschemas.validate({}, {"type": "no-such-type"})
