"""bench --conversation (quickdraft/tools/conversation.py): a chat as a client holds it, timed turn by turn, locally and
against a server; later turns take the history from the engine's kept slot."""

import pytest

import quickdraft
from quickdraft.tools import conversation, remote
from quickdraft.errors import QuickdraftError
from tests.helpers import save_hf_dir, tiny_hf_model
from quickdraft.tools.servers import ServerProcess

# the tiny models' word-level vocabulary names its ids t0, t1, ...: texts made of those words
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setattr(conversation, "reference_text", lambda: " ".join(f"t{5 + i % 40}" for i in range(120)))
    monkeypatch.setattr(conversation, "QUESTIONS", [f"t{50 + i} t{60 + i} t{70 + i}" for i in range(8)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = save_hf_dir(tiny_hf_model("qwen2", logit_scale=5), tmp_path_factory.mktemp("conv"))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(320)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a text of those words is one token each
    words.save(str(path / "tokenizer.json"))
    config = path / "tokenizer_config.json"
    config.write_text('{"chat_template": "' + TEMPLATE + '"}')
    return path


def test_a_conversation_is_timed_turn_by_turn_and_later_turns_reuse_the_history(model_dir, short):
    llm = quickdraft.load(str(model_dir), "ngram", dtype="bfloat16", weights="bf16", context=256, cache_slots=1,
                          progress=False)
    warm = conversation.converse("reuse", conversation.local_reply(llm), "chat", 3, 6)
    cold = conversation.converse("no reuse", conversation.local_reply(llm, reuse=False), "chat", 3, 6)
    assert [t.tokens for t in warm.turns] == [6, 6, 6] and all(t.ttft_s > 0 for t in warm.turns)
    assert warm.turns[0].cache_n == 0 and all(t.cache_n >= 120 for t in warm.turns[1:])
    assert all(t.cache_n == 0 for t in cold.turns)
    assert warm.turns[2].prompt_tokens > warm.turns[1].prompt_tokens > warm.turns[0].prompt_tokens  # the history
    text = conversation.table([warm, cold], "chat", 6)
    assert "turn 3" in text and "reuse: prompt tokens taken from the cache per turn: 0," in text


def test_a_server_conversation_reads_the_servers_reuse_from_its_timings(model_dir, short):
    with ServerProcess("-m", str(model_dir), "--draft", "ngram", "--ctx", "256", "--dtype", "bfloat16",
                       startup_timeout=120) as server:
        endpoint = remote.Endpoint(server.base_url)
        endpoint.check()
        run = conversation.converse(server.base_url, conversation.remote_reply(endpoint), "chat", 3, 5)
    assert [t.tokens for t in run.turns] == [5, 5, 5]
    assert run.turns[0].cache_n == 0 and all(t.cache_n >= 120 for t in run.turns[1:])
    assert run.total_s >= sum(t.ttft_s for t in run.turns)


def test_the_agent_script_sends_a_tool_result_before_each_question_and_tools_in_the_system_prompt():
    opening, steps = conversation.script("agent", 3)
    assert opening[0]["role"] == "system" and "search_archive" in opening[0]["content"]
    assert len(steps) == 3 and all(s[0]["content"].startswith("Results of search_archive:") for s in steps)
    with pytest.raises(QuickdraftError, match="--turns"):
        conversation.script("chat", 99)
