"""The demo's chat dataset: ``chat.jsonl`` (345 short conversations shipped in the package), a fixed
held-out split, and ChatML rendering into Tinker datums with the served tokenizer.

Each line is ``{"messages": [{"role", "content"}, ...]}`` (the cookbook's conversation format): arithmetic,
capitals, antonyms, plurals, unit conversions, spelling, calendar, short facts and a few ML definitions, each
family answered in one consistent sentence pattern, so a few dozen full fine-tuning steps visibly lower the
held-out NLL (the patterns transfer; the held-out facts themselves are not in the training split).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import tinker

from ringtune.errors import UserInputError

DATA_FILE = "chat.jsonl"
ROLES = ("system", "user", "assistant")


class TextTokenizer(Protocol):
    """What rendering needs of a tokenizer (a ``transformers`` tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


Conversation = list[dict[str, str]]


def load_conversations(path: str | Path | None = None) -> list[Conversation]:
    """The conversations of ``path`` (default: the packaged ``chat.jsonl``), in file order.

    Raises UserInputError naming the line when a line is not ``{"messages": [...]}`` with roles in
    :data:`ROLES`, string contents, and a final assistant message.
    """
    if path is None:
        text = resources.files("ringtune.demo").joinpath(DATA_FILE).read_text(encoding="utf-8")
        where = f"ringtune/demo/{DATA_FILE}"
    else:
        text, where = Path(path).read_text(encoding="utf-8"), str(path)
    conversations = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserInputError(f"{where}:{lineno}: expected a JSON object with 'messages' ({exc})") from None
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
            )
            and messages[-1]["role"] == "assistant"
        )
        if not ok:
            raise UserInputError(
                f"{where}:{lineno}: messages must be a non-empty list of {{role in {ROLES}, content: str}} "
                "ending with an assistant message"
            )
        conversations.append(messages)
    return conversations


def split_held_out(conversations: Sequence[Conversation], every: int = 8) -> tuple[list, list]:
    """``(train, held_out)``: every ``every``-th conversation (indices ``every-1``, ``2*every-1``, ...) is held out."""
    if every < 2:
        raise UserInputError(f"held-out split every={every} must be >= 2")
    train = [c for i, c in enumerate(conversations) if i % every != every - 1]
    held_out = [c for i, c in enumerate(conversations) if i % every == every - 1]
    return train, held_out


@dataclass(frozen=True)
class RenderedExample:
    """One conversation as a token stream: ``tokens`` [L] and ``weights`` [L] (1.0 on the tokens the model
    should learn to produce: the final assistant reply and its ``<|im_end|>``; 0.0 on the prompt)."""

    tokens: list[int]
    weights: list[float]

    def datum(self) -> tinker.Datum:
        """The next-token datum: input ``tokens[:-1]``, ``target_tokens = tokens[1:]``, ``weights = weights[1:]``."""
        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={"target_tokens": self.tokens[1:], "weights": self.weights[1:]},
        )


def render_chatml(messages: Conversation, tokenizer: TextTokenizer) -> RenderedExample:
    """ChatML (SmolLM2-Instruct's chat format, without its default system prompt)::

        <|im_start|>{role}\\n{content}<|im_end|>\\n ...  <|im_start|>assistant\\n{reply}<|im_end|>

    The prompt and the reply are tokenized separately (``add_special_tokens=False``), so the weight boundary
    falls on a token boundary. A tokenizer without the ChatML tokens splits them like any other text.
    """
    prompt = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages[:-1])
    prompt += "<|im_start|>assistant\n"
    reply = messages[-1]["content"] + "<|im_end|>"
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    reply_ids = list(tokenizer.encode(reply, add_special_tokens=False))
    return RenderedExample(prompt_ids + reply_ids, [0.0] * len(prompt_ids) + [1.0] * len(reply_ids))


def mean_nll(outputs: Sequence[dict[str, Any]], data: Sequence[tinker.Datum]) -> float:
    """Weighted NLL per token: ``-sum(weights * logprobs) / sum(weights)`` over ``data`` (SDK loss outputs)."""
    total, count = 0.0, 0.0
    for out, datum in zip(outputs, data, strict=True):
        logprobs = out["logprobs"].tolist()
        weights = datum.loss_fn_inputs["weights"].tolist()
        total -= sum(lp * w for lp, w in zip(logprobs, weights, strict=True))
        count += sum(weights)
    if count <= 0:
        raise UserInputError("mean_nll: the data carry no weighted tokens (sum of weights is 0)")
    return total / count
