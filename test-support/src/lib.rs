//! What the workspace's tests share: waiting for events ([`wait`]), real sockets (a served
//! router, HTTP/1.1 and HTTP/2 clients), proxies that inject faults between a client and its
//! server (a TCP fault proxy in Toxiproxy's model for the stores' links, and an HTTP one that
//! drops answers after the request ran), a layer that fails first attempts, a gate that holds requests, and
//! the real servers' URLs ([`env::env_url`]).
//!
//! It depends on none of the workspace's crates, so every crate's tests can use it.
#![allow(missing_docs)]

pub mod env;
pub mod fault_proxy;
pub mod faults;
pub mod gate;
pub mod headers;
pub mod net;
pub mod process;
pub mod proxy;
pub mod wait;
