"""vLLM's side endpoints: /tokenize and /detokenize, /version, /ping, /v1/models/{model}, and
SageMaker's /invocations, with raw HTTP and the official `openai` client; a served name's aliases."""

import importlib.metadata

import openai
import pytest
import requests

from server_fixtures import openai_client, serving, tiny_engine  # noqa: F401 - fixture

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, api_key="k", served_model_name=("test-model", "alias")) as server:
        yield server


def post(server, path, body, status=200):
    reply = requests.post(f"{server.url}{path}", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
    assert reply.status_code == status, reply.text
    return reply.json()


def test_tokenize_a_prompt_and_back(server, tiny_engine):
    reply = post(server, "/tokenize", {"prompt": "The sea is calm.", "return_token_strs": True})
    expected = tiny_engine.tokenizer.encode("The sea is calm.")
    assert reply == {"count": len(expected), "max_model_len": tiny_engine.max_model_len, "tokens": expected,
                     "token_strs": tiny_engine.tokenizer.convert_ids_to_tokens(expected)}
    assert post(server, "/detokenize", {"tokens": expected})["prompt"] == tiny_engine.tokenizer.decode(expected)


def test_tokenized_messages_are_the_chat_prompt(server):
    tokens = post(server, "/tokenize", {"messages": CHAT})
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert tokens["count"] == chat["usage"]["prompt_tokens"]
    shorter = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert shorter["tokens"] == tokens["tokens"][:shorter["count"]] and shorter["count"] < tokens["count"]


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
    ("/detokenize", {"tokens": [10**9]}, "tokens", 400),
    ("/detokenize", {"tokens": [-1]}, "tokens", 400),
])
def test_bad_tokenize_bodies_are_named(server, path, body, param, status):
    assert post(server, path, body, status)["error"]["param"] == param


def test_version_ping_and_one_model(server, tiny_engine):
    client = openai_client(server, api_key="k")
    card = client.models.retrieve("test-model")
    assert (card.id, card.max_model_len) == ("test-model", tiny_engine.max_model_len)
    assert card.root == client.models.list().data[0].root
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200   # open, as /health
    assert requests.get(f"{server.url}/version", timeout=10).status_code == 401
    version = requests.get(f"{server.url}/version", headers={"Authorization": "Bearer k"}, timeout=10).json()
    assert version == {"version": importlib.metadata.version("jaxserve")}


def test_invocations_serve_chat_and_completions(server):
    completion = {"prompt": "The sea", "max_tokens": 5, "temperature": 0}
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0}
    via_completion, via_chat = post(server, "/invocations", completion), post(server, "/invocations", chat)
    assert via_completion["object"] == "text_completion" and via_chat["object"] == "chat.completion"
    assert via_completion["choices"][0]["text"] == post(server, "/v1/completions", completion)["choices"][0]["text"]
    assert via_chat["choices"][0]["message"] == post(server, "/v1/chat/completions", chat)["choices"][0]["message"]
    assert post(server, "/invocations", {"prompt": "x", "stray": 1}, 400)["error"]["param"] == "stray"


def test_every_alias_is_listed_and_answered_as_asked(server):
    client = openai_client(server, api_key="k")
    assert [m.id for m in client.models.list().data] == ["test-model", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    for name in ("test-model", "alias"):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError, match="served: 'test-model', 'alias'"):
        client.completions.create(model="other", prompt="Hi", max_tokens=1)
