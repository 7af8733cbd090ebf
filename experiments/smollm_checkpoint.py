"""A checkpoint of SmolLM2-135M's shape with random weights, written by `transformers`, and
400 prompt/completion lines: what issue 46's user brought (no download needed).

Needs torch and transformers (not jaxzero):

    /path/to/venv-with-torch/bin/python -m experiments.smollm_checkpoint /tmp/smollm

writes /tmp/smollm/model (``save_pretrained``: config.json, model.safetensors in bf16, and
a byte-level BPE tokenizer trained on the lines, ``<|endoftext|>`` as token 0 as in
SmolLM2's) and /tmp/smollm/chat.jsonl.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M), the fields that shape it
SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
    eos_token_id=0,
)  # fmt: skip


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(out / "model")
    rng = random.Random(0)
    words = "the a model trains on data with zero sharding of state and gradients".split()
    lines = []
    with (out / "chat.jsonl").open("w") as f:
        for _ in range(400):
            prompt = " ".join(rng.choices(words, k=rng.randint(5, 30)))
            completion = " ".join(rng.choices(words, k=rng.randint(5, 60)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            lines += [prompt, completion]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0], bos_token=special[0])
    fast.save_pretrained(out / "model")
    print(f"wrote {out / 'model'} and {out / 'chat.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm"))
