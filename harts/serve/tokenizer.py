"""The served tokenizer: the directory clients load, checked once, and the decoding of stop strings.

``harts serve`` tells clients which tokenizer to load through ``get_info``'s ``tokenizer_id``: the
absolute path of the served checkpoint directory when it holds tokenizer files, or of the directory
``--tokenizer`` names (a preset has none of its own). The tinker SDK's
``TrainingClient.get_tokenizer`` loads ``AutoTokenizer.from_pretrained(tokenizer_id)``, so a
client on a machine that sees that path loads it with no Hub download. The SDK cuts
``tokenizer_id`` at its first ``:``, so ``--tokenizer`` refuses a path with a colon.

The server loads the same tokenizer to match string stop sequences (``sampling_params.stop``) on
the decoded text of each sample, special tokens included, so a stop string may span tokens.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.errors import UserError

if TYPE_CHECKING:
    from harts.rollout.sampler import Detokenize

__all__ = ["TOKENIZER_FILES", "detokenizer", "load_tokenizer", "tokenizer_eos"]

#: files of which a directory must hold at least one for ``AutoTokenizer`` to load it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: str, flag: str = "--tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, local files only, loaded once; a
    ``UserError`` naming ``flag`` and the directory when it is missing, holds no tokenizer or
    does not load."""
    try:
        # one load at a time: sampling threads may ask at once, and a first import of
        # transformers in several threads together can fail ("cannot import name AutoTokenizer")
        with _LOADING:
            return _load(directory)
    except UserError as err:
        raise UserError(f"{flag} {err}") from None


_LOADING = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load(directory: str) -> Any:
    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"{directory}: no such directory")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{directory}: holds no tokenizer ({', '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except ImportError:
        raise UserError(f"{directory}: loading a tokenizer needs transformers (pip install harts[hf])") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{directory}: does not load as a tokenizer ({first})") from None


def tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence token ids (none when it names no EOS token)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def detokenizer(directory: str) -> Detokenize:
    """Token ids -> text with the tokenizer of ``directory`` (special tokens kept, no spacing
    clean-up), as stop strings are matched."""
    tokenizer = load_tokenizer(directory, "the served tokenizer")

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode
