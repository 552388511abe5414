//! PostgresStore tests.
