"""Chat prompts for text-to-SQL, rendered with the tokenizer's own chat template."""

from __future__ import annotations

from .db import schema_summary
from .questions import Example

SYSTEM_PROMPT = (
    "You translate questions into SQLite queries for this database:\n"
    + schema_summary()
    + "\nAnswer with a single SQL query and nothing else."
)


def make_messages(question: str, answer: str | None = None) -> list[dict[str, str]]:
    """System (schema) + user (question) messages, plus the assistant answer if given."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    return msgs


def prompt_tokens(tokenizer, question: str) -> list[int]:
    """Token ids of the chat prompt up to and including the assistant header."""
    text = tokenizer.apply_chat_template(make_messages(question), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def end_of_turn_id(tokenizer) -> int:
    """The id that ends an assistant turn (``<|im_end|>`` for ChatML; else EOS)."""
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else tokenizer.eos_token_id


def sft_datum(tokenizer, example: Example):
    """A cross-entropy datum for one question: the loss is on the gold SQL + end-of-turn only."""
    from tinker import types

    prompt = prompt_tokens(tokenizer, example.question)
    answer = tokenizer.encode(example.sql, add_special_tokens=False) + [end_of_turn_id(tokenizer)]
    toks = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": weights})
