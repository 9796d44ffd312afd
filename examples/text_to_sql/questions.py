"""Question → gold SQL pairs for the shop database, generated from templates.

Each template is a question pattern and the SQL that answers it (filters, joins,
aggregates, GROUP BY/HAVING, ORDER BY with LIMIT), filled in with values taken from the
data (cities, categories, customers, products, suppliers, months). A pair is kept only if
its gold query returns at least one row with no NULL scalar, so an empty answer never
scores. Questions that ask for an order ("most expensive first") are ``ordered``: their
result is compared as a list, the others as a multiset.

``make_examples()`` is deterministic; ``split_examples()`` gives a fixed train/test split.
"""

from __future__ import annotations

import calendar
import random
import sqlite3
from collections import defaultdict
from dataclasses import dataclass

from . import db


@dataclass(frozen=True)
class Example:
    """One question with its gold SQL."""

    id: str
    question: str
    sql: str
    ordered: bool = False
    template: str = ""


def _q(s: str) -> str:
    """A SQL string literal."""
    return "'" + s.replace("'", "''") + "'"


def _candidates(rows: dict[str, list[tuple]], rng: random.Random) -> list[tuple[str, str, str, bool]]:
    """(template, question, sql, ordered) for every template and parameter choice."""
    out: list[tuple[str, str, str, bool]] = []

    def add(t: str, question: str, sql: str, ordered: bool = False) -> None:
        out.append((t, question, " ".join(sql.split()), ordered))

    cities = sorted(db.CITIES)
    countries = sorted(set(db.CITIES.values()))
    categories = sorted(db.PRODUCTS)
    customers = rows["customers"]
    products = rows["products"]
    has_orders = sorted({o[1] for o in rows["orders"]})
    some_customers = [customers[i - 1] for i in rng.sample(has_orders, 20)]

    for city in cities:
        add("customers_in_city", f"List the first and last names of the customers who live in {city}.",
            f"SELECT first_name, last_name FROM customers WHERE city = {_q(city)}")
    for country in countries:
        add("count_customers_country", f"How many customers are from {country}?",
            f"SELECT COUNT(*) FROM customers WHERE country = {_q(country)}")
    for cat in categories:
        add("count_products_category", f"How many products are in the {cat} category?",
            f"SELECT COUNT(*) FROM products WHERE category = {_q(cat)}")
        add("avg_price_category",
            f"What is the average price of the products in the {cat} category, rounded to 2 decimals?",
            f"SELECT ROUND(AVG(price), 2) FROM products WHERE category = {_q(cat)}")
        add("stock_category", f"How many units are in stock in total across the {cat} category?",
            f"SELECT SUM(stock) FROM products WHERE category = {_q(cat)}")
        add("customers_ordering_category",
            f"How many different customers have ordered products from the {cat} category?",
            f"""SELECT COUNT(DISTINCT o.customer_id) FROM orders o
                JOIN order_items oi ON oi.order_id = o.order_id
                JOIN products p ON p.product_id = oi.product_id WHERE p.category = {_q(cat)}""")
        for p in (20, 60, 120):
            add("category_over_price", f"Which products in the {cat} category cost more than {p} dollars? Give their names.",
                f"SELECT name FROM products WHERE category = {_q(cat)} AND price > {p}")
        for k in (2, 3):
            add("top_k_expensive_in_category",
                f"What are the {k} most expensive products in the {cat} category? "
                f"List name and price, most expensive first.",
                f"SELECT name, price FROM products WHERE category = {_q(cat)} ORDER BY price DESC LIMIT {k}", True)
    for n in (10, 25, 50):
        add("low_stock", f"Which products have fewer than {n} units in stock? List their names and stock.",
            f"SELECT name, stock FROM products WHERE stock < {n}")
    for s in db.STATUSES:
        add("count_status", f"How many orders have the status '{s}'?",
            f"SELECT COUNT(*) FROM orders WHERE status = {_q(s)}")
        add("revenue_status",
            f"What is the total revenue (quantity times unit price) of the orders with status '{s}', "
            f"rounded to 2 decimals?",
            f"""SELECT ROUND(SUM(oi.quantity * oi.unit_price), 2) FROM order_items oi
                JOIN orders o ON o.order_id = oi.order_id WHERE o.status = {_q(s)}""")
    for year in (2023, 2024):
        for month in range(1, 13):
            add("orders_in_month", f"How many orders were placed in {calendar.month_name[month]} {year}?",
                f"SELECT COUNT(*) FROM orders WHERE strftime('%Y-%m', order_date) = '{year}-{month:02d}'")
        for country in countries:
            add("orders_country_year", f"How many orders did customers from {country} place in {year}?",
                f"""SELECT COUNT(*) FROM orders o JOIN customers c ON c.customer_id = o.customer_id
                    WHERE c.country = {_q(country)} AND strftime('%Y', o.order_date) = '{year}'""")
        for city in cities:
            add("emails_city_year",
                f"List the email addresses of the customers from {city} who signed up in {year}.",
                f"SELECT email FROM customers WHERE city = {_q(city)} AND strftime('%Y', signup_date) = '{year}'")
    for pid, name, *_ in products:
        add("units_sold_product", f"How many units of {name} have been sold in total?",
            f"""SELECT SUM(oi.quantity) FROM order_items oi JOIN products p ON p.product_id = oi.product_id
                WHERE p.name = {_q(name)}""")
    for i, (cid, first, last, *_rest) in enumerate(some_customers):
        full = f"{first} {last}"
        where = f"c.first_name = {_q(first)} AND c.last_name = {_q(last)}"
        add("orders_of_customer", f"List the ids of the orders placed by {full}.",
            f"SELECT o.order_id FROM orders o JOIN customers c ON c.customer_id = o.customer_id WHERE {where}")
        add("count_orders_customer", f"How many orders has {full} placed?",
            f"SELECT COUNT(*) FROM orders o JOIN customers c ON c.customer_id = o.customer_id WHERE {where}")
        if i % 2 == 0:
            add("first_order_customer", f"On what date did {full} place their first order?",
                f"SELECT MIN(o.order_date) FROM orders o JOIN customers c ON c.customer_id = o.customer_id WHERE {where}")
        else:
            add("spend_customer", f"How much has {full} spent in total (quantity times unit price), rounded to 2 decimals?",
                f"""SELECT ROUND(SUM(oi.quantity * oi.unit_price), 2) FROM order_items oi
                    JOIN orders o ON o.order_id = oi.order_id
                    JOIN customers c ON c.customer_id = o.customer_id WHERE {where}""")
    for sid, sname, _country in rows["suppliers"]:
        add("supplier_products", f"List the names of the products supplied by {sname}.",
            f"""SELECT p.name FROM products p JOIN suppliers s ON s.supplier_id = p.supplier_id
                WHERE s.name = {_q(sname)}""")
    for tier in db.TIERS:
        for country in countries:
            add("tier_country", f"How many {tier} tier customers are there in {country}?",
                f"SELECT COUNT(*) FROM customers WHERE loyalty_tier = {_q(tier)} AND country = {_q(country)}")
    for n in (8, 10, 12):
        add("cities_having", f"Which cities have more than {n} customers?",
            f"SELECT city FROM customers GROUP BY city HAVING COUNT(*) > {n}")
    for k in (3, 5, 10):
        add("cheapest_k", f"List the {k} cheapest products with their prices, cheapest first.",
            f"SELECT name, price FROM products ORDER BY price ASC LIMIT {k}", True)
        add("recent_signups",
            f"Which {k} customers signed up most recently? Give first name, last name and sign-up date, newest first.",
            f"SELECT first_name, last_name, signup_date FROM customers ORDER BY signup_date DESC LIMIT {k}", True)
        add("latest_orders", f"What are the ids and dates of the {k} most recent orders, newest first?",
            f"SELECT order_id, order_date FROM orders ORDER BY order_date DESC LIMIT {k}", True)
    for k in (3, 5):
        add("top_spenders",
            f"Who are the {k} customers with the highest total spending (quantity times unit price) on orders that "
            f"were not cancelled? Give first name, last name and the total rounded to 2 decimals, highest first.",
            f"""SELECT c.first_name, c.last_name, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS total
                FROM customers c JOIN orders o ON o.customer_id = c.customer_id
                JOIN order_items oi ON oi.order_id = o.order_id WHERE o.status != 'cancelled'
                GROUP BY c.customer_id ORDER BY SUM(oi.quantity * oi.unit_price) DESC LIMIT {k}""", True)
    add("orders_per_status", "How many orders are there for each status? Give the status and the count.",
        "SELECT status, COUNT(*) FROM orders GROUP BY status")
    add("category_avg_ordered",
        "List each product category with its average price rounded to 2 decimals, from the highest average to the lowest.",
        "SELECT category, ROUND(AVG(price), 2) FROM products GROUP BY category ORDER BY AVG(price) DESC", True)
    add("never_ordered", "Which products have never been ordered? Give their names.",
        "SELECT name FROM products WHERE product_id NOT IN (SELECT product_id FROM order_items)")
    return out


def _memory_db(rows: dict[str, list[tuple]]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.executescript(db.SCHEMA)
    for table, rs in rows.items():
        conn.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rs[0]))})", rs)
    return conn


def make_examples(seed: int = db.DEFAULT_SEED) -> list[Example]:
    """All question → gold SQL pairs for the database built with ``seed`` (deterministic).

    A candidate is dropped when its gold query returns no row, or a single NULL.
    """
    rows = db._rows(seed)
    conn = _memory_db(rows)
    counts: dict[str, int] = defaultdict(int)
    out = []
    for template, question, sql, ordered in _candidates(rows, random.Random(seed)):
        res = conn.execute(sql).fetchall()
        if not res or (len(res) == 1 and all(v is None for v in res[0])):
            continue
        counts[template] += 1
        out.append(Example(f"{template}-{counts[template]:02d}", question, sql, ordered, template))
    conn.close()
    return out


def split_examples(examples: list[Example], test_fraction: float = 0.2, seed: int = 0
                   ) -> tuple[list[Example], list[Example]]:
    """A fixed shuffled (train, test) split; every template with 2+ questions appears in both."""
    by_t: dict[str, list[Example]] = defaultdict(list)
    for e in examples:
        by_t[e.template].append(e)
    rng = random.Random(seed)
    train, test = [], []
    for t in sorted(by_t):
        group = by_t[t][:]
        rng.shuffle(group)
        n_test = int(round(len(group) * test_fraction)) if len(group) > 1 else 0
        n_test = max(n_test, 1) if len(group) > 1 else 0
        test += group[:n_test]
        train += group[n_test:]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test
