"""The text-to-SQL data and reward (examples/text_to_sql): no stack needed.

The reward runs model-written SQL, so these tests check the guarantees around it: a
correct query scores 1 and a wrong one 0; malformed SQL, any write attempt and a query
that runs too long score 0; a write attempt never changes the database file; the row
limit holds; ordered questions compare as lists and the others as multisets.
"""

from __future__ import annotations

import hashlib
import sqlite3
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from text_to_sql import (  # noqa: E402
    Example, SQLEnv, build_database, extract_sql, make_examples, same_result, split_examples,
)
from text_to_sql import db as shopdb  # noqa: E402


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def db_path(tmp_path_factory) -> Path:
    p = build_database(tmp_path_factory.mktemp("sql") / "shop.db")
    p.chmod(0o644)
    return p


@pytest.fixture(scope="module")
def env(db_path) -> SQLEnv:
    return SQLEnv(db_path, timeout_s=0.5, max_rows=200)


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    return make_examples()


def by_template(examples, template: str) -> Example:
    return next(e for e in examples if e.template == template)


# -- data -------------------------------------------------------------------------------------


def test_database_is_deterministic_and_small(tmp_path, db_path):
    again = build_database(tmp_path / "again.db")
    assert sha256(again) == sha256(db_path)
    other = build_database(tmp_path / "other.db", seed=7)
    assert sha256(other) != sha256(db_path)
    conn = sqlite3.connect(db_path)
    counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
              for t in ("customers", "suppliers", "products", "orders", "order_items")}
    # foreign keys all resolve
    assert conn.execute("SELECT COUNT(*) FROM orders o LEFT JOIN customers c USING (customer_id) "
                        "WHERE c.customer_id IS NULL").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM order_items oi LEFT JOIN products p USING (product_id) "
                        "WHERE p.product_id IS NULL").fetchone()[0] == 0
    conn.close()
    assert counts["customers"] >= 100 and counts["orders"] >= 200 and counts["products"] >= 40
    assert 300 <= sum(counts.values()) <= 3000


def test_questions_cover_templates_and_split(examples):
    assert len(examples) >= 200
    assert examples == make_examples()  # deterministic
    assert len({e.id for e in examples}) == len(examples)
    assert len({e.question for e in examples}) == len(examples)
    sql = " ".join(e.sql for e in examples)
    for kw in ("WHERE", "JOIN", "COUNT(", "SUM(", "AVG(", "GROUP BY", "HAVING", "ORDER BY", "LIMIT", "DISTINCT"):
        assert kw in sql, kw
    assert any(e.ordered for e in examples) and any(not e.ordered for e in examples)
    train, test = split_examples(examples)
    assert len(train) + len(test) == len(examples)
    assert not {e.id for e in train} & {e.id for e in test}
    assert len(test) >= 40
    assert split_examples(examples) == (train, test)


def test_every_gold_query_scores_one(env, examples):
    for e in examples:
        r, res = env.score(e.sql, e)
        assert r == 1.0, (e, res)
        assert 0 < len(res.rows) <= env.max_rows


def test_ordered_questions_have_no_ties(db_path):
    """Ordered questions order by values that are distinct, so there is one right list."""
    conn = sqlite3.connect(db_path)
    for sql in ("SELECT price FROM products", "SELECT signup_date FROM customers", "SELECT order_date FROM orders",
                "SELECT AVG(price) FROM products GROUP BY category",
                "SELECT SUM(oi.quantity * oi.unit_price) FROM orders o JOIN order_items oi USING (order_id) "
                "WHERE o.status != 'cancelled' GROUP BY o.customer_id"):
        vals = [r[0] for r in conn.execute(sql)]
        assert len(vals) == len(set(vals)), sql
    conn.close()


# -- reward -----------------------------------------------------------------------------------


def test_equivalent_query_scores_one_and_wrong_result_zero(env, examples):
    e = next(x for x in examples if x.sql.startswith("SELECT first_name, last_name FROM customers WHERE city"))
    city = e.sql.split("= ")[-1]
    other = f"select c.first_name, c.last_name from customers as c where {city} = c.city order by c.last_name"
    assert env.score(other, e)[0] == 1.0
    assert env.score(f"SELECT first_name, last_name FROM customers WHERE city != {city}", e)[0] == 0.0
    assert env.score(f"SELECT last_name, first_name FROM customers WHERE city = {city}", e)[0] == 0.0  # column order
    assert env.score(f"SELECT first_name FROM customers WHERE city = {city}", e)[0] == 0.0
    count = by_template(examples, "count_status")
    r, res = env.score("SELECT 12345", count)
    assert r == 0.0 and res.ok  # valid SQL, wrong answer


@pytest.mark.parametrize("sql", [
    "SELEC name FROM products",
    "SELECT name FROM",
    "SELECT name FROM no_such_table",
    "SELECT no_such_column FROM products",
    "SELECT name FROM products WHERE (price > 3",
    "",
    "   ",
    "```sql\n```",
])
def test_malformed_sql_scores_zero(env, examples, sql):
    e = by_template(examples, "count_products_category")
    r, res = env.reward(sql, e)
    assert r == 0.0 and not res.ok and res.error


WRITES = [
    "INSERT INTO customers (first_name, last_name, email, city, country, signup_date, loyalty_tier) "
    "VALUES ('x', 'y', 'z', 'c', 'd', '2024-01-01', 'gold')",
    "UPDATE products SET price = 0",
    "DELETE FROM orders",
    "REPLACE INTO suppliers VALUES (1, 'x', 'y')",
    "DROP TABLE customers",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t AS SELECT * FROM customers",
    "ALTER TABLE products ADD COLUMN evil TEXT",
    "CREATE INDEX i ON products(price)",
    "WITH x AS (SELECT 1) DELETE FROM order_items",
    "PRAGMA user_version = 42",
    "PRAGMA journal_mode = WAL",
    "PRAGMA query_only = OFF",
    "PRAGMA writable_schema = ON",
    "BEGIN IMMEDIATE",
    "VACUUM",
    "REINDEX",
    "ANALYZE",
    "SELECT 1; DROP TABLE customers",
    "SELECT load_extension('/tmp/evil')",
]


@pytest.mark.parametrize("sql", WRITES)
def test_write_attempt_scores_zero_and_leaves_db_unchanged(env, db_path, examples, sql):
    before = sha256(db_path)
    siblings = set(db_path.parent.iterdir())
    r, res = env.reward(sql, by_template(examples, "count_status"))
    assert r == 0.0 and not res.ok
    assert sha256(db_path) == before
    assert set(db_path.parent.iterdir()) == siblings  # no journal, WAL or new file


@pytest.mark.parametrize("make_sql", [
    lambda d: f"ATTACH DATABASE '{d / 'evil.db'}' AS evil",
    lambda d: f"VACUUM INTO '{d / 'evil.db'}'",
])
def test_attach_and_vacuum_into_create_no_file(env, db_path, examples, make_sql):
    before = sha256(db_path)
    r, res = env.reward(make_sql(db_path.parent), by_template(examples, "count_status"))
    assert r == 0.0 and not res.ok
    assert not (db_path.parent / "evil.db").exists()
    assert sha256(db_path) == before


def test_the_connection_itself_is_read_only(db_path):
    """Even without the authorizer, the file is opened with mode=ro."""
    env = SQLEnv(db_path)
    conn = env._connect()
    conn.set_authorizer(None)
    conn.execute("PRAGMA query_only = OFF")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM orders")
    conn.close()


@pytest.mark.parametrize("sql", [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c",
    "SELECT COUNT(*) FROM order_items a, order_items b, order_items c, order_items d",
])
def test_slow_query_times_out_with_zero(db_path, examples, sql):
    env = SQLEnv(db_path, timeout_s=0.3)
    before = sha256(db_path)
    t0 = time.monotonic()
    r, res = env.score(sql, by_template(examples, "count_status"))
    elapsed = time.monotonic() - t0
    assert r == 0.0 and res.kind == "timeout"
    assert elapsed < 0.3 + 5.0  # both queries run for ever (or ~1e10 rows) unless cut off
    assert sha256(db_path) == before


def test_row_limit(db_path, examples):
    env = SQLEnv(db_path, timeout_s=2.0, max_rows=50)
    e = by_template(examples, "count_status")
    r, res = env.score("SELECT * FROM order_items", e)
    assert r == 0.0 and res.kind == "too_many_rows"
    t0 = time.monotonic()  # an endless row stream stops at the limit, long before the time limit
    r, res = env.score("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c", e)
    assert r == 0.0 and res.kind == "too_many_rows" and time.monotonic() - t0 < 5.0
    r, res = env.score("SELECT * FROM order_items LIMIT 50", e)
    assert res.ok and len(res.rows) == 50


def test_order_sensitive_only_when_asked(env, examples):
    ordered = by_template(examples, "cheapest_k")
    assert ordered.ordered and "cheapest first" in ordered.question
    k = int(ordered.sql.rsplit("LIMIT", 1)[1])
    reversed_sql = f"SELECT * FROM (SELECT name, price FROM products ORDER BY price LIMIT {k}) ORDER BY price DESC"
    assert env.score(ordered.sql, ordered)[0] == 1.0
    assert env.score(reversed_sql, ordered)[0] == 0.0

    unordered = by_template(examples, "customers_in_city")
    assert not unordered.ordered
    shuffled = unordered.sql + " ORDER BY last_name DESC, first_name DESC"
    assert env.score(shuffled, unordered)[0] == 1.0
    # multiset, not set: duplicated rows do not match
    doubled = f"{unordered.sql} UNION ALL {unordered.sql}"
    assert env.score(doubled, unordered)[0] == 0.0


def test_same_result_normalises_floats():
    assert same_result([(1.00001,)], [(1.0,)], ordered=False)
    assert same_result([(3.0,)], [(3,)], ordered=True)
    assert not same_result([(1.01,)], [(1.0,)], ordered=False)
    assert not same_result([(1,), (2,)], [(2,), (1,)], ordered=True)
    assert same_result([(1,), (2,)], [(2,), (1,)], ordered=False)


def test_extract_sql():
    assert extract_sql("SELECT 1;") == "SELECT 1"
    assert extract_sql("```sql\nSELECT name\nFROM products;\n```") == "SELECT name\nFROM products"
    assert extract_sql("Here it is:\n```\nSELECT 2\n```\nthanks") == "SELECT 2"
    assert extract_sql("SELECT 3<|im_end|>") == "SELECT 3"
    assert extract_sql("```sql\nSELECT 4") == "SELECT 4"  # unterminated fence (max_tokens reached)


def test_missing_database_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        SQLEnv(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()
