"""The server's pure parts: stop strings over streamed pieces, and request validation messages."""

import json

import pytest

from quickdraft.grammar import Grammar
from quickdraft.server import protocol as p
from quickdraft.server.bodies import parse_body
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
    (b'{"prompt": "x", "speculative": {"tree": 0}}', "speculative.tree", "speculative.tree"),
    (b'{"prompt": "x", "seed": 1.5}', "valid integer", "seed"),
    # a prompt's token ids have a bound of their own; anything else in a prompt counts as values anywhere do
    (json.dumps({"prompt": [[1] * 70_000, [2] * 70_000]}).encode(), "more than 131072 token ids", "prompt"),
    (json.dumps({"prompt": [[{}] * 70_000]}).encode(), "more than 65536 values", "prompt"),
])
def test_bad_completion_bodies_say_what_to_fix(body, fragment, param):
    with pytest.raises(p.APIError) as e:
        parse_body(body, p.CompletionRequest)
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
        parse_body(body, p.ChatRequest)
    assert e.value.status == 400 and fragment in e.value.message


@pytest.mark.parametrize("extra, param, fragment", [
    ({"n": 2}, "n", "not supported"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"mirostat": 2}, "mirostat", "set it to 0 (mirostat off)"),
    ({"dry_multiplier": 0.8}, "dry_multiplier", "set it to 0 (DRY off)"),
    ({"typical_p": 0.9}, "typical_p", "set it to 1"),
    ({"store": True}, "store", "nothing is stored here"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"max_tokens": 5, "n_predict": 6}, "n_predict", "disagree"),
    ({"samplers": ["top_p", "temperature"], "top_p": 0.9, "temperature": 0.7}, "samplers", "order"),
    ({"samplers": ["temperature"], "top_k": 40, "temperature": 0.7}, "samplers", "leaves out top_k"),
    ({"samplers": ["banana"]}, "samplers", "unknown sampler"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_unsupported_features_are_refused_not_ignored(extra, param, fragment):
    req = p.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(p.APIError) as e:
        req.check_fields()
        req.tool_choice_name()
    assert e.value.param == param and fragment in e.value.message, e.value.message


@pytest.mark.parametrize("extra", [
    {"mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0, "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0,
     "xtc_threshold": 0.1, "top_n_sigma": -1, "dynatemp_range": 0, "min_keep": 0, "n_keep": -1, "id_slot": -1,
     "cache_prompt": True, "user": "u1", "service_tier": "auto", "store": False, "logit_bias": {}},
    {"samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"], "top_p": 0.9},
    {"samplers": "edkypmxt", "min_p": 0.05, "temperature": 1.0},
])
def test_llama_server_fields_at_their_off_values_are_accepted(extra):
    req = p.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    req.check_fields()


def test_llama_server_names_map_to_ours():
    from quickdraft.server.requests import sampling

    req = p.CompletionRequest.model_validate({"prompt": "x", "n_predict": 7, "repeat_penalty": 1.3,
                                              "repeat_last_n": -1, "n_probs": 3, "post_sampling_probs": True})
    req.check_fields()
    params = sampling(req, req.requested_max_tokens())
    assert (params.max_tokens, params.repetition_penalty, params.repetition_window) == (7, 1.3, 0)
    assert params.logprobs == 3 and params.post_sampling
    off = p.CompletionRequest.model_validate({"prompt": "x", "repeat_penalty": 1.3, "presence_penalty": 0.5,
                                              "repeat_last_n": 0})
    params = sampling(off, 4)
    assert params.repetition_penalty == 1.0 and params.presence_penalty == 0.0  # llama-server: 0 turns them off
    assert p.CompletionRequest.model_validate({"prompt": "x", "n_predict": -1}).requested_max_tokens() is None


@pytest.mark.parametrize("extra, want", [
    ({}, None), ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Grammar("json_object")),
    ({"response_format": {"type": "json_object", "schema": {"type": "array"}}}, Grammar("json_schema", '{"type": "array"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     Grammar("json_schema", '{"type": "integer"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, Grammar("json_schema", '{"type": "object"}')),
    ({"grammar": 'root ::= "a"'}, Grammar("grammar", 'root ::= "a"')),
    ({"json_schema": {"type": "integer"}}, Grammar("json_schema", '{"type": "integer"}')),  # llama-server's
    ({"regex": "a+"}, Grammar("regex", "a+")),
])
def test_structured_output_fields_become_one_constraint(extra, want):
    req = p.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    req.check_fields()
    assert req.requested_grammar() == want


def test_valid_chat_request_maps_developer_to_system_and_joins_text_parts():
    req = parse_body(b'{"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", '
                       b'"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], '
                       b'"stop": "x", "speculative": {"draft_max": 0}}', p.ChatRequest)
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.stop_strings() == ["x"] and req.speculative.draft_max == 0 and req.temperature == 1.0
