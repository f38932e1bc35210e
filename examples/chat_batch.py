"""A batch file from chat messages with a real tokenizer, offline, then ``harts train`` on it.

    pip install 'harts[examples]'                 # mistral-common: its wheel ships the vocabularies
    python examples/chat_batch.py --out chat.jsonl
    harts train --data chat.jsonl --epochs 3 --run-dir runs/chat && harts plot runs/chat

    python examples/chat_batch.py --messages my_tree.jsonl --out mine.jsonl    # your own messages

Rollouts of an agent are trees: every sampled answer continues the same conversation, and a
follow-up turn continues one answer. Written as OpenAI-style messages with ``id`` and
``parent_id`` (``harts.rollout.messages``; a leaf carries its ``reward``), a tree becomes a
``RolloutBatch`` whose shared turns are shared token prefixes: ``harts train`` computes them once.

The tokenizer is Mistral's Tekken (tiktoken-based, 131,072 tokens), or its SentencePiece v3
vocabulary with ``--tokenizer sentencepiece`` (``pip install 'mistral-common[sentencepiece]'``);
both files come inside the mistral-common wheel, so nothing is downloaded. ``MistralChat`` gives
it the ``apply_chat_template`` that ``batch_from_messages`` calls: a conversation that ends with
the user's turn renders with the assistant's prompt after it, one that ends with an assistant
turn as a finished answer, and every rendering starts with the one before it (which
``batch_from_messages`` checks), so the tokens of a turn are what it adds.

With ``--train-steps N`` the script also runs ``harts train --data OUT`` for N steps itself.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mistral_common.protocol.instruct.normalize import get_normalizer
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from harts.rollout.messages import batch_from_messages, load_messages
from harts.tree.compact import prefix_index

#: a small rollout tree: two questions, several sampled answers each, one follow-up turn
MESSAGES: list[dict[str, Any]] = [
    {"id": "q1", "parent_id": None, "role": "user", "content": "What is 6 x 7? Answer with a number."},
    {"id": "a1", "parent_id": "q1", "role": "assistant", "content": "42", "reward": 1.0},
    {"id": "a2", "parent_id": "q1", "role": "assistant", "content": "41", "reward": 0.0},
    {"id": "a3", "parent_id": "q1", "role": "assistant", "content": "6 x 7 = 42"},
    {"id": "f3", "parent_id": "a3", "role": "user", "content": "Just the number, please."},
    {"id": "a3a", "parent_id": "f3", "role": "assistant", "content": "42", "reward": 1.0},
    {"id": "a3b", "parent_id": "f3", "role": "assistant", "content": "Forty-two", "reward": 0.5},
    {"id": "q2", "parent_id": None, "role": "user", "content": "Name the capital of France in one word."},
    {"id": "b1", "parent_id": "q2", "role": "assistant", "content": "Paris", "reward": 1.0},
    {"id": "b2", "parent_id": "q2", "role": "assistant", "content": "Lyon", "reward": 0.0},
    {"id": "b3", "parent_id": "q2", "role": "assistant", "content": "The capital is Paris.", "reward": 0.5},
]


class MistralChat:
    """A mistral-common tokenizer behind transformers' ``apply_chat_template`` (module docstring)."""

    def __init__(self, tokenizer: MistralTokenizer) -> None:
        inner = tokenizer.instruct_tokenizer
        version = inner.tokenizer.version
        # a conversation that ends with the user's turn is a request ("test" validation), one that
        # ends with the assistant's a finished sample ("finetuning"): one vocabulary, two validators
        self.request = tokenizer
        self.sample = MistralTokenizer(
            inner,
            validator=get_validator(version, mode=ValidationMode.finetuning),
            request_normalizer=get_normalizer(version, inner.tokenizer.model_settings_builder),
        )
        self.vocab_size = inner.tokenizer.n_words

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_: Any,
    ) -> list[int]:
        """Token ids of ``conversation``; after a user turn they end with the assistant's prompt
        (``[/INST]``) with or without ``add_generation_prompt``, as Mistral's template renders it."""
        assert tokenize, "only token ids are needed here"
        encoder = self.sample if conversation[-1]["role"] == "assistant" else self.request
        return list(encoder.encode_chat_completion(ChatCompletionRequest(messages=conversation)).tokens)


def load_tokenizer(kind: str) -> MistralChat:
    """Tekken or SentencePiece v3, from the files inside the mistral-common wheel."""
    return MistralChat(MistralTokenizer.v3(is_tekken=kind == "tekken"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="chat.jsonl", help="the batch file to write (.jsonl or .parquet)")
    p.add_argument("--messages", default=None, help="a JSON / JSON-lines file of messages (default: the tree above)")
    p.add_argument("--tokenizer", default="tekken", choices=["tekken", "sentencepiece"])
    p.add_argument("--train-steps", type=int, default=0, help="then run harts train --data OUT for this many steps")
    args = p.parse_args(argv)

    chat = load_tokenizer(args.tokenizer)
    messages = load_messages(args.messages) if args.messages else MESSAGES
    batch = batch_from_messages(messages, chat, vocab_size=chat.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    batch.save(args.out)
    compact = prefix_index(batch).num_compact_tokens
    print(
        f"wrote {args.out}: {batch.num_trajectories} conversations, {batch.num_tokens} tokens "
        f"({compact} once their shared prefixes are computed once: {batch.num_tokens / compact:.2f}x), "
        f"{int(batch.action_mask.sum())} action tokens, vocabulary {chat.vocab_size:,}"
    )
    for j in range(batch.num_trajectories):
        print(
            f"  conversation {j}: {batch.lengths[j]} tokens, advantage {batch.advantages[batch.offsets[j + 1] - 1]:+.2f}"
        )
    if args.train_steps:
        from harts.cli import main as harts

        return harts(["train", "--data", args.out, "--steps", str(args.train_steps), "--epochs", str(args.train_steps)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
