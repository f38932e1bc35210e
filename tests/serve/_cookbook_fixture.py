"""Offline Hugging Face caches for the tinker-cookbook recipes: a tokenizer and two small datasets.

The cookbook's ``sl_loop`` and ``rl_loop`` load ``Qwen/Qwen3.5-9B-Base``'s tokenizer and the
``HuggingFaceH4/no_robots`` and ``openai/gsm8k`` datasets by name. Run with the client's Python
(its ``datasets`` and ``tokenizers`` write the cache format that same client reads):

    python _cookbook_fixture.py HF_HOME TOKENIZER_DIR

fills ``HF_HOME`` so that, with ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1``, those names
load from it, and writes the same tokenizer to ``TOKENIZER_DIR`` for the server. It imports no
harts: the client's environment does not have it.

The tokenizer is a byte-level BPE as Qwen's (so any text round-trips), trained on the fixture's
own texts, with Qwen's special tokens and a ChatML chat template. Every question of the arithmetic
set has the same answer, ``ANSWER``, and ``\\boxed{ANSWER}`` is one added token: an untrained
model then writes the right answer in some of its samples (the tiny model: about one in seven of
48 tokens), so GRPO's group-centred rewards differ and ``rl_loop`` takes its steps (it skips a
batch whose rewards are all equal).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

#: a fixed stand-in for the Hub commit the caches are filed under
REVISION = "c0"
SNAPSHOT = "0" * 38 + REVISION

TOKENIZER_REPO = "Qwen/Qwen3.5-9B-Base"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
#: the answer of every question of the arithmetic set; ``\boxed{ANSWER}`` is one token
ANSWER = 3
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOPICS = ("rivers", "bread", "owls", "trains", "gardens", "clocks", "kites", "maps")
CATEGORIES = ("Generation", "Open QA", "Brainstorm", "Chat", "Rewrite", "Summarize")


def no_robots_rows(n: int) -> list[dict]:
    """``n`` rows in ``HuggingFaceH4/no_robots``' schema: prompt, prompt_id, messages, category."""
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"Write {i % 3 + 1} short sentences about {topic}."
        answer = " ".join(f"Sentence {j + 1} is about {topic} and the number {i + j}." for j in range(i % 3 + 1))
        messages = [{"content": prompt, "role": "user"}, {"content": answer, "role": "assistant"}]
        if i % 4 == 0:
            messages.insert(0, {"content": "You are a helpful assistant.", "role": "system"})
        rows.append({"prompt": prompt, "prompt_id": f"{i:064x}", "messages": messages, "category": CATEGORIES[i % 6]})
    return rows


def gsm8k_rows(n: int) -> list[dict]:
    """``n`` rows in ``openai/gsm8k``'s ``main`` schema: question, answer (ending ``#### N``)."""
    rows = []
    for i in range(n):
        a = i % (ANSWER + 1)
        b = ANSWER - a
        question = f"Tom has {a} apples and finds {b} more. How many apples does Tom have?"
        answer = f"Tom has {a} + {b} = <<{a}+{b}={ANSWER}>>{ANSWER} apples.\n#### {ANSWER}"
        rows.append({"question": question, "answer": answer})
    return rows


def corpus() -> list[str]:
    """The texts the tokenizer is trained on: everything the recipes render."""
    texts = ["User:", "Assistant:", "System:", "How many r's are in strawberry?"]
    for row in no_robots_rows(24):
        texts += [m["content"] for m in row["messages"]]
    for row in gsm8k_rows(26):
        texts += [row["question"], row["answer"]]
    return texts


def write_tokenizer(directory: Path) -> None:
    """A Qwen-style byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) in ``directory``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Qwen2Tokenizer's own normalizer and pre-tokenizer: transformers rebuilds them from its class
    # on load, so the server's and the client's versions split text the same way
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(f"\\boxed{{{ANSWER}}}", normalized=False)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hub_snapshot(hf_home: Path, repo_id: str, kind: str) -> Path:
    """The snapshot folder of ``repo_id`` in the Hub cache, with ``refs/main`` pointing at it."""
    root = hf_home / "hub" / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    snapshot = root / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def cache_dataset(hf_home: Path, repo_id: str, config: str, splits: dict[str, list[dict]]) -> None:
    """``splits`` in the datasets cache as one load of ``repo_id`` (config ``config``) files them,
    ``<namespace>___<name>/<config>/0.0.0/<revision>/``, which ``load_dataset`` reads offline."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            path = Path(tmp) / f"{split}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            files[split] = [str(path)]
        # written under the bare name, then filed under the namespaced one (a builder given the
        # repo id requires hf:// data files)
        builder = Json(
            cache_dir=str(Path(tmp) / "cache"),
            dataset_name=name,
            config_name=config,
            config_id=config,
            data_files=files,
            hash=SNAPSHOT,
        )
        builder.download_and_prepare()
        target = hf_home / "datasets" / f"{namespace}___{name}"
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / "cache" / name), str(target))


def main(hf_home: Path, tokenizer_dir: Path) -> None:
    write_tokenizer(tokenizer_dir)
    snapshot = hub_snapshot(hf_home, TOKENIZER_REPO, "model")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, snapshot / file)
    # AutoTokenizer reads the model's config.json too (for its model type)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    robots = no_robots_rows(28)
    cache_dataset(hf_home, "HuggingFaceH4/no_robots", "default", {"train": robots[:24], "test": robots[24:]})
    math = gsm8k_rows(26)
    cache_dataset(hf_home, "openai/gsm8k", "main", {"train": math[:24], "test": math[24:]})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
