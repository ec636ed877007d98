import json

from kvb_planner import PlanRefusal

MIB = 1 << 20


def make(**overrides) -> PlanRefusal:
    fields = dict(
        prompt_tokens=9000,
        max_new_tokens=256,
        predicted_peak_bytes=1536 * MIB,
        free_bytes=1000 * MIB,
        budget_bytes=900 * MIB,
        suggested_max_tokens=4321,
        suggested_max_new_tokens=0,
    )
    fields.update(overrides)
    return PlanRefusal(**fields)


def test_413_body_is_openai_style_and_carries_the_numbers():
    body = make().to_dict()
    assert json.loads(json.dumps(body, allow_nan=False)) == body
    error = body["error"]
    assert set(error) == {
        "message",
        "type",
        "param",
        "code",
        "prompt_tokens",
        "max_new_tokens",
        "predicted_peak_mb",
        "free_mb",
        "budget_mb",
        "suggested_max_tokens",
        "suggested_max_new_tokens",
    }
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large_for_memory"
    assert (
        error["prompt_tokens"],
        error["predicted_peak_mb"],
        error["free_mb"],
        error["suggested_max_tokens"],
    ) == (9000, 1536.0, 1000.0, 4321)
    assert error["message"] == (
        "Request needs about 1536.0 MB but only 900.0 MB of 1000.0 MB free may be used. "
        "Shorten the prompt to at most 4321 tokens."
    )


def test_message_mentions_max_tokens_when_that_would_help():
    assert make(suggested_max_new_tokens=12).message.endswith(
        "Shorten the prompt to at most 4321 tokens or lower max_tokens to at most 12."
    )


def test_mb_values_are_rounded():
    assert make(predicted_peak_bytes=MIB + MIB // 3).to_dict()["error"]["predicted_peak_mb"] == 1.3
