//! What the workspace's tests share: waiting for events ([`wait`]), real sockets (a served
//! router, HTTP/1.1 and HTTP/2 clients), proxies that inject faults between a client and its
//! server (a cuttable one for store outages, one that holds back replies, one that drops answers
//! after the request ran), a layer that fails first attempts, a gate that holds requests, and
//! the real servers' URLs ([`env::env_url`]).
//!
//! It depends on none of the workspace's crates, so every crate's tests can use it.
#![allow(missing_docs)]

pub mod cut;
pub mod env;
pub mod faults;
pub mod gate;
pub mod headers;
pub mod net;
pub mod process;
pub mod proxy;
pub mod slow;
pub mod wait;
