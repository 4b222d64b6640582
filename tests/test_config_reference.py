"""The configuration reference and JSON Schema come from the settings' one definition.

The checked-in copies (docs/configuration.md, docs/config.schema.json) must be what the code
generates; the schema must be a valid draft 2020-12 schema that lists exactly the settings the
reader accepts, section by section; config.example.yaml must name it and pass it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from gateway.cli import main as cli_main
from gateway.config import GatewayConfig, parse_config
from gateway.config.fields import Section
from gateway.config.reference import REFERENCE_PATH, SCHEMA_PATH, _tables, json_schema, reference, schema_text
from gateway.config.settings import declared

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
HASH = "sha256:" + "ab" * 32


def test_checked_in_reference_is_what_the_code_generates():
    assert (ROOT / REFERENCE_PATH).read_text(encoding="utf-8") == reference(), "run: gateway config reference > docs/configuration.md"


def test_checked_in_schema_is_what_the_code_generates():
    assert (ROOT / SCHEMA_PATH).read_text(encoding="utf-8") == schema_text(), "run: gateway config schema > docs/config.schema.json"


def test_cli_prints_the_reference_and_the_schema(capsys):
    assert cli_main(["config", "reference"]) == 0
    assert capsys.readouterr().out == reference()
    assert cli_main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


def test_schema_is_valid_draft_2020_12():
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_example_config_names_the_schema_and_passes_it():
    text = (ROOT / "config.example.yaml").read_text(encoding="utf-8")
    first = text.splitlines()[0]
    assert first == f"# yaml-language-server: $schema={SCHEMA_PATH.removeprefix('docs/')}" or first == f"# yaml-language-server: $schema={SCHEMA_PATH}"
    jsonschema.validate(yaml.safe_load(text), json_schema(), cls=jsonschema.Draft202012Validator)


def test_every_config_field_is_a_setting_or_marked_internal():
    for path, cls in _tables(GatewayConfig, ""):
        for f in dataclasses.fields(cls):
            assert "setting" in f.metadata or "internal" in f.metadata, f"{path or 'top level'}.{f.name}: declare it with setting() or internal()"


def test_every_declared_setting_has_one_sentence():
    for path, cls in _tables(GatewayConfig, ""):
        for f, meta in declared(cls):
            assert meta.doc.strip().endswith((".", ")")) and len(meta.doc) <= 300, f"{path}.{f.name}: {meta.doc!r}"


# One of everything the reader knows, so each section is read once.
EVERYTHING = {
    "server": {"cors": {"allow_origins": ["https://a.example"]}},
    "auth": {"keys": [{"name": "k", "hash": HASH, "priority": "batch"}]},
    "backends": [
        {"url": "http://127.0.0.1:9001", "models": ["m"]},
        {"discover": {"dns": "api.internal", "port": 23333}},
    ],
    "launch": [{"model": "m", "engine": "sim", "sim": {"ttft": 0.1}}],
    "limits": {},
    "timeouts": {},
    "health": {},
    "upstream": {},
    "balancer": {"queue": {"max_wait": {"interactive": 5}}},
    "media": {"mime_types": {}, "item_params": {}},
    "models": {"m": {"serving": "hybrid"}},
    "state": {},
    "log": {},
    "admin": {"key_hash": HASH},
    "tracing": {},
}
DISTSERVE = {
    "auth": {"disabled": True},
    "backends": [{"url": "http://127.0.0.1:9002", "models": ["d"], "role": "prefill"}, {"url": "http://127.0.0.1:9003", "models": ["d"], "role": "decode"}],
    "models": {"d": {"serving": "distserve", "rdma": {}}},
}


def _unwrap(node: dict) -> dict:
    """A list-or-mapping (``anyOf``) down to its item; backends' first alternative is a URL backend."""
    while "anyOf" in node:
        arrays = [n for n in node["anyOf"] if n.get("type") == "array"]
        node = arrays[0]["items"] if arrays else node["anyOf"][0]
    return node


def _schema_at(schema: dict, path: str) -> dict:
    """The object schema of a Section path such as ``launch[0].sim`` or ``models.m.rdma``."""
    node = schema
    for part in [p for p in re.split(r"\.|\[\d+\]", path) if p]:
        node = _unwrap(node["properties"][part] if "properties" in node else node["additionalProperties"])
    return node


def test_schema_lists_exactly_the_settings_the_reader_accepts(monkeypatch):
    """Each section's accepted keys (what its reader asked for) are its schema's properties."""
    seen: dict[str, set[str]] = {}
    finish = Section.finish

    def spy(self):
        seen[self.path] = set(self._seen)
        finish(self)

    monkeypatch.setattr(Section, "finish", spy)
    schema = json_schema()
    checked = 0
    for config in (EVERYTHING, DISTSERVE):
        seen.clear()
        parse_config(config, env={})
        for path, keys in seen.items():
            if path.startswith("environment"):
                continue
            if path == "backends[1]" and config is EVERYTHING:  # the {discover: ...} wrapper
                assert keys == {"discover"}
                continue
            if path == "backends[1].discover":
                node = schema["properties"]["backends"]["anyOf"][0]["items"]["anyOf"][1]["properties"]["discover"]
            else:
                node = _schema_at(schema, path)
            assert node.get("additionalProperties") is False, path
            props = set(node["properties"])
            assert keys == props, f"{path or 'top level'}: {sorted(keys ^ props)} differ between the reader and the schema"
            checked += 1
    assert checked >= 18


def test_balancer_and_its_queue_have_at_most_ten_settings():
    bal = json_schema()["properties"]["balancer"]
    queue = bal["properties"]["queue"]
    assert len(bal["properties"]) - 1 + len(queue["properties"]) <= 10


@pytest.mark.parametrize(
    "section, key",
    [("server", "http"), ("upstream", "transport"), ("upstream", "max_connections")],
)
def test_a_retired_setting_is_an_error_that_says_what_replaced_it(section, key):
    from gateway.config import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], section: {key: 1}}, env={})
    (problem,) = err.value.problems
    assert problem.startswith(f"{section}.{key}: this setting was retired; ")
    assert "valid fields" not in problem
