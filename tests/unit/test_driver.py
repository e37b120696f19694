"""A SQLAlchemy construct run on the driver: the text and arguments SQLAlchemy would send."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import bindparam, column, select, table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from langgraph_fence.database.driver import DriverStatement

T = table("t", column("a"), column("b"))
STMT = select(T.c.a).where(
    T.c.a == bindparam("p_a"), T.c.b.in_(["x", "y"]), T.c.b != bindparam("p_a")
)


def test_the_call_parameters_and_the_constants_go_to_their_positions() -> None:
    on_sqlite = DriverStatement(STMT, sqlite.dialect())
    assert on_sqlite.sql.count("?") == 4
    assert on_sqlite.args({"p_a": 1}) == [1, "x", "y", 1]
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a, b)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(1, "x"), (1, "z"), (2, "y")])
    assert conn.execute(on_sqlite.sql, on_sqlite.args({"p_a": 1})).fetchall() == [(1,)]
    on_postgres = DriverStatement(STMT, asyncpg_dialect())
    # $1 stands for p_a wherever it appears; the IN list's constants follow it.
    assert "$1" in on_postgres.sql
    assert "$3" in on_postgres.sql
    assert on_postgres.args({"p_a": 7}) == [7, "x", "y"]


def test_a_missing_parameter_is_refused_not_bound_as_null() -> None:
    with pytest.raises(KeyError, match="p_a"):
        DriverStatement(STMT, sqlite.dialect()).args({})


def test_a_parameter_rendered_per_call_is_refused() -> None:
    late = select(T.c.a).where(T.c.b.in_(bindparam("p_bs", expanding=True)))
    with pytest.raises(ValueError, match="p_bs"):
        DriverStatement(late, sqlite.dialect())
    with pytest.raises(ValueError, match="paramstyle"):
        DriverStatement(STMT, postgresql.dialect())  # psycopg's pyformat, not asyncpg's
