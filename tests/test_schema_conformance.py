"""Every constraint of every documented request schema, broken one at a time, is a 400 naming the field.

The cases are derived at test time from the server's own /openapi.json (sgrec.tools.schema_cases):
for each request body, starting from a valid one, one body per constraint (type, null, enum, bounds,
minItems / maxItems, wrong array elements, required keys, unknown keys). A field documented tomorrow
is covered by the same code, and a schema keyword the generator does not know fails the test.
"""

import json

import httpx
import pytest

from sgrec import demo
from sgrec.tools.schema_cases import UnknownKeyword, check_keywords, Schemas, violations

FLAGS = ["--device", "cpu", "--context-length", "256", "--max-total-tokens", "8192", "--max-n", "4",
         "--max-batch-size", "8", "--max-rank-candidates", "50", "--max-beam-width", "16", "--max-filter-items", "5"]
USER = {"id": "u1", "text": "<i1><i50>\nSemantic ID:"}
BASES = {  # route -> bodies the schema accepts and the server answers with 200; the second of each
    # leaves out, empties or switches the fields whose checks could hide behind another field
    "/generate": [{"text": "<i1>", "sampling_params": {"max_new_tokens": 1}},
                  {"input_ids": [[5, 6], [7]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
                   "return_logprob": [True, False], "rid": ["a", "b"]},
                  {"text": "<i1><i50>\nSemantic ID:", "sampling_params": {"beam_width": 4, "n": 2},
                   "constrain_to_catalog": True, "exclude_items": ["m1"], "include_items": ["m2", "m3", "m4"],
                   "filter": {"year": {"gte": 1900, "lte": 2000, "gt": 1, "lt": 3000, "in": [1995], "not_in": [1]},
                              "genres": {"eq": "Thriller", "in": ["Thriller"], "not_in": ["Horror"]}}},
                  {"input_ids": [5, 6], "sampling_params": {"beam_width": 4, "n": 2}, "constrain_to_catalog": True}],
    "/v1/completions": [{"prompt": "<i1>", "max_tokens": 1}, {"prompt": [5, 6], "max_tokens": 1, "logprobs": 2}],
    "/v1/chat/completions": [{"messages": [{"role": "user", "content": "<i1>"}], "max_tokens": 1},
                             {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                              "max_tokens": 1, "logprobs": True, "top_logprobs": 2},
                             {"messages": [{"role": "user", "content": [{"type": "text", "text": "<i1>"}]}],
                              "max_tokens": 1}],
    "/v1/score": [{"query": "<i1>", "items": ["<i2>"], "label_token_ids": [5, 6]},
                  {"query": None, "items": [], "label_token_ids": [5], "apply_softmax": True}],
    "/v1/rank": [{"user": USER, "items": ["m1", "m2"]},
                 {"user": {"token_ids": [5, 6, 7]}, "items": ["m3"], "prefix": "item", "top_k": 1,
                  "exclude_items": ["m9"], "include_items": ["m3"],
                  "filter": {"year": {"gte": 1900, "lte": 2000, "in": [1995], "not_in": [1990]},
                             "genres": {"eq": "Thriller"}}}],
    "/v1/retrieve": [{"user": USER, "beam_width": 2, "num_items": 1},
                     {"user": {"id": None, "token_ids": [5, 6, 7]}, "top_k": 2, "exclude_items": ["m1"],
                      "filter": {"genres": {"in": ["Comedy"], "not_in": ["Horror"]}, "year": {"gt": 1950, "lt": 2000}}}],
    "/v1/recommend": [{"user": USER, "retrieve": {"beam_width": 4, "num_candidates": 2, "top_k": 4}},
                      {"user": {"token_ids": [5, 6, 7]}, "rank": {"prefix": "item", "instruction": "x",
                                                                  "score_by": "auto"},
                       "top_k": 1, "exclude_items": ["m9"], "include_items": ["m1", "m2", "m3"],
                       "filter": {"year": {"gte": 1900, "lte": 2000, "gt": 1, "lt": 3000, "in": [1995], "not_in": [1]},
                                  "genres": {"eq": "Thriller", "in": ["Thriller"], "not_in": ["Horror"]}}}],
    "/v1/catalog/items": [{"items": [{"id": "new1", "token_ids": [5, 6]}]},
                          {"items": [{"id": "new2", "text": "<i1>", "id_token": 5, "attrs": {"year": 1990}}]}],
    "/v1/catalog/delete": [{"ids": ["not-there"]}, {"ids": ["new1", "zz"]}],
    "/v1/catalog/rollback": [{"version": 0}],
    "/pause_generation": [{"mode": "in_place"}],
    "/continue_generation": [{"torch_empty_cache": True}],
}
MIN_CASES = {"/v1/catalog/delete": 5, "/v1/catalog/rollback": 3,  # small schemas: few constraints to break
             "/pause_generation": 2, "/continue_generation": 2}
UNDO = {"/pause_generation": "/continue_generation"}  # what puts the server back after a route's base


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    journal = str(tmp_path_factory.mktemp("journal") / "catalog.journal")
    return start_server(demo.model_path(), "--item-catalog", demo.catalog_path(), "--catalog-journal", journal,
                        "--catalog-history", "1000", *FLAGS[2:])


@pytest.fixture(scope="module")
def doc(server):
    return server.client.get("/openapi.json").json()


def body_schema(doc: dict, route: str) -> str:
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[-1]


def error_message(body) -> str:
    """The message of either error shape: OpenAI's (/v1) or SGLang's native {"error": ...}."""
    if isinstance(body, dict) and "message" in body:
        return body["message"]
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, str) else (err or {}).get("message", "")


def test_every_route_with_a_body_has_a_base(doc):
    routes = {p for p, ops in doc["paths"].items() if "requestBody" in ops.get("post", {})}
    assert routes == set(BASES)


@pytest.mark.parametrize("route,which", [(r, i) for r in sorted(BASES) for i in range(len(BASES[r]))])
def test_each_broken_constraint_is_a_400_naming_the_field(server, doc, route, which):
    base = BASES[route][which]
    ok = server.client.post(route, json=base)
    if route in UNDO:
        assert server.client.post(UNDO[route]).status_code == 200
    assert ok.status_code == 200, ok.text  # so every 400 below is the broken constraint's
    cases, _ = violations(doc, body_schema(doc, route), base)
    # a constraint only some bodies reach (the filters of the beam form) is broken from those bases
    unbroken = set.intersection(*(set(violations(doc, body_schema(doc, route), b)[1]) for b in BASES[route]))
    assert not unbroken, f"constraints no generated body of {route} breaks: {sorted(unbroken)}"
    assert len(cases) >= MIN_CASES.get(route, 100)
    wrong = []
    for case in cases:
        r = server.client.post(route, json=case.body)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        msg = error_message(body) if r.status_code == 400 else ""
        if r.status_code != 400 or not case.message_names_field(msg):
            wrong.append(f"{case.id} -> {r.status_code} {json.dumps(body)[:160]} (should name {case.named})")
    assert not wrong, f"{len(wrong)} of {len(cases)} bodies:\n" + "\n".join(wrong)
    assert server.client.get("/health").status_code == 200


def test_score_with_empty_items_still_checks_its_labels(server):
    """Found by schemathesis: label ids that are not ints got 200 when `items` was empty."""
    r = server.client.post("/v1/score", json={"query": None, "items": [], "label_token_ids": ["x"],
                                              "apply_softmax": True, "item_first": False})
    assert r.status_code == 400 and "label_token_ids" in r.json()["message"], r.text
    r = server.client.post("/v1/score", json={"query": "a", "items": [], "label_token_ids": [1]})
    assert r.status_code == 200 and r.json()["scores"] == []  # SGLang: empty items give no scores


def test_the_generator_refuses_a_keyword_it_cannot_break():
    doc = {"components": {"schemas": {"X": {"type": "object", "properties": {"a": {"type": "string",
                                                                                   "format": "uuid",
                                                                                   "multipleOf": 2}}}}}}
    with pytest.raises(UnknownKeyword, match="multipleOf"):
        check_keywords(Schemas(doc), doc["components"]["schemas"]["X"])


def test_the_generator_breaks_each_constraint_of_a_small_schema():
    """A hand-checked schema: the exact bodies the generator derives."""
    doc = {"components": {"schemas": {"X": {
        "type": "object", "additionalProperties": False, "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3},
                       "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2}},
    }}}}
    cases, unbroken = violations(doc, "X", {"n": 2})
    assert unbroken == []
    got = {(c.id.split(":")[0], json.dumps(c.body, sort_keys=True)) for c in cases}
    for want in [(".n minimum", '{"n": 0}'), (".n maximum", '{"n": 4}'), (".n required", "{}"),
                 (".no_such_field_xyz additionalProperties", '{"n": 2, "no_such_field_xyz": 1}'),
                 (".tags maxItems", '{"n": 2, "tags": ["a", "a", "a"]}'),
                 (".tags items.enum", '{"n": 2, "tags": ["not-one-of-a-b"]}'),
                 (".n type", '{"n": 1.5}'), (".n type", '{"n": null}'), (".tags type", '{"n": 2, "tags": "x"}')]:
        assert want in got, (want, sorted(got))
    assert all(c.names == (("n",),) for c in cases if c.path == ("n",))
    assert {c.names for c in cases if c.path[:1] == ("tags",)} == {(("tags",),)}  # an element: named by its list
    # every body is one the schema rejects; the valid base itself never appears
    assert '{"n": 2}' not in {b for _, b in got}
