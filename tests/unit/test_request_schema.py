"""Every request field is declared once, in ``SamplingParams``: the ZeroMQ frame's type table, the
OpenAI passthrough and the sampling row's columns are built from that declaration, and each front
end takes (and refuses) a field as the declaration says."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest

from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.sampling_params import (
    MAPPED,
    OPENAI,
    ZMQ,
    FieldSpec,
    SamplingError,
    SamplingParams,
)
from fusedserve.coordinator.server import protocol
from fusedserve.shared_memory import sampling_row

ROOT = Path(__file__).resolve().parents[2]
FIELDS = SamplingParams.specs()


def _example(name: str, spec: FieldSpec) -> object:
    """A valid value of the field other than its default."""
    if spec.kind is bool:
        return True
    if spec.kind is int:
        return int(spec.lo or 0) + 1
    if spec.kind is float:
        lo, hi = spec.lo or 0.0, spec.hi if spec.hi is not None else 1.0
        return (lo + hi) / 2 if (lo + hi) / 2 != 0 else hi / 2
    if spec.kind is list:
        return [1] if spec.items is int else ["xyz"]
    if spec.kind is dict:
        return {"3": 1.5}
    raise AssertionError(f"no example for {name}")


def _wrong(spec: FieldSpec) -> object:
    """A value of the wrong kind (a bool where a number is declared: the classic slip)."""
    return "text" if spec.kind is bool else ([True] if spec.kind is list and spec.items is int else
                                             [1] if spec.kind is list else True)


def _frame(**fields: object) -> bytes:
    return msgpack.packb({"type": "generate", "id": 1, "prompt_ids": [1, 2], **fields})


def test_every_field_carries_a_spec_and_a_valid_default():
    assert len(FIELDS) == len(dataclasses.fields(SamplingParams)) >= 20
    SamplingParams()  # every default passes its own spec
    for name, spec in FIELDS.items():
        assert isinstance(spec, FieldSpec), name


@pytest.mark.parametrize("name", sorted(SamplingParams.front_end_fields(ZMQ)))
def test_the_zeromq_frame_takes_each_declared_field(name):
    spec = FIELDS[name]
    value = _example(name, spec)
    req = protocol.parse(_frame(**{name: value}))
    got = getattr(req.params, name)
    assert got == ({3: 1.5} if name == "logit_bias" else value)
    with pytest.raises(RequestError) as exc:
        protocol.parse(_frame(**{name: _wrong(spec)}))
    assert exc.value.code == "bad_field" and name in str(exc.value)


def test_the_zeromq_table_is_the_declaration():
    assert protocol.SAMPLING_FIELDS == SamplingParams.front_end_fields(ZMQ)
    assert "structured" not in protocol.SAMPLING_FIELDS  # its wire form is its own


@pytest.mark.parametrize("name", sorted(SamplingParams.front_end_fields(OPENAI)))
def test_the_openai_body_passes_each_declared_field(name):
    spec = FIELDS[name]
    value = _example(name, spec)
    prepared = oa.completion_request({"prompt": [1, 2], name: value}, None)
    assert prepared.params[name] == value
    with pytest.raises(oa.ApiError) as exc:
        oa.completion_request({"prompt": [1, 2], name: _wrong(spec)}, None)
    assert exc.value.status == 400


def test_openai_maps_its_own_names_for_the_mapped_fields():
    mapped = SamplingParams.front_end_fields(MAPPED)
    assert {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed"} <= set(mapped)
    assert not set(mapped) & set(SamplingParams.front_end_fields(OPENAI))
    body = {"prompt": [1], "stop": "ab", "top_k": -1, "max_completion_tokens": 5}
    p = oa.completion_request(body, None).params
    assert p["stop"] == ["ab"] and p["top_k"] == 0 and p["max_tokens"] == 5 and p["temperature"] == 1.0
    with pytest.raises(oa.ApiError) as exc:  # the stop limits are SamplingParams', named for OpenAI
        oa.completion_request({"prompt": [1], "stop": ["x"] * 65}, None)
    assert exc.value.param == "stop" and "at most 64" in str(exc.value)


def test_each_front_end_and_the_offline_engine_refuse_a_bool_where_a_number_is_declared():
    for name, spec in FIELDS.items():
        if spec.kind in (int, float):
            with pytest.raises(SamplingError, match=name):
                SamplingParams(**{name: True})


def test_no_other_module_declares_a_table_of_request_fields():
    """A module-level dict, set or tuple literal naming two or more request fields is a second
    declaration of them: build it from ``SamplingParams.specs()`` instead."""
    names = set(FIELDS)
    found = []
    for pkg in ("coordinator", "worker", "shared_memory", "kernels", "deploy"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "sampling_params.py":
                continue
            for node in ast.parse(path.read_text()).body:
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                v = node.value
                consts = v.keys if isinstance(v, ast.Dict) else getattr(v, "elts", [])
                named = {c.value for c in consts if isinstance(c, ast.Constant)} & names
                if len(named) >= 2 and path.name != "sampling_row.py":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    assert not found, found


def test_the_sampling_row_is_laid_out_once_from_the_declared_fields():
    for column in sampling_row.COLUMNS:
        assert FIELDS[column].kind in (int, float), column
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, top_k=12)
    row = np.asarray([sampling_row.row_values(params)], dtype=np.float32)
    assert row[0, sampling_row.TEMPERATURE] == np.float32(0.7) and row[0, sampling_row.TOP_K] == 12
    assert row[0, sampling_row.TOP_P] == np.float32(0.9) and row[0, sampling_row.MIN_P] == np.float32(0.05)
    plan = sampling_row.SamplingPlan.for_rows(row, candidates=64, vocab=1000)
    assert plan.candidates and not plan.full
