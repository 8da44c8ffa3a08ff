"""Benchmarks run by ``make bench`` (never by the tests): each returns a dict of numbers.

``python -m tests.bench [NAME ...]`` runs them, prints a table and writes
``reports/bench/<name>.json`` (ignored by git). Speed claims in the README come from here.
"""
