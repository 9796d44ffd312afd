"""Text-to-SQL: a generated SQLite shop database, template questions with gold SQL, and a
safe execution-match reward. Used by ``examples/text_to_sql_rl.py`` and
``notebooks/text_to_sql_sft.ipynb``.

    from text_to_sql import build_database, make_examples, split_examples, SQLEnv, make_prompt
"""

from .db import DEFAULT_SEED, build_database, schema_summary, schema_text
from .env import ExecResult, SQLEnv, extract_sql, same_result
from .prompts import SYSTEM_PROMPT, make_messages, prompt_tokens, sft_datum
from .questions import Example, make_examples, split_examples

__all__ = [
    "DEFAULT_SEED", "build_database", "schema_summary", "schema_text", "ExecResult", "SQLEnv", "extract_sql", "same_result",
    "SYSTEM_PROMPT", "make_messages", "prompt_tokens", "sft_datum", "Example", "make_examples", "split_examples",
]
