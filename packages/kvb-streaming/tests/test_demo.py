"""``python -m kvb_streaming.demo``: bad options and checkpoints are usage errors (exit 2), not tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvb_streaming.demo import main


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-new-tokens", "0"], "must be >= 1"),  # failed inside transformers' generate (ValueError)
        (["--n-staging-slots", "0"], "must be >= 1"),  # StreamingConfigError traceback
        (["--keep-first-k", "-1"], "must be >= 0"),
        (["--residency-mode", "full_stream", "--keep-first-k", "1"], "has no effect"),
        ([], "--tokenizer"),  # the packer saves no tokenizer: transformers' ValueError traceback
    ],
)
def test_bad_options_and_checkpoints_are_usage_errors(
    awq_llama_dir: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(awq_llama_dir), "--prompt", "hello", "--device", "cpu", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
