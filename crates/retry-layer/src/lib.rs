//! Client-side retry middleware (work in progress).
