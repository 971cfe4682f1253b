"""Make the small local assets the TorchTitan debug model trains on.

    python examples/torchtitan/make_assets.py [DIR]     (default: examples/torchtitan/assets)

TorchTitan's ``llama3_debugmodel`` reads a tokenizer from ``tests/assets/tokenizer`` and
the ``c4_test`` data set from ``tests/assets/c4_test`` of its source tree; neither ships
in the wheel, and nothing may be fetched from a hub here. This writes stand-ins of the
same shape: ``DIR/c4_test/data.json`` (JSON lines ``{"text": ...}``: sentences drawn with
a fixed seed from a small word list, so every machine makes the same bytes) and
``DIR/tokenizer/`` (a byte-level BPE with 2,048 tokens trained on that text, with the
Llama-3 begin/end-of-text tokens, as ``tokenizer.json`` + ``tokenizer_config.json``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near old river banks under grey autumn skies and "
         "young pilots train hard every morning before long flights across wide "
         "northern seas where whales sing songs of distant lands").split()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def texts(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))) + "."
                     for _ in range(rng.randint(3, 12)))
            for _ in range(n)]


def main(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    data = texts()
    (out / "c4_test").mkdir(parents=True, exist_ok=True)
    with open(out / "c4_test" / "data.json", "w") as f:
        for t in data:
            f.write(json.dumps({"text": t}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(data, trainer)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    with open(out / "tokenizer" / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                   "add_eos_token": False}, f, indent=1)
    print(f"assets in {out}: {len(data)} documents, vocabulary {tok.get_vocab_size()}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "assets")
