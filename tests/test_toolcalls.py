"""Tool-call formats against the real chat templates that define them (llama.cpp's models/templates/): a call as the
template itself writes it into an assistant turn is parsed back to the same call, and is accepted by the grammar
quickdraft constrains generation with; the grammar refuses a call that breaks its function's schema."""

import json
import re

import pytest

from quickdraft import grammar as grammars
from quickdraft.server import toolcalls
from quickdraft.tokenizer import Tokenizer
from quickdraft.weights import gguf as gguf_io
from tests import llamacpp

WEATHER = toolcalls.Tool("get_weather", "Current weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False})
TIME = toolcalls.Tool("get_time", "Local time in a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALLS = [toolcalls.ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}', "abcDEF123"),
         toolcalls.ToolCall("get_time", '{"city": "Oslo"}', "xyz789QRS")]
TEMPLATES = {  # template file -> (format, style, whether it writes several calls in one turn)
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None, True),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", None, True),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("hermes", None, True),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", "list", True),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", "call_id", True),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral", "args", True),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3", None, False),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("llama3", None, False),
    "google-gemma-2-2b-it.jinja": ("generic", None, True),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("generic", None, True),
    "Qwen3-Coder.jinja": ("generic", None, True),  # XML parameters: not a JSON format
}
END = ("<|im_end|>", "</s>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


@pytest.fixture(scope="module")
def vocab():
    """A real vocabulary (Qwen2's, vocabulary-only GGUF) for llguidance: none of the Mistral/Llama markers are single
    tokens in it, so those formats' grammars are checked with their markers spelled out."""
    path = llamacpp.tree() / "models" / "ggml-vocab-qwen2.gguf"
    tokenizer = Tokenizer.from_gguf_metadata(gguf_io.metadata(gguf_io.open_gguf(path)))
    return tokenizer, grammars.ll_tokenizer(tokenizer.backend.to_str(), tokenizer.vocab_size,
                                            sorted(tokenizer.eos_ids))


def with_template(tokenizer, name):
    source = (llamacpp.tree() / "models" / "templates" / name).read_text(encoding="utf-8")
    return Tokenizer(tokenizer.backend, chat_template=source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def assistant_turn(tok, fmt, calls):
    """What the template writes for an assistant turn holding these calls (the text after the generation prompt,
    its end-of-turn marker dropped: a generation stops at it)."""
    user = [{"role": "user", "content": "Weather in Paris, time in Oslo?"}]
    call_message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    specs = [t.spec() for t in (WEATHER, TIME)]
    before = tok.apply_chat_template(fmt.messages(user, [WEATHER, TIME]), True, tools=specs if fmt.native else None)
    after = tok.apply_chat_template(fmt.messages(user + [call_message], [WEATHER, TIME]), False,
                                    tools=specs if fmt.native else None)
    assert after.startswith(before), "the template renders the history differently once a turn is added"
    turn = re.sub(r"^<think>\s*</think>\s*", "", after[len(before):])  # Qwen3 marks the last turn's (empty) thought
    for end in END:
        turn = turn.split(end)[0]
    return turn.strip() if fmt.name != "hermes" else turn.rstrip()


def one_call(tok, fmt) -> str:
    """An answer with one get_weather call: as the template writes it, or the generic format's JSON."""
    if fmt.native:
        return assistant_turn(tok, fmt, CALLS[:1])
    return json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})


def accepts(ll_tok, tokenizer, grammar, text) -> bool:
    matcher = grammars.matcher(ll_tok, grammars.to_llguidance(grammar), grammar)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_bos=False)) and matcher.is_accepting()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_format_is_found_from_the_template(vocab, name):
    tok = with_template(vocab[0], name)
    fmt = toolcalls.detect(tok)
    kind, style, _ = TEMPLATES[name]
    assert fmt.name == kind and getattr(fmt, "style", None) == style


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_call_as_the_template_writes_it_parses_back_and_fits_the_grammar(vocab, name):
    tokenizer, ll_tok = vocab
    tok = with_template(tokenizer, name)
    fmt = toolcalls.detect(tok)
    several = TEMPLATES[name][2]
    calls = CALLS if several else CALLS[:1]
    if fmt.native:
        turn = assistant_turn(tok, fmt, calls)
    else:  # generic: the answer quickdraft asks for, as the history shows it
        turn = fmt.messages([{"role": "assistant", "tool_calls": [c.to_dict() for c in calls]}], [])[0]["content"]
    content, parsed = fmt.parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c.name, json.loads(c.arguments)) for c in calls]
    assert content == ""
    if fmt.name == "mistral" and fmt.style != "args":  # the ids it writes come back
        assert [c.id for c in parsed] == [c.id for c in calls]
    for choice in ("required", "auto"):
        assert accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], choice, several), turn), (choice, turn)


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                                  "meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-2-2b-it.jinja"])
def test_the_grammar_holds_calls_to_their_schema_and_choice(vocab, name):
    tokenizer, ll_tok = vocab
    tok = with_template(tokenizer, name)
    fmt = toolcalls.detect(tok)
    good = one_call(tok, fmt)
    bad_value = good.replace('"celsius"', '"kelvin"') if "celsius" in good else good.replace('"Paris"', "7")
    unknown = good.replace("get_weather", "get_wether")
    for choice in ("required", "auto", "get_weather"):
        grammar = fmt.grammar([WEATHER, TIME], choice, True)
        assert accepts(ll_tok, tokenizer, grammar, good)
        assert not accepts(ll_tok, tokenizer, grammar, bad_value), (choice, bad_value)
        assert not accepts(ll_tok, tokenizer, grammar, unknown), (choice, unknown)
    assert not accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], "get_time", True), good)
    prose = "It is sunny." if fmt.native else json.dumps({"response": "It is sunny."})
    assert accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], "auto", True), prose)
    assert accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], "none", True), prose)
    assert not accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], "none", True), good)
    assert not accepts(ll_tok, tokenizer, fmt.grammar([WEATHER, TIME], "required", True), prose)


def test_hermes_reads_a_bare_or_fenced_call_and_holds_it_to_the_schema(vocab):
    """Small models answer with the JSON alone or in a ```json fence: under "auto" such an answer must be a valid call,
    and it is read as one; JSON later in prose stays prose."""
    tokenizer, ll_tok = vocab
    fmt = toolcalls.Hermes(with_template(tokenizer, "Qwen-Qwen2.5-7B-Instruct.jinja"))
    grammar = fmt.grammar([WEATHER, TIME], "auto", True)
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    for text in (fenced, '{"name": "get_time", "arguments": {"city": "Oslo"}}'):
        assert accepts(ll_tok, tokenizer, grammar, text)
        content, calls = fmt.parse(text)
        assert content == "" and len(calls) == 1
    assert not accepts(ll_tok, tokenizer, grammar, fenced.replace("get_weather", "get_wether"))
    assert not accepts(ll_tok, tokenizer, grammar, fenced.replace('"Paris"', "3"))
    prose = 'Here is JSON: {"name": "x"} and ```python\nprint(1)\n```'
    assert accepts(ll_tok, tokenizer, grammar, prose) and fmt.parse(prose) == (prose, [])


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
                                  "meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-2-2b-it.jinja"])
def test_streamed_text_holds_back_the_call_and_gives_the_same_result(vocab, name):
    tokenizer, _ = vocab
    tok = with_template(tokenizer, name)
    fmt = toolcalls.detect(tok)
    turn = one_call(tok, fmt)
    for prefix in ("", "Let me look. ") if fmt.name in ("hermes", "mistral") else ("",):
        stream = toolcalls.ToolStream(fmt)
        streamed = "".join(stream.push(turn_piece) for turn_piece in _pieces(prefix + turn))
        rest, calls = stream.finish()
        assert streamed + rest == prefix.rstrip() or streamed + rest == prefix
        assert [c.name for c in calls] == ["get_weather"] and all(len(c.id) == 9 for c in calls)
    stream = toolcalls.ToolStream(fmt)
    prose = "Sunny, 18 degrees." if fmt.native else json.dumps({"response": "Sunny, 18 degrees."})
    streamed = "".join(stream.push(p) for p in _pieces(prose))
    rest, calls = stream.finish()
    assert streamed + rest == "Sunny, 18 degrees." and calls == []


def test_parallel_calls_stream_and_parse_as_several_calls(vocab):
    """Two calls in one answer (as Qwen's template writes them): two calls back, in order, each with its own id."""
    tok = with_template(vocab[0], "Qwen-Qwen2.5-7B-Instruct.jinja")
    fmt = toolcalls.detect(tok)
    turn = assistant_turn(tok, fmt, CALLS)
    stream = toolcalls.ToolStream(fmt, "auto")
    streamed = "".join(stream.push(p) for p in _pieces(turn))
    rest, calls = stream.finish()
    assert streamed + rest == "" and [c.name for c in calls] == [c.name for c in CALLS]
    assert [json.loads(c.arguments) for c in calls] == [json.loads(c.arguments) for c in CALLS]
    assert len({c.id for c in calls}) == 2 and [c.to_dict(i)["index"] for i, c in enumerate(calls)] == [0, 1]
    assert not accepts(vocab[1], vocab[0], fmt.grammar([WEATHER, TIME], "required", False), turn)  # one at most


def test_under_tool_choice_none_a_call_written_as_text_stays_text(vocab):
    """The grammar forbids the trigger under "none", but a model may still write a bare JSON call as its answer:
    it is the answer's text then, never a call (the real 1.5B did this after a tool result)."""
    fmt = toolcalls.detect(with_template(vocab[0], "Qwen-Qwen2.5-7B-Instruct.jinja"))
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert fmt.parse(bare)[1]  # under auto it is a call
    stream = toolcalls.ToolStream(fmt, "none")
    streamed = "".join(stream.push(p) for p in _pieces(bare))
    assert streamed == bare and stream.finish() == ("", [])


def _pieces(text, size=3):
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_history_with_calls_and_results_reaches_the_template_as_it_expects(vocab):
    """Arguments as objects (templates tojson them), results with the name of the call they answer."""
    tok = with_template(vocab[0], "Qwen-Qwen2.5-7B-Instruct.jinja")
    fmt = toolcalls.detect(tok)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [CALLS[0].to_dict()]},
               {"role": "tool", "tool_call_id": CALLS[0].id, "content": '{"temp": 18}'}]
    shaped = fmt.messages(history, [WEATHER])
    assert shaped[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert shaped[2]["name"] == "get_weather"
    text = tok.apply_chat_template(shaped, tools=[WEATHER.spec()])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n{\"temp\": 18}\n</tool_response>" in text


def test_parallel_calls_and_their_results_reach_the_template_in_one_turn_each(vocab):
    """An answer with two calls, then their two results: both calls in the assistant's turn, both results (in order)
    in the one turn the template gives tool results."""
    tok = with_template(vocab[0], "Qwen-Qwen2.5-7B-Instruct.jinja")
    fmt = toolcalls.detect(tok)
    history = [{"role": "user", "content": "Weather in Paris, time in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [c.to_dict() for c in CALLS]},
               {"role": "tool", "tool_call_id": CALLS[0].id, "content": '{"temp": 18}'},
               {"role": "tool", "tool_call_id": CALLS[1].id, "content": '{"time": "21:40"}'}]
    text = tok.apply_chat_template(fmt.messages(history, [WEATHER, TIME]), tools=[WEATHER.spec(), TIME.spec()])
    turn = text.split("<|im_start|>assistant\n")[1]
    assert turn.count("<tool_call>") == 2 and turn.index("get_weather") < turn.index("get_time")
    results = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
    assert results == ('<tool_response>\n{"temp": 18}\n</tool_response>\n'
                       '<tool_response>\n{"time": "21:40"}\n</tool_response>')


# tool parameters as Pydantic's model_json_schema() writes them: definitions in $defs, referenced from within
STEP_TOOL = toolcalls.Tool("plan", "", {
    "$defs": {"Step": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                       "additionalProperties": False}},
    "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}}},
    "required": ["steps"], "additionalProperties": False})
TREE_TOOL = toolcalls.Tool("tree", "", {  # "#" is the parameters' own root: a recursive schema
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["kids"], "additionalProperties": False})
DATA_TOOL = toolcalls.Tool("data", "", {  # a property named like a keyword refers; a "$ref" in a const is a value
    "$defs": {"N": {"type": "integer"}}, "type": "object",
    "properties": {"default": {"$ref": "#/$defs/N"}, "kind": {"const": {"$ref": "#"}}},
    "required": ["default", "kind"], "additionalProperties": False})


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
                                  "Mistral-Small-3.2-24B-Instruct-2506.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "google-gemma-2-2b-it.jinja"])
def test_references_in_parameters_resolve_against_the_parameters(vocab, name):
    """As OpenAI resolves them: "#/$defs/Step" and "#" point into the tool's own parameters, not into the schema
    quickdraft wraps them in."""
    tokenizer, ll_tok = vocab
    fmt = toolcalls.detect(with_template(tokenizer, name))

    def call(tool, arguments):
        if not fmt.native:
            return json.dumps({"tool_calls": [{"name": tool.name, "arguments": arguments}]})
        key = "parameters" if fmt.name == "llama3" else "arguments"
        if fmt.name == "hermes":
            return f'<tool_call>\n{json.dumps({"name": tool.name, key: arguments})}\n</tool_call>'
        style = getattr(fmt, "style", None)
        if style == "list":
            return "[TOOL_CALLS]" + json.dumps([{"name": tool.name, key: arguments, "id": "abcDEF123"}])
        if style == "call_id":
            return f"[TOOL_CALLS]{tool.name}[CALL_ID]abcDEF123[ARGS]{json.dumps(arguments)}"
        return json.dumps({"name": tool.name, key: arguments})

    for choice in ("required", "auto"):
        grammar = fmt.grammar([STEP_TOOL, TREE_TOOL, DATA_TOOL], choice, False)
        assert accepts(ll_tok, tokenizer, grammar, call(STEP_TOOL, {"steps": [{"n": 1}, {"n": 2}]})), choice
        assert not accepts(ll_tok, tokenizer, grammar, call(STEP_TOOL, {"steps": [{"m": 1}]})), choice
        assert accepts(ll_tok, tokenizer, grammar, call(TREE_TOOL, {"kids": [{"kids": []}]})), choice
        wrapper_shaped = {"kids": [{"name": "tree", "arguments": {"kids": []}}]}  # what "#" meant before
        assert not accepts(ll_tok, tokenizer, grammar, call(TREE_TOOL, wrapper_shaped)), choice
        assert accepts(ll_tok, tokenizer, grammar, call(DATA_TOOL, {"default": 3, "kind": {"$ref": "#"}})), choice
        assert not accepts(ll_tok, tokenizer, grammar, call(DATA_TOOL, {"default": "x", "kind": {"$ref": "#"}}))
