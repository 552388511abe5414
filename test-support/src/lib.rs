//! What the workspace's tests share: real sockets (a served router, HTTP/1.1 and HTTP/2
//! clients), a cuttable TCP proxy for store outages, a proxy that holds back replies, and the
//! real servers' URLs ([`env::env_url`]).
//!
//! It depends on none of the workspace's crates, so every crate's tests can use it.
#![allow(missing_docs)]

pub mod cut;
pub mod env;
pub mod net;
pub mod slow;
