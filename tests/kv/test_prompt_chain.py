"""`PromptChain`: a chat tokenized and hashed from the segments kept from earlier chats gives
exactly the ids and block hashes of tokenizing the whole rendered prompt at once."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.kv import token_block_hashes
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ODD = ["  two spaces", "\n\nnewlines\n", "Ünïcödé 日本語 🙂", "tabs\tand\r\nCRLF", "x" * 300, ""]


def byte_level_bpe() -> Tokenizer:
    """A small byte-level BPE (GPT-2 style) trained here, with ChatML's special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(1)
    corpus = [" ".join(rng.choice(VOCAB) for _ in range(50)) + " " + o for o in ODD * 20]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def chats(seed: int) -> list[list[dict[str, Any]]]:
    """Interleaved multi-turn chats on shared system prompts, odd text at the boundaries."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return rng.choice(ODD) + " ".join(rng.choice(VOCAB) for _ in range(n)) + rng.choice(ODD)

    systems = [text(300) for _ in range(3)]
    convs: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": rng.choice(systems)}] for _ in range(6)
    ]
    out = []
    for _turn in range(4):
        for conv in convs:
            conv.append({"role": "user", "content": text(rng.randrange(1, 40))})
            out.append(list(conv))
            conv.append({"role": "assistant", "content": text(rng.randrange(0, 30))})
    return out


@pytest.mark.parametrize(
    ("tokenizer", "template"),
    [(TOKENIZER, CHAT_TEMPLATE), (byte_level_bpe(), CHATML)],
    ids=["mocker-wordpiece", "byte-level-bpe-chatml"],
)
def test_kept_segments_give_the_whole_prompts_ids_and_hashes(
    tokenizer: Tokenizer, template: str
) -> None:
    prompts = PromptTokenizer(Tokenizer.from_str(tokenizer.to_str()), {"chat_template": template})
    assert prompts.chain is not None
    for chat in chats(7):
        text = prompts.render(chat)
        whole = tokenizer.encode(text, add_special_tokens=False).ids
        assert prompts.chat(chat) == whole
        hashes = prompts.chat_hashes(chat, [4, 16], 1024)
        assert hashes == {size: token_block_hashes(whole, size) for size in (4, 16)}
        capped = prompts.chat_hashes(chat, [4], 5)
        assert capped == {4: token_block_hashes(whole, 4, limit=5)}
    assert len(prompts.chain) > 0 and prompts.chain.bytes > 0


def test_a_long_new_message_is_cut_to_the_blocks_wanted_and_not_kept() -> None:
    prompts = PromptTokenizer(
        Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": CHAT_TEMPLATE}
    )
    assert prompts.chain is not None
    chat = [{"role": "user", "content": " ".join(VOCAB[i % 90] for i in range(50_000))}]
    whole = TOKENIZER.encode(prompts.render(chat), add_special_tokens=False).ids
    assert prompts.chat_hashes(chat, [16], 8) == {16: token_block_hashes(whole, 16, limit=8)}
    assert len(prompts.chain) == 1  # the role marker; the cut message is not kept
    assert prompts.chat_hashes(chat, [16], 100_000) == {16: token_block_hashes(whole, 16)}


def test_a_tokenizer_that_marks_only_the_start_of_a_text_is_tokenized_whole() -> None:
    """A Metaspace pre-tokenizer that prepends its marker to the first piece only would
    tokenize a segment alone unlike inside the prompt: no chain, the same ids as whole."""
    vocab = {
        t: i for i, t in enumerate(["<unk>", "▁", *(f"▁{w}" for w in VOCAB[:50]), *VOCAB[:50]])
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|user|>", "<|assistant|>")]
    )
    prompts = PromptTokenizer(tokenizer, {"chat_template": CHAT_TEMPLATE})
    assert prompts.chain is None
    chat = [{"role": "user", "content": f"{VOCAB[3]} {VOCAB[4]}"}]
    whole = tokenizer.encode(prompts.render(chat), add_special_tokens=False).ids
    assert prompts.chat(chat) == whole
    assert prompts.chat_hashes(chat, [2], 10) == {2: token_block_hashes(whole, 2, limit=10)}
