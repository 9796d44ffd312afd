"""The shop database: five related tables, a few hundred rows, generated from a fixed seed.

    customers(customer_id, first_name, last_name, email, city, country, signup_date, loyalty_tier)
    suppliers(supplier_id, name, country)
    products(product_id, name, category, price, stock, supplier_id → suppliers)
    orders(order_id, customer_id → customers, order_date, status)
    order_items(item_id, order_id → orders, product_id → products, quantity, unit_price)

The same seed always gives the same file content (row for row), so gold answers are
stable. A few properties are kept on purpose so that ordered questions have one right
answer: product prices, customer sign-up dates and order dates are all distinct.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import sqlite3
from pathlib import Path

DEFAULT_SEED = 1234

SCHEMA = """\
CREATE TABLE customers (customer_id INTEGER PRIMARY KEY, first_name TEXT NOT NULL, last_name TEXT NOT NULL, email TEXT NOT NULL UNIQUE, city TEXT NOT NULL, country TEXT NOT NULL, signup_date TEXT NOT NULL, loyalty_tier TEXT NOT NULL);
CREATE TABLE suppliers (supplier_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, country TEXT NOT NULL);
CREATE TABLE products (product_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, category TEXT NOT NULL, price REAL NOT NULL, stock INTEGER NOT NULL, supplier_id INTEGER NOT NULL REFERENCES suppliers(supplier_id));
CREATE TABLE orders (order_id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(customer_id), order_date TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (item_id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders(order_id), product_id INTEGER NOT NULL REFERENCES products(product_id), quantity INTEGER NOT NULL, unit_price REAL NOT NULL);
"""

FIRST_NAMES = [
    "Alice", "Bruno", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
    "Kavya", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Samir", "Tara",
    "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe",
]
LAST_NAMES = [
    "Anders", "Baker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jensen",
    "Kowalski", "Lopez", "Martin", "Nakamura", "Olsen", "Patel", "Rossi", "Schmidt", "Tanaka", "Weber",
]
CITIES = {  # city -> country
    "London": "United Kingdom", "Manchester": "United Kingdom",
    "Paris": "France", "Lyon": "France",
    "Berlin": "Germany", "Munich": "Germany",
    "Madrid": "Spain", "Barcelona": "Spain",
    "Tokyo": "Japan", "Osaka": "Japan",
    "Toronto": "Canada", "Chicago": "United States", "Seattle": "United States",
}
TIERS = ["bronze", "silver", "gold"]
STATUSES = ["pending", "shipped", "delivered", "cancelled"]
SUPPLIERS = [
    ("Acme Supply", "United States"), ("Nordic Goods", "Germany"), ("Sakura Trading", "Japan"),
    ("Maple Wholesale", "Canada"), ("Iberia Distrib", "Spain"), ("Thames Traders", "United Kingdom"),
    ("Lumiere Import", "France"), ("Pacific Source", "United States"), ("Alpine Partners", "Germany"),
    ("Kanto Works", "Japan"),
]
PRODUCTS = {  # category -> product names
    "Electronics": ["USB-C Cable", "Wireless Mouse", "Bluetooth Speaker", "Webcam", "Power Bank", "Headphones", "Keyboard"],
    "Books": ["Cookbook", "Travel Guide", "Sci-Fi Novel", "Poetry Collection", "History Atlas", "Mystery Novel"],
    "Kitchen": ["Chef Knife", "Cutting Board", "Frying Pan", "Coffee Grinder", "Teapot", "Mixing Bowl", "Spatula"],
    "Garden": ["Garden Hose", "Pruning Shears", "Seed Kit", "Watering Can", "Plant Pot"],
    "Toys": ["Puzzle Box", "Building Blocks", "Toy Train", "Kite", "Plush Bear", "Board Game"],
    "Sports": ["Yoga Mat", "Tennis Racket", "Football", "Jump Rope", "Water Bottle", "Running Cap"],
    "Office": ["Notebook", "Desk Lamp", "Stapler", "Fountain Pen", "Paper Tray", "Sticky Notes"],
    "Beauty": ["Hand Cream", "Shampoo", "Lip Balm", "Face Mask", "Soap Bar"],
}
N_CUSTOMERS = 120
N_ORDERS = 300
START_DATE = dt.date(2023, 1, 1)
N_DAYS = 730  # orders and sign-ups fall in 2023-2024


def _rows(seed: int) -> dict[str, list[tuple]]:
    """All rows of all tables, from ``seed`` (pure function: same seed, same rows)."""
    rng = random.Random(seed)
    customers = []
    used_names: set[tuple[str, str]] = set()
    signup_days = rng.sample(range(N_DAYS), N_CUSTOMERS)  # distinct sign-up dates
    cities = sorted(CITIES)
    for cid in range(1, N_CUSTOMERS + 1):
        while True:
            name = (rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES))
            if name not in used_names:
                used_names.add(name)
                break
        city = rng.choice(cities)
        email = f"{name[0].lower()}.{name[1].lower()}@example.com"
        signup = (START_DATE + dt.timedelta(days=signup_days[cid - 1])).isoformat()
        tier = rng.choices(TIERS, weights=[6, 3, 1])[0]
        customers.append((cid, name[0], name[1], email, city, CITIES[city], signup, tier))

    suppliers = [(i + 1, n, c) for i, (n, c) in enumerate(SUPPLIERS)]

    products = []
    all_names = [(cat, n) for cat in sorted(PRODUCTS) for n in PRODUCTS[cat]]
    cents = rng.sample(range(299, 19999), len(all_names))  # distinct prices
    for pid, ((cat, name), c) in enumerate(zip(all_names, cents), start=1):
        products.append((pid, name, cat, round(c / 100, 2), rng.randint(0, 250), rng.randint(1, len(suppliers))))

    orders = []
    items = []
    order_days = rng.sample(range(N_DAYS), N_ORDERS)  # distinct order dates
    item_id = 1
    for oid in range(1, N_ORDERS + 1):
        cust = rng.randint(1, N_CUSTOMERS)
        day = START_DATE + dt.timedelta(days=order_days[oid - 1])
        status = rng.choices(STATUSES, weights=[2, 3, 8, 1])[0]
        orders.append((oid, cust, day.isoformat(), status))
        for pid in rng.sample(range(1, len(products) + 1), rng.randint(1, 4)):
            price = products[pid - 1][3]
            if rng.random() < 0.2:  # some items were sold at a discount
                price = round(price * 0.9, 2)
            items.append((item_id, oid, pid, rng.randint(1, 5), price))
            item_id += 1
    return {"customers": customers, "suppliers": suppliers, "products": products,
            "orders": orders, "order_items": items}


def build_database(path: str | os.PathLike, seed: int = DEFAULT_SEED, overwrite: bool = False) -> Path:
    """Write the shop database to ``path`` (atomically: a temp file, then a rename).

    Args:
        path: the SQLite file to create.
        seed: the data seed (the default gives the database the questions were written for).
        overwrite: replace an existing file; otherwise an existing file is kept as is.

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        conn.executescript(SCHEMA)
        for table, rows in _rows(seed).items():
            marks = ",".join("?" * len(rows[0]))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        conn.commit()
    finally:
        conn.close()
    os.replace(tmp, path)
    return path


def schema_text() -> str:
    """The CREATE TABLE statements."""
    return SCHEMA.strip()


SCHEMA_SUMMARY = """\
customers(customer_id, first_name, last_name, email, city, country, signup_date, loyalty_tier)
suppliers(supplier_id, name, country)
products(product_id, name, category, price, stock, supplier_id -> suppliers)
orders(order_id, customer_id -> customers, order_date, status)
order_items(item_id, order_id -> orders, product_id -> products, quantity, unit_price)
Dates are 'YYYY-MM-DD' text. orders.status is one of pending, shipped, delivered, cancelled; \
customers.loyalty_tier is one of bronze, silver, gold."""


def schema_summary() -> str:
    """A compact schema (tables, columns, foreign keys, value notes) for prompts: about half
    the tokens of the CREATE TABLE statements."""
    return SCHEMA_SUMMARY
