"""The OpenAPI document the server embeds and serves at /openapi.json (crates/http/src/openapi.json)
is a valid OpenAPI 3.1 document: structure, schema dialect, $refs, unique operation ids (the
`openapi-spec-validator` package), and every `default` is a value its own schema allows. Run by
scripts/openapi-tests.sh (which `make test` calls); it prints a cargo-style `test result:` line the
Makefile sums. crates/http/tests/openapi.rs holds the document to the server itself."""

import json
import os
import sys
import unittest

import jsonschema
from openapi_spec_validator import OpenAPIV31SpecValidator

PATH = os.path.join(os.path.dirname(__file__), "../../crates/http/src/openapi.json")


def load():
    with open(PATH, encoding="utf-8") as f:
        return json.load(f)


def subschemas_with_defaults(node, at="#"):
    """(JSON pointer, schema) of every object under `node` that has a `default`."""
    if isinstance(node, dict):
        if "default" in node and isinstance(node.get("type", node.get("anyOf")), (str, list)):
            yield at, node
        for key, value in node.items():
            yield from subschemas_with_defaults(value, f"{at}/{key.replace('~', '~0').replace('/', '~1')}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from subschemas_with_defaults(value, f"{at}/{i}")


class Document(unittest.TestCase):
    def test_is_valid_openapi_3_1(self):
        doc = load()
        self.assertEqual(doc["openapi"], "3.1.0")
        errors = [e.message for e in OpenAPIV31SpecValidator(doc).iter_errors()]
        self.assertEqual(errors, [])

    def test_the_validator_catches_a_broken_document(self):
        doc = load()
        doc["components"]["schemas"]["Usage"]["properties"]["total_tokens"] = {"$ref": "#/components/schemas/Nope"}
        with self.assertRaises(Exception):
            OpenAPIV31SpecValidator(doc).validate()

    def test_defaults_are_values_their_schemas_allow(self):
        doc = load()
        found = list(subschemas_with_defaults(doc))
        self.assertGreater(len(found), 20)
        for at, schema in found:
            root = dict(doc, **{"$ref": at})
            with self.subTest(at=at):
                jsonschema.Draft202012Validator(root).validate(schema["default"])


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    passed = result.testsRun - failed - len(result.skipped)
    status = "ok" if failed == 0 else "FAILED"
    # Same shape as cargo's line, so the Makefile's summary sums it.
    print(f"test result: {status}. {passed} passed; {failed} failed; {len(result.skipped)} ignored (python openapi document)")
    sys.exit(0 if failed == 0 else 1)
