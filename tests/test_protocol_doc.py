"""docs/protocol.md and codec/messages.py say the same: every message type and field is documented.

The spec is a document (it is what a second client is written from); this
keeps it from drifting from the code in either direction.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from remotorch.codec import messages as m

DOC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text(encoding="utf-8")
ROW_TAG = re.compile(r'^\| `"([a-z_]+)"` ')


def tagged_structs() -> dict[str, type]:
    found = {}
    for value in vars(m).values():
        if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__struct_config__.tag:
            found[value.__struct_config__.tag] = value
    return found


def rows(tag: str) -> list[str]:
    return [line for line in DOC.splitlines() if line.startswith(f'| `"{tag}"` ')]


def test_every_message_type_has_a_row_in_the_spec():
    undocumented = [tag for tag, cls in tagged_structs().items() if not rows(tag)]
    assert not undocumented, undocumented


def test_every_field_is_named_in_its_row():
    missing = []
    for tag, cls in tagged_structs().items():
        for row in rows(tag):
            if cls.__struct_config__.array_like:  # ["t", TensorMeta]: positional, named by the row's form
                continue
            for field in cls.__struct_fields__:
                if f"`{field}`" not in row:
                    missing.append(f"{cls.__name__}.{field}")
    assert not missing, missing


def test_the_envelope_and_its_housekeeping_are_documented():
    """`pending` is the envelope's third element (no message has it as a field), with every field of Pending."""
    assert m.Envelope.__struct_fields__ == ("v", "body", "pending")
    assert not [cls.__name__ for cls in tagged_structs().values() if "pending" in cls.__struct_fields__]
    section = DOC[DOC.index("## 7. Frame 0: the envelope"):DOC.index("### 7.1 TensorMeta")]
    assert "[v, body, pending]" in section
    for i, field in enumerate(m.Pending.__struct_fields__):  # array form: the row gives its position
        assert f"| {i} | `{field}` |" in section, field


GRAPH_NODE_OPS = {"placeholder", "call", "const", "output"}  # node kinds of a graph document (§6), not messages


def test_the_spec_documents_no_message_the_code_lacks():
    known = set(tagged_structs()) | GRAPH_NODE_OPS
    documented = {ROW_TAG.match(line).group(1) for line in DOC.splitlines() if ROW_TAG.match(line)}
    assert documented - known == set()


def test_the_spec_states_the_protocol_version():
    assert f"version {m.PROTOCOL_VERSION}" in DOC
