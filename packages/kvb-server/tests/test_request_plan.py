from __future__ import annotations

import json
import re

import pytest
from fakes import FakeEngine

from kvb_cache.sampling import SamplingParams
from kvb_server.config import ServerConfig
from kvb_server.errors import InvalidParameterError, ModelNotFoundError
from kvb_server.request_body import parse_body
from kvb_server.request_plan import chat_plan, completion_plan
from kvb_server.responses_api.schemas import ResponsesRequest
from kvb_server.sampling_params import choice_params
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest
from kvb_server.validation import VLLM_EXTRAS

CONFIG = ServerConfig(model_names=("fake-model",), max_tokens=50)


def completion(**body):
    req = parse_body(json.dumps({"model": "fake-model", **body}).encode(), CompletionRequest)
    return completion_plan(req, FakeEngine(), CONFIG)


def chat(**body):
    req = parse_body(json.dumps({"model": "fake-model", **body}).encode(), ChatCompletionRequest)
    return chat_plan(req, FakeEngine(), CONFIG)


def test_openai_defaults_and_prompt_forms() -> None:
    plan = completion(prompt="abc")
    assert plan.prompts == ([97, 98, 99],)
    assert plan.sampling.max_new_tokens == 16  # OpenAI's completions default
    assert plan.sampling.temperature == 1.0 and plan.n == 1 and not plan.stream
    assert completion(prompt=["ab", "c"]).prompts == ([97, 98], [99])
    assert completion(prompt=[5, 6]).prompts == ([5, 6],)
    assert completion(prompt=[[5], [6, 7]]).prompts == ([5], [6, 7])


def test_max_tokens_capped_by_server_and_context() -> None:
    assert completion(prompt="a", max_tokens=150).sampling.max_new_tokens == 50  # --max-tokens clamps
    with pytest.raises(InvalidParameterError) as info:  # ... what fits the context window (200) only
        completion(prompt="a", max_tokens=500)
    assert info.value.param == "max_tokens"
    # Chat default: as much as the server allows and the context leaves (context 200).
    assert chat(messages=[{"role": "user", "content": "x" * 160}]).sampling.max_new_tokens == 200 - len(
        "<user>" + "x" * 160 + "<assistant>"
    )
    with pytest.raises(InvalidParameterError) as info:
        completion(prompt="x" * 199, max_tokens=2)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError) as info:
        completion(prompt="x" * 200)
    assert info.value.param == "prompt"


def test_a_default_budget_is_each_prompts_own_room() -> None:
    """vLLM sizes each prompt of a batch by itself: beside a 190-token prompt (context 200), a 1-token prompt
    still gets the completions default of 16, not the 10 that fit after the longest."""
    plan = completion(prompt=["a", "x" * 190])
    assert plan.budgets == (16, 10)
    assert [plan.prompt_sampling(p, 0).max_new_tokens for p in (0, 1)] == [16, 10]
    seeded = completion(prompt=["a", "x" * 190], n=2, seed=7)
    assert seeded.prompt_sampling(1, 1).seed == 8 and seeded.prompt_sampling(1, 1).max_new_tokens == 10
    assert completion(prompt=["a", "x" * 190], max_tokens=5).budgets == (5, 5)  # an explicit budget is one
    with pytest.raises(InvalidParameterError, match="min_tokens") as info:  # at most the smallest budget
        completion(prompt=["a", "x" * 190], min_tokens=12)
    assert info.value.param == "min_tokens"


def test_context_length_errors_use_vllms_wording() -> None:
    """Clients parse these sentences (to turn an over-long request into a ``length`` finish); the ``code``
    is ours on top."""
    with pytest.raises(InvalidParameterError) as info:
        completion(prompt="x" * 30, max_tokens=180)
    assert str(info.value.message) == (
        "'max_tokens' or 'max_completion_tokens' is too large: 180. This model's maximum context length is "
        "200 tokens and your request has 30 input tokens (180 > 200 - 30)."
    )
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidParameterError) as info:
        completion(prompt="x" * 231)
    assert str(info.value.message) == (
        "This model's maximum context length is 200 tokens. However, your request has 231 input tokens. "
        "Please reduce the length of the input messages."
    )
    assert info.value.code == "context_length_exceeded"


def test_max_completion_tokens_wins_and_top_p_zero_is_greedy() -> None:
    plan = chat(
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=9,
        max_completion_tokens=4,
        top_p=0.0,
        temperature=0.9,
    )
    assert plan.sampling.max_new_tokens == 4
    assert (plan.sampling.temperature, plan.sampling.top_p) == (0.0, 1.0)


def test_logprob_settings() -> None:
    assert completion(prompt="a", logprobs=0).sampling.logprobs == 0
    assert completion(prompt="a").sampling.logprobs is None
    assert chat(messages=[{"role": "user", "content": "a"}], logprobs=True).sampling.logprobs == 0
    assert (
        chat(messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=4).sampling.logprobs
        == 4
    )
    assert chat(messages=[{"role": "user", "content": "a"}], logprobs=False).sampling.logprobs is None


def test_stream_options_and_stop() -> None:
    plan = completion(prompt="a", stream=True, stream_options={"include_usage": True}, stop="\n")
    assert plan.stream and plan.include_usage and plan.sampling.stop == ("\n",)


def test_more_than_four_stop_strings_as_vllm_takes_them() -> None:
    """lm-eval's local-completions sends every stop sequence of a task plus end-of-text (OpenAI caps 4)."""
    stops = ["Question:", "</s>", "<|im_end|>", "\n\n", "<|endoftext|>"]
    assert completion(prompt="a", stop=stops).sampling.stop == tuple(stops)


def test_errors_name_the_parameter() -> None:
    with pytest.raises(ModelNotFoundError):
        completion(prompt="a", model="other")
    with pytest.raises(InvalidParameterError, match="Unrecognized request argument supplied: foo"):
        completion(prompt="a", foo=1)
    with pytest.raises(InvalidParameterError, match="Missing required parameter: 'prompt'"):
        completion()
    with pytest.raises(InvalidParameterError, match="only meaningful with echo") as info:
        completion(prompt="a", max_tokens=0)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError) as info:
        completion(prompt="a", n=17)
    assert info.value.param == "n"
    with pytest.raises(InvalidParameterError, match=r"best_of must be at least n \(1\); got 0") as info:
        completion(prompt="a", best_of=0)
    assert info.value.param == "best_of" and info.value.code != "unsupported_parameter"
    with pytest.raises(InvalidParameterError, match=r"at least n \(3\); got 2"):
        completion(prompt="a", n=3, best_of=2)
    with pytest.raises(InvalidParameterError, match="best_of above n is not supported") as info:
        completion(prompt="a", best_of=2)
    assert info.value.code == "unsupported_parameter"
    assert completion(prompt="a", n=2, best_of=2).n == 2
    with pytest.raises(InvalidParameterError) as info:
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert info.value.param == "messages[0].tool_calls[0]"


def test_sampling_is_the_engines_and_each_choice_gets_its_own_seed() -> None:
    plan = completion(prompt="a", temperature=0.7, seed=10, stop=["x"], logprobs=2, max_tokens=5)
    assert isinstance(plan.sampling, SamplingParams)
    assert plan.sampling == SamplingParams(
        max_new_tokens=5, temperature=0.7, seed=10, stop=("x",), logprobs=2
    )
    assert choice_params(plan.sampling, 0) is plan.sampling
    assert choice_params(plan.sampling, 3).seed == 13
    assert choice_params(plan.sampling, 3).temperature == 0.7
    assert choice_params(completion(prompt="a").sampling, 2).seed is None


def test_every_choice_of_a_seeded_request_keeps_a_seed() -> None:
    """seed=-2, n=3: choice 1's seed -1 was read as "no seed" and that choice changed on every call (an
    audit, 2026-11-30); the top of the 64-bit range overflowed into a seed torch refuses."""
    import dataclasses

    import torch

    def draws(seed: int) -> list[float]:
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(3, generator=generator).tolist()

    negative = completion(prompt="a", temperature=0.7, seed=-2).sampling
    assert [choice_params(negative, i).seed for i in range(3)] == [-2, 2**64 - 1, 0]
    assert draws(choice_params(negative, 1).seed) == draws(-1)  # the stream seed -1 names, as vLLM's child
    top = dataclasses.replace(negative, seed=2**64 - 1)  # the engine's top seed (the API stops at 2**63)
    assert choice_params(top, 1).seed == 0


def test_temperatures_near_zero_sample_greedily() -> None:
    """logits / 1e-83 overflow to inf: such a request must not reach the sampler (it failed the step)."""
    assert completion(prompt="hi", temperature=1.4e-83).sampling.temperature == 0.0
    assert completion(prompt="hi", temperature=1e-5).sampling.temperature == 1e-5


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        # The list branch says what is wrong, not the string branch pydantic tries first.
        (
            {"prompt": "a", "stop": ["s"] * 65},
            "Invalid value for 'stop': List should have at most 64 items",
            "stop",
        ),
        ({"prompt": [[]]}, "Invalid value for 'prompt[0]': List should have at least 1 item", "prompt[0]"),
        ({"prompt": ""}, "Invalid value for 'prompt': String should have at least 1 character", "prompt"),
        # Both branches fail on a type; the list branch's is deeper (the input is a list): its item is wrong.
        (
            {"prompt": "a", "stop": [1, 2]},
            "Invalid value for 'stop[0]': Input should be a valid string",
            "stop[0]",
        ),
        (
            {"prompt": [["a"]]},
            "Invalid value for 'prompt[0][0]': Input should be a valid integer",
            "prompt[0][0]",
        ),
    ],
)
def test_union_errors_name_the_branch_the_input_matched(body: dict, message: str, param: str) -> None:
    with pytest.raises(InvalidParameterError, match=re.escape(message)) as info:
        completion(**body)
    assert info.value.param == param


def test_nested_errors_name_the_full_path() -> None:
    with pytest.raises(
        InvalidParameterError, match=re.escape("Missing required parameter: 'messages[0].role'")
    ):
        chat(messages=[{"content": "hi"}])
    with pytest.raises(
        InvalidParameterError, match=re.escape("'messages[1].content': Input should be")
    ) as info:
        chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}])
    # As OpenAI's param: the full path, without pydantic's union branch name ("messages[1].content.str").
    assert info.value.param == "messages[1].content"


@pytest.mark.parametrize(
    ("schema", "body", "path"),
    [
        # A discriminated union's tag ("json_schema", "message", "input_text", "function_call") is pydantic's
        # name for the branch it tried, not a field the client sent.
        (ResponsesRequest, {"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        (ResponsesRequest, {"input": [{"role": "user"}]}, "input[0].content"),
        (
            ResponsesRequest,
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        (
            ResponsesRequest,
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
        ),
        (ResponsesRequest, {"tools": [{"type": "function"}]}, "tools[0].name"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",  # the part's text, not the string branch of content
        ),
        (ChatCompletionRequest, {"messages": [{"content": "a"}]}, "messages[0].role"),
        (ChatCompletionRequest, {"stop": [""]}, "stop[0]"),
        (ChatCompletionRequest, {"logit_bias": {"7": 500}}, "logit_bias"),  # a key is data, not a parameter
    ],
)
def test_error_paths_leave_out_union_tags(schema: type, body: dict, path: str) -> None:
    """param and message name the path the client sent, as OpenAI's do, never pydantic's union branch
    names or discriminator tags (``text.format.json_schema.name``, ``input[0].message.content``)."""
    defaults = {"model": "m", "input": "hi"} if schema is ResponsesRequest else {"model": "m"}
    if schema is ChatCompletionRequest:
        defaults["messages"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidParameterError) as info:
        parse_body(json.dumps({**defaults, **body}).encode(), schema)
    assert info.value.param == path
    assert f"'{path}'" in str(info.value)


@pytest.mark.parametrize("name", ["use_beam_search", "chat_template", "guided_decoding_backend"])
def test_vllm_extras_this_server_does_not_take_are_400s_naming_the_fix(name: str) -> None:
    with pytest.raises(InvalidParameterError, match=f"supplied: {name} \\(vLLM's; not supported") as info:
        chat(messages=[{"role": "user", "content": "a"}], **{name: True})
    assert info.value.param == name
    assert VLLM_EXTRAS[name] in str(info.value)


def test_spaces_between_special_tokens_takes_its_default_only() -> None:
    """vLLM's default (true), sent by clients that spell out every field, was a 400 like false."""
    messages = [{"role": "user", "content": "a"}]
    assert (
        chat(messages=messages, spaces_between_special_tokens=True).sampling
        == chat(messages=messages).sampling
    )
    with pytest.raises(InvalidParameterError, match="spaces_between_special_tokens false") as info:
        completion(prompt="a", spaces_between_special_tokens=False)
    assert info.value.param == "spaces_between_special_tokens"


@pytest.mark.parametrize(
    "metadata",
    [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}],
    ids=["17 keys", "65-character key", "513-character value"],
)
def test_chat_metadata_has_openais_limits(metadata) -> None:
    """OpenAI refuses more than 16 pairs, keys over 64 characters and values over 512 (the Responses API
    here did already; chat took anything)."""
    messages = [{"role": "user", "content": "a"}]
    chat(messages=messages, metadata={"k" * 64: "v" * 512})
    with pytest.raises(InvalidParameterError) as info:
        chat(messages=messages, metadata=metadata)
    assert str(info.value.param).startswith("metadata")


def test_a_refused_value_is_shown_cut_short() -> None:
    """A 70-item stop list was repeated whole in the 400's message."""
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(InvalidParameterError, match="at most 64 items") as info:
        chat(messages=messages, stop=[f"stop-{i}" for i in range(70)])
    assert len(str(info.value)) < 400 and "characters)" in str(info.value)
    with pytest.raises(InvalidParameterError, match=r"\(got 1\)"):
        chat(messages=messages, stop=["a", 1])


def test_vllm_extras_are_not_request_fields() -> None:
    """A hint for a field the server takes would never be shown: the table names only fields one of the
    routes refuses (``echo`` and ``best_of`` are completions' and refused on chat, naming completions)."""
    for name in VLLM_EXTRAS:
        assert not all(name in schema.model_fields for schema in (ChatCompletionRequest, CompletionRequest))
