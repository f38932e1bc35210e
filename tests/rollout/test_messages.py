"""OpenAI-style message trees -> RolloutBatch with a local chat-template tokenizer: shared turns
are shared token prefixes (checked against re-tokenizing every conversation), assistant turns
are actions, leaves' rewards become group advantages, and a template that breaks sharing or a
malformed tree is an error naming the message."""

from __future__ import annotations

import numpy as np
import pytest

from harts.errors import BatchValidationError
from harts.rollout.messages import batch_from_messages, load_messages
from harts.tree.compact import compact

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

WORDS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"]
WORDS += "you are helpful what is the key value call lookup answer 1 2 3 42 7 sorry error".split()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _tokenizer(template: str = TEMPLATE):  # noqa: ANN202
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


def _tree() -> list[dict]:
    return [
        {"id": "s", "parent_id": None, "role": "system", "content": "you are helpful"},
        {"id": "u", "parent_id": "s", "role": "user", "content": "what is the value of key 7"},
        {"id": "c1", "parent_id": "u", "role": "assistant", "content": "call lookup 7"},
        {"id": "t1", "parent_id": "c1", "role": "tool", "content": "value 42"},
        {"id": "a1", "parent_id": "t1", "role": "assistant", "content": "the answer is 42", "reward": 1.0},
        {"id": "a2", "parent_id": "t1", "role": "assistant", "content": "answer 3", "reward": 0.0},
        {"id": "c2", "parent_id": "u", "role": "assistant", "content": "call lookup"},
        {"id": "t2", "parent_id": "c2", "role": "tool", "content": "error"},
        {"id": "c3", "parent_id": "t2", "role": "assistant", "content": "call lookup 7", "reward": 0.5},
    ]


def _path(messages: list[dict], leaf: str) -> list[dict]:
    by_id = {m["id"]: m for m in messages}
    out = []
    while leaf is not None:
        out.append(by_id[leaf])
        leaf = by_id[leaf]["parent_id"]
    return [{"role": m["role"], "content": m["content"]} for m in reversed(out)]


def test_shared_turns_are_shared_prefixes_of_the_retokenized_conversations() -> None:
    tok, messages = _tokenizer(), _tree()
    batch = batch_from_messages(messages, tok)
    assert batch.num_trajectories == 3 and batch.tree is not None and batch.tree.num_nodes == len(messages)
    for j, leaf in enumerate(["a1", "a2", "c3"]):
        whole = tok.apply_chat_template(_path(messages, leaf), tokenize=True, return_dict=False)
        np.testing.assert_array_equal(batch.trajectory(j), whole)
    # a1 and a2 share everything up to the tool output; c3 shares system + user with them
    shared = len(tok.apply_chat_template(_path(messages, "t1"), tokenize=True, return_dict=False))
    common = len(tok.apply_chat_template(_path(messages, "u"), tokenize=True, return_dict=False))
    np.testing.assert_array_equal(batch.trajectory(0)[:shared], batch.trajectory(1)[:shared])
    assert batch.trajectory(0)[shared + 1] != batch.trajectory(1)[shared + 1]  # after the header
    np.testing.assert_array_equal(batch.trajectory(0)[:common], batch.trajectory(2)[:common])
    # compaction from the message tree and from a token trie of the re-tokenized paths (select
    # drops the tree) agree; siblings' equal assistant headers merge too, so at most the spans
    span_total = int(batch.tree.offsets[-1])
    assert compact(batch).num_compact_tokens == compact(batch.select(range(3))).num_compact_tokens <= span_total
    assert span_total < batch.num_tokens


def test_assistant_turns_are_actions_without_their_header() -> None:
    tok = _tokenizer()
    batch = batch_from_messages(_tree(), tok)
    header = tok.convert_tokens_to_ids("<|assistant|>")
    toks, mask = batch.trajectory(0), batch.action_mask[batch.offsets[0] : batch.offsets[1]]
    words = tok.convert_ids_to_tokens(toks[mask].tolist())
    assert words == "call lookup 7 </s> the answer is 42 </s>".split()
    assert not mask[toks == header].any()


def test_rewards_become_group_advantages() -> None:
    messages = _tree()
    batch = batch_from_messages(messages, _tokenizer())
    adv = batch.advantages[batch.offsets[:-1]]
    r = np.array([1.0, 0.0, 0.5])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std() + 1e-6))
    messages[5]["advantage"] = -2.0  # explicit advantages win
    messages[5]["group_id"] = "other"
    adv = batch_from_messages(messages, _tokenizer()).advantages
    assert adv[batch.offsets[1]] == -2.0


def test_template_that_breaks_sharing_names_the_message() -> None:
    # renders the last turn with an extra marker: every earlier turn changes once a turn follows
    bad = TEMPLATE.replace("</s> {% endfor %}", "</s> {% if loop.last %}</s> {% endif %}{% endfor %}")
    with pytest.raises(BatchValidationError, match="message 'u': the chat template renders"):
        batch_from_messages(_tree(), _tokenizer(bad))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m[4].pop("reward"), "message 'a1' is a leaf without 'reward'"),
        (lambda m: m[3].update(parent_id="nope"), "message 't1': parent 'nope' does not exist"),
        (lambda m: m.append(dict(m[0])), "duplicate message id 's'"),
        (lambda m: m[0].update(parent_id="u"), "is on a cycle"),
    ],
)
def test_malformed_trees_name_the_message(change, match) -> None:  # noqa: ANN001
    messages = _tree()
    change(messages)
    with pytest.raises(BatchValidationError, match=match):
        batch_from_messages(messages, _tokenizer())


def test_load_messages_json_and_jsonl(tmp_path) -> None:  # noqa: ANN001
    import json

    messages = _tree()
    (tmp_path / "a.json").write_text(json.dumps(messages))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(m) for m in messages))
    assert load_messages(str(tmp_path / "a.json")) == load_messages(str(tmp_path / "b.jsonl")) == messages
