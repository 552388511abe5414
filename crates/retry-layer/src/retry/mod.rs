//! The retry middleware: [`RetryLayer`] makes [`Retry`] services, whose [`ResponseFuture`]
//! sends a request's attempts. Its parts, in the shape of [`hedge`](crate::hedge)'s: the
//! policy and its builder ([`policy`]), the layer ([`layer`]) and the state its clones share
//! ([`shared`], [`stats`]), the service ([`service`]), and one call across its attempts: the
//! future that drives it ([`future`]), what it carries between attempts ([`call`]), what to do
//! after each attempt ([`decide`]), and what is logged and counted ([`observe`]).

pub(crate) mod call;
pub(crate) mod decide;
pub(crate) mod drain;
pub(crate) mod future;
pub(crate) mod layer;
pub(crate) mod observe;
pub(crate) mod policy;
pub(crate) mod service;
pub(crate) mod shared;
pub(crate) mod stats;

pub use future::ResponseFuture;
pub use layer::RetryLayer;
pub use service::Retry;
pub use stats::RetryStats;
