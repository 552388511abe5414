//! Test harness for end-to-end tests: a TCP fault proxy, a cuttable store proxy, a
//! fault-injecting layer, and helpers that start the example services on 127.0.0.1:0.

/// The cuttable store proxy (from the test-support crate).
pub use test_support::cut;
pub mod faults;
pub mod proxy;
pub mod scenario;
pub mod servers;
