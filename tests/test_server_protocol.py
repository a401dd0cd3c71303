"""The server's pure parts: stop strings over streamed pieces, and request validation messages."""

import pytest

from quickdraft.grammar import Grammar
from quickdraft.server import protocol as p
from quickdraft.server.stops import StopMatcher


def stream(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.push(x) for x in pieces)
    return out + m.flush(), m.matched


def test_stop_string_split_across_pieces_is_cut_and_held_back():
    m = StopMatcher(["END"])
    assert m.push("abc E") == "abc "  # "E" might start "END": held
    assert m.push("N") == ""
    assert m.push("Dxyz") == "" and m.matched
    assert m.push("more") == "" and m.flush() == ""


def test_held_text_is_released_when_it_stops_matching_or_at_the_end():
    assert stream(["END"], ["x E", "ND?"]) == ("x ", True)
    assert stream(["END"], ["x E", "nd"]) == ("x End", False)
    assert stream(["END"], ["x EN"]) == ("x EN", False)  # ended without a match: nothing lost


def test_earliest_of_several_stop_strings_wins():
    assert stream(["world", "lo w"], ["hello world"]) == ("hel", True)
    assert stream(["\n\n", "```"], ["code", "\n", "\nmore"]) == ("code", True)


def test_no_stop_strings_passes_everything():
    assert stream([], ["a", "b"]) == ("ab", False)


@pytest.mark.parametrize("body, fragment, param", [
    (b'\xff\xfe{}', "not valid UTF-8", None),
    (b'', "body is empty", None),
    (b'{"prompt": "x",', "not valid JSON", None),
    (b'[1, 2]', "must be a JSON object", None),
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number", None),
    (b'{}', "missing required field 'prompt'", "prompt"),
    (b'{"prompt": 3}', "it must be a string, a list with one string, or a list of token ids", "prompt"),
    (b'{"prompt": "x", "max_tokens": -1}', "greater than or equal to 0", "max_tokens"),
    (b'{"prompt": "x", "temperature": "0.5"}', "valid number", "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "greater than 0", "top_p"),
    (b'{"prompt": "x", "stop": [1]}', "a string or a list of strings", "stop"),
    (b'{"prompt": "x", "speculative": {"k": 3}}', "unknown field 'speculative.k'", "speculative.k"),
    (b'{"prompt": "x", "seed": 1.5}', "valid integer", "seed"),
])
def test_bad_completion_bodies_say_what_to_fix(body, fragment, param):
    with pytest.raises(p.APIError) as e:
        p.parse_body(body, p.CompletionRequest)
    assert e.value.status == 400 and fragment in e.value.message and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, fragment", [
    (b'{"messages": []}', "at least 1 item"),
    (b'{"messages": [{"role": "bot", "content": "x"}]}', "'messages.0.role'"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "'messages.0.content': it must be a string or a list"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "'messages.0.content'"),
])
def test_bad_chat_bodies_say_what_to_fix(body, fragment):
    with pytest.raises(p.APIError) as e:
        p.parse_body(body, p.ChatRequest)
    assert e.value.status == 400 and fragment in e.value.message


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
])
def test_unsupported_features_are_refused_not_ignored(extra, param):
    req = p.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(p.APIError) as e:
        req.refuse_unsupported()
    assert e.value.param == param and "not supported" in e.value.message


@pytest.mark.parametrize("extra, want", [
    ({}, None), ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Grammar("json_object")),
    ({"response_format": {"type": "json_object", "schema": {"type": "array"}}}, Grammar("json_schema", '{"type": "array"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     Grammar("json_schema", '{"type": "integer"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, Grammar("json_schema", '{"type": "object"}')),
    ({"grammar": 'root ::= "a"'}, Grammar("grammar", 'root ::= "a"')),
    ({"regex": "a+"}, Grammar("regex", "a+")),
])
def test_structured_output_fields_become_one_constraint(extra, want):
    req = p.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    req.refuse_unsupported()
    assert req.requested_grammar() == want


def test_valid_chat_request_maps_developer_to_system_and_joins_text_parts():
    req = p.parse_body(b'{"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", '
                       b'"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], '
                       b'"stop": "x", "speculative": {"draft_max": 0}}', p.ChatRequest)
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.stop_strings() == ["x"] and req.speculative.draft_max == 0 and req.temperature == 1.0
