//! Server-side idempotency middleware (work in progress).
