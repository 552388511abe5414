//! Macros the crate's services share.

/// `get_ref`, `get_mut` and `into_inner` for a service that keeps its inner service `S` in a
/// field named `inner` (as tower-http's `define_inner_service_accessors`). Expand it inside
/// the service's `impl<S> X<S> { .. }` block.
macro_rules! define_inner_service_accessors {
    () => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes `self`, returning the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}
