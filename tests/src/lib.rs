//! Test harness for end-to-end tests: helpers that start the example services on 127.0.0.1:0
//! and the order scenario the HTTP tests share. The HTTP fault proxy, the TCP fault proxy of the
//! store links and the fault-injecting layer are in the test-support crate
//! ([`test_support::proxy`], [`test_support::fault_proxy`], [`test_support::faults`]).

pub mod scenario;
pub mod servers;

#[cfg(test)]
mod tests {
    /// test-support spells the retry headers itself (it depends on none of the workspace's
    /// crates): they must be the ones retry-layer sends.
    #[test]
    fn the_fault_layer_knows_the_retry_headers() {
        assert_eq!(
            test_support::faults::RETRY_HEADERS,
            [
                reason_code::X_PREVIOUS_ATTEMPTS.as_str(),
                reason_code::GRPC_PREVIOUS_RPC_ATTEMPTS.as_str()
            ]
        );
    }
}
