CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."idempotency_records" (
    scope       bytea       PRIMARY KEY,
    state       text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
    token       uuid        NOT NULL,
    fingerprint bytea       NOT NULL,
    expires_at  timestamptz NOT NULL,
    record      bytea,
    watched     boolean     NOT NULL DEFAULT false,
    CHECK ((state = 'completed') = (record IS NOT NULL))
);
ALTER TABLE "public"."idempotency_records" ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS "idempotency_records_expires_at" ON "public"."idempotency_records" (expires_at);
